"""jobs.peers.cli, what jobs.bench_peers and jobs.load_peers share: their main (measure, or re-render --from), the
lists, and the CPU lock held per measurement."""
from __future__ import annotations

import argparse
import fcntl
import json

import pytest

from eyas.config import ConfigError
from jobs.peers import cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_report_args(parser, "job.json", lock_help="for each measurement")
    return parser.parse_args(argv)


def render(report: dict) -> str:
    return f"rows: {report['rows']}\n"


def test_a_run_writes_its_json_and_its_markdown(tmp_path, capsys):
    out, page = tmp_path / "job.json", tmp_path / "job.md"
    args = parse(["--out", str(out), "--report", str(page)])
    assert cli.report_main(args, "job", lambda a: {"rows": [1, 2]}, render) == 0
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    assert page.read_text() == "rows: [1, 2]\n"
    assert "rows: [1, 2]" in capsys.readouterr().out


def test_from_renders_without_measuring(tmp_path):
    source = tmp_path / "old.json"
    source.write_text(json.dumps({"rows": [3]}))

    def run(args):
        raise AssertionError("--from must not measure")

    args = parse(["--from", str(source), "--report", str(tmp_path / "p.md"), "--out", str(tmp_path / "new.json")])
    assert cli.report_main(args, "job", run, render) == 0
    assert (tmp_path / "p.md").read_text() == "rows: [3]\n" and not (tmp_path / "new.json").exists()


def test_from_renders_several_reports_into_one_page_in_order(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"rows": [1]}))
    second.write_text(json.dumps({"rows": [2]}))
    args = parse(["--from", f"{first},{second}", "--report", str(tmp_path / "p.md")])
    assert cli.report_main(args, "job", lambda a: {}, render) == 0
    assert (tmp_path / "p.md").read_text() == "rows: [1]\n\nrows: [2]\n"


def test_a_users_mistake_is_one_line_and_status_2_and_a_bug_keeps_its_traceback(tmp_path, capsys):
    def bad_flag(args):
        raise ConfigError("--threads 0: must be >= 1")

    assert cli.report_main(parse(["--out", str(tmp_path / "x.json")]), "job", bad_flag, render) == 2
    assert capsys.readouterr().err == "error: --threads 0: must be >= 1\n"
    assert cli.report_main(parse(["--from", str(tmp_path / "missing.json")]), "job", bad_flag, render) == 2

    def bug(args):
        raise KeyError("rows")

    with pytest.raises(KeyError):
        cli.report_main(parse(["--out", str(tmp_path / "x.json")]), "job", bug, render)


def test_lists_keep_their_order_drop_repeats_and_name_the_flag():
    assert cli.parse_list("b, a,b,", ("a", "b"), "--engines") == ["b", "a"]
    assert cli.parse_list("7,x", None, "--threads") == ["7", "x"]  # None: any item
    with pytest.raises(ConfigError, match=r"--engines 'a,c': unknown \['c'\]; known: \['a', 'b'\]"):
        cli.parse_list("a,c", ("a", "b"), "--engines")
    with pytest.raises(ConfigError, match="--methods ' ,': empty"):
        cli.parse_list(" ,", ("a",), "--methods")


def test_cpu_lock_is_exclusive_while_held(tmp_path):
    lock = tmp_path / "cpu.lock"
    with cli.cpu_lock(str(lock)):
        with open(lock) as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the block
    with cli.cpu_lock(None):
        pass


def test_loadavg_is_three_rounded_figures():
    load = cli.loadavg()
    assert len(load) == 3 and all(round(x, 2) == x for x in load)
