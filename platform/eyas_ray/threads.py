"""eyas's thread policy (``eyas.threads``) in Ray processes.

OpenMP reads its wait policy when torch loads, so a Ray worker, actor or Serve replica must start with it in its
environment: it travels in ``runtime_env`` env_vars, job-wide (``init_ray``) and on the actors that run the target
(serving's TP workers, which ``serve run`` starts without ``init_ray``). The thread count is set in the worker
itself, from the CPUs its config gave it (``eyas.threads.configure_threads(cpu_budget=...)``).
"""
from __future__ import annotations

from typing import Any

from eyas.threads import openmp_env


def with_openmp_env(runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """``runtime_env`` with the policy's OpenMP variables added to its env_vars (its own values win)."""
    runtime_env = dict(runtime_env or {})
    env_vars = {**openmp_env(), **(runtime_env.get("env_vars") or {})}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    return runtime_env
