"""Shared fixtures: small Hugging Face checkpoints built in seconds, so no test needs a model hub."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from eyas.threads import configure_threads, set_openmp_env

# eyas's thread policy (eyas.threads): OpenMP's wait policy must be in the environment before torch loads, and every
# process the tests start (jobs, Ray workers) inherits it. Tests use one intra-op thread: tiny models on a shared
# machine, where a second thread only waits on the first (10x slower tests); OMP_NUM_THREADS carries that to the
# subprocesses, whose jobs apply the same policy (eyas.threads.configure_threads reads it).
os.environ["OMP_NUM_THREADS"] = "1"
set_openmp_env()
import torch  # noqa: E402  (after the OpenMP environment above)

REPO_ROOT = Path(__file__).resolve().parents[1]

# Nothing may depend on state that earlier runs left in the home directory (a Ray token in ~/.ray, ~/.cache/eyas,
# Hugging Face caches, MLflow stores): the session runs with an empty HOME of its own, inherited by every process it
# starts (Ray heads, jobs, Serve), and with none of the variables that would point elsewhere.
SESSION_HOME = tempfile.mkdtemp(prefix="eyas-test-home-")
os.environ["HOME"] = SESSION_HOME
for _name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "EYAS_HOME", "HF_HOME",
              "XDG_CACHE_HOME", "MLFLOW_TRACKING_URI"):
    os.environ.pop(_name, None)
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing comes from a model hub at run time


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test``: ``-n 2``) the integration tests are one unit of work, run by one worker
    in file order: each starts its own local Ray (sharing /tmp/ray), MLflow or Serve, and two Ray clusters with
    Serve on 2 cores at once made health checks miss (a 503 from a replica whose workers were declared failed, in
    1 of 2 runs). The unit and golden tests start none of these and spread freely over both workers.

    A scheduler rather than ``xdist_group`` marks: xdist 3.8 groups by rewriting ``item._nodeid``, which pytest 9.2's
    nodes no longer read, so ``--dist loadgroup`` silently spreads a group."""
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/integration" if nodeid.startswith("tests/integration/") else nodeid

    return IntegrationInOrder(config, log)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


def build_random_checkpoint(out_dir: Path, tokenizer_dir: Path | None = None, num_layers: int = 3,
                            hidden_size: int = 48, seed: int = 0) -> Path:
    """A random-weight LlamaForCausalLM + a BPE tokenizer trained on a slice of the corpus, saved HF-style."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.tokenizer import TokenizerConfig, build_tokenizer, load_tokenizer

    if tokenizer_dir is None:
        tokenizer = build_tokenizer(TokenizerConfig(vocab_size=320, max_chars=40_000), out_dir)
    else:
        tokenizer = load_tokenizer(tokenizer_dir)
        tokenizer.save_pretrained(str(out_dir))
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper random model: greedy continuations repeat, so drafters get accepted
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory) -> Path:
    return build_random_checkpoint(tmp_path_factory.mktemp("random-target"))


@pytest.fixture(scope="session")
def random_draft_checkpoint(tmp_path_factory, random_checkpoint) -> Path:
    return build_random_checkpoint(tmp_path_factory.mktemp("random-draft"), tokenizer_dir=random_checkpoint,
                                   num_layers=1, seed=1)


@pytest.fixture()
def eyas_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "eyas-home"))
    return tmp_path / "eyas-home"


@pytest.fixture()
def mlflow_uri(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
configure_threads()  # one thread: OMP_NUM_THREADS above
