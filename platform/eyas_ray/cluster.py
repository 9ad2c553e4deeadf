"""Connect a job, a sweep or a load test to Ray, with token auth on."""
from __future__ import annotations

import os
from typing import Any

from eyas_ray import auth
from eyas_ray.threads import with_openmp_env


# Ray Train on one machine: no node is preempted, so no preemption watcher (one actor process fewer per run), and the
# controller polls its workers every 0.5 s instead of 2 s. A no-op 2-worker TorchTrainer.fit took 15.2-15.3 s
# instead of 18.1-19.8 s on this project's 2-core box (tests/unit/ray_glue/test_local_head_env.py). A fresh local Ray
# (init_ray) and a LocalRayHead run with them; the caller's environment overrides both.
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def init_ray(**kwargs: Any) -> None:
    """``ray.init()``: a fresh local Ray of its own unless ``RAY_ADDRESS`` names a cluster (``ray job submit`` sets it).

    Token auth stays on without eyas setting ``RAY_AUTH_MODE``: Ray 2.60 turns it on by itself for a new local
    cluster and for a client that has a token, and it reads the variable once, when ``ray`` is imported, so setting
    it here would be too late (the driver would then speak without a token to a cluster that wants one). What eyas
    does is make sure the token exists. Joining a cluster needs its token (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``; a job submitted to a cluster inherits the head's). A fresh
    local Ray is the user's own cluster: its token is ``~/.ray/auth_token``, created when missing. Idempotent.
    """
    import ray

    if ray.is_initialized():
        return
    kwargs.setdefault("log_to_driver", True)
    # every worker starts with eyas's OpenMP wait policy (torch reads it on import; eyas.threads)
    runtime_env = with_openmp_env(kwargs.get("runtime_env"))
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
        for name, value in LOCAL_TRAIN_ENV.items():  # read by Ray Train's controller, a child of this Ray
            os.environ.setdefault(name, value)
        kwargs.setdefault("include_dashboard", False)
        # "local": a Ray of this process's own; a bare ray.init() would attach to whatever cluster
        # /tmp/ray/ray_current_cluster names (someone else's `ray start`, with another token)
        ray.init(address="local", **kwargs)
