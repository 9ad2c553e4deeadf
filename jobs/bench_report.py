"""How a bench.json is shown: the terminal table, the figure, and Markdown (the results page and the tables generated
into the README), all from the JSON alone: rendering measures nothing again.

    python -m jobs.bench --from docs/bench-smollm2-s5.json,docs/bench-smollm2-s5-chat8.json \\
        --report docs/results.md --update-tables README.md

``--report PATH`` writes a whole results page: per target, per bench.json, the summary table (method x suite:
speedup and tau, with the command, commit, machine and settings) and the details (tok/s, per-depth acceptance,
the cycle's time split, the cost model, the figure). ``--update-tables FILE`` rewrites each block of FILE between
``<!-- bench-table PATH -->`` and ``<!-- bench-table:end -->`` with the summary of the bench.json at PATH (relative
to FILE), the very text the results page shows for it, so the README cannot drift from its JSON.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from eyas.config import ConfigError
from eyas.files import atomic_write

BLOCK = re.compile(r"(<!-- bench-table (\S+) -->\n)(.*?)(<!-- bench-table:end -->)", re.S)
REPORT_KEYS = {"commit", "machine", "config", "results"}


def load_report(path: str | Path) -> dict:
    """A bench.json, or a ConfigError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such bench.json") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not a readable bench.json ({err})") from None
    if not isinstance(report, dict) or not REPORT_KEYS <= set(report):
        raise ConfigError(f"{path}: not a bench.json (needs the keys {sorted(REPORT_KEYS)})")
    return report


# ---------------------------------------------------------------- facts about one run

def target_name(report: dict) -> str:
    return Path(report["config"]["target"]).name


def suites(report: dict) -> list[str]:
    return list(report["config"].get("suites") or dict.fromkeys(r["suite"] for r in report["results"]))


def methods(report: dict) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in report["results"]))


def command(report: dict) -> str:
    """The measuring command as a reader types it: ``python -m jobs.bench`` and ``$EYAS_HOME`` for the paths the
    run's own machine had there."""
    words = report["config"].get("command", "").split()
    if words and words[0].endswith("bench.py"):
        words[0:1] = ["python", "-m", "jobs.bench"]
    text = " ".join(words)
    target = Path(report["config"]["target"])
    if target.parent.name == "targets":  # $EYAS_HOME/targets/<name>
        text = text.replace(f"{target.parent.parent}/", "$EYAS_HOME/")
    return text


def dtype(report: dict) -> str:
    found = report["config"].get("dtype") or ((report.get("cost_model") or {}).get("bandwidth") or {}).get("dtype")
    if found:
        return found
    match = re.search(r"--dtype[ =](\S+)", report["config"].get("command", ""))
    return match.group(1) if match else "float32"  # the bench's default


def machine(report: dict) -> str:
    info, cost = report["machine"], report.get("cost_model") or {}
    threads = info.get("threads") or {}
    cores = threads.get("available_cores") or cost.get("cpu_count")
    parts = [info.get("cpu_model") or info.get("cpu") or "unknown CPU"]
    kind = (info.get("cpu_features") or {}).get("kind")
    if kind:
        parts.append(f"{kind} kernels")
    if cores:
        parts.append(f"{cores} cores")
    num = info.get("torch_threads")
    if num:
        policy = f" ({threads['policy']} policy)" if threads.get("policy") else ""
        parts.append(f"{num} torch thread{'s' if num != 1 else ''}{policy}")
    adaptive = threads.get("kernel_threads")
    if adaptive:
        parts.append(f"eyas kernels {adaptive[0]}-{adaptive[1]} threads (adaptive)")
    parts.append(f"GPU {info['cuda']}" if info.get("cuda") else "no GPU")
    band = cost.get("bandwidth")
    if band:
        parts.append(f"weights read at {band['read_GBps']['best']:.1f} GB/s")
    others = (cost.get("cpu") or {}).get("others_cores")
    if others is not None:
        parts.append(f"other processes {others:.2f} cores while measuring")
    return ", ".join(parts)


def settings(spec: dict | None) -> str:
    """A spec's non-default tree settings, short (``4 nodes, depth 3, top-4``)."""
    if not spec or spec.get("method") == "vanilla":
        return ""
    parts = [" + ".join(spec["proposers"])] if spec.get("proposers") else []
    if spec.get("tree"):
        parts.append(spec["tree"])
    if spec.get("num_nodes") is not None:
        parts.append(f"{spec['num_nodes']} nodes")
    if spec.get("depth") is not None:
        parts.append(f"depth {spec['depth']}")
    if spec.get("top_k") is not None:
        parts.append(f"top-{spec['top_k']}")
    if spec.get("num_draft") is not None:  # ngram: the tokens a match copies; draft-lm: its chain
        parts.append(f"{spec['num_draft']} tokens a match" if spec.get("method") == "ngram" else
                     f"chain of {spec['num_draft']}")
    if spec.get("max_matches") is not None:
        parts.append(f"{spec['max_matches']} matches")
    if spec.get("datastore"):
        parts.append(f"datastore {' + '.join(spec['datastore'])}")
    if spec.get("learned_below") is not None:
        parts.append(f"learned below {spec['learned_below']}")
    if spec.get("cost_cut"):
        parts.append("cost cut")
    return ", ".join(parts) or "defaults"


