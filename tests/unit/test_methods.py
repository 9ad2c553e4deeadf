"""eyas.methods: the one method table, SpecConfig's checks (settings that do not apply, the tree cap), tree settings
over a method's default, drafter factories, and the checkpoint resolver."""
from __future__ import annotations

import pytest
import torch

from eyas.config import ConfigError, from_dict
from eyas.drafters import registry
from eyas.drafters.ngram import NgramDrafter
from eyas.train.data import response_row, shard_path, write_shard
from eyas.drafters.trees import TreeSpec
from eyas.methods import (FAMILY_METHOD, METHODS, SpecConfig, build_drafter, drafter_factory, resolve_checkpoint,
                          tree_over)
from eyas.models import Decoder, ModelConfig

DESIGN_METHODS = {"vanilla", "ngram", "draft-lm", "medusa", "eagle1", "eagle2", "eagle3", "dflash", "dflash-ddtree",
                  "hybrid",
                  "dspark", "dflash2", "eagle3.1", "peagle", "suffix"}


@pytest.fixture(scope="module")
def target() -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=6,
                               num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)).eval()


def test_the_table_covers_design_methods_and_families():
    assert set(METHODS) == DESIGN_METHODS
    assert {m.family for m in METHODS.values() if m.trained} == set(registry.FAMILIES)
    assert all(METHODS[method].family == family for family, method in FAMILY_METHOD.items())
    assert [name for name, m in METHODS.items() if not m.speculates] == ["vanilla"]
    for name, method in METHODS.items():  # a trained method's default tree is one its family draws
        if method.trained:
            assert method.tree.mode in registry.family(method.family).tree_modes, name


def test_defaults_and_tree_settings_over_them():
    assert SpecConfig(method="eagle2").tree_spec == TreeSpec("dynamic", depth=5, top_k=4, num_nodes=24)
    assert SpecConfig(method="eagle1").tree_spec == TreeSpec("static")
    assert SpecConfig(method="eagle3", num_nodes=12).tree_spec == TreeSpec("dynamic", depth=5, top_k=4,
                                                                           num_nodes=12)
    # another mode starts from that mode's defaults, not the method's
    assert SpecConfig(method="eagle1", tree="chain", depth=3).tree_spec == TreeSpec("chain", depth=3)
    assert SpecConfig(method="dflash-ddtree").tree_spec == TreeSpec("ddtree", top_k=4, num_nodes=24)
    assert SpecConfig(method="ngram").tree_spec is None
    assert SpecConfig(method="ngram").setting("num_draft") == 4 and SpecConfig(method="ngram", num_draft=2
                                                                              ).setting("num_draft") == 2
    assert tree_over(TreeSpec("static"), {"mode": "best-first", "depth": 3}) == TreeSpec("best-first", depth=3,
                                                                                        top_k=4, num_nodes=24)


@pytest.mark.parametrize("data, message", [
    ({"method": "eagle9"}, r"spec.method='eagle9': must be one of"),
    ({"method": "dflash", "top_k": 3}, r"spec.top_k=3: does not apply to a block tree"),
    ({"method": "eagle1", "top_k": 2}, r"spec.top_k=2: does not apply to a static tree"),
    ({"method": "ngram", "depth": 2}, r"spec.depth=2: does not apply to method ngram"),
    ({"method": "vanilla", "num_draft": 2}, r"spec.num_draft=2: does not apply to method vanilla"),
    ({"method": "draft-lm", "drafter": "x"}, r"spec.drafter='x': does not apply to method draft-lm"),
    ({"method": "eagle2", "num_nodes": 64}, r"spec.num_nodes=64: a tree may draft at most 63 nodes"),
    ({"method": "eagle1", "tree": "chain", "depth": 64}, r"spec.depth=64: a tree may draft at most 63"),
    ({"method": "eagle3", "top_k": 9, "num_nodes": 8}, r"spec.top_k=9: cannot exceed the node budget "
                                                       r"spec.num_nodes=8"),
    ({"method": "dflash", "tree": "dynamic"}, r"spec.tree='dynamic': a dflash drafter drafts one of"),
    ({"method": "eagle2", "tree": "ddtree"}, r"spec.tree='ddtree': a eagle2 drafter drafts one of"),
    ({"method": "ngram", "max_matches": 0}, r"spec.max_matches=0: must be >= 1"),
    ({"method": "ngram", "num_nodes": 0}, r"spec.num_nodes=0: must be >= 1"),
    ({"method": "draft-lm", "datastore": ["d"]}, r"spec.datastore=\('d',\): does not apply to method draft-lm"),
    ({"method": "ngram", "datastore": "d"}, r"spec.datastore: expected a list"),
    ({"method": "ngram", "datastore": []}, r"spec.datastore=\(\): name at least one data set"),
    ({"method": "hybrid", "proposers": ["ngram", "ngram"]}, r"spec.proposers=\['ngram', 'ngram'\]: name one "
                                                            r"retrieval proposer"),
    ({"method": "hybrid", "proposers": ["eagle3"]}, r"spec.proposers=\['eagle3'\]: name one retrieval"),
    ({"method": "hybrid", "proposers": ["ngram", "draft-lm"], "top_k": 2}, r"spec.top_k=2: is read by neither"),
    ({"method": "hybrid", "proposers": ["ngram", "eagle3"], "draft_model": "m"}, r"spec.draft_model='m': is read "
                                                                                  r"by neither"),
    ({"method": "hybrid", "proposers": ["ngram", "dflash"], "top_k": 2}, r"spec.top_k=2: does not apply to a "
                                                                        r"block tree"),
    ({"method": "hybrid", "num_nodes": 64}, r"spec.num_nodes=64: a tree may draft at most 63"),
    ({"method": "hybrid", "proposers": "ngram"}, r"spec.proposers: expected a list"),
    ({"method": "eagle3", "proposers": ["ngram", "eagle3"]}, r"spec.proposers=.*does not apply to method eagle3"),
])
def test_spec_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(SpecConfig, data, prefix="spec.")


