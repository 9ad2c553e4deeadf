"""Deploy an eyas Serve config from Python, as ``serve run FILE`` would, on the Ray this process is connected to.

jobs.load and the serving tests deploy the application a config file names without importing serving/: each
application is built by the builder its ``import_path`` names (``serving.app:build_app``), called with its
``args``, and its ``deployments:`` entries then override that deployment's options by name, as Serve applies a
config file's. The args are ServeArgs, so the final options are checked like the builder's own, and a
``user_config`` is checked as the replica's ``reconfigure`` will read it (LiveSettings) before anything deploys.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from ray import serve
from ray.serve import Application

from eyas.config import ConfigError
from eyas_ray.serve_config import LiveSettings, ServeArgs, check_back_pressure


def run_config(config: dict[str, Any]) -> list[str]:
    """Start Serve with the config's HTTP options, deploy each application and return the application names."""
    serve.start(http_options=config.get("http_options") or {"host": "127.0.0.1"},
                proxy_location=config.get("proxy_location", "HeadOnly"))
    names = []
    for entry in config["applications"]:
        name = entry.get("name", "default")
        serve.run(build(entry), name=name, route_prefix=entry.get("route_prefix", "/"))
        names.append(name)
    return names


def build(entry: dict[str, Any]) -> Application:
    """One ``applications:`` entry as an Application: its builder's, with the ``deployments:`` options on top."""
    args = entry.get("args") or {}
    app = import_builder(entry.get("import_path"))(args)
    deployment = app._bound_deployment  # Serve's own config path reads it here too; it has no public accessor
    overrides = {}
    for options in entry.get("deployments") or []:
        options = dict(options)
        name = options.pop("name", None)
        if name != deployment.name:
            raise ConfigError(f"deployments: {name!r}: the application {entry.get('name', 'default')!r} has one "
                              f"deployment, {deployment.name!r}; name that one")
        overrides.update(options)
    LiveSettings.from_user_config(overrides.get("user_config"))  # a bad schedule fails here, not in the replica
    deployment = deployment.options(**overrides)
    check_back_pressure(ServeArgs.from_args(args), {"max_ongoing_requests": deployment.max_ongoing_requests,
                                                    "max_queued_requests": deployment.max_queued_requests})
    return deployment.bind(*deployment.init_args, **deployment.init_kwargs)


def import_builder(import_path: str | None) -> Callable[[dict[str, Any]], Application]:
    """``module:attribute`` (Serve's import_path) -> the application builder it names."""
    module, _, attribute = (import_path or "").partition(":")
    if not module or not attribute:
        raise ConfigError(f"import_path: {import_path!r}: give module:builder, e.g. serving.app:build_app")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"import_path: {import_path!r} cannot be imported ({err})") from None
