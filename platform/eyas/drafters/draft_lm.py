"""A small causal LM with the target's tokenizer drafting a chain (Leviathan et al.; Chen et al.).

Greedy decoding drafts the argmax chain (deterministic candidates). With temperature > 0 it SAMPLES each token from
q = softmax(logits / T) and hands q to the verifier (sampled=True), so the p/q rejection path is exercised.

Shape legend (docs/SHAPES.md): T tokens, V vocab, K drafted positions (the chain length).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.models.decoder import Decoder
from eyas.decoding.tree import DraftTree, chain
from eyas.decoding.verify import argmax_rows


@dataclass(frozen=True)
class DraftLMConfig:
    num_draft: int = 4  # chain length K

    def __post_init__(self) -> None:
        if self.num_draft < 1:
            raise ValueError(f"num_draft={self.num_draft}: must be >= 1")


class DraftLMDrafter:
    name = "draft-lm"
    target_taps: tuple[int, ...] = ()

    def __init__(self, draft_model: Decoder, config: DraftLMConfig = DraftLMConfig(), max_len: int | None = None):
        self.model = draft_model
        self.config = config
        self.max_draft_nodes = config.num_draft
        self.max_len = max_len or draft_model.config.max_position_embeddings
        self.cache = draft_model.new_cache(1, self.max_len)
        self.fed: list[int] = []  # the tokens whose K/V sit in the draft cache, in order

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self.cache.truncate(0, 0)
        self.fed = []

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the draft cache; return the logits after the last one ([V])."""
        start = len(self.fed)
        device = self.model.device
        logits_BTV, _ = self.model(torch.tensor([tokens], device=device),
                                   torch.arange(start, start + len(tokens), device=device)[None], self.cache,
                                   logits_slice=slice(-1, None))
        self.fed += tokens
        return logits_BTV[0, -1]

    def _sync(self, context_ids: list[int]) -> torch.Tensor:
        """Make the cache hold exactly ``context_ids``: keep the common prefix, feed the rest."""
        common = 0
        limit = min(len(self.fed), len(context_ids) - 1)  # always re-feed at least the last token for its logits
        while common < limit and self.fed[common] == context_ids[common]:
            common += 1
        self.cache.truncate(0, common)
        self.fed = self.fed[:common]
        return self._feed(context_ids[common:])

    @torch.inference_mode()
    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        room = self.max_len - len(context_ids) - 1
        num_draft = min(self.config.num_draft, room)
        if num_draft <= 0:
            return chain(root_token, [])
        logits_V = self._sync(context_ids)
        tokens: list[int] = []
        probs_rows = []
        for k in range(num_draft):
            if temperature > 0:
                probs_V = torch.softmax(logits_V.float() / temperature, dim=-1)
                token = int(torch.multinomial(probs_V, 1, generator=generator))
            else:
                probs_V = torch.softmax(logits_V.float(), dim=-1)
                token = int(argmax_rows(logits_V[None])[0])
            tokens.append(token)
            probs_rows.append(probs_V)
            if k + 1 < num_draft:
                logits_V = self._feed([token])
        probs_KV = torch.stack(probs_rows)
        return chain(root_token, tokens, probs_KV=probs_KV, sampled=temperature > 0)

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        pass  # _sync keeps the cache's common prefix with the next context, which is the rollback
