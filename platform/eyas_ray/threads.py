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
    return with_env_vars(runtime_env, openmp_env())


def with_env_vars(runtime_env: dict[str, Any] | None, env_vars: dict[str, str]) -> dict[str, Any]:
    """``runtime_env`` with ``env_vars`` added to its env_vars (its own values win)."""
    runtime_env = dict(runtime_env or {})
    merged = {**env_vars, **(runtime_env.get("env_vars") or {})}
    if merged:
        runtime_env["env_vars"] = merged
    return runtime_env
