"""The target's linear layers at M rows: plain ``F.linear``, eyas's packed layout (eyas.models.packing) and a
transposed (column-major) copy, per weight kind, and what eyas runs (``PackedLinear``: the panel kernel for up to
32 float32 or bfloat16 rows at one thread, eyas.models.panels; else column-major parameters at one float32 row, the
packed copy otherwise).

    python -m jobs.bench_linear [--target PATH] [--dtypes float32,bfloat16] [--rows 1,4,16,64] [--repeats 5]
        [--threads N] [--out bench_linear.json]

Per dtype and M, the milliseconds to multiply M rows by every linear weight one target forward reads (the fused
q/k/v and gate/up, o_proj, down_proj and the LM head), in three layouts: ``F.linear`` on row-major copies of the
weights, the packed copies ``Decoder.fuse`` builds (``PackedLinear.multi_row``), and ``F.linear`` on a transposed
view of a contiguous [I, O] copy (``x @ W_IO``, what a column-major weight costs), and as eyas runs them
(``PackedLinear``); the best of ``--repeats`` passes, the layouts interleaved, and the read bandwidth each reaches
(weight bytes / time), in all and per weight kind. A decode step is M = 1; a tree verify is M = its nodes. In
bfloat16 on a CPU with AMX, eyas's panels also run on the AVX512_BF16 vector kernel (AMX off, ``vector_ms``), side
by side with the AMX one.
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
from eyas.models import CheckpointError, load_target, panels, torch_dtype
from eyas.models.decoder import Decoder
from eyas.models.packing import PackedLinear
from eyas.threads import configure_threads


LAYOUTS = ("linear", "packed", "transposed", "eyas")


def linears(target: Decoder) -> list[tuple[str, torch.Tensor, PackedLinear]]:
    """(weight kind, a row-major copy of weight_OI, its PackedLinear) of every linear one forward reads, in forward
    order."""
    triples = []
    for layer in target.layers:
        attn, mlp = layer.self_attn, layer.mlp
        triples.append(("qkv", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                        attn.fused_qkv))
        triples.append(("o_proj", attn.o_proj.weight.detach().contiguous(), attn.packed_o))
        triples.append(("gate_up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                        mlp.fused_gate_up))
        triples.append(("down_proj", mlp.down_proj.weight.detach().contiguous(), mlp.packed_down))
    triples.append(("lm_head", target.lm_head.weight.detach().contiguous(), target.lm_head.packed))
    return triples


@torch.inference_mode()
def measure(target: Decoder, rows: list[int], repeats: int) -> list[dict]:
    triples = linears(target)
    transposed = [weight_OI.t().contiguous().t() for _, weight_OI, _ in triples]  # [O, I] view of an [I, O] copy
    kind_bytes: dict[str, int] = {}
    for kind, weight_OI, _ in triples:
        kind_bytes[kind] = kind_bytes.get(kind, 0) + weight_OI.numel() * weight_OI.element_size()
    weight_bytes = sum(kind_bytes.values())
    amx = target.dtype == torch.bfloat16 and panels.uses_amx()
    # vector: the AVX512_BF16 kernel, AMX off, side by side with eyas's AMX one. It reads the same panels, so it
    # runs after another layout (not right after eyas): a pass over the same bytes would find part of them cached.
    layouts = ("linear", "eyas", "packed", "vector", "transposed") if amx else LAYOUTS
    out = []
    for M in rows:
        inputs = {w.shape[1]: torch.randn(M, w.shape[1], dtype=target.dtype) for _, w, _ in triples}
        best = {(layout, k): float("inf") for layout in layouts for k in kind_bytes}
        for _ in range(repeats + 1):  # the first pass warms up and is not counted
            for layout in layouts:
                seconds = dict.fromkeys(kind_bytes, 0.0)
                if amx:
                    panels.set_amx(layout != "vector")
                for (kind, weight_OI, packed), weight_T in zip(triples, transposed):
                    x_MI = inputs[weight_OI.shape[1]]
                    start = time.perf_counter()
                    if layout == "packed":
                        packed.multi_row(x_MI)
                    elif layout in ("eyas", "vector"):
                        packed(x_MI)
                    else:
                        F.linear(x_MI, weight_OI if layout == "linear" else weight_T)
                    seconds[kind] += time.perf_counter() - start
                for kind, s in seconds.items():
                    best[(layout, kind)] = min(best[(layout, kind)], s)
        if amx:
            panels.set_amx(True)
        totals = {layout: sum(best[(layout, k)] for k in kind_bytes) for layout in layouts}
        out.append({"dtype": str(target.dtype).removeprefix("torch."), "rows": M, "weight_bytes": weight_bytes,
                    "packed_on": triples[0][2].packed, "amx": amx,
                    **{f"{layout}_ms": seconds * 1e3 for layout, seconds in totals.items()},
                    **{f"{layout}_gb_s": weight_bytes / seconds / 1e9 for layout, seconds in totals.items()},
                    "by_kind_gb_s": {k: {layout: b / best[(layout, k)] / 1e9 for layout in layouts}
                                     for k, b in kind_bytes.items()}})
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
    print(f"{'dtype':9s} {'rows':>4s} {'F.linear ms':>11s} {'packed ms':>9s} {'transposed ms':>13s} {'eyas ms':>7s} "
          f"{'ratio':>6s} {'eyas GB/s':>9s}  GB/s per weight (F.linear / packed / transposed)")
    for r in results:
        kinds_gb_s = "  ".join(f"{k} {v['linear']:.1f}/{v['packed']:.1f}/{v['transposed']:.1f}"
                               for k, v in r["by_kind_gb_s"].items())
        print(f"{r['dtype']:9s} {r['rows']:4d} {r['linear_ms']:11.1f} {r['packed_ms']:9.1f} {r['transposed_ms']:13.1f} "
              f"{r['eyas_ms']:7.1f} {r['linear_ms'] / r['eyas_ms']:5.2f}x {r['eyas_gb_s']:9.1f}  {kinds_gb_s}"
              + ("" if r["packed_on"] else "  (not packed here: plain F.linear as packed)")
              + (f"  AMX; AVX512_BF16 vectors {r['vector_ms']:.1f} ms" if r["amx"] else ""))
    print(f"{settings.num_threads} torch thread(s); {results[0]['weight_bytes'] / 1e6:.0f} MB of "
          f"{results[0]['dtype']} weights")
    Path(args.out).write_text(json.dumps({"threads": settings.num_threads, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
