"""The tree-drafting side of EAGLE-1 and EAGLE-3: a drafter KV cache with tree attention over it.

Shape legend (docs/SHAPES.md): T tokens (entries appended in one drafter call), S attended key slots, P tree nodes
run in one drafter call, C committed drafter entries, E target hidden size, V target vocab, X the drafter's output
vocab. Indexing and the committed entries: eagle.py's module docstring.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.decoding.tree import DraftTree, PartialTree, SparseProbs
from eyas.drafters.eagle import EagleModel
from eyas.drafters.trees import EXPAND_MODES, TreeSpec, grow_tree
from eyas.models.cache import KVCache


@dataclass
class _Node:
    slot: int | None  # the node's K/V slot in the drafter cache (None: the root, whose entry is committed)
    hidden_E: torch.Tensor  # the drafter output at this node: the state its children read
    probs_V: torch.Tensor | SparseProbs  # the draft distribution over the target vocab for its children



def queue_entries(pending_TE: torch.Tensor | None, pending_next: list[int], hidden_TE: torch.Tensor,
                  tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``commit``'s queue of target states [T, E] that wait for the drafter, each with its next token: after a
    propose (``pending_TE`` None) the root's entry is committed already, so the new states pair with ``tokens[1:]``
    and the last waits for the next root; commits with no propose between them (base.py allows it) append, the
    root completing the last waiting entry."""
    if pending_TE is None:
        return hidden_TE, list(tokens[1:])
    return torch.cat([pending_TE, hidden_TE]), pending_next + list(tokens)

