"""A preallocated KV cache that rolls back by keeping a list of slot indices.

Shape legend (docs/SHAPES.md): L layers, B batch rows, H kv heads, S cache slots, D head dim, T new tokens.

The cache owns its tensors: appending (begin / write / finish, or ``extend``), rollback (``keep``, ``truncate``),
row views (``rows``), row moves (``move_row``), prefix copies (``row_slots``, ``fill_row``) and growth (``grow``,
``ensure_room``) are its methods, and nothing else writes ``k_LBHSD`` / ``v_LBHSD``. The target's cache, the
engine's batch rows and the drafters' own caches (EAGLE's tree-attention cache, DFlash's context cache) are all this
one class.

Every forward appends its T new tokens at slots ``[start_b, start_b + T)`` of each row b. After a tree
verification only the accepted path survives: ``keep(nodes)`` copies the K/V of the kept new slots to
``[start_b, start_b + len(nodes))`` and truncates the row there, so a rejected branch leaves nothing behind and
the cache equals the cache of plainly decoding the accepted tokens.
"""
from __future__ import annotations

from typing import Sequence

import torch


def is_sequence(item: object) -> bool:
    return isinstance(item, (list, tuple)) or (isinstance(item, torch.Tensor) and item.dim() > 0)


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self._adopt(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                    [0] * batch_size)

    def _adopt(self, k_LBHSD: torch.Tensor, v_LBHSD: torch.Tensor, lengths: Sequence[int]) -> None:
        self.k_LBHSD, self.v_LBHSD = k_LBHSD, v_LBHSD
        self.max_len = k_LBHSD.shape[3]
        self.lengths: list[int] = list(lengths)  # valid slots per row, new tokens included once appended
        self.starts: list[int] = list(lengths)   # where the last forward's new tokens begin, per row

    def rows(self, start: int, stop: int, lengths: Sequence[int]) -> "KVCache":
        """A cache over rows [start, stop) that shares this one's storage (its writes land here), holding the given
        per-row lengths. The caller keeps the rows' true lengths and reads them back from the view."""
        if not 0 <= start <= stop <= self.batch_size or len(lengths) != stop - start:
            raise ValueError(f"rows [{start}, {stop}) with {len(lengths)} lengths: the cache has "
                             f"{self.batch_size} rows")
        view = KVCache.__new__(KVCache)
        view._adopt(self.k_LBHSD[:, start:stop], self.v_LBHSD[:, start:stop], lengths)
        return view

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` slots of row ``src`` into row ``dst`` (a leaving row's slot is refilled)."""
        self.k_LBHSD[:, dst, :, :length] = self.k_LBHSD[:, src, :, :length]
        self.v_LBHSD[:, dst, :, :length] = self.v_LBHSD[:, src, :, :length]

    def row_slots(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row ``row``'s first ``length`` slots: (k_LHSD, v_LHSD)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} slots, not {length}")
        return self.k_LBHSD[:, row, :, :length].clone(), self.v_LBHSD[:, row, :, :length].clone()

    def fill_row(self, row: int, k_LHSD: torch.Tensor, v_LHSD: torch.Tensor) -> None:
        """Row ``row`` becomes the given slots (a prefix cache's): it holds exactly their length."""
        length = k_LHSD.shape[2]
        if length > self.max_len:
            raise ValueError(f"{length} slots do not fit a cache of {self.max_len}")
        self.k_LBHSD[:, row, :, :length] = k_LHSD
        self.v_LBHSD[:, row, :, :length] = v_LHSD
        self.lengths[row] = self.starts[row] = length

    def grow(self, max_len: int) -> None:
        """Reallocate to ``max_len`` slots per row, keeping every row's valid slots."""
        length = max(self.lengths, default=0)
        if max_len < length:
            raise ValueError(f"cannot shrink a KV cache holding {length} slots to {max_len}")
        k_LBHSD = self.k_LBHSD.new_zeros(*self.k_LBHSD.shape[:3], max_len, self.k_LBHSD.shape[4])
        v_LBHSD = self.v_LBHSD.new_zeros(*self.v_LBHSD.shape[:3], max_len, self.v_LBHSD.shape[4])
        k_LBHSD[..., :length, :] = self.k_LBHSD[..., :length, :]
        v_LBHSD[..., :length, :] = self.v_LBHSD[..., :length, :]
        self.k_LBHSD, self.v_LBHSD, self.max_len = k_LBHSD, v_LBHSD, max_len

    def ensure_room(self, num_new: int, limit: int | None = None) -> None:
        """Grow (doubling, at most to ``limit`` slots) so that ``num_new`` more slots fit after the longest row."""
        needed = max(self.lengths, default=0) + num_new
        if needed > self.max_len:
            size = max(needed, 2 * self.max_len)
            self.grow(min(size, limit) if limit is not None else size)

    def extend(self, kv_per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append one forward's (k_BHTD, v_BHTD) for every layer at once (a drafter's own cache)."""
        num_new = kv_per_layer[0][0].shape[2]
        self.begin(num_new)
        for layer, (k_BHTD, v_BHTD) in enumerate(kv_per_layer):
            self.write(layer, k_BHTD, v_BHTD)
        self.finish(num_new)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def num_layers(self) -> int:
        return self.k_LBHSD.shape[0]

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

    def window_mask(self, positions_BT: torch.Tensor, span: int, window: int) -> torch.Tensor:
        """[B, T, S]: True where the key lies inside the query's sliding window (query_pos - key_pos < window).

        A cached slot s holds position s (rows start at position 0 and ``keep`` compacts them); the new slot
        start_b + j holds positions_BT[b, j] (a tree node sits at prefix_len + depth, not at its slot).
        """
        B, T = positions_BT.shape
        key_pos_BS = torch.arange(span, device=positions_BT.device).repeat(B, 1)
        for b, start in enumerate(self.starts):
            key_pos_BS[b, start:start + T] = positions_BT[b]
        return (positions_BT[:, :, None] - key_pos_BS[:, None, :]) < window

    def view(self, layer: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_LBHSD[layer, :, :, :span], self.v_LBHSD[layer, :, :, :span]

    def layer_views(self, span: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (k_BHSD, v_BHSD) over the first ``span`` slots."""
        return [self.view(layer, span) for layer in range(self.num_layers)]

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
