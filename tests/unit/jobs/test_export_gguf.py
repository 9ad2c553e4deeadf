"""jobs.export --to gguf for DFlash, through llama.cpp's own converter and llama-server (`--spec-type draft-dflash`).

llama.cpp reads DFlash drafters (``DFlashDraftModel``, Qwen3 layers; ggml-org/llama.cpp#22105, in the release
`make tools-llamacpp` builds). A tiny random Qwen3 target with q/k norms (the engines' DFlash layers always normalise
q and k, so eyas exports DFlash for such targets only) is saved with a tokenizer llama.cpp's converter knows (it
refuses a BPE tokenizer whose pre-tokenizer it has no hash for, like the test suite's own): ``EYAS_PEER_TARGET``'s
(e.g. $EYAS_HOME/targets/smollm2-135m). Skipped where llama.cpp is not built or that variable is unset (CI);
about 20 s where both are."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.config import ConfigError
from eyas.drafters import registry
from eyas.models import load_target, load_tokenizer
from jobs import export
from jobs.peers import llamacpp

PEER_TARGET = os.environ.get("EYAS_PEER_TARGET")
DFLASH = {"num_layers": 1, "block_size": 4, "num_taps": 2, "mask_token_id": 3, "num_anchors": 8}


def why_skip() -> str | None:
    try:
        llamacpp.converter_script()
    except ConfigError as err:
        return str(err)
    return None if PEER_TARGET else "set EYAS_PEER_TARGET to a target whose tokenizer llama.cpp knows (smollm2-135m)"


pytestmark = pytest.mark.skipif(why_skip() is not None, reason=f"DFlash GGUF: {why_skip()}")


@pytest.fixture()
def qwen3_target(tmp_path) -> Path:
    """A random 8-layer Qwen3 (q/k norms) with the peer target's tokenizer, saved HF-style."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = load_tokenizer(PEER_TARGET)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper: greedy continuations repeat
    out = tmp_path / "qwen3"
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def gguf_fields(path: Path) -> dict:
    """The GGUF's metadata, read by the gguf package llama.cpp's source carries."""
    script = ("import gguf, json, sys; r = gguf.GGUFReader(sys.argv[1]); "
              "print(json.dumps({k: f.contents() for k, f in r.fields.items() if not k.startswith('tokenizer.ggml.') "
              "or k.endswith('mask_token_id')}, default=str))")
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=llamacpp.converter_env(), capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def test_dflash_exports_to_gguf_and_llama_server_drafts_with_it(qwen3_target, tmp_path):
    torch.manual_seed(0)
    model = registry.build_model("dflash", DFLASH, load_target(qwen3_target))
    drafter = registry.save_drafter(model, tmp_path / "dflash", qwen3_target)
    out = tmp_path / "dflash.gguf"
    assert export.main(["--drafter", str(drafter), "--to", "gguf", "--out", str(out)]) == 0
    fields = gguf_fields(out)
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == DFLASH["block_size"] and fields["dflash.block_count"] == 1
    assert fields["tokenizer.ggml.mask_token_id"] == DFLASH["mask_token_id"]
    # the converter turns "output of 0-based layer j" into j + 1: hidden-state indices counted from the embeddings,
    # eyas's own tap numbering (eyas.interop.layer_ids)
    assert fields["dflash.target_layers"] == list(model.target_taps)

    target = llamacpp.convert_to_gguf(qwen3_target, tmp_path / "qwen3-f32.gguf", "f32")
    prompt = [5, 9, 2, 100, 200, 5, 9, 2, 100]
    with llamacpp.llama_server(target, 1) as url:
        vanilla = llamacpp.complete(url, prompt, 24)
    log = tmp_path / "llama-server.log"
    with llamacpp.llama_server(target, 1, out, llamacpp.dflash_spec_args(3), log_path=log, trace=True) as url:
        spec = llamacpp.complete(url, prompt, 24)
    steps = llamacpp.draft_steps(log.read_text(errors="replace"))
    assert steps[0][1] == 3 and all(1 <= drafted <= 3 for _, drafted in steps)  # blocks of 3, cut near the end
    assert spec.timings["draft_n"] == sum(drafted for _, drafted in steps)
    assert spec.token_ids == vanilla.token_ids  # greedy: speculation changes nothing
