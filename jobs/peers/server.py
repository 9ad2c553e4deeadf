"""A server process for the peer jobs: start it in its own process group, wait for its /health, always stop it.

``running(cmd, env, base_url, label)`` is the lifecycle every engine module (jobs.peers.vllm, jobs.peers.llamacpp)
wraps: the server's output goes to a log file (a temporary one unless given), progress is printed every ~20 s while
it starts, and an exit or a time-out before /health answers raises with the log's tail.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

START_TIMEOUT_S = 900.0


def healthy(base_url: str, health_path: str = "/health") -> bool:
    """True when GET ``base_url + health_path`` answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url}{health_path}", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def log_tail(path: Path, num_lines: int = 30) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


def wait_healthy(process: subprocess.Popen, base_url: str, log: Path, timeout_s: float, label: str,
                 health_path: str = "/health") -> None:
    """Polls /health until it answers; prints progress every ~20 s; raises (with the log's tail) when the server
    exits or the time runs out."""
    start = time.monotonic()
    last_report = start
    while not healthy(base_url, health_path):
        now = time.monotonic()
        if process.poll() is not None:
            raise RuntimeError(f"{label} exited with code {process.returncode} before it was healthy; its log "
                               f"({log}) ends:\n{log_tail(log)}")
        if now - start > timeout_s:
            raise TimeoutError(f"{label} not healthy after {timeout_s:.0f} s; its log ({log}) ends:\n{log_tail(log)}")
        if now - last_report >= 20:
            last = (log_tail(log, 1) or "(no output yet)")[-160:]
            print(f"[{label}] starting, {now - start:.0f} s: {last}", flush=True)
            last_report = now
        time.sleep(2)
    print(f"[{label}] healthy at {base_url} after {time.monotonic() - start:.0f} s", flush=True)


def stop(process: subprocess.Popen, grace_s: float = 20.0, stop_signal: int = signal.SIGTERM) -> None:
    """``stop_signal`` to the server's process group (its engine-core children too), SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, stop_signal)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def running(cmd: list[str], env: dict[str, str], base_url: str, label: str, timeout_s: float = START_TIMEOUT_S,
            log_path: Path | None = None, health_path: str = "/health", stop_signal: int = signal.SIGTERM,
            grace_s: float = 20.0) -> Iterator[str]:
    """Runs ``cmd`` (a server) in its own process group, yields ``base_url`` once ``health_path`` answers 200,
    always stops it (``stop_signal``, then SIGKILL after ``grace_s``)."""
    log = log_path or Path(tempfile.mkstemp(prefix=f"eyas-{label}-", suffix=".log")[1])
    print(f"[{label}] $ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        wait_healthy(process, base_url, log, timeout_s, label, health_path)
        yield base_url
    finally:
        stop(process, grace_s, stop_signal)
