"""How a load_peers.json is shown: one row per engine and method, tok/s at each concurrency with the speed-up over
the same engine's vanilla, acceptance and greedy agreement; then every measured level (jobs.load_peers prints it
and writes it with --report; --from re-renders a JSON). Pure: no engine, no Ray."""
from __future__ import annotations

from pathlib import Path

ENGINES = ("eyas", "vllm", "llamacpp")
ENGINE_NAMES = {"eyas": "eyas", "vllm": "vLLM", "llamacpp": "llama.cpp"}
METHODS = ("vanilla", "ngram", "eagle3")
METHOD_NAMES = {"vanilla": "vanilla", "ngram": "ngram", "eagle3": "EAGLE-3"}


def _rate(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def speedups(rows: list[dict]) -> dict[tuple[str, str, int], float]:
    """(engine, method, c) -> tok/s over the same engine's vanilla at the same c."""
    vanilla = {(r["engine"], r["concurrency"]): r["tokens_per_s"] for r in rows if r["method"] == "vanilla"}
    return {(r["engine"], r["method"], r["concurrency"]): r["tokens_per_s"] / vanilla[(r["engine"], r["concurrency"])]
            for r in rows if vanilla.get((r["engine"], r["concurrency"]))}


def summary_table(report: dict) -> str:
    """Markdown: per (engine, method), tok/s (x vanilla) at each concurrency, then acceptance, tau and agreement."""
    rows, levels = report["results"], report["config"]["concurrency"]
    ratio = speedups(rows)
    by_key = {(r["engine"], r["method"], r["concurrency"]): r for r in rows}
    head = ["engine", "method", *[f"c={c} tok/s" for c in levels], f"accept (c={levels[0]})",
            f"tau (c={levels[0]})", "same as vanilla"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine in [e for e in ENGINES if e in report["config"]["engines"]]:
        for method in [m for m in METHODS if m in report["config"]["methods"]]:
            cells = []
            for c in levels:
                row = by_key.get((engine, method, c))
                speedup = ratio.get((engine, method, c))
                cells.append("-" if row is None else f"{row['tokens_per_s']:.1f}" + (
                    f" ({speedup:.2f}x)" if method != "vanilla" and speedup is not None else ""))
            first = by_key.get((engine, method, levels[0]), {})
            same = [r["same_as_vanilla"] for r in rows if (r["engine"], r["method"]) == (engine, method)
                    and r.get("same_as_vanilla") is not None]
            lines.append("| " + " | ".join([ENGINE_NAMES[engine], METHOD_NAMES[method], *cells,
                                            _rate(first.get("acceptance")), _rate(first.get("tau"), 2),
                                            _rate(min(same) if same else None, 2)]) + " |")
    return "\n".join(lines)


def detail_table(report: dict) -> str:
    """Markdown: every measured level with its latency percentiles and per-position acceptance."""
    head = ["engine", "method", "c", "tok/s", "p50 s", "p99 s", "TTFT p50 s", "TTFT p99 s", "accept", "per position",
            "same"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        positions = " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"] or []) or "-"
        lines.append("| " + " | ".join([
            ENGINE_NAMES[r["engine"]], METHOD_NAMES[r["method"]], str(r["concurrency"]), f"{r['tokens_per_s']:.1f}",
            f"{r['latency_p50_s']:.2f}", f"{r['latency_p99_s']:.2f}", f"{r['ttft_p50_s']:.3f}",
            f"{r['ttft_p99_s']:.3f}", _rate(r["acceptance"]), positions, _rate(r.get("same_as_vanilla"), 2)]) + " |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    machine, config = report["machine"], report["config"]
    loads = [r["load_before"][0] for r in report["results"] if r.get("load_before")]
    load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "unknown"
    features = machine.get("cpu_features") or {}
    settings = "; ".join(f"{ENGINE_NAMES[e]} {METHOD_NAMES[m]}: {text}" for e, methods in config["settings"].items()
                         for m, text in methods.items() if m != "vanilla")
    return "\n".join([
        f"## eyas, vLLM and llama.cpp serving side by side ({Path(config['target']).name})", "",
        f"`{config['command']}`, commit {report['commit']}, {features.get('model') or 'unknown CPU'} "
        f"({machine.get('num_cpus')} CPUs, ISA: {' '.join(features.get('flags') or []) or 'unknown'}), 1-minute load "
        f"before each server started {load}. {config['dtype']}, {config['threads']} thread(s) per engine; "
        f"{config['requests_per_level']} requests a level (at least c) over {config['num_prompts']} "
        f"{config['prompts']} prompts, {config['max_tokens']} greedy tokens each, streamed through the openai client "
        "(jobs.load --endpoint's loop).", "",
        summary_table(report), "",
        "tok/s: generated tokens over the level's wall time, c closed-loop clients; (x vanilla): over the same "
        "engine's vanilla at the same c. accept: accepted over drafted tokens; tau: tokens per target forward (llama"
        ".cpp reports no draft rounds: -); same as vanilla: the least share, over the levels, of requests whose text "
        "equals the same engine's vanilla text for the same request.", "",
        *([f"Speculation: {settings}.", ""] if settings else []),
        detail_table(report), ""])
