"""A throwaway Ray head on a machine that never ran Ray: token auth on, a token of its own, Ray's errors shown, and
stopped with its driver, even one ended by SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from eyas_ray import auth
from eyas_ray.local_head import LocalRayHead, ray_cli

pytestmark = pytest.mark.slow

JOB = "import ray; ray.init(); print('answer', ray.get(ray.remote(lambda: 6 * 7).remote()))"


# the head lives in a driver process of its own, which the test ends with SIGTERM, as a killed `make demo` ends
DRIVER = """
import json, sys, time
from eyas_ray.local_head import LocalRayHead
with LocalRayHead(num_cpus=1) as head:
    done = head.submit_entrypoint([sys.executable, "-c", sys.argv[1]], capture=True, timeout_s=300)
    print(json.dumps({"stdout": done.stdout, "address": head.address, "env": head.env, "temp_dir": head.temp_dir,
                      "node_pid": head.proc.pid}), flush=True)
    time.sleep(600)
"""


def test_fresh_home_head_runs_a_job_with_token_auth_and_a_sigterm_stops_it(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in (auth.TOKEN, auth.TOKEN_PATH, auth.AUTH_MODE):
        monkeypatch.delenv(name, raising=False)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, JOB], stdout=subprocess.PIPE, text=True)
    try:
        head = json.loads(driver.stdout.readline())
        assert head["env"][auth.AUTH_MODE] == "token"
        token_file = head["env"][auth.TOKEN_PATH]
        assert token_file.startswith(head["temp_dir"]) and os.path.exists(token_file)
        assert "answer 42" in head["stdout"]
        # auth is really on: a client without the token is refused
        stranger = {**os.environ, **{k: v for k, v in head["env"].items() if k != auth.TOKEN_PATH}}
        refused = subprocess.run([ray_cli(), "job", "list", "--address", head["address"]], env=stranger,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0
        assert "token" in (refused.stdout + refused.stderr).lower()
        driver.send_signal(signal.SIGTERM)  # the head's node runs in a session of its own: only the driver stops it
        assert driver.wait(120) == 128 + signal.SIGTERM
    finally:
        driver.kill()
    with pytest.raises(ProcessLookupError):  # the node's whole process group is gone
        os.killpg(head["node_pid"], 0)
    assert not os.path.exists(token_file)  # the throwaway token goes with the head
    assert not (home / ".ray").exists()  # and the user's ~/.ray was never touched


def test_a_failed_ray_start_shows_rays_own_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # past LocalRayHead's own port check, so that `ray start` itself meets the taken port
        head = LocalRayHead(num_cpus=1, extra_args=(f"--port={port}",), start_timeout_s=150)
        with pytest.raises(RuntimeError) as failure:
            head.__enter__()
    message = str(failure.value)
    assert "`ray start --head` exited" in message
    assert "Failed to start GCS" in message and str(port) in message
    assert not os.path.exists(head.temp_dir)
