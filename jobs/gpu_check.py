"""The GPU check: one prepared run for a lent device (about 5 minutes on an H200), the same code at a tiny size on
CPU in CI.

    python -m jobs.gpu_check --out out/gpu-check [--size 1b|tiny] [--device auto|cuda|cpu] [--dtype NAME]
        [--new-tokens N] [--threads N]

On a random-weight Llama (``1b``: hidden 2048, 16 layers, GQA 32/8, vocab 32000, 1.1B parameters; ``tiny`` for
CI), nothing downloaded, it runs in order and times each step:

  parity      eyas's decoder against transformers on the same weights: max logit difference, greedy agreement
              (judged in float32; a reduced --dtype is reported, then the same checkpoint is judged in float32)
  curve       the target's t(N) for N = 1 ... 64 new tokens after a 512-token context, and the memory read
              bandwidth against the weight bytes a decode step reads (eyas.decoding.costs)
  speed       vanilla and speculative tokens/s (ngram; EAGLE-3 and DFlash drafters with random weights: their tau is
              near 1, but their cost per cycle and the cycle's draft / verify / other split are real)
  train       one EAGLE-3 drafter training step (target features, loss, backward, AdamW)
  serve       TP=1 serving through the in-process SpecEngine (the engine a Serve replica runs, without Ray Serve and
              HTTP: starting Ray and Serve on a fresh machine would take a good part of the budget), 8 requests at
              concurrency 1, 4 and 8

and writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out``. A failing step is recorded with its error and the
run goes on; the exit status is 1 if any step failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.decoding import costs
from eyas.decoding.engine import SpecEngine
from eyas.decoding.generate import generate
from eyas.decoding.requests import SequenceRequest
from eyas.drafters import registry
from eyas.files import write_text_atomic
from eyas.methods import SpecConfig, build_drafter, drafter_factory
from eyas.models import DTYPES, Decoder, ModelConfig, load_target, torch_dtype
from eyas.models.features import TrainBatch, target_features
from eyas.models.parity import first_difference, greedy_native, max_logit_diff
from eyas.threads import configure_threads
from jobs.bench import git_commit, machine


@dataclass(frozen=True)
class Size:
    """A random-weight Llama (the library's ModelConfig) and the workload run on it."""
    model: ModelConfig
    context: int          # tokens before the t(N) curve's new ones; the prompts' length
    new_tokens: int       # per generation
    num_prompts: int
    curve_repeats: int
    train_batch: tuple[int, int]  # (sequences, tokens) of the training step

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


SIZES = {
    "1b": Size(ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                           num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=4096),
               context=512, new_tokens=128, num_prompts=2, curve_repeats=10, train_batch=(4, 512)),
    # 6 layers: the fewest that give DFlash its 3 distinct taps (2nd .. 3rd-from-last) and EAGLE-3 its low/mid/high
    "tiny": Size(ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=6,
                             num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256),
                 context=48, new_tokens=16, num_prompts=2, curve_repeats=2, train_batch=(2, 32)),
}
PARITY_ATOL = {torch.float32: 1e-4}  # reduced precision: reported, not judged (kernels differ by shape)


def build_checkpoint(size: Size, directory: Path, dtype: torch.dtype, device: torch.device) -> Path:
    """A seeded random-weight LlamaForCausalLM saved as a checkpoint directory (built on the device: fast)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = size.model
    config = LlamaConfig(vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                         intermediate_size=model.intermediate_size, num_hidden_layers=model.num_layers,
                         num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads,
                         head_dim=model.head_dim, max_position_embeddings=model.max_position_embeddings,
                         tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # a sharper random model: greedy continuations repeat, so n-gram drafts get accepted
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(directory))
    return directory


def random_prompts(size: Size, count: int, length: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, size.vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def parity(directory: Path, target: Decoder, size: Size, dtype: torch.dtype) -> dict[str, Any]:
    """Logits of one causal forward and greedy tokens, eyas against transformers on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(target.device).eval()
    prompts = random_prompts(size, 2, min(64, size.context))
    diffs = [max_logit_diff(target, hf, torch.tensor([ids], device=target.device)) for ids in prompts]
    num_new = min(32, size.new_tokens)
    mismatches = []
    for ids in prompts:
        ours = greedy_native(target, ids, num_new)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device=target.device), do_sample=False, max_new_tokens=num_new,
                              eos_token_id=[], pad_token_id=0,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=target.device))
        mismatches.append(first_difference(ours, out[0, len(ids):].tolist()))
    atol = PARITY_ATOL.get(dtype)
    passed = None if atol is None else max(diffs) <= atol and all(m is None for m in mismatches)
    del hf
    return {"max_logit_diff": max(diffs), "atol": atol, "greedy_new_tokens": num_new,
            "greedy_first_mismatch": mismatches, "passed": passed}


