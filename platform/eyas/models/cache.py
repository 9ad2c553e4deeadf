"""A preallocated KV cache that rolls back by keeping a list of slot indices.

Shape legend: L layers, B batch rows, H kv heads, S cache slots, D head dim, T new tokens.

Every forward appends its T new tokens at slots ``[start_b, start_b + T)`` of each row b. After a tree
verification only the accepted path survives: ``keep(nodes)`` copies the K/V of the kept new slots to
``[start_b, start_b + len(nodes))`` and truncates the row there, so a rejected branch leaves nothing behind and
the cache equals the cache of plainly decoding the accepted tokens.
"""
from __future__ import annotations

import torch


def is_sequence(item: object) -> bool:
    return isinstance(item, (list, tuple)) or (isinstance(item, torch.Tensor) and item.dim() > 0)


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k_LBHSD = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LBHSD = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths: list[int] = [0] * batch_size  # valid slots per row, new tokens included once appended
        self.starts: list[int] = [0] * batch_size   # where the last forward's new tokens begin, per row

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def begin(self, num_new: int, rows_active: list[bool] | None = None) -> None:
        """Reserve ``num_new`` slots at the end of every (active) row for the coming forward."""
        for b, length in enumerate(self.lengths):
            if rows_active is not None and not rows_active[b]:
                self.starts[b] = length
                continue
            if length + num_new > self.max_len:
                raise ValueError(f"KV cache full: row {b} has {length} of {self.max_len} slots, "
                                 f"{num_new} more requested; raise max_len (the context limit)")
            self.starts[b] = length

    def write(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> None:
        num_new = k_BHTD.shape[2]
        if self.batch_size == 1 or len(set(self.starts)) == 1:
            start = self.starts[0]
            self.k_LBHSD[layer, :, :, start:start + num_new] = k_BHTD
            self.v_LBHSD[layer, :, :, start:start + num_new] = v_BHTD
            return
        for b, start in enumerate(self.starts):
            self.k_LBHSD[layer, b, :, start:start + num_new] = k_BHTD[b]
            self.v_LBHSD[layer, b, :, start:start + num_new] = v_BHTD[b]

    def finish(self, num_new: int, rows_active: list[bool] | None = None) -> None:
        for b in range(self.batch_size):
            if rows_active is None or rows_active[b]:
                self.lengths[b] = self.starts[b] + num_new

    def span(self, num_new: int) -> int:
        """Number of slots attention must read during the current forward."""
        return max(self.starts) + num_new

    def view(self, layer: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_LBHSD[layer, :, :, :span], self.v_LBHSD[layer, :, :, :span]

    def keep(self, nodes_per_row: list[list[int]] | list[int] | torch.Tensor) -> None:
        """Keep only the given new-token indices (e.g. the accepted tree path) of the last forward, per row.

        A flat list (or 1-D tensor) is the single row of a batch of one; ``[]`` there keeps nothing.
        """
        if isinstance(nodes_per_row, torch.Tensor):
            nodes_per_row = nodes_per_row.tolist()
        if self.batch_size == 1 and not any(is_sequence(n) for n in nodes_per_row):
            nodes_per_row = [nodes_per_row]  # type: ignore[list-item]
        if len(nodes_per_row) != self.batch_size:
            raise ValueError(f"keep: got node lists for {len(nodes_per_row)} rows, the cache has "
                             f"{self.batch_size}; pass one list per row")
        for b, row_nodes in enumerate(nodes_per_row):  # type: ignore[arg-type]
            nodes = [int(n) for n in row_nodes]
            start = self.starts[b]
            num_new = self.lengths[b] - start
            if any(not 0 <= n < num_new for n in nodes):
                raise ValueError(f"keep: row {b} nodes {nodes} must index the last forward's {num_new} new tokens")
            num_keep = len(nodes)
            if nodes != list(range(num_keep)):  # a prefix of the new tokens is already in place
                src = torch.as_tensor(nodes, device=self.k_LBHSD.device) + start
                self.k_LBHSD[:, b, :, start:start + num_keep] = self.k_LBHSD[:, b, :, src]
                self.v_LBHSD[:, b, :, start:start + num_keep] = self.v_LBHSD[:, b, :, src]
            self.lengths[b] = start + num_keep

    def truncate(self, row: int, length: int) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0
        self.starts[row] = 0
