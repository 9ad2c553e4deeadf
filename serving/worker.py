"""Tensor-parallel worker actors: one per rank of a replica, each in its own bundle of the replica's placement group.

Every rank holds 1/tp of the target (Megatron-style: attention heads and MLP columns split, o_proj / down_proj
row-parallel and all-reduced; see eyas.models.decoder) and runs the same ``SpecEngine`` SPMD: the replica sends
every rank the same ``step(joins, leaves)`` and the ranks' collectives line up. Rank 0 is the leader: it alone holds
the drafters (one per batch row) and the sampling generators, drafts and verifies, and broadcasts the tree shapes
and accepted paths (why there and not on every rank: eyas.decoding.engine's module docstring). Only rank 0's step result
carries tokens; the others return None.

The leader also keeps the replica's shared index of finished answers (``SharedAnswers``) when the spec's suffix
proposer reads one and ``args.share_answers`` is on: a request that finishes adds its answer, which later requests'
drafters then find.

Collectives use gloo on CPU and NCCL on GPU. A worker is never restarted in place (max_restarts=0): a dead rank
breaks its process group, so the whole replica fails its health check and Serve replaces it, placement group
and all.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import ray
import torch

from eyas.drafters.suffix import SuffixIndex
from eyas.methods import METHODS, SpecConfig, drafter_factory, history_index, resolve_checkpoint
from eyas.models import load_target
from eyas.models.dtypes import target_dtype
from eyas.decoding.engine import SpecEngine
from eyas.decoding.requests import SequenceRequest, SpeculationSchedule, StepOutput
from eyas.decoding.tp import BroadcastChannel, free_port, init_tensor_parallel
from eyas.threads import configure_threads
from eyas_ray.serve_config import ServeArgs


def resolved_spec(spec: SpecConfig) -> SpecConfig:
    """The spec with its drafter / draft model locations made local (registry URIs downloaded once)."""
    changes = {}
    if spec.drafter:
        changes["drafter"] = str(resolve_checkpoint(spec.drafter, "spec.drafter", drafter=True))
    if spec.draft_model:
        changes["draft_model"] = str(resolve_checkpoint(spec.draft_model, "spec.draft_model"))
    return replace(spec, **changes) if changes else spec


@ray.remote(max_restarts=0)
class TPWorker:
    def __init__(self, rank: int, args: dict[str, Any], eos_token_ids: list[int]) -> None:
        self.rank = rank
        self.args = ServeArgs.from_args(args)
        self.eos_token_ids = list(eos_token_ids)
        self.engine: SpecEngine | None = None
        self.shared: SharedAnswers | None = None
        # the thread policy within this worker's CPUs (its OpenMP environment came with its runtime_env: app.py)
        configure_threads(self.args.torch_threads, cpu_budget=self.args.worker_cpus or None)
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
        activation_dtype, weight_format = target_dtype(args.dtype)
        target = load_target(resolve_checkpoint(args.target, "target"), dtype=activation_dtype,
                             device=self.device, tp=tp, weight_format=weight_format)
        if self.rank == 0:  # the leader alone drafts (eyas.decoding.engine); the others only need to know it speculates
            spec = resolved_spec(args.spec)
            history = history_index(spec, args.shared_answer_tokens) if args.share_answers else None
            self.shared = SharedAnswers(history) if history is not None else None
            factory = drafter_factory(target, spec, history)  # weights loaded once, shared by the rows
        else:
            factory = _never_called if METHODS[args.spec.method].speculates else None
        self.engine = SpecEngine(target, capacity=args.max_batch_size, max_len=args.max_len,
                                 drafter_factory=factory, schedule=args.schedule,
                                 eos_token_ids=self.eos_token_ids, max_tree_nodes=args.max_tree_nodes,
                                 channel=BroadcastChannel(tp, self.device),
                                 prefix_cache_tokens=args.prefix_cache_tokens)
        return {"vocab_size": target.config.vocab_size, "max_len": self.engine.max_len,
                "tree_room": self.engine.max_tree_nodes, "device": str(self.device), "pid": os.getpid()}

    def step(self, joins: list[SequenceRequest], leaves: list[str]) -> list[StepOutput] | None:
        outputs = self.engine.step(joins, leaves)
        if self.shared is not None:
            self.shared.record(joins, leaves, outputs)
        return outputs if self.rank == 0 else None

    def set_schedule(self, speculation_by_batch: dict[int, int | None]) -> None:
        """Swap the load-adaptive schedule in place (``EyasServer.set_speculation``). An actor runs one method at a
        time, so it lands between two steps; every rank takes it, though only the leader drafts."""
        self.engine.schedule = SpeculationSchedule(speculation_by_batch)

    def ping(self) -> int:
        return self.rank

    def occupancy(self) -> dict[str, int]:
        """What live requests hold on this rank: batch rows, KV cache slots, and (leader) drafters lent to rows.
        All three are 0 once every request has finished or left (the chaos and soak checks read them)."""
        engine = self.engine
        lent = engine.capacity - len(engine.free_drafters) if engine.speculative and engine.leader else 0
        return {"rows": len(engine.rows), "kv_slots": sum(row.length for row in engine.rows), "drafters": lent}


class SharedAnswers:
    """A replica's finished answers into its shared suffix index: each request's tokens are collected step by step
    and its answer (the generated tokens, not the prompt) is indexed when it finishes by a stop or its length; a
    request that left early or failed adds nothing."""

    def __init__(self, index: SuffixIndex) -> None:
        self.index = index
        self.answers: dict[str, list[int]] = {}  # request id -> its tokens so far

    def record(self, joins: list[SequenceRequest], leaves: list[str], outputs: list[StepOutput]) -> None:
        for request_id in leaves:
            self.answers.pop(request_id, None)
        for request in joins:
            self.answers[request.request_id] = []
        for out in outputs:
            answer = self.answers.get(out.request_id)
            if answer is None:
                continue
            answer += out.new_token_ids
            if out.finished:
                del self.answers[out.request_id]
                if out.finish_reason in ("stop", "length") and answer:
                    self.index.add(answer)


def _never_called() -> Any:
    raise AssertionError("only the leader (rank 0) builds drafters")
