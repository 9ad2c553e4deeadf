"""The target's logits as one request sees them: its ``logit_bias`` and presence / frequency penalties applied at
every tree node, the choices made over them (a prefill's first token, a cycle's verification), and the logprobs a
request reports for the tokens it emits (and, when asked, its prompt's).

Shape legend (docs/SHAPES.md): N tree nodes (root included), V vocab, T prompt tokens, W candidates kept per node
(here: the top logprobs reported per token). This file adds U (the distinct token ids a request's penalties touch).

Penalties are OpenAI's (and vLLM's) definition, over the tokens GENERATED before the position (the prompt does not
count)::

    logits[v] + logit_bias[v] - frequency_penalty * count[v] - presence_penalty * (count[v] > 0)

In a draft tree the tokens generated so far differ per node: node i's row predicts the token after the request's
output (its last token is the tree's root) and the drafted tokens on the root-to-i path, so node i's counts are the
output's plus that path's (root excluded). Every accepted node's row is then exactly the row plain decoding would
have computed at that position, so verification over these rows (greedy argmax, or ``process_logits`` then rejection
sampling) stays lossless with respect to the penalised distribution, and a request's logprobs are the same numbers
vanilla decoding reports for the same tokens.

Logprobs are the log-softmax of these adjusted logits: what greedy decoding chooses from, before temperature,
top_p and top_k (as OpenAI's and vLLM's), so they are finite for every token.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from eyas.decoding.sampling import SamplingParams, pick_token
from eyas.decoding.tree import DraftTree
from eyas.decoding.verify import Accepted, process_logits, verify_greedy, verify_sampling

# prompt logprobs are computed this many rows at a time: a long prompt's full [T, V] float32 log-softmax would hold
# T * V * 4 bytes at once (2,000 tokens of smollm2's 49,152-word vocabulary: 393 MB)
PROMPT_ROWS_PER_CHUNK = 256


@dataclass(frozen=True)
class TokenLogprob:
    """One position's report: the chosen token's logprob and the ``num_top`` most likely tokens with theirs."""
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def adjusted_logits(logits_NV: torch.Tensor, sampling: SamplingParams, generated: Sequence[int],
                    tree: DraftTree | None = None) -> torch.Tensor:
    """float32 [N, V]: ``logits_NV`` with the request's logit_bias and penalties (module docstring), a copy; or
    ``logits_NV`` itself, unchanged, when the request asks for neither. ``tree``: the cycle's tree, row i = node i;
    None: one row after ``generated`` (a prefill's last position)."""
    num_rows = logits_NV.shape[0] if logits_NV.dim() == 2 else -1
    assert num_rows == (tree.num_nodes if tree is not None else 1), \
        f"logits_NV {tuple(logits_NV.shape)}: one row per tree node (one without a tree)"
    if not sampling.adjusts_logits:
        return logits_NV
    out_NV = _with_bias(logits_NV, sampling)
    if sampling.presence_penalty or sampling.frequency_penalty:
        ids_U, counts_NU = _counts(generated, tree, out_NV.device)
        if ids_U.numel():
            penalty_NU = sampling.frequency_penalty * counts_NU + sampling.presence_penalty * (counts_NU > 0)
            out_NV[:, ids_U] -= penalty_NU
    return out_NV


def first_token(logits_TV: torch.Tensor, prompt_ids: Sequence[int], sampling: SamplingParams, num_top: int | None,
                num_prompt_top: int | None, generator: torch.Generator | None
                ) -> tuple[int, list[TokenLogprob], list[TokenLogprob | None] | None]:
    """A prefill's choice: (the first token, its logprob when asked (num_top not None), the prompt's logprobs when
    asked). ``logits_TV``: the prefill's logits, its last position's alone ([1, V]) unless the prompt's logprobs are
    asked ([T, V]). Nothing is generated yet, so only logit_bias changes the logits."""
    logits_1V = adjusted_logits(logits_TV[-1:], sampling, ())
    token = pick_token(logits_1V[0], sampling, generator)
    logprobs = [] if num_top is None else token_logprobs(logits_1V, [0], [token], num_top)
    if num_prompt_top is None:
        return token, logprobs, None
    return token, logprobs, prompt_logprobs(logits_TV, prompt_ids, sampling, num_prompt_top)


def verify_tree(tree: DraftTree, logits_NV: torch.Tensor, sampling: SamplingParams, num_top: int | None,
                generated: Sequence[int], generator: torch.Generator | None
                ) -> tuple[Accepted, list[TokenLogprob] | None]:
    """A cycle's accepted path over the request's adjusted logits (``generated``: its output so far, the tree's
    root last), and when asked the logprobs of the tokens it commits: node ``nodes[k]``'s row chose committed token
    k (the root's row the first, the last accepted node's row the bonus)."""
    logits_NV = adjusted_logits(logits_NV, sampling, generated, tree)
    if sampling.greedy:
        accepted = verify_greedy(tree, logits_NV)
    else:
        probs_NV = process_logits(logits_NV, sampling.temperature, sampling.top_p, sampling.top_k)
        accepted = verify_sampling(tree, probs_NV, generator)
    if num_top is None:
        return accepted, None
    return accepted, token_logprobs(logits_NV, accepted.nodes, accepted.committed, num_top)


def _counts(generated: Sequence[int], tree: DraftTree | None, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_U, counts_NU): the distinct tokens generated before each node's prediction, and how often, per node."""
    drafted = tree.tokens_list[1:] if tree is not None else []
    base = Counter(generated)
    ids = sorted(set(base) | set(drafted))
    num_rows = tree.num_nodes if tree is not None else 1
    ids_U = torch.tensor(ids, dtype=torch.long, device=device)
    counts_U = torch.tensor([float(base[t]) for t in ids], device=device)
    counts_NU = counts_U.expand(num_rows, len(ids)).clone()
    if drafted:
        # node i counts the drafted tokens on its root-to-i path: its ancestors and itself, the root excluded
        drafted_M = torch.searchsorted(ids_U, torch.tensor(drafted, device=device))
        one_hot_MU = torch.nn.functional.one_hot(drafted_M, len(ids)).float()
        counts_NU += tree.ancestor_mask_NN[:, 1:].to(device).float() @ one_hot_MU
    return ids_U, counts_NU


def token_logprobs(logits_NV: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], num_top: int
                   ) -> list[TokenLogprob]:
    """The logprob of ``tokens[k]`` under row ``rows[k]`` of (adjusted) ``logits_NV``, and that row's ``num_top``
    best, for the few rows a cycle emitted from (its accepted path: the root's row chose the first token)."""
    assert len(rows) == len(tokens), f"{len(rows)} rows for {len(tokens)} tokens"
    if not rows:
        return []
    index = torch.as_tensor(list(rows), device=logits_NV.device)
    logprobs_KV = torch.log_softmax(logits_NV[index].float(), dim=-1)
    return _report(logprobs_KV, tokens, num_top)


