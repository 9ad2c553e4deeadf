"""The generation loop: prefill, then draft -> verify -> commit until a stop.

``vanilla`` is the same loop with no drafter: every cycle verifies an empty draft, which is plain decoding.

Shape legend: B batch (1 here), T new tokens, N tree nodes (root included), V vocab, E hidden size.

One cycle, for a drafter:
  root = the last emitted token (its K/V is not yet in the target cache, at position L = cache length)
  tree = drafter.propose(root)                     nodes in topological order, node 0 = root
  logits_NV, taps = target(tree.tokens, positions L + depth, ancestor mask)   one forward over the whole tree
  accepted = verify(tree, logits_NV)               path from the root + one bonus token
  cache.keep(accepted.nodes)                       KV rollback: only the accepted path survives
  drafter.commit(path tokens, taps at the path)    the drafter advances on the target's own features
  emit accepted tokens + bonus; root = bonus
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.models.decoder import Decoder
from eyas.decoding.stats import SpecStats
from eyas.decoding.tree import DraftTree
from eyas.decoding.verify import process_logits, sample, verify_greedy, verify_sampling


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    token_ids: list[int]  # the new tokens, stop token included when one was hit
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str = "length"  # "stop" (EOS) or "length" (max_new_tokens)


def make_generator(sampling: SamplingParams, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed if sampling.seed is not None else int(torch.seed() % 2**63))
    return generator


def pick_token(logits_V: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's own choice: argmax, or a sample from its processed distribution."""
    if sampling.greedy:
        return int(logits_V.argmax())
    probs_1V = process_logits(logits_V[None].float(), sampling.temperature, sampling.top_p, sampling.top_k)
    return int(sample(probs_1V[0], generator))


def truncate_at_stop(tokens: list[int], eos_token_ids: set[int], budget: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first stop token, and at most ``budget`` of them."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos_token_ids:
            return tokens[: i + 1], True
    return tokens[:budget], False


def judged_nodes(tree: DraftTree, path: list[int]) -> tuple[int, list[tuple[float, bool]]]:
    """Nodes the target judged (children of accepted nodes): (deepest depth, [(confidence, accepted)])."""
    on_path = set(path)
    scores = tree.scores_N.tolist()
    parents = tree.parents_N.tolist()
    depth = tree.depth_N.tolist()
    judged, deepest = [], 0
    for i in range(1, tree.num_nodes):
        if parents[i] in on_path:
            parent_score = scores[parents[i]]
            confidence = scores[i] / parent_score if parent_score > 0 else 0.0
            judged.append((confidence, i in on_path))
            deepest = max(deepest, depth[i])
    return deepest, judged


@torch.inference_mode()
def generate(target: Decoder, prompt_ids: list[int], max_new_tokens: int, drafter=None,
             sampling: SamplingParams = SamplingParams(), eos_token_ids: tuple[int, ...] | set[int] = (),
             max_len: int | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; stops exactly at EOS or the budget."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be > 0")
    context_limit = max_len or target.config.max_position_embeddings
    tree_room = 64 if drafter is not None else 1  # slots a draft tree may occupy beyond the committed tokens
    if len(prompt_ids) + max_new_tokens + tree_room > context_limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"context of {context_limit} tokens")
    device = target.device
    eos = set(eos_token_ids)
    generator = make_generator(sampling, device)
    cache = target.new_cache(1, context_limit)
    stats = SpecStats()
    t_start = time.perf_counter()

    taps = tuple(drafter.target_taps) if drafter is not None else ()
    prompt_BT = torch.tensor([prompt_ids], device=device)
    logits_BTV, hidden = target(prompt_BT, torch.arange(len(prompt_ids), device=device)[None], cache, taps=taps,
                                logits_slice=slice(-1, None))
    first = pick_token(logits_BTV[0, -1], sampling, generator)
    out, stopped = truncate_at_stop([first], eos, max_new_tokens)
    if drafter is not None and not stopped and len(out) < max_new_tokens:
        t = time.perf_counter()
        drafter.begin(list(prompt_ids), {l: h[0] for l, h in hidden.items()})
        stats.draft_s += time.perf_counter() - t

    while not stopped and len(out) < max_new_tokens:
        root = out[-1]
        if drafter is None:
            out, stopped = vanilla_step(target, cache, root, sampling, generator, out, eos, max_new_tokens)
            continue
        t0 = time.perf_counter()
        tree = drafter.propose(root, list(prompt_ids) + out, sampling.temperature, generator)
        t1 = time.perf_counter()
        prefix_len = cache.lengths[0]
        logits_BNV, hidden = target(tree.tokens_N[None].to(device), tree.position_ids(prefix_len)[None].to(device),
                                    cache, mask=tree.ancestor_mask_NN.to(device), taps=taps)
        if sampling.greedy:
            accepted = verify_greedy(tree, logits_BNV[0])
        else:
            probs_NV = process_logits(logits_BNV[0].float(), sampling.temperature, sampling.top_p, sampling.top_k)
            accepted = verify_sampling(tree, probs_NV, generator)
        t2 = time.perf_counter()
        cache.keep(accepted.nodes)
        path_idx = torch.as_tensor(accepted.nodes, device=device)
        drafter.commit([root] + accepted.tokens, {l: h[0, path_idx] for l, h in hidden.items()})
        t3 = time.perf_counter()
        judged_depth, judged = judged_nodes(tree, accepted.nodes)
        stats.record_cycle(accepted.num_accepted, judged_depth, judged, tree.num_nodes - 1)
        out, stopped = truncate_at_stop(out + accepted.tokens + [accepted.bonus], eos, max_new_tokens)
        stats.draft_s += (t1 - t0) + (t3 - t2)
        stats.verify_s += t2 - t1
    stats.new_tokens = len(out)
    stats.other_s = time.perf_counter() - t_start - stats.draft_s - stats.verify_s
    return Generation(out, stats, "stop" if stopped else "length")


def vanilla_step(target: Decoder, cache, root: int, sampling: SamplingParams, generator, out: list[int],
                 eos: set[int], budget: int) -> tuple[list[int], bool]:
    """The empty draft: one target forward on the root, and the target's own next token."""
    position = cache.lengths[0]
    logits_BTV, _ = target(torch.tensor([[root]], device=target.device),
                           torch.tensor([[position]], device=target.device), cache)
    token = pick_token(logits_BTV[0, -1], sampling, generator)
    return truncate_at_stop(out + [token], eos, budget)
