"""Tensor-parallel worker actors: one per rank of a replica, each in its own bundle of the replica's placement group.

Every rank holds 1/tp of the target (Megatron-style: attention heads and MLP columns split, o_proj / down_proj
row-parallel and all-reduced; see eyas.models.decoder) and runs the same ``SpecEngine`` SPMD: the replica sends
every rank the same ``step(joins, leaves)`` and the ranks' collectives line up. Rank 0 is the leader: it alone holds
the drafters (one per batch row) and the sampling generators, drafts and verifies, and broadcasts the tree shapes
and accepted paths (why there and not on every rank: eyas.decoding.engine's module docstring). Only rank 0's step result
carries tokens; the others return None.

Collectives use gloo on CPU and NCCL on GPU. A worker is never restarted in place (max_restarts=0): a dead rank
breaks its process group, so the whole replica fails its health check and Serve replaces it, placement group
and all.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable

import ray
import torch

from eyas.config import resolve_path
from eyas.methods import METHODS, SpecConfig, build_drafter
from eyas.models import load_target
from eyas.decoding.engine import SpecEngine
from eyas.decoding.requests import SequenceRequest, StepOutput
from eyas.decoding.tp import BroadcastChannel, free_port, init_tensor_parallel
from serving.config import ServeArgs

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_location(path_or_uri: str) -> str:
    """A local directory for a path ($EYAS_HOME expands) or an MLflow ``models:/NAME@ALIAS`` URI (downloaded)."""
    if str(path_or_uri).startswith(("models:/", "runs:/")):
        from eyas.track import resolve_model

        return str(resolve_model(path_or_uri))
    return str(resolve_path(path_or_uri))


def resolved_spec(spec: SpecConfig) -> SpecConfig:
    """The spec with its drafter / draft model locations made local (registry URIs downloaded once)."""
    changes = {}
    if spec.drafter:
        changes["drafter"] = resolve_location(spec.drafter)
    if spec.draft_model:
        changes["draft_model"] = resolve_location(spec.draft_model)
    return replace(spec, **changes) if changes else spec


def drafter_factory(target, spec: SpecConfig) -> Callable[[], Any] | None:
    """Makes one drafter per batch row (drafters hold per-sequence state) without loading weights per row: a
    trained drafter's checkpoint is read once and its rows share the model (registry.drafter_factory); a draft LM
    is loaded once and each row gets its own KV cache. None for vanilla. The first drafter is built the ordinary
    way, so a bad spec fails here with methods.build_drafter's message."""
    first = build_drafter(target, spec)
    if first is None:
        return None
    if METHODS[spec.method].needs_drafter:
        from eyas.drafters.registry import drafter_factory as shared_factory

        return shared_factory(spec.drafter, target, method=spec.method,
                              tree=spec.tree or METHODS[spec.method].default_tree, depth=spec.depth,
                              top_k=spec.top_k, num_nodes=spec.num_nodes)
    if spec.method == "draft-lm":
        from eyas.drafters.draft_lm import DraftLMDrafter

        return lambda: DraftLMDrafter(first.model, first.config, first.max_len)
    return lambda: build_drafter(target, spec)


@ray.remote(max_restarts=0)
class TPWorker:
    def __init__(self, rank: int, args: dict[str, Any], eos_token_ids: list[int]) -> None:
        self.rank = rank
        self.args = ServeArgs.from_args(args)
        self.eos_token_ids = list(eos_token_ids)
        self.engine: SpecEngine | None = None
        threads = self.args.torch_threads or max(1, int(self.args.worker_cpus))
        torch.set_num_threads(threads)
        want_cuda = self.args.device == "cuda" or (self.args.device == "auto" and self.args.worker_gpus > 0)
        if want_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"rank {rank}: device={self.args.device} with worker_gpus={self.args.worker_gpus} "
                               "but torch sees no CUDA device")
        self.device = torch.device("cuda", 0) if want_cuda else torch.device("cpu")  # Ray narrows CUDA_VISIBLE_DEVICES

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address for the process group."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the TP group, load this rank's shard and build the engine; returns what the replica validates on."""
        args = self.args
        tp = init_tensor_parallel(self.rank, args.tensor_parallel_size, master_addr, master_port, self.device,
                                  timeout_s=args.collective_timeout_s)
        target = load_target(resolve_location(args.target), dtype=TORCH_DTYPES[args.dtype], device=self.device, tp=tp)
        if self.rank == 0:  # the leader alone drafts (eyas.decoding.engine); the others only need to know it speculates
            factory = drafter_factory(target, resolved_spec(args.spec))
        else:
            factory = None if args.spec.method == "vanilla" else _never_called
        self.engine = SpecEngine(target, capacity=args.max_batch_size, max_len=args.max_len,
                                 drafter_factory=factory, schedule=args.schedule,
                                 eos_token_ids=self.eos_token_ids, max_tree_nodes=args.max_tree_nodes,
                                 channel=BroadcastChannel(tp, self.device))
        return {"vocab_size": target.config.vocab_size, "max_len": self.engine.max_len,
                "tree_room": self.engine.max_tree_nodes, "device": str(self.device), "pid": os.getpid()}

    def step(self, joins: list[SequenceRequest], leaves: list[str]) -> list[StepOutput] | None:
        outputs = self.engine.step(joins, leaves)
        return outputs if self.rank == 0 else None

    def ping(self) -> int:
        return self.rank


def _never_called() -> Any:
    raise AssertionError("only the leader (rank 0) builds drafters")