def model_used(spec: dict | None) -> str:
    """The drafter (or draft LM) a method ran with, by its directory name."""
    if not spec:
        return ""
    path = spec.get("drafter") or spec.get("draft_model")
    return f"`{Path(path).name}`" if path else ""


def rows_by_suite(report: dict) -> dict[str, dict[str, dict]]:
    table: dict[str, dict[str, dict]] = {}
    for row in report["results"]:
        table.setdefault(row["suite"], {})[row["method"]] = row
    return table


# ---------------------------------------------------------------- Markdown

def _speedup(row: dict | None, best: float) -> str:
    if row is None:
        return ""
    text = f"{row['speedup']:.2f}x"
    return f"**{text}**" if row["speedup"] == best and row["method"] != "vanilla" else text


def _tau(row: dict | None) -> str:
    return "" if row is None else (f"{row['tau']:.2f}" if row.get("tau") else "-")


def summary(report: dict, json_path: Path, base: Path) -> str:
    """Method x suite, speedup and tau, with what was run where: the README's table and the page's first one."""
    names, by_suite, specs = suites(report), rows_by_suite(report), report["config"].get("specs") or {}
    best = {s: max((r["speedup"] for m, r in by_suite.get(s, {}).items() if m != "vanilla"), default=None)
            for s in names}
    lines = ["| method | settings | " + " | ".join(f"{s} speedup | {s} tau" for s in names) + " |",
             "|---|---|" + "---|---|" * len(names)]
    for method in methods(report):
        cells = [f"{_speedup(by_suite.get(s, {}).get(method), best[s])} | {_tau(by_suite.get(s, {}).get(method))}"
                 for s in names]
        lines.append(f"| {method} | {settings(specs.get(method))} | " + " | ".join(cells) + " |")
    vanilla = [f"{by_suite[s]['vanilla']['tokens_per_s']:.1f} tok/s on {s}" for s in names
               if "vanilla" in by_suite.get(s, {})]
    config = report["config"]
    speculative = [r for r in report["results"] if r.get("same_as_vanilla") is not None]
    differ = sorted({r["method"] for r in speculative if r["same_as_vanilla"] != 1.0})
    lossless = ("every speculative method decoded vanilla's very tokens on every prompt" if not differ else
                f"{', '.join(differ)} decoded another text than vanilla on some prompts: not a lossless speedup")
    lines += ["",
              f"Speedup is tokens/s over eyas `vanilla` on the same prompts in the same run ({', '.join(vanilla)}); "
              "tau is the tokens a cycle emits (accepted + 1). "
              f"Target `{target_name(report)}`, {dtype(report)}, greedy, {config.get('num_prompts')} prompts a "
              f"suite, {config.get('max_new_tokens')} new tokens; {lossless}.",
              "",
              f"- command: `{command(report)}`",
              f"- commit: `{report['commit']}`",
              f"- machine: {machine(report)}",
              f"- data: [{json_path.name}]({_link(json_path, base)})"]
    return "\n".join(lines) + "\n"


