"""Tree verification: the target's scores at every node -> the accepted path and one bonus token.

Shape legend (docs/SHAPES.md): N tree nodes (root included), V vocab; ``logits_V`` may carry leading dims [..., V].
This file adds Z (a row's chunks) and Y (a chunk's scores) for ``argmax_rows``.

Row i of the target's logits / probs is the target's next-token distribution AT node i, i.e. after the prefix and
the path to node i (row 0: at the root). Both routines return the accepted root-to-node path and a bonus token.

Sampling (SpecInfer multi-candidate recursive rejection), at an accepted node with target distribution p, children
tried in node order:
  sampled children x ~ q (i.i.d.):  accept w.p. min(1, p(x)/q(x)); on reject p <- norm(max(0, p - q))
  deterministic children (q = point mass at x):  accept w.p. p(x); on reject p(x) <- 0, renormalise
  (the second rule is the first with q = one_hot(x)). If every child is rejected the bonus is sampled from the
residual p; after accepting a leaf, from the target p at the leaf. Either way each committed token follows the
target distribution exactly (lossless); tests/unit/decoding/test_verify.py checks this with a chi-square test.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.decoding.tree import DraftTree

# A residual whose mass is at most this is treated as empty (see _normalised).
_MIN_MASS = 1e-12
# argmax_rows reads a row in chunks of this many scores
ARGMAX_CHUNK = 1024


@dataclass
class Accepted:
    nodes: list[int]  # node indices of the accepted path, root (0) included
    tokens: list[int]  # the accepted drafted tokens (root excluded)
    bonus: int  # the target's own next token after the accepted path

    @property
    def num_accepted(self) -> int:
        return len(self.tokens)

    @property
    def committed(self) -> list[int]:
        """Tokens this cycle appends to the sequence: accepted tokens then the bonus."""
        return [*self.tokens, self.bonus]


def _check_rows(tree: DraftTree, scores_NV: torch.Tensor, name: str) -> None:
    if scores_NV.dim() != 2 or scores_NV.shape[0] != tree.num_nodes:
        raise ValueError(f"{name} has shape {tuple(scores_NV.shape)}, expected ({tree.num_nodes}, V): one row "
                         f"per tree node")


def argmax_rows(scores_NV: torch.Tensor) -> torch.Tensor:
    """``scores_NV.argmax(-1)``, the same indices (each row's first maximum), in two passes on a CPU: the max of
    every ``ARGMAX_CHUNK`` scores, then the argmax inside the first chunk that holds the row's max. torch's CPU
    argmax reads ~1 score a nanosecond (bfloat16: a quarter of that) where its amax reads ~15: on smollm2's
    49,152-word vocabulary a 5-row bfloat16 verify spent 0.9 ms, 4-5% of its cycle, in argmax."""
    num_rows, vocab = scores_NV.shape
    if scores_NV.device.type != "cpu" or vocab < 4 * ARGMAX_CHUNK:
        return scores_NV.argmax(dim=-1)
    full = vocab - vocab % ARGMAX_CHUNK
    chunk_max_NZ = scores_NV[:, :full].reshape(num_rows, -1, ARGMAX_CHUNK).amax(dim=-1)
    if full < vocab:  # a shorter last chunk
        chunk_max_NZ = torch.cat([chunk_max_NZ, scores_NV[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    start_N = chunk_max_NZ.argmax(dim=-1) * ARGMAX_CHUNK  # the first chunk holding the max
    # the last chunk's missing columns repeat the row's last score: they come after it, so never win a tie
    index_NY = (start_N[:, None] + torch.arange(ARGMAX_CHUNK)).clamp_(max=vocab - 1)
    return start_N + scores_NV.gather(1, index_NY).argmax(dim=-1)


def verify_greedy(tree: DraftTree, target_logits_NV: torch.Tensor) -> Accepted:
    """Accept the longest root-to-node path whose every drafted token equals the target's argmax at its parent
    (ties in length: the earliest node); the bonus is the argmax at the last accepted node."""
    _check_rows(tree, target_logits_NV, "target_logits_NV")
    best_N = argmax_rows(target_logits_NV).tolist()
    parents, tokens = tree.parents_list, tree.tokens_list
    matched = [True] * tree.num_nodes  # matched[i]: the whole root->i path equals the target's choices
    depth = [0] * tree.num_nodes
    last = 0
    for i in range(1, tree.num_nodes):
        matched[i] = matched[parents[i]] and tokens[i] == best_N[parents[i]]
        depth[i] = depth[parents[i]] + 1
        if matched[i] and depth[i] > depth[last]:
            last = i
    nodes = tree.path(last)
    return Accepted(nodes, [tokens[i] for i in nodes[1:]], best_N[last])


def verify_sampling(tree: DraftTree, target_probs_NV: torch.Tensor, generator: torch.Generator) -> Accepted:
    """Lossless multi-candidate rejection sampling (module docstring). target_probs_NV is the target's processed
    distribution (temperature / top-p / top-k already applied, see process_logits). Uniforms and the bonus come
    from `generator`; the arithmetic is done in float64 on `generator`'s device."""
    _check_rows(tree, target_probs_NV, "target_probs_NV")
    if tree.sampled and tree.draft_probs_NV is None:
        raise ValueError("verify_sampling: a sampled tree needs draft_probs_NV (the q each child was drawn from)")
    device = generator.device

    def row(rows_NV: torch.Tensor, i: int) -> torch.Tensor:
        return _normalised(rows_NV[i].to(device=device, dtype=torch.float64), fallback_V=None)

    node, nodes, tokens = 0, [0], []
    target_p_V = row(target_probs_NV, 0)
    while True:
        for child in tree.children(node):
            x = tree.tokens_list[child]
            draft_q_V = row(tree.draft_probs_NV, child) if tree.sampled else None
            accept = _accept_probability(target_p_V[x].item(), draft_q_V[x].item() if tree.sampled else 1.0)
            if torch.rand((), generator=generator, device=device).item() < accept:
                break
            target_p_V = _residual(target_p_V, draft_q_V) if tree.sampled else _without(target_p_V, x)
        else:  # every child rejected (or a leaf): the bonus comes from the current p
            return Accepted(nodes, tokens, sample(target_p_V, generator))
        node = child
        nodes.append(child)
        tokens.append(x)
        target_p_V = row(target_probs_NV, child)


def _accept_probability(target_px: float, draft_qx: float) -> float:
    """min(1, p(x) / q(x)). A drafter that picked x with q(x) = 0 is inconsistent; accept iff p(x) > 0."""
    if draft_qx <= 0.0:
        return 1.0 if target_px > 0.0 else 0.0
    return min(1.0, target_px / draft_qx)


def _residual(target_p_V: torch.Tensor, draft_q_V: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution a rejection must be followed by for the output to be exactly p."""
    return _normalised((target_p_V - draft_q_V).clamp_(min=0.0), fallback_V=target_p_V)


def _without(target_p_V: torch.Tensor, token: int) -> torch.Tensor:
    """p with the rejected deterministic candidate removed and renormalised (the residual for q = one_hot(x))."""
    residual_V = target_p_V.clone()
    residual_V[token] = 0.0
    return _normalised(residual_V, fallback_V=target_p_V)


def _normalised(weights_V: torch.Tensor, fallback_V: torch.Tensor | None) -> torch.Tensor:
    """weights / sum. An (almost) empty residual falls back to the current p: max(0, p - q) has mass
    sum |p - q| / 2 = the rejection probability itself, so an empty residual means the rejection that produced it
    had probability <= _MIN_MASS (it only happens through rounding, e.g. p == q up to float error). The fallback
    thus changes the output distribution by at most _MIN_MASS in total variation, and avoids dividing by zero."""
    mass = weights_V.sum().item()
    if mass > _MIN_MASS:
        return weights_V / mass
    if fallback_V is None:
        raise ValueError("verify_sampling: a target or draft distribution row has no probability mass")
    return fallback_V


def sample(probs_V: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs_V (non-negative weights, need not sum to 1), drawn on generator's device."""
    return torch.multinomial(probs_V.to(generator.device), 1, generator=generator).item()


def process_logits(logits_V: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The sampling distribution: softmax(logits / temperature) restricted to the top_k tokens (0: all; tokens
    tied with the k-th are kept) and to the smallest top-probability set of mass >= top_p (1.0: all), renormalised.
    Greedy decoding (temperature 0) is handled by the caller with argmax, not here."""
    if not temperature > 0:
        raise ValueError(f"process_logits: temperature must be > 0 (use argmax for greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"process_logits: top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"process_logits: top_k must be >= 0 (0 disables it), got {top_k}")
    logits_V = logits_V.float() / temperature
    if 0 < top_k < logits_V.shape[-1]:
        kth_1 = logits_V.topk(top_k, dim=-1).values[..., -1:]
        logits_V = logits_V.masked_fill(logits_V < kth_1, float("-inf"))
    if top_p < 1.0:
        sorted_V, order_V = logits_V.sort(dim=-1, descending=True)
        sorted_probs_V = sorted_V.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p. The top token always stays, also when
        # top_p rounds to 0 in float32 (5e-324, 1e-46: "0 >= 0" would drop every token, and softmax gives NaN)
        drop_sorted_V = (sorted_probs_V.cumsum(dim=-1) - sorted_probs_V) >= top_p
        drop_sorted_V[..., 0] = False
        drop_V = drop_sorted_V.scatter(-1, order_V, drop_sorted_V)
        logits_V = logits_V.masked_fill(drop_V, float("-inf"))
    return logits_V.softmax(dim=-1)
