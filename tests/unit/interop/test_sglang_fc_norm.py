"""EAGLE-3.1 on SGLang (eyas.interop.eagle3's docstring): the SGLang export carries what SGLang's llama_eagle3.py reads
for the per-tap norms, computed the way SGLang computes them; its README says an older SGLang drops them silently;
SGLang's older spellings (``use_aux_norm``, ``aux_norm_{low,mid,high}``) import as the same drafter."""
import json

import torch
from interop_testing import drafter, tiny
from safetensors.torch import load_file, save_file

from eyas.drafters import registry
from eyas.interop import write_export

NOTE = "Needs an SGLang whose llama_eagle3.py reads `fc_norm` and `norm_output`"


def sglang_fuse(config: dict, state: dict, concat_TF: torch.Tensor) -> torch.Tensor:
    """SGLang's LlamaModel.forward on the 3E-wide target input, from the export alone: one RMSNorm(target_hidden_size,
    rms_norm_eps) per aux state (as many as eagle_config's layer ids), chunk by chunk, then fc."""
    num_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    chunks = concat_TF.chunk(num_aux, dim=-1)
    normed = [torch.nn.functional.rms_norm(c, (config["target_hidden_size"],), state[f"fc_norm.{i}.weight"],
                                           config["rms_norm_eps"]) for i, c in enumerate(chunks)]
    return torch.cat(normed, -1) @ state["fc.weight"].T


def test_the_sglang_export_of_eagle31_is_what_sglang_reads(tmp_path):
    target = tiny()
    model = drafter("eagle3.1", target)
    out = write_export(model, "sglang", tmp_path / "e31", "tiny")
    config, state = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["fc_norm"] is True and config["norm_output"] is True and "use_aux_norm" not in config
    assert len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3 and config["target_hidden_size"] == 32
    assert config["rms_norm_eps"] == target.config.rms_norm_eps
    assert {k: tuple(v.shape) for k, v in state.items() if "norm" in k and not k.startswith("midlayer.")} == {
        "fc_norm.0.weight": (32,), "fc_norm.1.weight": (32,), "fc_norm.2.weight": (32,), "norm.weight": (32,)}
    concat_TF = torch.randn(5, 3 * 32) * torch.tensor([1.0, 30.0, 0.01]).repeat_interleave(32)  # unequal scales
    torch.testing.assert_close(sglang_fuse(config, state, concat_TF), model.fuse(concat_TF), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(concat_TF @ state["fc.weight"].T, model.fuse(concat_TF), atol=1e-2)  # norms matter
    assert NOTE in (out / "README.md").read_text()
    for kind, fmt in (("eagle3", "sglang"), ("eagle3.1", "vllm")):  # the note is for EAGLE-3.1 on SGLang only
        other = write_export(drafter(kind, target), fmt, tmp_path / f"{kind}-{fmt}", "tiny")
        assert NOTE not in (other / "README.md").read_text()


def test_sglangs_older_spellings_import_as_the_same_drafter(tmp_path):
    """``use_aux_norm`` for the flag and ``aux_norm_{low,mid,high}`` for the tensors, as SGLang's loader maps them."""
    target = tiny()
    model = drafter("eagle3.1", target)
    out = write_export(model, "sglang", tmp_path / "e31", "tiny")
    config = json.loads((out / "config.json").read_text())
    config["use_aux_norm"] = config.pop("fc_norm")
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(str(out / "model.safetensors"))
    for i, name in enumerate(("low", "mid", "high")):
        state[f"aux_norm_{name}.weight"] = state.pop(f"fc_norm.{i}.weight")
    save_file(state, str(out / "model.safetensors"))
    loaded = registry.load_model(out, target)
    assert loaded.drafter_type == "eagle3.1" and loaded.config == model.config
    mine = model.state_dict()
    assert loaded.state_dict().keys() == mine.keys()
    assert all(torch.equal(tensor, mine[name]) for name, tensor in loaded.state_dict().items())