def prompt_logprobs(logits_TV: torch.Tensor, prompt_ids: Sequence[int], sampling: SamplingParams, num_top: int
                    ) -> list[TokenLogprob | None]:
    """Each prompt token's logprob given the tokens before it (the first has none: None), from a prefill's logits
    over the whole prompt. Nothing was generated yet, so only logit_bias changes them."""
    assert logits_TV.dim() == 2 and logits_TV.shape[0] == len(prompt_ids), \
        f"logits_TV {tuple(logits_TV.shape)}: one row per prompt token ({len(prompt_ids)})"
    out: list[TokenLogprob | None] = [None]
    for start in range(0, len(prompt_ids) - 1, PROMPT_ROWS_PER_CHUNK):
        stop = min(start + PROMPT_ROWS_PER_CHUNK, len(prompt_ids) - 1)
        logprobs_TV = torch.log_softmax(_with_bias(logits_TV[start:stop], sampling), dim=-1)
        out += _report(logprobs_TV, prompt_ids[start + 1:stop + 1], num_top)
    return out


def _with_bias(logits_NV: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """A float32 copy of logits_NV ([..., V]) with the request's logit_bias added."""
    out_NV = logits_NV.to(torch.float32, copy=True)
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], device=out_NV.device)
        out_NV[..., ids] += torch.tensor([b for _, b in sampling.logit_bias], device=out_NV.device)
    return out_NV


def _report(logprobs_KV: torch.Tensor, tokens: Sequence[int], num_top: int) -> list[TokenLogprob]:
    chosen_K = logprobs_KV.gather(1, torch.as_tensor(list(tokens), device=logprobs_KV.device)[:, None])[:, 0]
    chosen = chosen_K.tolist()
    if num_top <= 0:
        return [TokenLogprob(lp, ()) for lp in chosen]
    top_values_KW, top_ids_KW = logprobs_KV.topk(min(num_top, logprobs_KV.shape[-1]), dim=-1)
    return [TokenLogprob(lp, tuple(zip(ids, values)))
            for lp, ids, values in zip(chosen, top_ids_KW.tolist(), top_values_KW.tolist())]
