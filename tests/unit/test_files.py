"""eyas.files: result files are written whole or not at all, and a bad output path fails before the work."""
from __future__ import annotations

import pytest

from eyas.config import ConfigError
from eyas.files import atomic_write, writable_path, write_text_atomic


def test_write_text_atomic_makes_the_directory_and_replaces_whole(tmp_path):
    path = write_text_atomic(tmp_path / "a" / "b" / "report.json", "{}")
    assert path.read_text() == "{}"
    write_text_atomic(path, '{"x": 1}')
    assert path.read_text() == '{"x": 1}' and sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = write_text_atomic(tmp_path / "report.json", "old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_writable_path_names_the_flag(tmp_path):
    assert writable_path(tmp_path / "new" / "out.json").parent.is_dir()
    with pytest.raises(ConfigError, match="--out .*is a directory"):
        writable_path(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--report .*cannot create its directory"):
        writable_path(tmp_path / "file" / "out.json", flag="--report")
