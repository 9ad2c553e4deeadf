"""Security defaults (issue 16, section 6) that need no HTTP server: loopback binds, checkpoints without pickle, the
Ray token never printed. The API key, request paths and size limits go through the real app:
tests/unit/serving/test_security_http.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from eyas.drafters import registry
from eyas.models import Decoder, ModelConfig
from eyas.train.config import OptimConfig
from eyas.train.step import TRAINER_STATE, load_training_checkpoint, make_strategy, save_training_checkpoint
from eyas_ray import auth, deploy

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("platform", "jobs", "serving", "tune") for p in (REPO / folder).rglob("*.py")]


def test_servers_bind_to_loopback_by_default(monkeypatch):
    from ray.serve.config import HTTPOptions

    for path in sorted((REPO / "serving" / "configs").glob("*.yaml")):
        host = (yaml.safe_load(path.read_text()).get("http_options") or {}).get("host", HTTPOptions().host)
        assert host == "127.0.0.1", f"{path.name} binds {host}"
    assert HTTPOptions().host == "127.0.0.1"  # what Serve binds when a config names no host
    started = {}
    monkeypatch.setattr(deploy.serve, "start", lambda **options: started.update(options))
    deploy.run_config({"applications": []})  # a config without http_options, deployed from Python
    assert started["http_options"] == {"host": "127.0.0.1"}
    assert "--dashboard-host=127.0.0.1" in (REPO / "platform" / "eyas_ray" / "local_head.py").read_text()
    assert "--host 127.0.0.1" in (REPO / "Makefile").read_text()  # make mlflow-ui


def test_no_code_loads_a_pickle():
    """Weights are safetensors and configs JSON/YAML; the one torch file (the optimizer state) loads with
    weights_only=True; a pickled HF checkpoint (pytorch_model.bin) is refused (tests/unit/models)."""
    for path in SOURCES:
        text = path.read_text()
        assert not re.search(r"^\s*(import|from) (pickle|dill|cloudpickle)\b", text, re.M), path
        for call in re.findall(r"torch\.load\((.*)", text):
            assert "weights_only=True" in call, f"{path}: torch.load({call}"


class RunsCode:
    """A pickle that runs code when loaded: what a tampered checkpoint would hold."""
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_tampered_optimizer_state_is_refused_unrun(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    target = Decoder(config).eval().requires_grad_(False)

    def strategy():
        return make_strategy("ddp", registry.build_model("medusa", {"num_heads": 1}, target),
                             OptimConfig(lr=1e-3), 2, 4, 1, torch.device("cpu"))

    save_training_checkpoint(tmp_path, strategy(), 0, {"step": 1}, "tiny")
    assert load_training_checkpoint(tmp_path, strategy())["step"] == 1  # the real file loads weights-only
    marker = tmp_path / "code-ran"
    torch.save({"optimizer": RunsCode(marker), "scheduler": {}}, tmp_path / TRAINER_STATE)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_training_checkpoint(tmp_path, strategy())
    assert not marker.exists()


def test_the_ray_token_is_never_printed(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in (auth.TOKEN, auth.TOKEN_PATH, "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    source = auth.ensure_user_token()  # creates ~/.ray/auth_token and says so
    token = Path(source).read_text().strip()
    printed = capsys.readouterr()
    assert "created a Ray auth token" in printed.out and token not in printed.out + printed.err
    monkeypatch.setenv(auth.TOKEN_PATH, str(tmp_path / "empty"))
    (tmp_path / "empty").write_text("")
    with pytest.raises(RuntimeError) as info:
        auth.token_source()
    assert token not in str(info.value) and str(tmp_path / "empty") in str(info.value)
    assert token not in capsys.readouterr().out
