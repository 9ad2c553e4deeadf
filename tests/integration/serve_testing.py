"""Helpers for the Ray Serve tests on loopback (test_serving.py, test_fuzz_api.py): one local Ray with Serve on
127.0.0.1 per test module, the micro config deployed with the shared random-weight target, clients and waits."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY_ENV, API_KEY = "EYAS_TEST_API_KEY", "test-key-123"
PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "The quick brown fox", "class A:\n    def"]
NUM_NEW = 24
MODEL = "eyas-micro"


@pytest.fixture(scope="module")
def ray_session():
    """(HTTP port, Prometheus metrics port) of a local Ray with Serve on loopback."""
    from eyas.decoding.tp import free_port

    # autoscaling metrics reach the controller every half second instead of every 10 s (read by Serve's actors,
    # which inherit this process's environment through the local Ray it starts)
    os.environ["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    metrics_port = free_port()
    # address="local": a Ray of our own, even while another test's cluster runs on this machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000},
             runtime_env={"env_vars": {API_KEY_ENV: API_KEY}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    yield port, metrics_port
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def serve_port(ray_session):
    return ray_session[0]


@pytest.fixture(scope="module")
def reference(random_checkpoint):
    """The library's own vanilla greedy continuation of each prompt, and the prompts' token ids."""
    from eyas.models import load_target, load_tokenizer
    from eyas.decoding.generate import generate

    target = load_target(random_checkpoint)
    tokenizer = load_tokenizer(random_checkpoint)
    eos = set(target.config.eos_token_ids) | {tokenizer.eos_token_id}
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return {p: generate(target, i, NUM_NEW, eos_token_ids=eos).token_ids for p, i in zip(PROMPTS, ids)}


def micro_config(target: Path, name: str, route: str, **args) -> dict:
    config = yaml.safe_load((REPO_ROOT / "serving" / "configs" / "micro.yaml").read_text())
    app = config["applications"][0]
    app.update(name=name, route_prefix=route)
    app["args"].update(target=str(target), **args)
    return config


def deploy(config: dict, single_replica: bool = True) -> None:
    from eyas_ray.deploy import run_config

    config = copy.deepcopy(config)
    if single_replica:
        deployment = config["applications"][0]["deployments"][0]
        deployment.pop("autoscaling_config")
        deployment["num_replicas"] = 1
    run_config(config)


def client(port: int, route: str, key: str | None = API_KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=f"http://127.0.0.1:{port}{route}", headers=headers, timeout=120)


def complete(http: httpx.Client, prompt, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "return_token_ids": True,
            **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def running_replicas(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())


def worker_names(app: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"eyas-worker-{app}-")}
