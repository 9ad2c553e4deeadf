"""eyas_ray.deploy builds a Serve config's application from its import_path, without Ray running and without the
apps importing each other: the builder's options, then the config's ``deployments:`` on top, back-pressure checked."""
from __future__ import annotations

import pytest

from eyas.config import ConfigError
from eyas_ray.deploy import build

ENTRY = {"name": "eyas", "import_path": "serving.app:build_app",
         "args": {"target": "/x", "max_batch_size": 4, "max_waiting_requests": 4, "tensor_parallel_size": 2}}


def test_the_builder_named_by_import_path_with_the_config_options_on_top():
    deployment = build({**ENTRY, "deployments": [{"name": "EyasServer", "num_replicas": 3,
                                                  "max_ongoing_requests": 11}]})._bound_deployment
    assert deployment.name == "EyasServer" and deployment.num_replicas == 3
    assert deployment.max_ongoing_requests == 11  # the builder's own default is 4 + 4 + 4 = 12
    assert build(ENTRY)._bound_deployment.max_ongoing_requests == 12
    (args,) = deployment.init_args  # the replica still gets its ServeArgs
    assert args.tensor_parallel_size == 2 and args.target == "/x"


def test_overrides_are_checked_and_must_name_the_deployment():
    with pytest.raises(ConfigError, match="max_ongoing_requests=8 must exceed"):
        build({**ENTRY, "deployments": [{"name": "EyasServer", "max_ongoing_requests": 8}]})
    with pytest.raises(ConfigError, match="'Other'.*'EyasServer'"):
        build({**ENTRY, "deployments": [{"name": "Other", "num_replicas": 1}]})
    with pytest.raises(ConfigError, match=r"user_config.speculation_by_batch\[1\]='many'"):
        build({**ENTRY, "deployments": [{"name": "EyasServer", "user_config": {"speculation_by_batch": {1: "many"}}}]})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['user_config.schedule'\]"):
        build({**ENTRY, "deployments": [{"name": "EyasServer", "user_config": {"schedule": {1: 2}}}]})
    live = build({**ENTRY, "deployments": [{"name": "EyasServer", "user_config": {"speculation_by_batch": {1: 2}}}]})
    assert live._bound_deployment.user_config == {"speculation_by_batch": {1: 2}}
    with pytest.raises(ConfigError, match="give module:builder"):
        build({**ENTRY, "import_path": "serving.app"})
    with pytest.raises(ConfigError, match="cannot be imported"):
        build({**ENTRY, "import_path": "serving.app:no_such_builder"})
