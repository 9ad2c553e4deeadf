"""jobs.ship_drafter: a bfloat16 copy with a model card, only for a drafter a bench timed, within the size cap, and
replacing a shipped one only when the same bench measured the new one faster on every suite. The card's Data section
comes from the data sets' own data.json, its Engines section from what jobs.export does with the drafter."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.config import ConfigError
from eyas.drafters import registry
from eyas.models import load_target
from eyas.train.config import target_path
from jobs import export, ship_drafter

# data.json of the training data (a mix) and its parts, as jobs.generate_data writes them (the fields the card reads)
CODE = {"name": "data-code", "rows": {"train": 1024, "heldout": 16}, "config": {
    "name": "data-code", "source": "regenerate", "suite": "docstring", "exclude_humaneval": True, "num_prompts": 1024,
    "max_prompt_tokens": 192, "max_new_tokens": 192, "temperature": 0.0, "dtype": "auto"},
    "last_run": {"rows": 1040, "new_tokens": 164980, "dtype": "bfloat16"}}
CHAT = {"name": "data-chat", "rows": {"train": 640, "heldout": 16}, "config": {
    "name": "data-chat", "source": "sharegpt", "max_prompt_tokens": 256, "max_new_tokens": 128, "temperature": 0.0,
    "dtype": "float32"}, "last_run": {"rows": 56, "new_tokens": 7000, "dtype": "float32"}}  # a resumed build
MIX = {"name": "data-mix", "rows": {"train": 1664, "heldout": 32},
       "config": {"name": "data-mix", "source": "mix", "parts": ["data-code", "data-chat"]}, "last_run": {"rows": 1696}}


@pytest.fixture
def shipped(tmp_path, monkeypatch, random_checkpoint):
    """serving/drafters in tmp; EYAS_HOME with the random target (named as the shipped one's) and the data sets; the
    repository's data configs: data-code's only, asking for 2048 prompts."""
    folder = tmp_path / "shipped"
    monkeypatch.setattr("jobs.ship_drafter.SHIPPED_DRAFTERS", folder)
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "home"))
    shutil.copytree(random_checkpoint, tmp_path / "home" / "targets" / "smollm2-135m")
    for meta in (CODE, CHAT, MIX):
        (tmp_path / "home" / "data" / meta["name"]).mkdir(parents=True)
        (tmp_path / "home" / "data" / meta["name"] / "data.json").write_text(json.dumps(meta))
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "data-code.yaml").write_text("name: data-code\nsource: regenerate\nsuite: docstring\n"
                                            "exclude_humaneval: true\nnum_prompts: 2048\nmax_prompt_tokens: 192\n"
                                            "max_new_tokens: 192\ndtype: auto\n")
    monkeypatch.setattr("jobs.ship_drafter.DATA_CONFIGS", configs)
    return folder


def checkpoint(directory, scale=1.0, **config):
    """A real EAGLE-3 beside the random target (its fc filled with ``scale``), with its training.json."""
    target = load_target(target_path("smollm2-135m"))
    torch.manual_seed(0)
    model = registry.build_model("eagle3", {"ttt_steps": 3, **config}, target)
    with torch.no_grad():
        model.fc.weight.fill_(scale)
    registry.save_drafter(model, directory, str(target_path("smollm2-135m")))
    (directory / "training.json").write_text(json.dumps({"step": 7, "config": {"data": "data-mix", "train": {
        "batch_size": 4}}, "metrics": {"heldout_code_acc_1": 0.5, "loss": 1.0}}))
    return directory


def bench(path, drafter, speedups, shipped_speedups=None):
    rows = [{"method": "vanilla", "suite": s, "speedup": 1.0} for s in speedups]
    rows += [{"method": "eagle3", "suite": s, "speedup": v, "tau": 2.0, "same_as_vanilla": 1.0}
             for s, v in speedups.items()]
    rows += [{"method": "eagle3@shipped", "suite": s, "speedup": v, "tau": 1.5} for s, v in (shipped_speedups or {}).items()]
    path.write_text(json.dumps({"commit": "abc", "machine": {"cpu_model": "a CPU"}, "results": rows, "config": {
        "dtype": "bfloat16", "num_prompts": 8, "max_new_tokens": 128, "command": "/x/jobs/bench.py --methods x",
        "specs": {"eagle3": {"drafter": str(drafter)}}}}))
    return path


def bfloat16_megabytes(source, tmp_path) -> float:
    save_file(ship_drafter.bfloat16_state(source / "model.safetensors"), str(tmp_path / "bf16.safetensors"))
    return (tmp_path / "bf16.safetensors").stat().st_size / 1e6


def test_a_timed_drafter_ships_in_bfloat16_with_a_model_card(tmp_path, shipped, monkeypatch):
    source = checkpoint(tmp_path / "home" / "drafters" / "eagle3-mix")
    monkeypatch.setattr("jobs.ship_drafter.MAX_SHIPPED_MB", 1.5 * bfloat16_megabytes(source, tmp_path))  # not two
    where = ship_drafter.ship("eagle3-mix", "eagle3-t", bench(tmp_path / "b.json", source, {"chat": 1.3}),
                              notes="Trained in 3 minutes.\n")
    assert where == shipped / "eagle3-t" and sorted(p.name for p in shipped.iterdir()) == ["eagle3-t"]
    state = load_file(str(where / "model.safetensors"))
    assert state.keys() == load_file(str(source / "model.safetensors")).keys()
    assert state["fc.weight"].dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in state.values())
    save_file({"w": torch.ones(2), "ids": torch.arange(3)}, str(tmp_path / "mixed.safetensors"))
    mixed = ship_drafter.bfloat16_state(tmp_path / "mixed.safetensors")  # index tensors stay as they are
    assert mixed["w"].dtype == torch.bfloat16 and mixed["ids"].dtype == torch.int64
    assert json.loads((where / "config.json").read_text())["target"] == "smollm2-135m"
    card = (where / "README.md").read_text()
    assert "| chat | 2.00 | 1.30x | 1.0 |" in card and "data-mix" in card and "heldout_code_acc_1" in card
    assert "python -m jobs.bench --methods x" in card
    assert card.endswith("## Notes\n\nTrained in 3 minutes.\n")


def test_the_data_section_and_commands_come_from_the_data_sets_own_metadata(tmp_path, shipped):
    card = (ship_drafter.ship(str(checkpoint(tmp_path / "a")), "eagle3-t",
                              bench(tmp_path / "b.json", tmp_path / "a", {"chat": 1.3})) / "README.md").read_text()
    data = card[card.index("## Data"):card.index("## Measured")]
    assert "- `data-mix`: 1,664 train + 32 held-out sequences, joining `data-code` and `data-chat`" in data
    assert ("  - `data-code`: 1,024 train + 16 held-out sequences: HumanEval-shaped stdlib prompts" in data
            and "of at most 192 tokens, HumanEval's own functions excluded, answered by the target itself (greedy, "
                "bfloat16, at most 192 new tokens): 164,980 answer tokens" in data)
    assert ("  - `data-chat`: 640 train + 16 held-out sequences: ShareGPT first turns in the target's chat template "
            "of at most 256 tokens, answered by the target itself (greedy, float32, at most 128 new tokens): answer "
            "tokens not recorded for every row" in data)  # its last run built 56 of its 656 rows
    commands = card[card.index("```bash"):card.index("python -m jobs.train_drafter")].splitlines()[1:]
    assert commands == ["python -m jobs.generate_data --config jobs/configs/data-code.yaml num_prompts=1024",
                        "# data-chat: no jobs/configs/data-chat.yaml; its data.json records the config it was built "
                        "with",
                        "# data-mix: no jobs/configs/data-mix.yaml; its data.json records the config it was built with"]


def test_a_data_set_built_by_jobs_generate_data_is_described(tmp_path, shipped):
    from eyas.config import load_config
    from eyas.train.config import DataConfig
    from jobs.generate_data import build

    shutil.copytree(tmp_path / "home" / "targets" / "smollm2-135m", tmp_path / "home" / "targets" / "target-rand")
    build(load_config(DataConfig, overrides=["name=rand-corpus", "target=target-rand", "source=corpus",
                                             "num_prompts=10", "num_heldout_prompts=3", "chunk_tokens=32"]))
    assert ship_drafter.data_section("rand-corpus") == [
        "## Data", "", "- `rand-corpus`: 10 train + 3 held-out sequences: 32-token chunks of the stdlib/pydoc corpus "
        "(all)", ""]
    with pytest.raises(ConfigError, match=r"data set nowhere: no .*nowhere/data.json"):
        ship_drafter.data_section("nowhere")


@pytest.mark.parametrize("last_layer_tap", [False, True])
def test_the_engines_section_says_what_jobs_export_does_with_the_drafter(tmp_path, shipped, last_layer_tap):
    """Asked of the export code: a three-tap EAGLE-3 exports to every format, one with the last layer's tap (four)
    to none, and the card quotes the export's own reason."""
    source = checkpoint(tmp_path / "a", last_layer_tap=last_layer_tap)
    card = (ship_drafter.ship(str(source), "eagle3-t", bench(tmp_path / "b.json", source, {"chat": 1.3}))
            / "README.md").read_text()
    engines = card[card.index("## Engines"):]
    refused = export.refusals(export.load_beside_target(str(source))[0])
    code = export.main(["--drafter", str(source), "--to", "vllm", "--out", str(tmp_path / "vllm")])
    if last_layer_tap:
        assert code == 2 and set(refused) == {"sglang", "vllm", "speculators", "gguf"}
        assert "4 taps" in refused["vllm"] and "without last_layer_tap" in refused["vllm"]
        assert f"`jobs.export --to sglang|vllm|speculators|gguf` refuses it: {refused['vllm']}." in engines
        assert "It runs on eyas's engine only." in engines and "writes it" not in engines
    else:
        assert code == 0 and refused == {} and (tmp_path / "vllm" / "config.json").is_file()
        assert "--to sglang|vllm|speculators|gguf` writes it in the engines' own formats" in engines
        assert "refuses" not in engines and "engine only" not in engines


def test_a_drafter_the_bench_did_not_time_is_refused(tmp_path, shipped):
    source = checkpoint(tmp_path / "a")
    with pytest.raises(ConfigError, match="timed the drafter"):
        ship_drafter.ship(str(source), "eagle3-t", bench(tmp_path / "b.json", tmp_path / "other", {"chat": 1.3}))
    assert ship_drafter.main([str(source), "--as", "eagle3-t", "--bench", str(tmp_path / "missing.json")]) == 2
    assert ship_drafter.main([str(source), "--as", "eagle3-t", "--bench", str(bench(tmp_path / "c.json", source, {
        "chat": 1.3})), "--notes", str(tmp_path / "missing.md")]) == 2
    assert not shipped.exists() or not any(shipped.iterdir())


def test_a_shipped_drafter_gives_way_only_to_a_faster_one(tmp_path, shipped):
    first = checkpoint(tmp_path / "first")
    ship_drafter.ship(str(first), "eagle3-t", bench(tmp_path / "1.json", first, {"chat": 1.2, "humaneval": 1.1}))
    second = checkpoint(tmp_path / "second", scale=2.0)
    with pytest.raises(ConfigError, match="needs a bench that ran eagle3@shipped"):
        ship_drafter.ship(str(second), "eagle3-t", bench(tmp_path / "2.json", second, {"chat": 1.5, "humaneval": 1.5}))
    with pytest.raises(ConfigError, match=r"not faster than the shipped eagle3-t on \['humaneval'\]"):
        ship_drafter.ship(str(second), "eagle3-t", bench(tmp_path / "3.json", second, {"chat": 1.5, "humaneval": 1.1},
                                                         {"chat": 1.2, "humaneval": 1.1}))
    assert load_file(str(shipped / "eagle3-t" / "model.safetensors"))["fc.weight"][0, 0] == 1.0  # kept
    ship_drafter.ship(str(second), "eagle3-t", bench(tmp_path / "4.json", second, {"chat": 1.5, "humaneval": 1.2},
                                                     {"chat": 1.2, "humaneval": 1.1}))
    assert load_file(str(shipped / "eagle3-t" / "model.safetensors"))["fc.weight"][0, 0] == 2.0
    assert sorted(p.name for p in shipped.iterdir()) == ["eagle3-t"]


def test_the_shipped_drafters_stay_within_the_size_cap(tmp_path, shipped, monkeypatch):
    monkeypatch.setattr("jobs.ship_drafter.MAX_SHIPPED_MB", 1e-5)
    source = checkpoint(tmp_path / "a")
    with pytest.raises(ConfigError, match="stay within"):
        ship_drafter.ship(str(source), "eagle3-t", bench(tmp_path / "b.json", source, {"chat": 1.3}))
    assert not any(shipped.iterdir())  # the staging folder is gone too
