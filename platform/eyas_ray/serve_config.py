"""The serving application's arguments: the ``args:`` of an application in a Serve config file.

Shared glue: serving/ builds its deployment from them and jobs.load sizes a local Ray by them, so they live here,
beside the Ray helpers both apps use (the apps never import each other).

    applications:
      - name: eyas
        import_path: serving.app:build_app
        args: {target: ..., spec: {...}, tensor_parallel_size: 1, ...}   <- ServeArgs
        deployments:
          - name: EyasServer                                            <- Serve's own deployment options:
            max_ongoing_requests: 16                                       autoscaling_config, max_ongoing_requests,
            autoscaling_config: {min_replicas: 1, max_replicas: 2, ...}    health_check_period_s, ...
            user_config: {speculation_by_batch: {1: 4, 8: 0}}           <- LiveSettings: changed in place

``spec`` is the ``spec:`` section that jobs.generate, jobs.bench and tune.sweep's best-config YAML share
(eyas.methods.SpecConfig), taken as is; ``spec_file`` names such a YAML instead (best.yaml: its ``target:`` serves
when the args name none, ``sweep:`` is ignored), and ``spec`` keys, when both are given, override the file's. The
placement group of a replica (bundle 0: the replica, then one bundle per tensor-parallel rank) is derived from these
arguments by ``serving.app.build_app``;
``check_back_pressure`` checks them against the deployment's options (``eyas_ray.deploy`` applies a config file's).

``user_config`` (Serve's own deployment option) holds the ``LiveSettings``: what a running replica changes in place,
without reloading its weights. Serve hands it to the replica at start and again on every change (``serve deploy``
of the edited file is a lightweight update: the replicas stay), and it wins over ``args.speculation_by_batch``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eyas.config import ConfigError, from_dict, require, resolve_path
from eyas.methods import SpecConfig
from eyas.decoding.requests import SpeculationSchedule
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.models.dtypes import TARGET_DTYPES, WEIGHT_FORMAT_DTYPES

DEVICES = ("auto", "cpu", "cuda")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class ServeArgs:
    target: str                         # HF checkpoint directory ($EYAS_HOME expands) or models:/NAME@ALIAS
    model_name: str | None = None       # the `model` clients ask for; default: the target directory's name
    spec: SpecConfig = field(default_factory=SpecConfig)  # method, drafter (path or models:/NAME@ALIAS), tree
    spec_file: str | None = None        # a YAML with a `spec:` section (tune.sweep's best config), read as is
    tensor_parallel_size: int = 1       # ranks per replica, one TP worker actor (and bundle) each
    max_batch_size: int = 8             # sequences one replica decodes together (continuous batching)
    max_waiting_requests: int = 16      # requests one replica queues for a batch row; more get 429 + Retry-After
    # load-adaptive speculation: batch size -> most drafted nodes per sequence (null: full tree, 0: none)
    speculation_by_batch: dict[int, int | None] = field(default_factory=lambda: {1: None})
    max_len: int | None = None          # context limit (KV slots per sequence); default: the target's
    max_tokens_limit: int | None = None  # the largest max_tokens a request may ask for; default: the context
    default_max_tokens: int = 16        # /v1/completions without max_tokens (OpenAI's default)
    max_tree_nodes: int = MAX_TREE_NODES  # a draft tree's cap (root included), reserved in the context
    # the suffix proposer (spec.method suffix, or a hybrid with it) also drafts from the replica's finished answers,
    # held in one index of at most shared_answer_tokens tokens (oldest answers evicted first); false: each request
    # drafts from its own context and spec.datastore only, so tenants never influence each other's drafts
    share_answers: bool = True
    shared_answer_tokens: int = 200_000
    # prompt tokens whose K/V (eyas.decoding.prefixes) a replica keeps, so a prompt that starts like an earlier one
    # (the chat template's system turn, a conversation's next turn, a resent prompt) prefills only the rest;
    # smollm2 float32 K/V take about 46 KB a token. 0: off, e.g. where tenants must not see each other's timings
    prefix_cache_tokens: int = 8192
    dtype: str = "float32"              # or bfloat16, float16; q8_0 (CPU): the target's linears in GGUF's Q8_0
    device: str = "auto"                # auto: CUDA when the worker was given a GPU, else CPU
    replica_cpus: float = 0.5           # bundle 0: the replica (HTTP, tokenizer, scheduling)
    worker_cpus: float = 1.0            # each TP worker's bundle
    worker_gpus: float = 0.0
    placement_strategy: str = "STRICT_PACK"  # keep a replica's ranks on one node: all-reduce every layer
    torch_threads: int | None = None    # per worker; default: its CPU share (at least 1)
    api_key_env: str | None = None      # env var holding a bearer API key; unset: no key is checked
    step_timeout_s: float = 120.0       # one scheduling round on the workers; past it the replica is unhealthy
    collective_timeout_s: float = 120.0  # torch.distributed timeout between ranks

    def __post_init__(self) -> None:
        require(bool(str(self.target).strip()), "target", self.target, "set it to a checkpoint directory")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        require(self.max_batch_size >= 1, "max_batch_size", self.max_batch_size, "must be >= 1")
        require(self.max_waiting_requests >= 0, "max_waiting_requests", self.max_waiting_requests, "must be >= 0")
        require(self.max_len is None or self.max_len >= 2, "max_len", self.max_len, "must be >= 2")
        require(self.max_tokens_limit is None or self.max_tokens_limit >= 1, "max_tokens_limit",
                self.max_tokens_limit, "must be >= 1")
        require(self.default_max_tokens >= 1, "default_max_tokens", self.default_max_tokens, "must be >= 1")
        require(self.max_tree_nodes >= 1, "max_tree_nodes", self.max_tree_nodes, "must be >= 1")
        require(self.shared_answer_tokens >= 1, "shared_answer_tokens", self.shared_answer_tokens, "must be >= 1")
        require(self.prefix_cache_tokens >= 0, "prefix_cache_tokens", self.prefix_cache_tokens, "must be >= 0 (0: off)")
        require(self.dtype in TARGET_DTYPES, "dtype", self.dtype, f"must be one of {list(TARGET_DTYPES)}")
        require(self.dtype not in WEIGHT_FORMAT_DTYPES or self.device != "cuda", "dtype", self.dtype,
                "is a CPU weight format (eyas's panel kernel); use bfloat16 or float16 on cuda")
        require(self.device in DEVICES, "device", self.device, f"must be one of {list(DEVICES)}")
        require(self.placement_strategy in PLACEMENT_STRATEGIES, "placement_strategy", self.placement_strategy,
                f"must be one of {list(PLACEMENT_STRATEGIES)}")
        for name in ("replica_cpus", "worker_cpus", "worker_gpus"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        require(self.device != "cuda" or self.worker_gpus > 0, "device", self.device,
                "cuda needs worker_gpus > 0 (each TP worker's GPU share)")
        require(self.torch_threads is None or self.torch_threads >= 1, "torch_threads", self.torch_threads,
                "must be >= 1")
        require(self.step_timeout_s > 0, "step_timeout_s", self.step_timeout_s, "must be > 0")
        require(self.collective_timeout_s > 0, "collective_timeout_s", self.collective_timeout_s, "must be > 0")
        try:
            schedule = SpeculationSchedule(self.speculation_by_batch)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        object.__setattr__(self, "speculation_by_batch", schedule.max_draft_nodes_by_batch)

    @classmethod
    def from_args(cls, args: dict[str, Any] | "ServeArgs") -> "ServeArgs":
        """From an application's ``args`` mapping; merges ``spec_file``'s ``spec:`` section under ``spec``."""
        if isinstance(args, ServeArgs):
            return args
        if not isinstance(args, dict):
            raise ConfigError(f"application args must be a mapping, got {args!r}")
        data = dict(args)
        spec = dict(data.get("spec") or {})
        if data.get("spec_file"):
            best = read_spec_file(data["spec_file"])
            spec = {**best["spec"], **spec}
            if not data.get("target") and best.get("target"):
                data["target"] = best["target"]
        data["spec"] = spec
        if not data.get("target"):
            raise ConfigError("args.target is missing: set it to the target's checkpoint directory (or give a "
                              "spec_file whose YAML names a `target:`)")
        return from_dict(cls, data, prefix="args.")

    @property
    def schedule(self) -> SpeculationSchedule:
        return SpeculationSchedule(self.speculation_by_batch)

    @property
    def served_name(self) -> str:
        return self.model_name or Path(str(self.target).rstrip("/")).name or "eyas"

    @property
    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(f"api_key_env={self.api_key_env!r}: that environment variable is unset or empty "
                              "in the replica; set it (e.g. runtime_env.env_vars) or drop api_key_env")
        return key

    def bundles(self) -> list[dict[str, float]]:
        """Bundle 0 holds the replica, bundles 1..tp one TP worker each."""
        worker = {"CPU": self.worker_cpus}
        if self.worker_gpus:
            worker["GPU"] = self.worker_gpus
        return [{"CPU": self.replica_cpus}] + [dict(worker) for _ in range(self.tensor_parallel_size)]


@dataclass(frozen=True)
class LiveSettings:
    """A deployment's ``user_config``: the settings a running replica takes in place (``EyasServer.reconfigure``).

    speculation_by_batch: the load-adaptive schedule (batch size -> most drafted nodes per sequence; null: the
    drafter's full tree, 0: none), as ``args.speculation_by_batch``; unset keeps the args' schedule. A new sweep's
    schedule (tune.sweep's schedule.yaml) goes live this way, the replicas and their loaded weights untouched."""
    speculation_by_batch: dict[int, int | None] | None = None  # as args.speculation_by_batch; unset: the args'

    def __post_init__(self) -> None:
        if self.speculation_by_batch is not None:
            try:
                schedule = SpeculationSchedule(self.speculation_by_batch)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"user_config.{err}") from None
            object.__setattr__(self, "speculation_by_batch", schedule.max_draft_nodes_by_batch)

    @classmethod
    def from_user_config(cls, user_config: Any) -> "LiveSettings":
        if user_config is None:
            return cls()
        if not isinstance(user_config, dict):
            raise ConfigError(f"user_config must be a mapping like {{speculation_by_batch: {{1: 4}}}}, got "
                              f"{user_config!r}")
        return from_dict(cls, user_config, prefix="user_config.")


def read_spec_file(path: str) -> dict[str, Any]:
    """A best-config YAML (tune.sweep's best.yaml): its ``spec:`` section and, if present, its ``target:``."""
    file = resolve_path(path)
    if not file.is_file():
        raise ConfigError(f"args.spec_file={path!r}: file does not exist")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("spec"), dict):
        raise ConfigError(f"args.spec_file={path!r}: expected a YAML mapping with a `spec:` section")
    return {"spec": dict(data["spec"]), "target": data.get("target")}


def check_back_pressure(args: ServeArgs, options: dict[str, Any]) -> None:
    """A replica answers 429 only to requests Serve hands it: with max_ongoing_requests at or below the requests it
    admits, the rest would wait in Serve's router queue, unbounded unless max_queued_requests bounds it."""
    admitted = args.max_batch_size + args.max_waiting_requests
    ongoing = options["max_ongoing_requests"]
    if ongoing <= admitted and options.get("max_queued_requests", -1) < 0:
        raise ConfigError(f"deployments: EyasServer max_ongoing_requests={ongoing} must exceed args.max_batch_size + "
                          f"args.max_waiting_requests = {admitted}, so requests past those get a 429 instead of "
                          "waiting in Serve's unbounded queue; raise it (or set max_queued_requests)")