def curve(target: Decoder, size: Size) -> dict[str, Any]:
    timings = costs.forward_costs(target, size.context, repeats=size.curve_repeats)
    t_1 = timings[1].median
    weight_bytes = costs.decode_weight_bytes(target)
    # twice the weights, at least 64 MiB: past the caches (a GPU's L2 is tens of MiB)
    read_bytes, read = costs.read_seconds(max(2 * weight_bytes, 64 << 20), target.device, target.dtype,
                                          size.curve_repeats)
    return {"context_tokens": size.context,
            "t_forward_ms": {str(n): t.to_dict(1e3) for n, t in timings.items()},
            "t_ratio": {str(n): round(t.median / t_1, 3) for n, t in timings.items()},
            "weight_bytes_per_token": weight_bytes,
            "read_GBps": round(read_bytes / read.min / 1e9, 1),
            "bandwidth_limit_tokens_per_s": round(read_bytes / read.min / weight_bytes, 1),
            "warnings": costs.busy_reasons({f"t({n})": t for n, t in timings.items()})}


def random_drafter_dir(target: Decoder, family: str, directory: Path, size: Size) -> Path:
    """A drafter of ``family`` with random (untrained) weights, saved for the method table to load."""
    torch.manual_seed(2)
    config = {"draft_vocab_size": min(8192, size.vocab_size)} if family == "eagle3" else {
        "num_layers": 1, "block_size": 8, "num_taps": 3}
    draft_vocab = list(range(min(8192, size.vocab_size))) if family == "eagle3" else None
    model = registry.build_model(family, config, target, draft_vocab=draft_vocab)
    return registry.save_drafter(model, directory / family, directory / "target")


