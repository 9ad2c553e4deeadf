"""Tensor-parallel plumbing for the batched loop, without Ray: process-group setup and the leader's broadcast.

Ranks find each other through a TCP rendezvous at rank 0's address (``free_port`` picks the port). Collectives run
on gloo for CPU tensors and NCCL on GPUs. ``BroadcastChannel`` is the ``Channel`` of ``eyas.decoding.engine``: the
leader's decisions (small Python lists of ints) reach every rank by ``broadcast_object_list``.

Why the leader (rank 0) alone drafts, verifies and samples, and not a drafter replica per rank:
  - every rank must feed the target the very same tree, or the ranks' forwards (and their all-reduces) diverge;
    replicas would have to draft bit-identically (same floats, same sampling RNG state) on every rank, forever, and
    one mismatch hangs or corrupts the replica. A broadcast makes agreement true by construction.
  - the broadcast is two small messages per cycle (B trees of <= MAX_TREE_NODES ints, then B accepted paths), next
    to the 2 * num_layers all-reduces of hidden states the target forward already does;
  - the drafter's weights and its per-sequence state live once, not tp times; the target's final hidden states
    (its taps) are all-reduced, so rank 0 already sees exactly what a single-GPU drafter would.
The cost is that ranks > 0 idle while rank 0 drafts, which replicas would not save either: they would draft the
same tree at the same time.
"""
from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from eyas.models.decoder import TensorParallel


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, size: int, master_addr: str, master_port: int, device: torch.device | str,
                         timeout_s: float = 120.0) -> TensorParallel:
    """Join the tensor-parallel group (every rank calls this at once) and return this rank's TensorParallel.

    ``timeout_s`` bounds every collective, so a rank that died mid-cycle fails its peers instead of hanging them.
    """
    if size == 1:
        return TensorParallel()
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} must lie in [0, {size})")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(default_backend(device), init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallel(rank, size, dist.group.WORLD)


def shutdown_tensor_parallel() -> None:
    """Leave the group together: a rank that tears gloo down while a peer is still mid-collective (or still
    connecting) aborts the peer's process ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class BroadcastChannel:
    """The leader (rank 0) shares a picklable value; every rank returns it."""

    def __init__(self, tp: TensorParallel, device: torch.device | str) -> None:
        self.tp = tp
        self.is_leader = tp.rank == 0
        self.device = torch.device(device) if torch.device(device).type == "cuda" else None

    def share(self, value: Any) -> Any:
        if self.tp.size == 1:
            return value
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.tp.group, device=self.device)
        return box[0]