class EagleDrafter:
    """Drafter protocol (base.py) for EAGLE-1 and EAGLE-3 models, with chain / static / dynamic / best-first trees.

    The drafter's KV cache holds the committed entries (index k: real token t_{k+1} with the target state at k);
    it starts small and doubles on demand. ``commit`` only queues the target states it is given: the newest waits
    for its next token (the root). ``propose`` runs every queued entry in one call, then grows the tree: ``expand``
    runs the not-yet-run parents in one call, each node attending the committed prefix and its own ancestors (tree
    attention over the drafter cache). The tree's slots are dropped afterwards, so the cache again ends at the
    committed prefix. Commits may follow each other without a propose (base.py: any split of the tokens into calls).
    """

    def __init__(self, model: EagleModel, tree: TreeSpec, name: str | None = None,
                 max_len: int | None = None) -> None:
        tree.require_mode(EXPAND_MODES, "EAGLE")
        self.model = model.eval()
        self.tree = tree
        self.max_draft_nodes = tree.max_draft_nodes
        self.name = name or model.drafter_type
        self.target_taps = tuple(model.target_taps)
        self.max_len = max_len or model.target_config.max_position_embeddings
        self.cache: KVCache | None = None
        self._pending_hidden_TE: torch.Tensor | None = None
        self._pending_next: list[int] = []  # the known next tokens of all pending entries but the last
        self._nodes: dict[int, _Node] = {}
        self._num_committed = 0
        self._root_position = 0

    @property
    def num_committed(self) -> int:
        return self._num_committed

    @torch.no_grad()
    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self.cache = self._new_cache(2 * len(prompt_ids) + self.tree.max_expanded)
        self._num_committed = 0
        self._nodes = {}
        self._pending_hidden_TE = self.model.initial_hidden(taps)
        self._pending_next = list(prompt_ids[1:])
        assert len(self._pending_next) + 1 == self._pending_hidden_TE.shape[0], "one tap row per prompt token"

    @property
    def _max_slots(self) -> int:
        """The committed context plus the largest tree's entries."""
        return self.max_len + self.tree.max_expanded

    def _new_cache(self, num_slots: int) -> KVCache:
        """On CPU the cache holds float32 whatever the weights' dtype, as the target's does, and attention runs on
        eyas's float32 kernel (``eagle.drafted_attention``)."""
        config, device = self.model.layer_config, self.model.inv_freq.device
        dtype = torch.float32 if device.type == "cpu" else self.model.dtype
        return KVCache(1, 1, config.num_kv_heads, min(num_slots, self._max_slots), config.head_dim, dtype, device)

    @torch.no_grad()
    def propose(self, root_token: int, context_ids: list[int], temperature: float = 0.0,
                generator: torch.Generator | None = None) -> DraftTree:
        """Deterministic top-k trees at any temperature (verification accepts them exactly): temperature and
        generator are not used."""
        self.advance(root_token)
        tree = grow_tree(self.tree, root_token, self.expand)
        self._rollback()
        return tree

    @torch.no_grad()
    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        self._rollback()
        self._pending_hidden_TE, self._pending_next = queue_entries(
            self._pending_hidden_TE, self._pending_next, self.model.initial_hidden(taps), tokens)

    @torch.no_grad()
    def advance(self, root_token: int) -> None:
        """Commit every pending entry (their next tokens end with the root) and compute the root's draft state."""
        assert self.cache is not None and self._pending_hidden_TE is not None, "call begin() first"
        hidden_TE, self._pending_hidden_TE = self._pending_hidden_TE, None
        tokens = self._pending_next + [root_token]
        T, C = len(tokens), self._num_committed
        device = hidden_TE.device
        mask_TS = torch.ones(T, C + T, dtype=torch.bool, device=device)
        mask_TS[:, C:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        positions_T = torch.arange(C, C + T, device=device)
        out_TE, probs_1V = self._run(torch.tensor(tokens, device=device), hidden_TE, positions_T, mask_TS,
                                     last_logits=True)  # the root's distribution alone: its children's
        self._num_committed = C + T
        self._root_position = C + T - 1
        self._nodes = {0: _Node(None, out_TE[-1], probs_1V[0])}

    @torch.no_grad()
    def expand(self, parent_ids: list[int], partial: PartialTree) -> torch.Tensor | SparseProbs:
        """probs_PV: the draft distribution for the children of each parent (running those not yet run)."""
        todo = [n for n in dict.fromkeys(parent_ids) if n not in self._nodes]
        if todo:
            self._run_nodes(todo, partial)
        rows = [self._nodes[n].probs_V for n in parent_ids]
        if isinstance(rows[0], SparseProbs):
            return SparseProbs(torch.stack([row.probs_PX for row in rows]), rows[0].d2t_X, rows[0].vocab_size)
        return torch.stack(rows)

    def _run_nodes(self, nodes: list[int], partial: PartialTree) -> None:
        assert self.cache is not None
        S, C, P = self.cache.lengths[0], self._num_committed, len(nodes)
        device = self._nodes[0].hidden_E.device
        mask_PS = torch.zeros(P, S + P, dtype=torch.bool, device=device)
        mask_PS[:, :C] = True
        rows, slots = [], []  # each node sees its drafted ancestors' slots and its own: one scatter, not one per slot
        for row, node in enumerate(nodes):
            path_slots = [self._nodes[ancestor].slot for ancestor in partial.path(node)[1:-1]] + [S + row]
            rows += [row] * len(path_slots)
            slots += path_slots
        mask_PS[torch.tensor(rows, device=device), torch.tensor(slots, device=device)] = True
        tokens_P = torch.tensor([partial.tokens[n] for n in nodes], device=device)
        hidden_PE = torch.stack([self._nodes[partial.parents[n]].hidden_E for n in nodes])
        positions_P = torch.tensor([self._root_position + partial.depth[n] for n in nodes], device=device)
        out_PE, probs_PV = self._run(tokens_P, hidden_PE, positions_P, mask_PS)
        for row, node in enumerate(nodes):
            self._nodes[node] = _Node(S + row, out_PE[row], probs_PV[row])

    def _run(self, tokens_P: torch.Tensor, hidden_PE: torch.Tensor, positions_P: torch.Tensor,
             mask_PS: torch.Tensor, last_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | SparseProbs]:
        """One drafter pass over P new entries appended to the cache; returns (hidden_out_PE, probs_PV), the
        distributions of the last entry alone with ``last_logits``. Over a reduced draft vocabulary probs_PV is a
        SparseProbs: the tree ranks its X entries, not all V (decoding/tree.py)."""
        assert self.cache is not None
        self.cache.ensure_room(tokens_P.shape[0], limit=self._max_slots)  # it starts small and doubles
        S, P = self.cache.lengths[0], tokens_P.shape[0]
        past = self.cache.view(0, S) if S else None
        out_1PE, logits_1PX, (k_1HPD, v_1HPD) = self.model.step(tokens_P[None], hidden_PE[None], positions_P[None],
                                                                past, mask_PS[None, None], last_logits)
        self.cache.begin(P)
        self.cache.write(0, k_1HPD, v_1HPD)
        self.cache.finish(P)
        if self.model.draft_vocab is None:
            return out_1PE[0], self.model.draft_probs(logits_1PX[0])
        # the softmax draft_probs takes (vocab.to_target_probs), without spreading it over V
        return out_1PE[0], SparseProbs(logits_1PX[0].float().softmax(-1), self.model.d2t,
                                       self.model.target_config.vocab_size)

    def _rollback(self) -> None:
        """Drop the tree's slots: the cache ends at the committed prefix again."""
        if self.cache is not None:
            self.cache.truncate(0, self._num_committed)
        self._nodes = {}
