"""A local Ray cluster of our own (token auth on) and `ray job submit` against it: the real user path, on loopback.

``LocalRayHead`` is a throwaway head; ``head.add_worker(...)`` joins more nodes to it on this machine with
``ray start --address`` (``LocalRayWorker``), each with its own resources, which is as close as one machine gets to
a cluster: a worker node's ``kill()`` is a machine that crashed. Used by ``jobs.demo`` and the integration tests.

Every node runs as ``ray start --block`` in a process group of its own (``RayStartProcess``) and is stopped by
signalling that process group, never by ``ray stop`` (which would stop every Ray on the machine).

It is a throwaway cluster, so it has a token of its own: a file in the head's temp dir, named by
``RAY_AUTH_TOKEN_PATH`` in ``head.env``, which every process that talks to it (its worker nodes, ``ray job submit``,
``serve deploy``, the jobs themselves) runs with. The user's ``~/.ray`` is neither read nor written.
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
import threading
import time
from pathlib import Path
from typing import Any

from eyas_ray import auth

STOP_GRACE_S = 10.0  # a node's own shutdown (usually ~4 s); what is left after it is SIGKILLed with its group
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


def short_temp_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Unix socket paths max 107 bytes


def node_flags(num_cpus: int | None, resources: dict[str, float] | None) -> list[str]:
    flags = [f"--num-cpus={num_cpus}"] if num_cpus is not None else []
    return flags + (["--resources", json.dumps(resources)] if resources else [])


class RayStartProcess:
    """One ``ray start --block`` (head or worker node) in a process group of its own, its output in ``log_path``."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, what: str) -> None:
        self.cmd, self.env, self.log_path, self.what = cmd, env, log_path, what
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, deadline: float) -> str | None:
        """Start it and wait until it blocks (the node is up); None, or what went wrong with Ray's own output."""
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while "block forever" not in self.log_path.read_text():
            if self.proc.poll() is not None:
                return f"`{self.what}` exited with code {self.proc.returncode}. Ray said:\n{self.log()}"
            if time.monotonic() > deadline:
                return f"`{self.what}` did not come up in time. Ray said:\n{self.log()}"
            time.sleep(0.5)
        return None

    def log(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.is_file() else ""

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (``ray start --block`` shuts its node down), or with ``kill`` SIGKILL to the whole group: a
        crashed machine. Stragglers of the group (raylet workers) get a few seconds, then SIGKILL."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if kill:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            else:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        if proc is not None:
            for _ in range(20):
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class LocalRayHead:
    """``with LocalRayHead(num_cpus=2) as head: head.submit(...)``; ``head.address`` is the dashboard URL.

    ``resources`` are the head's custom resources (``ray start --resources``); ``env`` is added to the environment
    of the head and of every process started through it (e.g. ``RAY_health_check_period_ms`` for the GCS)."""

    def __init__(self, num_cpus: int | None = None, dashboard_port: int | None = None, gcs_port: int | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 180.0,
                 extra_args: tuple[str, ...] = (), resources: dict[str, float] | None = None) -> None:
        ports = free_ports(5)
        self.gcs_port = gcs_port or ports[0]
        self.dashboard_port = dashboard_port or ports[1]
        for name, port in (("gcs", self.gcs_port), ("dashboard", self.dashboard_port)):
            if not port_free(port):
                raise RuntimeError(f"port {port} ({name}) is already taken on 127.0.0.1: stop whatever holds it "
                                   f"(another Ray? `ray status`) or choose another port")
        self.client_port, self.agent_listen_port, self.agent_grpc_port = ports[2:]
        self.num_cpus, self.resources = num_cpus, dict(resources or {})
        self.env = auth.token_env({**os.environ, **(env or {})})
        for name in ("RAY_ADDRESS", auth.TOKEN):  # a token of our own, never one inherited from the caller
            self.env.pop(name, None)
        # Ray's state API inside the cluster (Ray Train's placement-group cleaner asks it every second) finds the
        # dashboard here; without it, it looks in /tmp/ray/ray_current_cluster (another Ray's, or a stale one: our
        # temp dir is our own) and waits 40 s for that GCS on every call, and every training run ends 12 s late
        self.env["RAY_API_SERVER_ADDRESS"] = self.address
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)  # more `ray start` flags
        self.node: RayStartProcess | None = None
        self.workers: list[LocalRayWorker] = []
        self.temp_dir = ""

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.node.proc if self.node is not None else None

    def __enter__(self) -> "LocalRayHead":
        # the nodes run in sessions of their own, so a SIGTERM to this process (a killed `make demo`) reaches none
        # of them: turn it into SystemExit, which runs __exit__ and stops them, instead of leaving Ray running
        self._sigterm = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self.temp_dir = short_temp_dir("eyr")
        self.env[auth.TOKEN_PATH] = str(auth.write_token_file(Path(self.temp_dir) / "auth_token"))
        cmd = [ray_cli(), "start", "--head", "--block", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={self.dashboard_port}", "--include-dashboard=true",
               f"--ray-client-server-port={self.client_port}",
               f"--dashboard-agent-listen-port={self.agent_listen_port}",
               f"--dashboard-agent-grpc-port={self.agent_grpc_port}", f"--temp-dir={self.temp_dir}",
               "--disable-usage-stats", *node_flags(self.num_cpus, self.resources), *self.extra_args]
        self.node = RayStartProcess(cmd, self.env, Path(self.temp_dir) / "start.log", "ray start --head")
        deadline = time.monotonic() + self.start_timeout_s
        failure = self.node.start(deadline)
        if failure is not None:
            self._fail(failure)
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
        for worker in reversed(self.workers):
            worker.stop()
        self.workers.clear()
        if self.node is not None:
            self.node.stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.node = None
        if getattr(self, "_sigterm", None) is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    # ------------------------------------------------------------ more nodes

    def add_worker(self, num_cpus: int | None = None, resources: dict[str, float] | None = None,
                   timeout_s: float | None = None) -> "LocalRayWorker":
        """Join a worker node (``ray start --address``, the head's token); returns once the head lists it ALIVE."""
        worker = LocalRayWorker(self, num_cpus, resources)
        self.workers.append(worker)
        worker.start(timeout_s or self.start_timeout_s)
        return worker

    def list_state(self, kind: str, *filters: str) -> list[dict[str, Any]]:
        """``ray list KIND --detail`` (nodes, jobs, actors, ...) as dicts, e.g. ``list_state("actors",
        "state=ALIVE")``: a node's ``node_id``/``state``/``resources_total``, a job's ``driver_info``, an actor's
        ``class_name``/``node_id``/``pid``."""
        cmd = [ray_cli(), "list", kind, "--detail", "--format", "json", "--limit", "10000", "--address", self.address]
        for condition in filters:
            cmd += ["--filter", condition]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"`ray list {kind}` failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout)

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes, dead ones included."""
        return self.list_state("nodes")

    def head_node_id(self) -> str:
        return next(node["node_id"] for node in self.nodes() if node["is_head_node"] and node["state"] == "ALIVE")

    # ------------------------------------------------------------ jobs

    def submit(self, module: str, args: list[str], env_vars: dict[str, str] | None = None,
               working_dir: str = ".", timeout_s: float | None = None,
               capture: bool = False) -> subprocess.CompletedProcess:
        """``ray job submit --working-dir . -- python -m MODULE ARGS``; raises on failure. With ``capture`` the
        output is returned (``.stdout``) instead of streaming through."""
        return self.submit_entrypoint([sys.executable, "-m", module, *args], env_vars, working_dir, timeout_s,
                                      capture)

    def submit_command(self, entrypoint: list[str], env_vars: dict[str, str] | None = None,
                       working_dir: str = ".", submission_id: str | None = None) -> list[str]:
        """The ``ray job submit`` command line (run it with ``env=head.env``), e.g. to submit in the background."""
        runtime_env = {"excludes": JOB_EXCLUDES, "env_vars": env_vars or {}}
        named = ["--submission-id", submission_id] if submission_id else []
        return [ray_cli(), "job", "submit", "--address", self.address, "--working-dir", working_dir,
                "--runtime-env-json", json.dumps(runtime_env), *named, "--", *entrypoint]

    def submit_entrypoint(self, entrypoint: list[str], env_vars: dict[str, str] | None = None,
                          working_dir: str = ".", timeout_s: float | None = None,
                          capture: bool = False) -> subprocess.CompletedProcess:
        cmd = self.submit_command(entrypoint, env_vars, working_dir)
        if not capture:
            return subprocess.run(cmd, env=self.env, timeout=timeout_s, check=True)
        done = subprocess.run(cmd, env=self.env, timeout=timeout_s, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`ray job submit` failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        return done


class LocalRayWorker:
    """A worker node of a ``LocalRayHead``'s cluster, on this machine (``head.add_worker``): ``ray start --address
    HEAD --block`` with the head's token, its own temp dir, free ports of its own and its own resources.

    ``kill()`` SIGKILLs every process of the node at once (raylet, object store, the workers and actors on it), as
    a crashed machine would go: the head notices through missed health checks (``RAY_health_check_period_ms`` x
    ``RAY_health_check_failure_threshold`` in the head's env; Ray's defaults take about 15 s)."""

    def __init__(self, head: LocalRayHead, num_cpus: int | None = None,
                 resources: dict[str, float] | None = None) -> None:
        self.head, self.num_cpus, self.resources = head, num_cpus, dict(resources or {})
        self.temp_dir = ""
        self.node: RayStartProcess | None = None
        self.node_id = ""

    def start(self, timeout_s: float = 180.0) -> "LocalRayWorker":
        known = {node["node_id"] for node in self.head.nodes()}
        self.temp_dir = short_temp_dir("eyw")
        listen, grpc, metrics, runtime_env = free_ports(4)
        cmd = [ray_cli(), "start", f"--address={self.head.gcs_address}", "--block", f"--temp-dir={self.temp_dir}",
               f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
               f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
               "--disable-usage-stats", *node_flags(self.num_cpus, self.resources)]
        self.node = RayStartProcess(cmd, self.head.env, Path(self.temp_dir) / "start.log", "ray start --address")
        deadline = time.monotonic() + timeout_s
        failure = self.node.start(deadline)
        while failure is None:
            joined = [n["node_id"] for n in self.head.nodes() if n["node_id"] not in known and n["state"] == "ALIVE"]
            if joined:
                self.node_id = joined[0]
                return self
            if time.monotonic() > deadline:
                failure = f"the head never listed the new node as ALIVE. Ray said:\n{self.node.log()}"
            time.sleep(1)
        self.stop()
        raise RuntimeError(failure)

    @property
    def alive(self) -> bool:
        return self.node is not None and self.node.proc is not None and self.node.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to every process of this node: a crashed machine, no goodbye to the head."""
        if self.node is not None:
            self.node.stop(kill=True)

    def stop(self) -> None:
        if self.node is not None:
            self.node.stop()
            self.node = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)
