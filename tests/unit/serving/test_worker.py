"""serving.worker.drafter_factory: one drafter per batch row, weights loaded once (no Ray started)."""
from __future__ import annotations

import pytest
import torch

from eyas.config import ConfigError
from eyas.methods import SpecConfig
from eyas.models import load_target
from serving.worker import drafter_factory


@pytest.fixture(scope="module")
def target(random_checkpoint):
    return load_target(random_checkpoint)


def test_rows_get_their_own_drafter_sharing_weights(target, random_checkpoint, random_draft_checkpoint, tmp_path):
    from eyas.drafters.registry import build_model, save_drafter

    assert drafter_factory(target, SpecConfig(method="vanilla")) is None
    make = drafter_factory(target, SpecConfig(method="draft-lm", draft_model=str(random_draft_checkpoint)))
    a, b = make(), make()
    assert a is not b and a.model is b.model and a.cache is not b.cache
    torch.manual_seed(0)
    path = save_drafter(build_model("eagle3", None, target, token_counts_V=torch.ones(target.config.vocab_size)),
                        tmp_path / "eagle3", random_checkpoint)
    make = drafter_factory(target, SpecConfig(method="eagle3", drafter=str(path), num_nodes=8, top_k=2))
    a, b = make(), make()
    assert a is not b and next(a.model.parameters()) is next(b.model.parameters())
    with pytest.raises(ConfigError, match="needs a trained drafter"):
        drafter_factory(target, SpecConfig(method="eagle3"))


def test_build_app_is_a_one_argument_serve_builder():
    import inspect

    from ray.serve import Application

    from serving.app import application, build_app

    assert len(inspect.signature(build_app).parameters) == 1  # `serve run` refuses any other builder
    assert isinstance(build_app({"target": "/x", "tensor_parallel_size": 2}), Application)
    assert isinstance(application({"target": "/x"}, {"num_replicas": 2}), Application)
