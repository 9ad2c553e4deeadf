"""Connect a job, a sweep or a load test to Ray, with token auth on."""
from __future__ import annotations

import logging
import os
from typing import Any

from eyas_ray.allocator import preload_env
from eyas_ray import auth
from eyas_ray.threads import with_env_vars, with_openmp_env


def init_ray(preload_allocator: bool = False, **kwargs: Any) -> None:
    """``ray.init()``: a fresh local Ray of its own unless ``RAY_ADDRESS`` names a cluster (``ray job submit`` sets it).

    Token auth stays on without eyas setting ``RAY_AUTH_MODE``: Ray 2.60 turns it on by itself for a new local
    cluster and for a client that has a token, and it reads the variable once, when ``ray`` is imported, so setting
    it here would be too late (the driver would then speak without a token to a cluster that wants one). What eyas
    does is make sure the token exists. Joining a cluster needs its token (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``; a job submitted to a cluster inherits the head's). A fresh
    local Ray is the user's own cluster: its token is ``~/.ray/auth_token``, created when missing. Idempotent.

    ``preload_allocator``: the job's workers start on tcmalloc or jemalloc (``eyas_ray.allocator``), where a
    training step's varied tensor sizes fragment glibc's heap.
    """
    import ray

    if ray.is_initialized():
        return
    kwargs.setdefault("log_to_driver", True)
    # every worker starts with eyas's OpenMP wait policy (torch reads it on import; eyas.threads)
    runtime_env = with_openmp_env(kwargs.get("runtime_env"))
    if preload_allocator:
        runtime_env = with_env_vars(runtime_env, preload_env())
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    address = os.environ.get("RAY_ADDRESS")
    if address:
        if os.environ.get(auth.AUTH_MODE, "token") == "token" and auth.token_source() is None:
            raise RuntimeError(f"RAY_ADDRESS={address} but no Ray auth token was found: set {auth.TOKEN} or "
                               f"{auth.TOKEN_PATH}, or copy the cluster's token to {auth.user_token_file()}")
        ray.init(address=address, **kwargs)
    else:
        auth.ensure_user_token()
        kwargs.setdefault("include_dashboard", False)
        if not kwargs["include_dashboard"]:
            kwargs["runtime_env"] = with_quiet_state_api(kwargs.get("runtime_env"))
        # "local": a Ray of this process's own; a bare ray.init() would attach to whatever cluster
        # /tmp/ray/ray_current_cluster names (someone else's `ray start`, with another token)
        ray.init(address="local", **kwargs)


# Ray Train's PlacementGroupCleaner asks the State API, which the dashboard serves, once a second whether the train
# controller lives; a local Ray without a dashboard has no State API, so it warned every second of a training
# ("Failed to query Ray Train Controller actor state") and can never clean anything there. The placement groups of
# a local Ray end with it.
PG_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def quiet_state_api_warnings() -> None:
    """Worker process setup hook of a local Ray without a dashboard: only errors from the PlacementGroupCleaner."""
    logging.getLogger(PG_CLEANER_LOGGER).setLevel(logging.ERROR)


def with_quiet_state_api(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """``runtime_env`` with ``quiet_state_api_warnings`` as its worker setup hook, unless it has a hook already."""
    runtime_env = dict(runtime_env or {})
    runtime_env.setdefault("worker_process_setup_hook", f"{__name__}.{quiet_state_api_warnings.__name__}")
    return runtime_env
