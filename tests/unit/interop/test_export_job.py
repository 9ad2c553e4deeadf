"""python -m jobs.export: a drafter directory or models:/NAME@ALIAS -> an engine directory (config.json,
model.safetensors, README.md naming the target), logged to the drafter's MLflow run; user mistakes exit 2."""
import json

import torch

from eyas import track
from eyas.drafters import registry
from eyas.models import load_target
from jobs import export


def trained_drafter(random_checkpoint, directory):
    target = load_target(random_checkpoint)
    torch.manual_seed(3)
    model = registry.build_model("eagle3", {"ttt_steps": 2}, target)
    return target, registry.save_drafter(model, directory, random_checkpoint)


def test_export_directory_and_errors(random_checkpoint, tmp_path, capsys):
    target, drafter = trained_drafter(random_checkpoint, tmp_path / "eagle3")
    meta = json.loads((drafter / "config.json").read_text())
    assert meta["target_fingerprint"]["tokenizer"] is not None  # the target dir has tokenizer.json
    assert export.main(["--drafter", str(drafter), "--to", "sglang", "--out", str(tmp_path / "sg")]) == 0
    out = tmp_path / "sg"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert f"Trained for target: `{random_checkpoint}`" in (out / "README.md").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eyas"]["target_fingerprint"] == meta["target_fingerprint"]
    loaded = registry.load_model(out, target, target_dir=random_checkpoint)  # tokenizer fingerprint checked too
    assert loaded.target_taps == registry.load_model(drafter, target).target_taps
    assert export.main(["--drafter", str(drafter), "--to", "sglang", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert export.main(["--drafter", str(tmp_path / "nowhere"), "--to", "vllm", "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint there" in capsys.readouterr().err


def test_export_logs_to_the_drafters_run(random_checkpoint, tmp_path, mlflow_uri):
    _, drafter = trained_drafter(random_checkpoint, tmp_path / "eagle3")
    assert track.register_directory(drafter, "eagle3-interop", alias="champion") == "1"
    uri = "models:/eagle3-interop@champion"
    assert export.main(["--drafter", uri, "--to", "vllm", "--out", str(tmp_path / "vl")]) == 0
    run_id = export.drafter_run_id(uri)
    names = {entry.path for entry in track.client().list_artifacts(run_id, "export/vllm")}
    assert names == {"export/vllm/README.md", "export/vllm/config.json", "export/vllm/model.safetensors"}


def test_gguf_export_without_a_llamacpp_build_names_the_make_target(random_checkpoint, tmp_path, monkeypatch,
                                                                   capsys):
    # the conversion itself runs in `make peer-check-llamacpp` (tests/peers), where llama.cpp is built
    _, drafter = trained_drafter(random_checkpoint, tmp_path / "eagle3")
    monkeypatch.setenv("EYAS_LLAMACPP_DIR", str(tmp_path / "no-build"))
    assert export.main(["--drafter", str(drafter), "--to", "gguf", "--out", str(tmp_path / "d.gguf")]) == 2
    assert "make tools-llamacpp" in capsys.readouterr().err
    assert not (tmp_path / "d.gguf").exists()
