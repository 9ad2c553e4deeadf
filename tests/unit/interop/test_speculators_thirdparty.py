"""Third-party load: the ``speculators`` package (0.9.0) loads eyas's EAGLE-3, EAGLE-3.1, P-EAGLE, DFlash, DSpark and
DFlash2 exports with its own classes (Eagle3DraftModel / PEagleDraftModel / DFlashDraftModel / DSparkDraftModel /
DFlash2DraftModel.from_pretrained) and its draft logits equal eyas's within 1e-4 (float32); for DSpark and DFlash2 its
Markov head / candidate selector, fed the tokens eyas's greedy walk drafted, gives the same distributions, the same
tokens and (DSpark) the same confidences.

speculators pins transformers <= 5.19, older than eyas's, so it runs in a subprocess from a separate tool folder:
``make test`` installs it (with --no-deps) into .venv-tools/speculators, put before .venv's site-packages on
PYTHONPATH (torch and the rest come from .venv). EYAS_SPECULATORS_PYTHON, if set, names a python with speculators
0.9.0 to use instead. Skipped only when neither exists (pytest run by hand before any ``make test``); a broken tool
folder fails. No network is needed (the verifier is a local directory); about 15 s."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interop_testing import QWEN3, drafter, tiny
from safetensors.torch import save_file

from eyas.drafters.dflash2 import DFlash2Drafter
from eyas.drafters.dspark import DSparkDrafter
from eyas.drafters.peagle import PEagleDrafter
from eyas.drafters.trees import TreeSpec
from eyas.interop import write_export

TOOL_DIR = Path(__file__).resolve().parents[3] / ".venv-tools" / "speculators"  # the Makefile's $(SPECULATORS)
PYTHON = os.environ.get("EYAS_SPECULATORS_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON and not TOOL_DIR.is_dir(), reason=(
    f"no speculators 0.9.0 environment: `make test` builds {TOOL_DIR}; or set EYAS_SPECULATORS_PYTHON to a python "
    "with speculators 0.9.0 (CI runs `make test`, so this never skips there)"))


def speculators_run(args: list[str]) -> subprocess.CompletedProcess:
    """Runs ``python ARGS`` with speculators importable: EYAS_SPECULATORS_PYTHON, else this python with the tool folder
    first on PYTHONPATH (its transformers 5.19 shadows .venv's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not PYTHON:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TOOL_DIR), env.get("PYTHONPATH")) if p)
    return subprocess.run([PYTHON or sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)


def verifier_dir(target, directory: Path) -> str:
    """What speculators reads of the verifier: its config.json and embed / lm_head / final norm weights."""
    c = target.config
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[c.model_type]],
        "model_type": c.model_type, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "vocab_size": c.vocab_size, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim}))
    save_file({"model.embed_tokens.weight": target.embed_tokens.weight.contiguous(),
               "lm_head.weight": target.lm_head.weight.contiguous(), "model.norm.weight": target.norm.weight.contiguous()},
              str(directory / "model.safetensors"))
    return str(directory)


def export(model, kind: str, target, tmp_path: Path, computed: dict) -> None:
    """``model`` in speculators' format at tmp_path/KIND (with its verifier), and what eyas computed with it at
    tmp_path/KIND.pt for speculators_check.py to compare."""
    write_export(model, "speculators", tmp_path / kind, verifier_dir(target, tmp_path / f"verifier-{kind}"))
    torch.save(computed, tmp_path / f"{kind}.pt")


@torch.no_grad()
def test_speculators_loads_exports_with_equal_logits(tmp_path):
    tokens_1T = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    T = tokens_1T.shape[1]
    target = tiny()
    eagles = {kind: drafter(kind, target) for kind in ("eagle3", "eagle3.1", "peagle")}  # the same taps
    _, taps = target(tokens_1T, torch.arange(T)[None], target.new_cache(1, T), taps=eagles["eagle3"].target_taps)
    prefix = {k: taps[k][:, :-1] for k in taps}  # index i: (embed(t_{i+1}), taps at i), position i
    for kind in ("eagle3", "eagle3.1"):  # EAGLE-3.1: fc_norm, a norm per tap before fc; norm_output
        eagle = eagles[kind]
        _, logits_1TX, _ = eagle.step(tokens_1T[:, 1:], eagle.initial_hidden(prefix), torch.arange(T - 1)[None], None,
                                      None)
        export(eagle, kind, target, tmp_path, {"hidden": torch.cat([prefix[k] for k in eagle.target_taps], -1),
                                               "ids": tokens_1T[:, 1:], "logits": logits_1TX.float()})

    parallel = eagles["peagle"]  # 2 layers, 3 depths: the root's entry and 2 mask entries in one pass
    one_pass = PEagleDrafter(parallel, TreeSpec(mode="block"))
    one_pass.begin(tokens_1T[0, :-1].tolist(), {k: prefix[k][0] for k in parallel.target_taps})
    export(parallel, "peagle", target, tmp_path, {"hidden": torch.cat([prefix[k] for k in parallel.target_taps], -1),
                                                  "ids": tokens_1T[:, 1:], "depths": one_pass.depth,
                                                  "logits": one_pass.draft_logits(int(tokens_1T[0, -1]))})

    qwen3 = tiny(QWEN3)
    block = drafter("dflash", qwen3)
    _, taps = qwen3(tokens_1T, torch.arange(T)[None], qwen3.new_cache(1, T), taps=block.target_taps)
    C = T - 1  # the root (last token) is not yet run by the target: the context is positions 0..C-1
    context = {k: taps[k][:, :C] for k in block.target_taps}
    kv = block.context_kv(block.fuse(context), torch.arange(C)[None])
    hidden_1GE = block.block_hidden(block.embed_block(tokens_1T[:, -1]), torch.arange(C, C + block.block_size)[None],
                                    kv, mask_BQS=None)
    block_inputs = {"features": torch.cat([context[k] for k in block.target_taps], -1), "root": int(tokens_1T[0, -1]),
                    "context_len": C}
    export(block, "dflash", qwen3, tmp_path, {**block_inputs, "logits": block.logits(hidden_1GE).float()})

    for kind, drafter_cls in (("dspark", DSparkDrafter), ("dflash2", DFlash2Drafter)):  # one pass, then the walk
        family = drafter(kind, qwen3)
        walker = drafter_cls(family, TreeSpec(mode="block"))
        walker.begin(tokens_1T[0, :C].tolist(), {k: context[k][0] for k in family.target_taps})
        walked = walker.walk(int(tokens_1T[0, -1]), 0.0, None)
        states_GE = walker.draft_states(int(tokens_1T[0, -1]))
        export(family, kind, qwen3, tmp_path, {**block_inputs, "tokens": walked[0], "probs": walked[1].float(),
                                               "confidence": walked[2].float() if kind == "dspark" else None,
                                               "unary": family.logits(states_GE).float()})

    script = Path(__file__).with_name("speculators_check.py")
    run = speculators_run([str(script), str(tmp_path)])
    print(run.stdout[-2000:], file=sys.stderr)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]