def details(report: dict, json_path: Path, base: Path) -> str:
    """Per suite: tok/s, acceptance, time split and the cost model's limit; then the cost curve and the figure."""
    specs = report["config"].get("specs") or {}
    lines = []
    for suite, rows in rows_by_suite(report).items():
        lines += [f"**{suite}**", "",
                  "| method | model | tok/s | speedup | tau | per-depth acceptance | same | draft / verify / other "
                  "| of limit |", "|---|---|---|---|---|---|---|---|---|"]
        for method, row in rows.items():
            split = row.get("time_split")
            shares = " / ".join(f"{100 * split[k]:.0f}%" for k in ("draft", "verify", "other")) if split else "-"
            depth = " ".join(f"{a:.2f}" for a in row.get("per_depth_accept") or []) or "-"
            same = f"{row['same_as_vanilla']:.2f}" if row.get("same_as_vanilla") is not None else "-"
            limit = f"{row['of_limit']:.2f}" if row.get("of_limit") else "-"
            lines.append(f"| {method} | {model_used(specs.get(method))} | {row['tokens_per_s']:.1f} | "
                         f"{row['speedup']:.2f}x | {_tau(row)} | {depth} | {same} | {shares} | {limit} |")
        lines.append("")
    cost = report.get("cost_model")
    if cost:
        ratio = " / ".join(f"{r:.2f}" for r in cost["t_ratio"].values())
        sizes = " / ".join(cost["t_ratio"])
        t1 = cost["t_forward_ms"]["1"]["median"]
        lines.append(f"Cost model: t(N)/t(1) {ratio} at N = {sizes} new tokens after {cost['context_tokens']} "
                     f"tokens of context (t(1) {t1:.1f} ms). \"of limit\" is the measured speedup over "
                     "tau * t(1) / (t(N) + t_draft).")
        for suite, v in cost["vanilla"].items():
            hf = f", {v['vs_hf']:.2f}x transformers `generate()`" if v.get("vs_hf") else ""
            lines.append(f"Vanilla on {suite}: {v['of_bandwidth_limit']:.0%} of the memory-bandwidth limit "
                         f"({cost['bandwidth']['limit_tokens_per_s']:.1f} tok/s){hf}.")
        lines += [f"WARNING (measured by the run): {w}" for w in cost.get("warnings", [])]
        lines.append("")
    skipped = report["config"].get("skipped") or {}
    if skipped:
        lines += [f"Skipped: {', '.join(f'{m} ({why})' for m, why in skipped.items())}.", ""]
    figure = json_path.with_suffix(".png")
    if figure.is_file():
        lines += [f"![speedup and tau per method, {json_path.stem}]({_link(figure, base)})", ""]
    return "\n".join(lines)


def page(sources: list[str], out: str) -> str:
    """The whole results page ``out`` from the bench.json files ``sources`` (paths as typed, from the cwd)."""
    base = Path(out).parent
    reports = [(Path(s), load_report(s)) for s in sources]
    lines = ["# Results", "",
             "Generated from bench JSON, not written by hand: change a run, then regenerate this page with",
             "", "```bash", f"python -m jobs.bench --from {','.join(sources)} --report {out}", "```", "",
             "Every method ran on the same prompts, interleaved, in one `jobs.bench` run per table: compare methods "
             "within a table, not across machines. Columns: *speedup* is tokens/s over eyas `vanilla` in the same "
             "run; *tau* the tokens a cycle emits (accepted + 1); *per-depth acceptance* the share of drafts "
             "reaching depth d that the target accepted there; *same* the share of prompts decoded to vanilla's "
             "very tokens (1.00: lossless); *draft / verify / other* a cycle's time; *of limit* the speedup over "
             "the cost model's prediction tau * t(1) / (t(N) + t_draft). Why bfloat16 can be exact on a CPU: "
             "[threads and dtypes](threads-and-dtypes.md).", "",
             "A run of your own (`python -m jobs.bench --help` lists every flag):", "", "```bash",
             "python -m jobs.bench --methods vanilla,hf,ngram,eagle3 --suite humaneval,chat --num-prompts 4 \\",
             "    --dtype bfloat16 --spec '$EYAS_HOME/sweeps/eagle3-tree-smollm2/best.yaml' --out docs/bench-NAME.json",
             "```", "",
             "A trained method reads its drafter at `$EYAS_HOME/drafters/<family>-<target>`, else the one eyas ships in "
             "`serving/drafters`, unless a `--spec` (a sweep's `best.yaml`) names one; `<method>@shipped` (`eagle3@shipped`) "
             "always reads the shipped one; `--suite` is code, prose, chat, humaneval or all, or `--prompts-file "
             "FILE.jsonl` brings your own prompts. Then add the JSON to this page's `--from` list.", ""]
    for target in dict.fromkeys(target_name(r) for _, r in reports):
        lines += [f"## {target}", ""]
        for path, report in reports:
            if target_name(report) != target:
                continue
            config = report["config"]
            lines += [f"### {', '.join(suites(report))}: {config.get('num_prompts')} prompts a suite "
                      f"({path.name})", "", summary(report, path, base), details(report, path, base)]
    return "\n".join(lines).rstrip() + "\n"


def update_tables(text: str, base: Path) -> str:
    """``text`` with every bench-table block rewritten from the bench.json its start marker names (relative to
    ``base``, the directory of the file the text comes from)."""
    def render(match: re.Match) -> str:
        path = base / match.group(2)
        return match.group(1) + summary(load_report(path), path, base) + match.group(4)

    return BLOCK.sub(render, text)


def write_page(sources: list[str], out: str) -> Path:
    text = page(sources, out)
    return atomic_write(Path(out), lambda tmp: tmp.write_text(text))


def write_tables(file: str) -> Path:
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"--update-tables {path}: no such file")
    text = path.read_text()
    if not BLOCK.search(text):
        raise ConfigError(f"--update-tables {path}: no <!-- bench-table PATH --> ... <!-- bench-table:end --> block")
    new = update_tables(text, path.parent)
    return atomic_write(path, lambda tmp: tmp.write_text(new))


