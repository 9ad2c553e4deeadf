"""How a bench_peers.json is shown: each engine at its best thread count per dtype, eyas over each peer, and every
measured row, as Markdown (jobs.bench_peers prints it and writes it with --report; --from re-renders a JSON)."""
from __future__ import annotations

from pathlib import Path

ENGINES = ("eyas", "llamacpp", "vllm")
ENGINE_NAMES = {"eyas": "eyas", "llamacpp": "llama.cpp", "vllm": "vLLM"}
DTYPES = ("bfloat16", "float32", "q8_0")
GGUF_TYPE = {"bfloat16": "bf16", "float32": "f32", "q8_0": "q8_0"}
ENGINE_DTYPES = {"eyas": DTYPES, "llamacpp": DTYPES, "vllm": ("bfloat16", "float32")}  # eyas q8_0: Q8_0 weights
TIMING_NOTES = {"eyas": "eyas, in-process wall time",
                "llamacpp": "llama.cpp, llama-server's own timings (prompt + decode, no HTTP)",
                "vllm": "vLLM, HTTP wall time on localhost"}


def best_rows(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(engine, dtype) -> the row of its fastest thread count."""
    best: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["engine"], row["dtype"])
        if key not in best or row["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = row
    return best


def summary(rows: list[dict]) -> list[dict]:
    """Per dtype: each engine's best (tok/s, threads) and eyas's tok/s over each peer's, both at their best."""
    best = best_rows(rows)
    out = []
    for dtype in [d for d in DTYPES if any(k[1] == d for k in best)]:
        entry: dict = {"dtype": dtype, "engines": {}, "eyas_over": {}}
        for engine in ENGINES:
            row = best.get((engine, dtype))
            if row is not None:
                entry["engines"][engine] = {"tokens_per_s": row["tokens_per_s"], "threads": row["threads"]}
        eyas = entry["engines"].get("eyas")
        for engine, peer in entry["engines"].items():
            if engine != "eyas" and eyas and peer["tokens_per_s"]:
                entry["eyas_over"][engine] = round(eyas["tokens_per_s"] / peer["tokens_per_s"], 3)
        out.append(entry)
    return out


def _cell(engine_entry: dict | None) -> str:
    if engine_entry is None:
        return "-"
    threads = engine_entry["threads"]
    return f"{engine_entry['tokens_per_s']:.1f} ({threads}{'t' if isinstance(threads, int) else ''})"


def summary_table(report: dict) -> str:
    """Markdown: per dtype, each engine's tok/s at its best thread count, and eyas/peer."""
    entries = report["summary"]
    engines = [e for e in ENGINES if any(e in entry["engines"] for entry in entries)]
    peers = [e for e in engines if e != "eyas"]
    head = ["dtype"] + [f"{ENGINE_NAMES[e]} tok/s (threads)" for e in engines] + [f"eyas / {ENGINE_NAMES[p]}"
                                                                                  for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in entries:
        cells = [entry["dtype"]] + [_cell(entry["engines"].get(e)) for e in engines]
        cells += [f"{entry['eyas_over'][p]:.2f}x" if p in entry["eyas_over"] else "-" for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(report: dict) -> str:
    """Markdown: every (engine, dtype, threads) row, per-suite tok/s and agreement with eyas's tokens."""
    suites = report["config"]["suites"]
    head = ["engine", "dtype", "threads", "tok/s", *[f"{s} tok/s" for s in suites], "wall tok/s", "same as eyas",
            "timing"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["results"]:
        same = "-" if row["same_as_eyas"] is None else f"{row['same_as_eyas']:.2f}"
        cells = [ENGINE_NAMES[row["engine"]], row["dtype"], str(row["threads"]), f"{row['tokens_per_s']:.1f}",
                 *[f"{row['suites'].get(s, 0.0):.1f}" for s in suites], f"{row['wall_tokens_per_s']:.1f}", same,
                 row["timing"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    machine, config = report["machine"], report["config"]
    loads = [r["load_before"][0] for r in report["results"] if r["load_before"]]
    load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "unknown"
    return "\n".join([
        f"## eyas vanilla beside the peer engines ({Path(config['target']).name})", "",
        f"`{config['command']}`, commit {report['commit']}, {machine['cpu_model']} ({machine['num_cpus']} CPUs, "
        f"ISA: {' '.join(machine['cpu_features']['flags']) or 'unknown'}), 1-minute load before each measurement {load}. "
        f"{config['num_prompts']} prompts a suite ({', '.join(config['suites'])}), {config['max_new_tokens']} "
        "greedy tokens, one request at a time.", "",
        summary_table(report), "",
        detail_table(report), "",
        "Timing: " + "; ".join(TIMING_NOTES[e] for e in ENGINES if e in config.get("engines", ENGINES)) + ". "
        "eyas/peer compares each engine at its best thread count.", ""])
