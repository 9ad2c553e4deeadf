"""cluster.yaml passes the Ray cluster launcher's own validation, without touching any cloud.

``ray up`` runs ``prepare_config`` (merge the provider's defaults.yaml, merge setup commands, fill per-type worker
limits) and then ``validate_config`` (ray/autoscaler/ray-schema.json plus cross-field checks) before it asks the
provider to bootstrap; this test runs exactly those two steps.
"""
from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_passes_ray_validation(raw):
    validate_config(prepare_config(copy.deepcopy(raw)))


def test_validation_catches_mistakes(raw):
    """The check has teeth: a misspelt key and an impossible worker budget are both refused."""
    typo = {**copy.deepcopy(raw), "max_worker": 3}
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(typo))
    too_few = copy.deepcopy(raw)
    too_few["available_node_types"]["gpu_a10g"]["min_workers"] = raw["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        validate_config(prepare_config(too_few))


def test_head_and_gpu_workers(raw):
    node_types = raw["available_node_types"]
    assert raw["provider"]["type"] == "aws"
    assert raw["head_node_type"] in node_types
    gpu_types = {name: t for name, t in node_types.items() if name != raw["head_node_type"]}
    instance_types = {t["node_config"]["InstanceType"] for t in gpu_types.values()}
    assert any(i.startswith(("g5.", "p4d.", "p5.")) for i in instance_types), instance_types
    for node_type in gpu_types.values():
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"] <= raw["max_workers"]


def test_setup_installs_eyas_from_the_mounted_repo(raw):
    commands = raw["setup_commands"]
    torch_at = next(i for i, c in enumerate(commands) if "pip install" in c and "torch" in c)
    eyas_at = next(i for i, c in enumerate(commands) if "pip install -e ." in c)
    assert torch_at < eyas_at, "torch must be installed before eyas"
    repo_mount = next(remote for remote, local in raw["file_mounts"].items() if local == ".")
    assert f"cd {repo_mount}" in commands[eyas_at]


def test_nodes_share_the_auth_token(raw):
    assert any(local.endswith(".ray/auth_token") for local in raw["file_mounts"].values())
    for command in raw["head_start_ray_commands"][-1:] + raw["worker_start_ray_commands"][-1:]:
        assert "RAY_AUTH_MODE=token" in command and "ray start" in command
    assert "auth token" in CLUSTER_YAML.read_text().lower()