def test_factories(target, tmp_path):
    assert drafter_factory(target, SpecConfig()) is None and build_drafter(target, SpecConfig()) is None
    make = drafter_factory(target, SpecConfig(method="ngram", num_draft=3, max_matches=2))
    first, second = make(), make()
    assert isinstance(first, NgramDrafter) and first is not second and first.max_draft_nodes == 6
    with pytest.raises(ConfigError, match=r"spec.datastore: .*no-such-data.*no parquet shards"):
        drafter_factory(target, SpecConfig(method="ngram", datastore=(str(tmp_path / "no-such-data"),)))
    write_shard(shard_path(tmp_path / "answers", "train", 0), [response_row([1, 2], [3, 4])])
    make = drafter_factory(target, SpecConfig(method="ngram", num_nodes=3, datastore=(str(tmp_path / "answers"),)))
    first, second = make(), make()
    assert first.datastore is second.datastore and first.datastore.num_tokens == 4 and first.max_draft_nodes == 3
    with pytest.raises(ConfigError, match="spec.method=dflash needs a trained drafter"):
        drafter_factory(target, SpecConfig(method="dflash"))
    torch.manual_seed(1)
    model = registry.build_model("dflash", {"num_layers": 1, "block_size": 4, "num_taps": 3}, target)
    path = registry.save_drafter(model, tmp_path / "dflash", "tiny")
    make = drafter_factory(target, SpecConfig(method="dflash", drafter=str(path)))
    a, b = make(), make()
    assert a.model is b.model and a.context is not b.context and a.max_draft_nodes == 3
    assert a.model.fc.packed is not None  # a checkpoint's drafter drafts through packed linears (pack_linears)
    with pytest.raises(ConfigError, match="method 'eagle1' needs a eagle1 drafter, but .* holds a dflash"):
        drafter_factory(target, SpecConfig(method="eagle1", drafter=str(path)))
    # hybrid: one drafter of each proposer per sequence, the learned one's weights shared, one node budget
    make = drafter_factory(target, SpecConfig(method="hybrid", proposers=("ngram", "dflash"), drafter=str(path),
                                              max_matches=2))
    a, b = make(), make()
    assert isinstance(a.retrieval, NgramDrafter) and a.retrieval.config.max_matches == 2
    assert a.learned.model is b.learned.model and a.learned is not b.learned
    assert a.max_draft_nodes == 3 and a.target_taps == a.learned.target_taps  # default: the learned tree's budget
    assert drafter_factory(target, SpecConfig(method="hybrid", proposers=("dflash", "ngram"), drafter=str(path),
                                              num_nodes=5))().max_draft_nodes == 5
    with pytest.raises(ConfigError, match="spec.method=eagle3 needs a trained drafter"):
        drafter_factory(target, SpecConfig(method="hybrid"))


def test_resolve_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_HOME", str(tmp_path))
    (tmp_path / "drafters" / "x").mkdir(parents=True)
    assert resolve_checkpoint("$EYAS_HOME/drafters/x", "spec.drafter") == tmp_path / "drafters" / "x"
    with pytest.raises(ConfigError, match=r"spec.drafter=\$EYAS_HOME/drafters/y: no checkpoint there"):
        resolve_checkpoint("$EYAS_HOME/drafters/y", "spec.drafter")
    seen = []
    monkeypatch.setattr("eyas.track.download_model", lambda uri: seen.append(uri) or tmp_path)
    assert resolve_checkpoint("models:/eagle3@champion", "spec.drafter") == tmp_path
    assert resolve_checkpoint("runs:/abc/drafter", "target") == tmp_path
    assert seen == ["models:/eagle3@champion", "runs:/abc/drafter"]


def test_a_drafter_name_falls_back_to_the_shipped_drafter(tmp_path, monkeypatch):
    """A bare drafter name reads $EYAS_HOME/drafters/<name> where a checkpoint is there, else the shipped one."""
    home, shipped = tmp_path / "home", tmp_path / "shipped"
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setattr("eyas.train.config.SHIPPED_DRAFTERS", shipped)
    (shipped / "eagle3-t").mkdir(parents=True)
    (shipped / "eagle3-t" / "config.json").write_text("{}")
    assert resolve_checkpoint("eagle3-t", "spec.drafter", drafter=True) == shipped / "eagle3-t"
    (home / "drafters" / "eagle3-t").mkdir(parents=True)
    (home / "drafters" / "eagle3-t" / "config.json").write_text("{}")
    assert resolve_checkpoint("eagle3-t", "spec.drafter", drafter=True) == home / "drafters" / "eagle3-t"
    with pytest.raises(ConfigError, match="spec.drafter=eagle3-u: no checkpoint there"):
        resolve_checkpoint("eagle3-u", "spec.drafter", drafter=True)
