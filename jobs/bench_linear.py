"""The target's linear layers at M rows: plain ``F.linear`` against eyas's packed layout (eyas.models.packing).

    python -m jobs.bench_linear [--target PATH] [--dtypes float32,bfloat16] [--rows 1,4,16,64] [--repeats 5]
        [--threads N] [--out bench_linear.json]

Per dtype and M, the milliseconds to multiply M rows by every linear weight one target forward reads (the fused
q/k/v and gate/up, o_proj, down_proj and the LM head), through ``F.linear`` on the row-major weights and through
the ``PackedLinear`` copies ``Decoder.fuse`` builds; the best of ``--repeats`` passes, the two interleaved, and
the read bandwidth each reaches (weight bytes / time). A decode step is M = 1; a tree verify is M = its nodes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eyas.config import eyas_home, resolve_path
from eyas.models import CheckpointError, load_target, torch_dtype
from eyas.models.decoder import Decoder
from eyas.models.packing import PackedLinear
from eyas.threads import configure_threads


def linears(target: Decoder) -> list[tuple[torch.Tensor, PackedLinear]]:
    """(row-major weight_OI, its packed copy) of every linear one forward reads, in forward order."""
    pairs = []
    for layer in target.layers:
        attn, mlp = layer.self_attn, layer.mlp
        pairs.append((torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                      attn.fused_qkv))
        pairs.append((attn.o_proj.weight.detach(), attn.packed_o))
        pairs.append((torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), mlp.fused_gate_up))
        pairs.append((mlp.down_proj.weight.detach(), mlp.packed_down))
    pairs.append((target.lm_head.weight.detach(), target.lm_head.packed))
    return pairs


@torch.inference_mode()
def measure(target: Decoder, rows: list[int], repeats: int) -> list[dict]:
    pairs = linears(target)
    weight_bytes = sum(w.numel() * w.element_size() for w, _ in pairs)
    out = []
    for M in rows:
        inputs = {w.shape[1]: torch.randn(M, w.shape[1], dtype=target.dtype) for w, _ in pairs}
        best = {"linear": float("inf"), "packed": float("inf")}
        for _ in range(repeats + 1):  # the first pass warms up and is not counted
            for kind in best:
                start = time.perf_counter()
                for weight_OI, packed in pairs:
                    x_MI = inputs[weight_OI.shape[1]]
                    F.linear(x_MI, weight_OI) if kind == "linear" else packed(x_MI)
                best[kind] = min(best[kind], time.perf_counter() - start)
        out.append({"dtype": str(target.dtype).removeprefix("torch."), "rows": M, "weight_bytes": weight_bytes,
                    "packed_on": pairs[0][1].packed,
                    **{f"{kind}_ms": seconds * 1e3 for kind, seconds in best.items()},
                    **{f"{kind}_gb_s": weight_bytes / seconds / 1e9 for kind, seconds in best.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: eyas.threads' policy)")
    parser.add_argument("--out", default="bench_linear.json")
    args = parser.parse_args(argv)
    settings = configure_threads(args.threads)
    try:
        dtypes = [torch_dtype(name.strip(), "--dtypes") for name in args.dtypes.split(",") if name.strip()]
        rows = [int(m) for m in args.rows.split(",") if m.strip()]
        if not rows or min(rows) < 1:
            raise ValueError(f"--rows={args.rows!r}: positive row counts, joined by commas")
        results = [r for dtype in dtypes
                   for r in measure(load_target(resolve_path(args.target), dtype=dtype), rows, args.repeats)]
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{'dtype':9s} {'rows':>4s} {'F.linear ms':>11s} {'packed ms':>9s} {'ratio':>6s} {'packed GB/s':>11s}")
    for r in results:
        print(f"{r['dtype']:9s} {r['rows']:4d} {r['linear_ms']:11.1f} {r['packed_ms']:9.1f} "
              f"{r['linear_ms'] / r['packed_ms']:5.2f}x {r['packed_gb_s']:11.1f}"
              + ("" if r["packed_on"] else "  (not packed here: plain F.linear both ways)"))
    print(f"{settings.num_threads} torch thread(s); {results[0]['weight_bytes'] / 1e6:.0f} MB of "
          f"{results[0]['dtype']} weights")
    Path(args.out).write_text(json.dumps({"threads": settings.num_threads, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
