"""How a bench_peers.json is shown: each engine's vanilla at its best thread count per dtype and eyas over each peer;
where the run measured speculative methods, eyas's best lossless method against the best peer row (plain or
speculative) per suite and overall, and the 1.3x goal (GOAL); then every measured row, refused ones with the
engine's reason, as Markdown (jobs.bench_peers prints it and writes it with --report; --from re-renders a JSON).

A row's ``method`` is "vanilla" where a report from before methods has none. eyas's lossless rows: vanilla, and
every speculative method that decoded its own vanilla's very tokens on every prompt (``same_as_vanilla`` 1.0). A peer
row counts whether lossless or not (its ``same_as_vanilla`` is shown): the goal is against the fastest it offers."""
from __future__ import annotations

from pathlib import Path

ENGINES = ("eyas", "llamacpp", "vllm")
ENGINE_NAMES = {"eyas": "eyas", "llamacpp": "llama.cpp", "vllm": "vLLM"}
DTYPES = ("bfloat16", "float32", "q8_0")
GGUF_TYPE = {"bfloat16": "bf16", "float32": "f32", "q8_0": "q8_0"}
ENGINE_DTYPES = {"eyas": DTYPES, "llamacpp": DTYPES, "vllm": ("bfloat16", "float32")}  # eyas q8_0: Q8_0 weights
GOAL = 1.3  # eyas's best lossless method over the best peer row (issue 47)
VANILLA = "vanilla"
TIMING_NOTES = {"eyas": "eyas, in-process wall time",
                "llamacpp": "llama.cpp, llama-server's own timings (prompt + decode, no HTTP)",
                "vllm": "vLLM, HTTP wall time on localhost"}


def method_of(row: dict) -> str:
    return row.get("method", VANILLA)


def measured(row: dict) -> bool:
    """The row has a speed: the engine ran the method (not refused) and generated tokens."""
    return not row.get("refused") and row["tokens_per_s"] > 0


def lossless(row: dict) -> bool:
    """Vanilla, or a speculative method whose tokens were its own vanilla's on every prompt."""
    return method_of(row) == VANILLA or row.get("same_as_vanilla") == 1.0


