"""The target's features kept from the forwards that regenerate a data set (jobs.generate_data ``keep_taps``): the
taps, the final-normed state and the greedy next token at every position of prompt + answer, taken from the prefill
and each decode step as they run, so that drafter training reads them from its disk feature cache
(eyas.train.feature_cache) instead of running the target over every sequence again.

Shape legend: B batch, S cache slots (a row's left padding, then its prompt, then its answer), T new tokens,
E hidden size, V vocab, N rows of one LM head chunk.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from eyas.models.decoder import Decoder
from eyas.train.feature_cache import ARGMAX, row_file, sequence_key, write_row

HEAD_ROWS = 256  # positions per LM head product when the prefill's argmax is derived (a [N, V] block at a time)


class TapRecorder:
    """Every slot's taps and greedy next token of one batched regeneration (``eyas.train.data.regenerate``).

    Slot s of row b holds what the forward that wrote cache slot s computed: the prompt's slots come from the
    prefill, slot P + k from the decode step that fed answer token k. A row's features are its slots
    [pad_b, P + len(answer_b)): the positions a forward over prompt + answer alone (FeatureCache) computes.
    """

    def __init__(self, target: Decoder, taps: Sequence[int], batch_size: int, num_slots: int) -> None:
        self.final = target.config.num_layers
        assert self.final in taps, "a feature row holds the final-normed state (feature_cache.stored_taps)"
        self.taps = tuple(taps)
        self.head = target.lm_head.packed or target.lm_head
        E, B, S = target.config.hidden_size, batch_size, num_slots
        self.hidden_BSE = {t: torch.zeros(B, S, E, dtype=target.dtype, device=target.device) for t in self.taps}
        self.argmax_BS = torch.zeros(B, S, dtype=torch.long, device=target.device)

    def record(self, start: int, hidden: dict[int, torch.Tensor], logits_BTV: torch.Tensor | None = None) -> None:
        """Keep one forward's taps ({tap: hidden_BTE}) at slots [start, start + T); the greedy next tokens from its
        logits when it computed them at every new token, else from the final-normed state (a prefill computes
        logits at its last token only: the LM head over a whole batch of prompts at once would be [B, P, V])."""
        final_BTE = hidden[self.final]
        B, T, E = final_BTE.shape
        for tap in self.taps:
            self.hidden_BSE[tap][:, start:start + T] = hidden[tap]
        if logits_BTV is not None and logits_BTV.shape[1] == T:
            argmax_BT = logits_BTV.argmax(-1)
        else:
            rows_NE = final_BTE.reshape(B * T, E)
            argmax_BT = torch.cat([self.head(rows_NE[i:i + HEAD_ROWS]).argmax(-1)
                                   for i in range(0, B * T, HEAD_ROWS)]).view(B, T)
        self.argmax_BS[:, start:start + T] = argmax_BT

    def rows(self, first_slots: Sequence[int], end_slots: Sequence[int]) -> list[dict[int | str, torch.Tensor]]:
        """Row b's features, slots [first_slots[b], end_slots[b]), as a feature cache stores a row (on the CPU)."""
        out = []
        for b, (first, end) in enumerate(zip(first_slots, end_slots)):
            row: dict[int | str, torch.Tensor] = {t: h[b, first:end].cpu().clone() for t, h in self.hidden_BSE.items()}
            row[ARGMAX] = self.argmax_BS[b, first:end].cpu().clone()
            out.append(row)
        return out


def write_kept(directory: Path, sequences: Sequence[Sequence[int]], rows: Sequence[dict[int | str, torch.Tensor]],
               tag: str) -> None:
    """Each sequence's features in the feature cache ``directory``, named by its token ids as the trainer names it
    (``sequence_key`` of prompt + answer), one file each, atomically; ``tag`` names the temp files' writer."""
    for ids, row in zip(sequences, rows):
        ids_T = torch.tensor(list(ids), dtype=torch.int64)
        assert row[ARGMAX].shape[0] == ids_T.shape[0], "a kept row covers its whole sequence"
        write_row(directory, sequence_key(ids_T), row, tag)


def missing_rows(directory: Path, sequences: Sequence[Sequence[int]]) -> int:
    """How many of ``sequences`` have no features in ``directory`` (a shard built before ``keep_taps`` was set)."""
    return sum(not row_file(directory, sequence_key(torch.tensor(list(ids), dtype=torch.int64))).is_file()
               for ids in sequences)
