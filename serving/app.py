"""The Serve application: the OpenAI-style HTTP layer (serving.api) in front of tensor-parallel speculative workers.

    serve run serving/configs/tiny.yaml          (RAY_AUTH_MODE=token when joining a `ray start` cluster)

A replica is one placement group: bundle 0 holds this deployment's replica (HTTP, tokenizer, the batching loop in
serving.scheduler) and bundles 1..tp hold the TP worker actors (serving.worker), which shard the target and run
the speculative loop SPMD with the drafter on rank 0. The routes, the wire format and the error and stream contracts
are serving.api's; the replica builds that app over its own scheduler once its workers are up.
"""

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from eyas.methods import resolve_checkpoint
from eyas.models import ModelConfig, load_tokenizer
from eyas_ray.serve_config import LiveSettings, ServeArgs, check_back_pressure
from eyas_ray.threads import with_openmp_env
from serving.api import Frontend, build_api
from serving.metrics import ServingMetrics
from serving.protocol import Limits
from serving.scheduler import Scheduler, shielded
from serving.worker import TPWorker

WORKER_NAMESPACE = "eyas-serving"  # TP workers are named eyas-worker-<app>-<replica>-rank<r> there
HEALTH_PING_TIMEOUT_S = 30.0


@serve.deployment(name="EyasServer", health_check_period_s=5.0, health_check_timeout_s=60.0)
@serve.ingress()  # the app comes from __serve_build_asgi_app__, once __init__ has the scheduler
class EyasServer:
    async def __init__(self, args: ServeArgs | dict[str, Any]) -> None:
        self.args = ServeArgs.from_args(args)
        target_dir = resolve_checkpoint(self.args.target, "args.target")
        self.tokenizer = load_tokenizer(target_dir)
        config = ModelConfig.from_file(target_dir / "config.json")
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.api_key = self.args.api_key
        self.workers: list[Any] = []
        try:
            info = await self._start_workers(sorted(eos))
        except BaseException:
            self._kill_workers()
            raise
        self.limits = Limits(self.args.served_name, info["vocab_size"], info["max_len"], info["tree_room"],
                             self.args.max_tokens_limit or info["max_len"], self.args.default_max_tokens)
        self.metrics = ServingMetrics(self.args.served_name)
        self.scheduler = Scheduler(self.workers, self.args.max_batch_size, self.args.step_timeout_s,
                                   on_round=self.metrics.batch)
        self.frontend = Frontend(self.args, self.tokenizer, self.limits, self.scheduler, self.metrics, self.api_key)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this after __init__ on the replica: the HTTP app over this replica's scheduler."""
        return build_api(self.frontend)

    async def _start_workers(self, eos: list[int]) -> dict[str, Any]:
        """One TPWorker per rank in bundles 1..tp of this replica's placement group, then the TP rendezvous."""
        placement_group = ray.util.get_current_placement_group()
        context = serve.get_replica_context()
        base = f"eyas-worker-{context.app_name}-{context.replica_id.unique_id}"
        for rank in range(self.args.tensor_parallel_size):
            options: dict[str, Any] = {"num_cpus": self.args.worker_cpus, "num_gpus": self.args.worker_gpus,
                                       "name": f"{base}-rank{rank}", "namespace": WORKER_NAMESPACE}
            runtime_env = with_openmp_env()  # `serve run` starts Ray without init_ray's job-wide env_vars
            if runtime_env:
                options["runtime_env"] = runtime_env
            if placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=1 + rank)
            self.workers.append(TPWorker.options(**options).remote(rank, self.args, eos))
        host, port = await self.workers[0].rendezvous.remote()
        infos = await asyncio.gather(*[worker.setup.remote(host, port) for worker in self.workers])
        return infos[0]

    async def reconfigure(self, user_config: dict[str, Any] | None) -> None:
        """Serve calls this with the deployment's ``user_config`` (``LiveSettings``) after ``__init__`` and on every
        change of it, a lightweight update that keeps the replica, its workers and their loaded weights. A bad
        ``user_config`` raises, and Serve reports the update failed."""
        settings = LiveSettings.from_user_config(user_config)
        if settings.speculation_by_batch is not None:
            await self.set_speculation(settings.speculation_by_batch)

    async def set_speculation(self, speculation_by_batch: dict[int, int | None]) -> dict[int, int | None]:
        """Make ``speculation_by_batch`` this replica's schedule from its next round on; returns it as parsed.
        ``reconfigure`` calls it, and so does jobs.load through a deployment handle (drafting off, ``{1: 0}``, is
        its baseline on the very same replica). /v1/models reports the live schedule."""
        args = replace(self.args, speculation_by_batch=speculation_by_batch)  # ServeArgs checks and normalises it

        async def every_rank() -> None:  # all ranks or none: a caller cancelled half-way must not split them
            await asyncio.gather(*[worker.set_schedule.remote(args.speculation_by_batch) for worker in self.workers])
            self.args = self.frontend.args = args

        await shielded(every_rank())
        return args.speculation_by_batch

    def _kill_workers(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker)

    def __del__(self) -> None:
        self._kill_workers()

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes it replace the replica."""
        if self.scheduler.broken is not None:
            raise RuntimeError(f"eyas workers failed: {self.scheduler.broken!r}")
        await asyncio.wait_for(asyncio.gather(*[w.ping.remote() for w in self.workers]), HEALTH_PING_TIMEOUT_S)


def build_app(args: dict[str, Any]) -> Application:
    """The application builder ``import_path: serving.app:build_app`` names (Serve passes exactly the ``args``).

    The placement group (bundle 0 for the replica, one bundle per TP rank) follows from the args; a config file's
    ``deployments:`` entry (autoscaling_config, max_ongoing_requests, ...) overrides these options as usual."""
    return application(args)


def application(args: dict[str, Any] | ServeArgs, deployment_options: dict[str, Any] | None = None) -> Application:
    """``build_app`` with deployment options applied on top, for Python callers (``eyas_ray.deploy`` applies a
    config file's ``deployments:`` the same way)."""
    serve_args = ServeArgs.from_args(args)
    admitted = serve_args.max_batch_size + serve_args.max_waiting_requests
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": serve_args.replica_cpus},
                               "placement_group_bundles": serve_args.bundles(),
                               "placement_group_strategy": serve_args.placement_strategy,
                               # room past the admitted requests, so the ones beyond get their 429 at once
                               "max_ongoing_requests": admitted + serve_args.max_batch_size}
    options.update(deployment_options or {})
    check_back_pressure(serve_args, options)
    return EyasServer.options(**options).bind(serve_args)