def best_rows(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(engine, dtype) -> the vanilla row of its fastest thread count."""
    best: dict[tuple[str, str], dict] = {}
    for row in [r for r in rows if method_of(r) == VANILLA and measured(r)]:
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


def _rate(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _speed(scope: str):
    """A row's tok/s over every prompt (scope "overall") or over one suite's."""
    return (lambda r: r["tokens_per_s"]) if scope == "overall" else (lambda r: r["suites"].get(scope, 0.0))


def _pick(row: dict, speed) -> dict:
    return {"engine": row["engine"], "method": method_of(row), "threads": row["threads"],
            "tokens_per_s": speed(row), "same_as_vanilla": row.get("same_as_vanilla")}


def best_vs_best(rows: list[dict], suites: list[str]) -> list[dict]:
    """Per dtype and scope (each suite, then overall): eyas's fastest lossless row against the fastest peer row of
    any method, each at its best thread count; their ratio and whether it reaches GOAL. Beside it, the fastest peer
    row that is lossless too (``lossless_peer``, ``lossless_ratio``). A dtype with no eyas or no peer row is left
    out."""
    out = []
    for dtype in DTYPES:
        mine = [r for r in rows if r["dtype"] == dtype and r["engine"] == "eyas" and measured(r) and lossless(r)]
        peers = [r for r in rows if r["dtype"] == dtype and r["engine"] != "eyas" and measured(r)]
        if not mine or not peers:
            continue
        for scope in [*suites, "overall"]:
            speed = _speed(scope)
            eyas, peer = max(mine, key=speed), max(peers, key=speed)
            lossless_peer = max([r for r in peers if lossless(r)], key=speed)  # vanilla is lossless: never empty
            ratio = round(speed(eyas) / speed(peer), 3) if speed(peer) else None
            out.append({"dtype": dtype, "scope": scope, "eyas": _pick(eyas, speed), "peer": _pick(peer, speed),
                        "ratio": ratio, "meets_goal": ratio is not None and ratio >= GOAL,
                        "lossless_peer": _pick(lossless_peer, speed),
                        "lossless_ratio": round(speed(eyas) / speed(lossless_peer), 3) if speed(lossless_peer)
                        else None})
    return out


def _who(entry: dict) -> str:
    threads = entry["threads"]
    return (f"{entry['tokens_per_s']:.1f} ({ENGINE_NAMES[entry['engine']]} {entry['method']}, "
            f"{threads}{'t' if isinstance(threads, int) else ''})")


def goal_table(report: dict) -> str:
    """Markdown: per dtype and scope, eyas's best lossless row, the best peer row, their ratio against GOAL."""
    head = ["dtype", "prompts", "eyas best lossless tok/s", "best peer tok/s", "peer same as its vanilla",
            "eyas / best peer", f">= {GOAL}x", "best lossless peer tok/s", "eyas / best lossless peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratio = lambda value: "-" if value is None else f"{value:.2f}x"  # noqa: E731
    for entry in best_vs_best(report["results"], report["config"]["suites"]):
        cells = [entry["dtype"], entry["scope"], _who(entry["eyas"]), _who(entry["peer"]),
                 _rate(entry["peer"]["same_as_vanilla"]), ratio(entry["ratio"]),
                 "yes" if entry["meets_goal"] else "no", _who(entry["lossless_peer"]), ratio(entry["lossless_ratio"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tokens_per_forward(row: dict) -> float | None:
    """Tokens a target forward yields, over every prompt: generated / (generated - accepted drafted tokens)."""
    accepted = row.get("num_accepted")
    if accepted is None or not row["new_tokens"]:
        return None
    return row["new_tokens"] / (row["new_tokens"] - accepted)


def ratio_parts(rows: list[dict], entry: dict) -> dict:
    """Where a best_vs_best ratio comes from: ratio = plain x eyas_speedup / peer_speedup, where plain is eyas's
    vanilla over the peer engine's vanilla and each speedup is a method over its own engine's vanilla (same dtype
    and threads); and each side's tokens per target forward (overall only: acceptance is counted per run)."""
    speed = _speed(entry["scope"])

    def row_of(side: dict, method: str) -> dict | None:
        return next((r for r in rows if r["engine"] == side["engine"] and r["dtype"] == entry["dtype"]
                     and r["threads"] == side["threads"] and method_of(r) == method and measured(r)), None)

    eyas, eyas_plain = row_of(entry["eyas"], entry["eyas"]["method"]), row_of(entry["eyas"], VANILLA)
    peer, peer_plain = row_of(entry["peer"], entry["peer"]["method"]), row_of(entry["peer"], VANILLA)
    if None in (eyas, eyas_plain, peer, peer_plain) or not speed(peer_plain) or not speed(eyas_plain):
        return {}
    def per_forward(row: dict) -> float | None:
        value = tokens_per_forward(row) if entry["scope"] == "overall" else None
        return None if value is None else round(value, 2)

    return {"plain": round(speed(eyas_plain) / speed(peer_plain), 3),
            "eyas_speedup": round(speed(eyas) / speed(eyas_plain), 3),
            "peer_speedup": round(speed(peer) / speed(peer_plain), 3),
            "eyas_tokens_per_forward": per_forward(eyas), "peer_tokens_per_forward": per_forward(peer)}


def parts_table(report: dict) -> str:
    """Markdown: each goal row's ratio as plain speed x eyas's speedup / the peer's speedup, and tokens per
    target forward on each side."""
    head = ["dtype", "prompts", "eyas vanilla / peer vanilla", "eyas method / its vanilla",
            "peer method / its vanilla", "tokens per target forward, eyas / peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in best_vs_best(report["results"], report["config"]["suites"]):
        parts = ratio_parts(report["results"], entry)
        if not parts:
            continue
        per_forward = ("-" if parts["eyas_tokens_per_forward"] is None and parts["peer_tokens_per_forward"] is None
                       else f"{_rate(parts['eyas_tokens_per_forward'])} / {_rate(parts['peer_tokens_per_forward'])}")
        lines.append("| " + " | ".join([entry["dtype"], entry["scope"], f"{parts['plain']:.2f}x",
                                        f"{parts['eyas_speedup']:.2f}x", f"{parts['peer_speedup']:.2f}x",
                                        per_forward]) + " |")
    return "\n".join(lines)


def has_methods(report: dict) -> bool:
    """The run measured speculative methods (or an engine refused one)."""
    return any(method_of(r) != VANILLA for r in report["results"])


def detail_table(report: dict) -> str:
    """Markdown: every (engine, [method,] dtype, threads) row, per-suite tok/s and agreement with eyas's tokens; with
    methods also acceptance, tau, agreement with the engine's own vanilla, and a refused method's reason."""
    suites = report["config"]["suites"]
    methods = has_methods(report)
    head = ["engine", *(["method"] if methods else []), "dtype", "threads", "tok/s", *[f"{s} tok/s" for s in suites],
            "wall tok/s", *(["accept", "tau", "same as its vanilla"] if methods else []), "same as eyas", "timing"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["results"]:
        cells = [ENGINE_NAMES[row["engine"]], *([method_of(row)] if methods else []), row["dtype"], str(row["threads"])]
        if row.get("refused"):
            cells += ["refused"] + ["-"] * (len(head) - len(cells) - 2) + [row["refused"].replace("|", "/")]
        else:
            cells += [f"{row['tokens_per_s']:.1f}", *[f"{row['suites'].get(s, 0.0):.1f}" for s in suites],
                      f"{row['wall_tokens_per_s']:.1f}"]
            if methods:
                cells += [_rate(row.get("acceptance")), _rate(row.get("tau")), _rate(row.get("same_as_vanilla"))]
            cells += [_rate(row["same_as_eyas"]), row["timing"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settings_notes(report: dict) -> list[str]:
    """One line per engine: each method's settings as the run gave them."""
    settings = report["config"].get("settings") or {}
    return [f"- {ENGINE_NAMES[engine]}: " + "; ".join(f"{method}: {text}" for method, text in by_method.items())
            for engine, by_method in settings.items()]


def markdown(report: dict) -> str:
    machine, config = report["machine"], report["config"]
    loads = [r["load_before"][0] for r in report["results"] if r["load_before"]]
    load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "unknown"
    methods = has_methods(report)
    title = ("eyas's speculative methods beside the peer engines'" if methods
             else "eyas vanilla beside the peer engines")
    run = (f"`{config['command']}`, commit {report['commit']}, {machine['cpu_model']} ({machine['num_cpus']} CPUs, "
           f"ISA: {' '.join(machine['cpu_features']['flags']) or 'unknown'}), 1-minute load before each measurement "
           f"{load}. {config['num_prompts']} prompts a suite ({', '.join(config['suites'])}), "
           f"{config['max_new_tokens']} greedy tokens, one request at a time.")
    timing = ("Timing: " + "; ".join(TIMING_NOTES[e] for e in ENGINES if e in config.get("engines", ENGINES)) + ". "
              "eyas/peer compares each engine at its best thread count.")
    if not methods:
        return "\n".join([f"## {title} ({Path(config['target']).name})", "", run, "", summary_table(report), "",
                          detail_table(report), "", timing, ""])
    return "\n".join([
        f"## {title} ({Path(config['target']).name})", "", run, "",
        f"eyas's best lossless method (vanilla, or a speculative method that decoded vanilla's very tokens on every "
        f"prompt) against the fastest peer row, plain or speculative, each at its best thread count (goal: "
        f">= {GOAL}x):", "",
        goal_table(report), "",
        "Where each ratio comes from (it equals the first column times the second over the third):", "",
        parts_table(report), "",
        "Vanilla, each engine at its best thread count:", "",
        summary_table(report), "",
        detail_table(report), "",
        timing + " accept: accepted over drafted tokens; tau: tokens per target forward (eyas, vLLM; llama-server "
        "does not count draft rounds); same as its vanilla: the share of prompts whose tokens equal the same engine's "
        "vanilla at the same dtype and threads. Settings:", "",
        *settings_notes(report), ""])
