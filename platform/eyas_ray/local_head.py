"""A local Ray head of our own (token auth on) and `ray job submit` against it: the real user path, on loopback.

Used by ``jobs.demo`` and the integration tests. The head runs as ``ray start --head --block`` in its own process
group and is stopped by signalling that process, never by ``ray stop`` (which would stop every Ray on the machine).

It is a throwaway head, so it has a token of its own: a file in its temp dir, named by ``RAY_AUTH_TOKEN_PATH`` in
``head.env``, which every process that talks to it (``ray job submit``, ``serve deploy``, the jobs themselves) runs
with. The user's ``~/.ray`` is neither read nor written.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eyas_ray import auth

JOB_EXCLUDES = [".git", ".venv", "mlartifacts", "mlruns.db", "out", "bench.json", "bench.png"]


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalRayHead:
    """``with LocalRayHead(num_cpus=2) as head: head.submit(...)``; ``head.address`` is the dashboard URL."""

    def __init__(self, num_cpus: int | None = None, dashboard_port: int | None = None, gcs_port: int | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 180.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        ports = free_ports(5)
        self.gcs_port = gcs_port or ports[0]
        self.dashboard_port = dashboard_port or ports[1]
        for name, port in (("gcs", self.gcs_port), ("dashboard", self.dashboard_port)):
            if not port_free(port):
                raise RuntimeError(f"port {port} ({name}) is already taken on 127.0.0.1: stop whatever holds it "
                                   f"(another Ray? `ray status`) or choose another port")
        self.client_port, self.agent_listen_port, self.agent_grpc_port = ports[2:]
        self.num_cpus = num_cpus
        self.env = auth.token_env({**os.environ, **(env or {})})
        for name in ("RAY_ADDRESS", auth.TOKEN):  # a token of our own, never one inherited from the caller
            self.env.pop(name, None)
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)  # more `ray start` flags, e.g. --resources
        self.proc: subprocess.Popen | None = None
        self.temp_dir = ""

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def __enter__(self) -> "LocalRayHead":
        self.temp_dir = tempfile.mkdtemp(prefix="eyr", dir="/tmp")  # short: Unix socket paths max 107 bytes
        self.env[auth.TOKEN_PATH] = str(auth.write_token_file(Path(self.temp_dir) / "auth_token"))
        log_path = Path(self.temp_dir) / "start.log"
        cmd = [ray_cli(), "start", "--head", "--block", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={self.dashboard_port}", "--include-dashboard=true",
               f"--ray-client-server-port={self.client_port}",
               f"--dashboard-agent-listen-port={self.agent_listen_port}",
               f"--dashboard-agent-grpc-port={self.agent_grpc_port}", f"--temp-dir={self.temp_dir}",
               "--disable-usage-stats", *self.extra_args]
        if self.num_cpus is not None:
            cmd.append(f"--num-cpus={self.num_cpus}")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while "block forever" not in log_path.read_text():
            if self.proc.poll() is not None:
                self._fail(f"`ray start --head` exited with code {self.proc.returncode}. Ray said:\n"
                           f"{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self._fail(f"`ray start --head` did not come up in {self.start_timeout_s:.0f} s. Ray said:\n"
                           f"{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        self._wait_for_job_agent(deadline)
        return self

    def _fail(self, message: str) -> None:
        """Stop what started and raise ``message`` (read from the log before the temp dir goes)."""
        self.__exit__(None, None, None)
        raise RuntimeError(message)

    def _wait_for_job_agent(self, deadline: float) -> None:
        """The dashboard's job agent comes up after `ray start` returns ("No available agent to submit job")."""
        while True:
            probe = subprocess.run([ray_cli(), "job", "list", "--address", self.address], env=self.env,
                                   capture_output=True, text=True, timeout=60)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                self._fail(f"Ray's job agent did not come up. `ray job list` said:\n{probe.stderr[-2000:]}")
            time.sleep(2)

    def __exit__(self, *exc) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` shuts its node down on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if proc is not None:
            for _ in range(20):  # stragglers of our group (raylet workers) get a few seconds, then SIGKILL
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.proc = None

    def submit(self, module: str, args: list[str], env_vars: dict[str, str] | None = None,
               working_dir: str = ".", timeout_s: float | None = None,
               capture: bool = False) -> subprocess.CompletedProcess:
        """``ray job submit --working-dir . -- python -m MODULE ARGS``; raises on failure. With ``capture`` the
        output is returned (``.stdout``) instead of streaming through."""
        return self.submit_entrypoint([sys.executable, "-m", module, *args], env_vars, working_dir, timeout_s,
                                      capture)

    def submit_entrypoint(self, entrypoint: list[str], env_vars: dict[str, str] | None = None,
                          working_dir: str = ".", timeout_s: float | None = None,
                          capture: bool = False) -> subprocess.CompletedProcess:
        runtime_env = {"excludes": JOB_EXCLUDES, "env_vars": env_vars or {}}
        cmd = [ray_cli(), "job", "submit", "--address", self.address, "--working-dir", working_dir,
               "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint]
        if not capture:
            return subprocess.run(cmd, env=self.env, timeout=timeout_s, check=True)
        done = subprocess.run(cmd, env=self.env, timeout=timeout_s, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`ray job submit` failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        return done