def _link(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


# ---------------------------------------------------------------- the terminal and the figure

def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = report["config"]["suites"]
    order = methods(report)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(names)
    for j, suite in enumerate(names):
        rows = {r["method"]: r for r in report["results"] if r["suite"] == suite}
        xs = [i + j * width for i in range(len(order))]
        axes[0].bar(xs, [rows[m]["speedup"] if m in rows else 0 for m in order], width, label=suite)
        axes[1].bar(xs, [(rows[m]["tau"] or 0) if m in rows else 0 for m in order], width, label=suite)
    for ax, title in zip(axes, ("speedup over eyas vanilla", "tau (accepted + 1 per cycle)")):
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(order))], order, rotation=45,
                      ha="right")
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
    fig.suptitle(f"eyas bench @ {report['commit']}, {report['config']['max_new_tokens']} new tokens")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def print_table(report: dict) -> None:
    print(f"{'method':<18}{'suite':<10}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'same':>6}{'limit':>8}{'of-lim':>8}"
          f"{'draft':>7}{'verify':>7}{'other':>7}  per-depth accept")
    for r in report["results"]:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        same = f"{r['same_as_vanilla']:.2f}" if r.get("same_as_vanilla") is not None else "-"
        limit = f"{r['predicted_speedup']:.2f}x" if r.get("predicted_speedup") else "-"
        of_limit = f"{r['of_limit']:.2f}" if r.get("of_limit") else "-"
        split = r.get("time_split")
        shares = "".join(f"{100 * split[k]:>6.0f}%" for k in ("draft", "verify", "other")) if split else \
            f"{'-':>7}" * 3
        depth = " ".join(f"{a:.2f}" for a in (r["per_depth_accept"] or [])[:6])
        print(f"{r['method']:<18}{r['suite']:<10}{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x{tau:>7}{same:>6}"
              f"{limit:>8}{of_limit:>8}{shares}  {depth}")
        for name, rates in (r.get("per_proposer_accept") or {}).items():  # a hybrid's, under its row
            print(f"{'':<18}{'':<10}{'':>58}  {name}: {' '.join(f'{a:.2f}' for a in rates[:6])}")
    cost = report.get("cost_model")
    if cost:
        print_costs(cost)
    differ = sorted({r["method"] for r in report["results"] if r.get("same_as_vanilla") not in (None, 1.0)})
    if differ:
        print(f"NOTE: {differ} decoded another text than vanilla on some prompts (column 'same'): their speedup "
              "is not a lossless one here (reduced precision where the verify is not exact: "
              "docs/threads-and-dtypes.md)")
    print(f"commit {report['commit']}; {report['config']['command']}")


def print_costs(cost: dict) -> None:
    curve = "  ".join(f"t({n}) {t['median']:.2f}" for n, t in cost["t_forward_ms"].items())
    ratio = "  ".join(f"{n}:{r:.2f}" for n, r in cost["t_ratio"].items())
    band = cost["bandwidth"]
    print(f"target forward after {cost['context_tokens']} tokens, ms (median of {cost['repeats']}): {curve}")
    print(f"t(N)/t(1): {ratio}")
    print(f"memory: {band['weight_bytes_per_token'] / 1e6:.0f} MB of {band['dtype']} weights per decode token, "
          f"read at {band['read_GBps']['best']:.1f} GB/s -> limit {band['limit_tokens_per_s']:.1f} tok/s")
    for suite, v in cost["vanilla"].items():
        hf = f", {v['vs_hf']:.2f}x transformers generate()" if v["vs_hf"] else ""
        decode = (f"; its decode steps alone {v['decode_tokens_per_s']:.1f} tok/s, "
                  f"{v['decode_of_bandwidth_limit']:.0%}" if v.get("decode_tokens_per_s") else "")
        print(f"vanilla on {suite}: {v['tokens_per_s']:.1f} tok/s end to end, {v['of_bandwidth_limit']:.0%} of the "
              f"bandwidth limit{decode}{hf}")
    cpu = cost["cpu"]
    load = cpu["load_average"]
    print(f"load average {load['start']:.2f} -> {load['end']:.2f} on {cost['cpu_count']} cores, "
          f"{cost['torch_threads']} torch threads")
    others = (f"other processes {cpu['others_cores']:.2f}" if cpu["others_cores"] is not None else
              "other processes not measured (no /proc/stat: the load average stands in)")
    print(f"CPU while measuring ({cpu['wall_s']:.0f} s, {cpu['num_cores']} cores): ours {cpu['own_cores']:.2f} "
          f"cores, {others}")
    for warning in cost["warnings"]:
        print(f"WARNING: {warning}")
