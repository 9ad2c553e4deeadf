"""What the peer jobs (jobs.bench_peers, jobs.load_peers) share around their measurements: the output flags, the
``main`` that measures or re-renders a report, the comma-separated lists, the CPU lock and the load average.

    parser = argparse.ArgumentParser(...)
    ...                                   # the job's own flags
    add_report_args(parser, "bench_peers.json", lock_help="... for each measurement")
    return report_main(parser.parse_args(argv), "bench_peers", run, markdown)

``report_main``: with ``--from JSON[,JSON...]`` it renders those reports, one after the other, and measures nothing;
else it calls the job's ``run`` and writes its JSON to ``--out`` (atomically). Either way it prints the Markdown and
writes it to ``--report`` when given. A user's mistake (ConfigError, a missing file, a bad value) is one line on
stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from eyas.config import ConfigError
from eyas.files import write_text_atomic
from eyas.models import CheckpointError

# a user's mistake: reported in one line, exit status 2 (anything else is a bug and keeps its traceback)
USER_ERRORS = (ConfigError, CheckpointError, FileNotFoundError, ValueError)


def add_report_args(parser: argparse.ArgumentParser, default_out: str, lock_help: str) -> None:
    """--out, --report, --from and --lock, as every peer job takes them."""
    parser.add_argument("--out", default=default_out, help="the JSON report")
    parser.add_argument("--report", help="write the Markdown tables here too")
    parser.add_argument("--lock", metavar="FILE", help=f"take this flock (a shared machine's CPU lock) {lock_help}, "
                        "not for the whole run")
    parser.add_argument("--from", dest="source", metavar="JSON",
                        help=f"render this {Path(default_out).name} (several joined by commas: one page); measure "
                        "nothing")


def report_main(args: argparse.Namespace, job: str, run: Callable[[argparse.Namespace], dict[str, Any]],
                markdown: Callable[[dict[str, Any]], str]) -> int:
    """Measure (``run(args)``, its JSON to --out) or read --from's JSONs, then print and write their Markdown; the exit
    status (2 for a user's mistake, said on stderr)."""
    try:
        if args.source:
            reports = [json.loads(Path(source).read_text()) for source in parse_list(args.source, None, "--from")]
        else:
            reports = [run(args)]
            write_text_atomic(Path(args.out), json.dumps(reports[0], indent=2))
            print(f"[{job}] wrote {args.out}", file=sys.stderr)
        text = "\n".join(markdown(report) for report in reports)
        if args.report:
            write_text_atomic(Path(args.report), text)
        print(text)
        return 0
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def parse_list(text: str, known: tuple[str, ...] | None, flag: str) -> list[str]:
    """``a,b,c`` as a list without repeats, in order; every item one of ``known`` (None: any)."""
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not items:
        raise ConfigError(f"{flag} {text!r}: empty; give one or more items joined by commas")
    unknown = [x for x in items if known is not None and x not in known]
    if unknown:
        raise ConfigError(f"{flag} {text!r}: unknown {unknown}; known: {list(known)}")
    return items


@contextlib.contextmanager
def cpu_lock(path: str | None) -> Iterator[None]:
    """Hold ``path``'s exclusive flock for the block (None: no lock). A job takes it per measurement, so on a shared
    machine each engine is timed while the other lock-takers wait, and none of them waits for the whole run."""
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