def speed(target: Decoder, size: Size, drafters: dict[str, Path], curve_s: dict[int, float] | None
          ) -> dict[str, Any]:
    """Tokens/s of vanilla and each speculative method on the same prompts, with each cycle's split."""
    prompts = random_prompts(size, size.num_prompts, size.context // 2, seed=3)
    specs = {"vanilla": SpecConfig(), "ngram": SpecConfig(method="ngram"),
             **{m: SpecConfig(method=m, drafter=str(path)) for m, path in drafters.items()}}
    rows = {}
    for method, spec in specs.items():
        generate(target, prompts[0][:16], 4, drafter=build_drafter(target, spec))  # warm-up: kernels, caches
        seconds, tokens, stats = 0.0, 0, None
        for ids in prompts:
            drafter = build_drafter(target, spec)
            _sync(target.device)
            start = time.perf_counter()
            result = generate(target, ids, size.new_tokens, drafter=drafter)
            _sync(target.device)
            seconds += time.perf_counter() - start
            tokens += len(result.token_ids)
            stats = result.stats if stats is None else stats.merge(result.stats)
        speculates = method != "vanilla"
        cycles = stats.cycles if speculates else tokens - len(prompts)
        mean_nodes = stats.num_draft_nodes / stats.cycles + 1 if speculates and stats.cycles else 1.0
        rows[method] = {"tokens_per_s": round(tokens / seconds, 2), "new_tokens": tokens,
                        "tau": round(stats.tau, 3) if speculates and stats.tau else None,
                        **costs.method_costs(stats.draft_s, stats.verify_s, stats.other_s, cycles, mean_nodes,
                                             stats.tau if speculates else None, curve_s)}
    base = rows["vanilla"]["tokens_per_s"]
    for row in rows.values():
        row["speedup"] = round(row["tokens_per_s"] / base, 3)
    return rows


def train_step(target: Decoder, size: Size) -> dict[str, Any]:
    """One EAGLE-3 training step on the target's features of random sequences (the first step warms up)."""
    num_rows, length = size.train_batch
    ids_BT = torch.tensor(random_prompts(size, num_rows, length, seed=4), device=target.device)
    batch = TrainBatch(ids_BT, torch.ones_like(ids_BT, dtype=torch.float32), torch.ones_like(ids_BT,
                                                                                            dtype=torch.float32))
    torch.manual_seed(5)
    model = registry.build_model("eagle3", {"ttt_steps": 3}, target, draft_vocab=list(range(min(8192,
                                                                                               size.vocab_size))))
    model.float()  # the drafter trains in float32 beside a reduced-precision target (EagleModel.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = {}
    for label in ("warmup", "timed"):
        _sync(target.device)
        start = time.perf_counter()
        features = target_features(target, batch.input_ids_BT, model.target_taps)
        _sync(target.device)
        features_s = time.perf_counter() - start
        model.train()
        loss, _ = model.training_loss(batch, features)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        _sync(target.device)
        out = {"batch": [num_rows, length], "features_s": round(features_s, 4),
               "step_s": round(time.perf_counter() - start - features_s, 4), "loss": round(float(loss.detach()), 4),
               "finite": bool(torch.isfinite(loss))}
    return out


def serve(target: Decoder, size: Size) -> dict[str, Any]:
    """TP=1 serving through the in-process engine: 8 requests at concurrency 1, 4 and 8, vanilla and ngram, and how
    many requests' tokens equal vanilla's at concurrency 1 (all of them in float32; batched kernels may flip
    near-ties in reduced precision)."""
    prompts = random_prompts(size, 8, size.context // 2, seed=6)
    rows, reference = {}, None
    for method in ("vanilla", "ngram"):
        factory = drafter_factory(target, SpecConfig(method=method))
        for concurrency in (1, 4, 8):
            engine = SpecEngine(target, capacity=concurrency, max_len=size.context + size.new_tokens + 64,
                                drafter_factory=factory)
            requests = [SequenceRequest(f"r{i}", ids, size.new_tokens) for i, ids in enumerate(prompts)]
            _sync(target.device)
            start = time.perf_counter()
            done = engine.run(requests)
            _sync(target.device)
            seconds = time.perf_counter() - start
            outputs = {request_id: tokens for request_id, (tokens, _) in done.items()}
            reference = reference or outputs  # vanilla at concurrency 1 runs first
            new_tokens = sum(len(tokens) for tokens in outputs.values())
            rows[f"{method}@{concurrency}"] = {
                "method": method, "concurrency": concurrency, "tokens_per_s": round(new_tokens / seconds, 2),
                "new_tokens": new_tokens,
                "num_equal_vanilla": sum(outputs[r] == reference[r] for r in reference)}
    return {"how": "in-process SpecEngine (a TP=1 Serve replica's engine), not Ray Serve over HTTP", "runs": rows}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(name: str, summary: dict, call: Callable[[], Any],
             record: Callable[[Any], Any] = lambda result: result) -> Any:
    """Run one step, record its result (or its error: the run goes on) and its seconds. ``record`` turns what the
    step returns (a checkpoint path, a loaded model) into what gpu_check.json keeps of it."""
    print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        result = call()
        summary["steps"][name] = {"ok": True, "seconds": round(time.perf_counter() - start, 2),
                                  "result": record(result)}
        return result
    except Exception as err:  # noqa: BLE001 (recorded in the summary and the exit status, never hidden)
        summary["steps"][name] = {"ok": False, "seconds": round(time.perf_counter() - start, 2),
                                  "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        print(f"[gpu_check] {name} FAILED: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return None


def run(size_name: str, device: torch.device, dtype: torch.dtype, out: Path, new_tokens: int | None = None
        ) -> dict[str, Any]:
    size = SIZES[size_name]
    if new_tokens:
        size = replace(size, new_tokens=new_tokens)
    started = time.perf_counter()
    summary: dict[str, Any] = {"commit": git_commit(), "machine": machine(), "device": str(device),
                               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
                               "cpu", "dtype": str(dtype).replace("torch.", ""), "size": size_name,
                               "config": asdict(size), "steps": {}}
    with tempfile.TemporaryDirectory(prefix="eyas-gpu-check-") as tmp:
        work = Path(tmp)
        checkpoint = work / "target"
        built = run_step("build", summary, lambda: build_checkpoint(size, checkpoint, dtype, device),
                         record=lambda path: {"checkpoint_bytes": sum(f.stat().st_size for f in path.iterdir())})
        target = run_step("load", summary, lambda: load_target(checkpoint, dtype=dtype, device=device),
                          record=lambda model: {"num_parameters": sum(p.numel() for p in model.parameters()),
                                                "dtype": str(model.dtype).replace("torch.", ""),
                                                "device": str(model.device)}) if built else None
        if target is not None:
            summary["num_parameters"] = summary["steps"]["load"]["result"]["num_parameters"]
            run_step("parity", summary, lambda: parity(checkpoint, target, size, dtype))
            if dtype != torch.float32:  # reduced precision is reported, not judged: judge the same weights in float32
                run_step("parity_float32", summary, lambda: parity(
                    checkpoint, load_target(checkpoint, dtype=torch.float32, device=device), size, torch.float32))
            measured = run_step("curve", summary, lambda: curve(target, size))
            curve_s = ({int(n): t["median"] / 1e3 for n, t in measured["t_forward_ms"].items()}
                       if measured else None)
            drafters = run_step("drafters", summary, lambda: {
                "eagle3": str(random_drafter_dir(target, "eagle3", work, size)),
                "dflash": str(random_drafter_dir(target, "dflash", work, size))}) or {}
            run_step("speed", summary, lambda: speed(target, size, {m: Path(p) for m, p in drafters.items()},
                                                      curve_s))
            run_step("train", summary, lambda: train_step(target, size))
            run_step("serve", summary, lambda: serve(target, size))
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["ok"] = all(step["ok"] for step in summary["steps"].values())
    write_text_atomic(out / "gpu_check.json", json.dumps(summary, indent=2))
    write_text_atomic(out / "gpu_check.md", markdown(summary))
    return summary


def markdown(summary: dict[str, Any]) -> str:
    steps = summary["steps"]
    lines = [f"# eyas GPU check: {summary['device_name']}, {summary['dtype']}, size {summary['size']}",
             "", f"commit {summary['commit']}, {summary.get('num_parameters', 0):,} parameters, "
             f"{summary['seconds']} s in all", "", "| step | ok | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if s['ok'] else 'FAILED: ' + s['error']} | {s['seconds']} |"
              for name, s in steps.items()]
    result = lambda name: steps.get(name, {}).get("result")  # noqa: E731
    for name, label in (("parity", summary["dtype"]), ("parity_float32", "float32")):
        if (p := result(name)):
            lines += ["", f"Parity ({label}): max logit diff {p['max_logit_diff']:.3e} (limit {p['atol']}); greedy "
                          f"first mismatch per prompt {p['greedy_first_mismatch']} of {p['greedy_new_tokens']} tokens"]
    if (c := result("curve")):
        lines += ["", f"t(N) after {c['context_tokens']} tokens (ms, median): " +
                  ", ".join(f"t({n}) {t['median']:.3f}" for n, t in c["t_forward_ms"].items()),
                  f"t(N)/t(1): " + ", ".join(f"{n}: {r:.2f}" for n, r in c["t_ratio"].items()),
                  f"Read bandwidth {c['read_GBps']} GB/s; {c['weight_bytes_per_token'] / 1e9:.2f} GB of weights per "
                  f"decode token: limit {c['bandwidth_limit_tokens_per_s']} tok/s"]
    if (s := result("speed")):
        lines += ["", "| method | tok/s | speedup | tau | limit | draft | verify | other |",
                  "|---|---|---|---|---|---|---|---|"]
        for method, r in s.items():
            split = r["time_split"]
            lines.append(f"| {method} | {r['tokens_per_s']} | {r['speedup']} | {r['tau'] or '-'} | "
                         f"{r['predicted_speedup'] or '-'} | {split['draft']:.0%} | {split['verify']:.0%} | "
                         f"{split['other']:.0%} |")
    if (t := result("train")):
        lines += ["", f"EAGLE-3 training step, batch {t['batch']}: features {t['features_s']} s, step {t['step_s']} s, "
                      f"loss {t['loss']}"]
    if (v := result("serve")):
        lines += ["", f"Serving ({v['how']}): " + ", ".join(
            f"{k} {r['tokens_per_s']} tok/s ({r['num_equal_vanilla']}/8 equal vanilla@1)"
            for k, r in v["runs"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gpu-check")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cuda, cuda:N or cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--new-tokens", type=int, help="tokens per generation (default: the size's)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: eyas.threads' policy)")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device}: no CUDA device here (torch {torch.__version__})", file=sys.stderr)
        return 2
    dtype = torch_dtype(args.dtype, "--dtype") if args.dtype else (torch.bfloat16 if device.type == "cuda" else
                                                                 torch.float32)
    summary = run(args.size, device, dtype, Path(args.out), args.new_tokens)
    print(markdown(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
