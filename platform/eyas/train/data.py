"""Drafter training data: regeneration by the target, parquet shards, batches per worker (the target features: eyas.train.feature_cache).

Shape legend: B batch (sequences), P prompt tokens (left-padded), S cache slots, T tokens, E hidden size, V vocab.

On disk (written by ``jobs.generate_data``)::

    $EYAS_HOME/data/<name>/data.json                 what produced the shards (content key, counts, complete)
    $EYAS_HOME/data/<name>/train/shard-00000.parquet  prompt_ids, response_ids, loss_mask (one row per sequence)
    $EYAS_HOME/data/<name>/heldout/shard-00000.parquet

``loss_mask`` covers prompt + response: 1 where the token is one the drafter should learn to predict (the
response), 0 on the prompt. Training reads every shard of a split into memory (drafter data sets are small next to
the target features computed from them) and each worker takes a deterministic slice of a per-epoch permutation, so
a resumed run can skip exactly the batches it already trained on (``DataPosition``).

Nothing partial is read as if complete: a shard is written under a temp name and renamed, data.json says
``"complete": false`` while a build runs (readers refuse every split but those it leaves as they are, listed in
``"readable"`` with their rows), and reading checks every shard and the row counts data.json records; a
truncated or missing shard is a ShardError naming the file, and a rerun of jobs.generate_data builds it again.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from eyas.models.decoder import Decoder
from eyas.decoding.verify import process_logits
from eyas.models.features import TrainBatch
from eyas.train.kept_features import TapRecorder

SPLITS = ("train", "heldout")
COLUMNS = ("prompt_ids", "response_ids", "loss_mask")
META_FILE = "data.json"
REBUILD = ("rerun python -m jobs.generate_data with the data set's config: a rerun builds missing and unreadable "
           "shards again (--force starts over)")


class ShardError(ValueError):
    """A data set that cannot be read whole; the message names the file and how to rebuild it."""


# ---------------------------------------------------------------- regeneration (the target answers prompts)


@torch.inference_mode()
def regenerate(target: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               eos_token_ids: Sequence[int] = (), temperature: float = 0.0, top_p: float = 1.0,
               generator: torch.Generator | None = None, recorder: TapRecorder | None = None) -> list[list[int]]:
    """The target's continuation of every prompt, batched: prompts are left-padded and masked out.

    Rows stop at their first EOS (kept) or at ``max_new_tokens``. Greedy when temperature is 0; otherwise
    each token is sampled from process_logits(temperature, top_p) with ``generator``.

    Left padding, for prompts [a1 a2 a3] and [b1]:   tokens  a1 a2 a3 | n1 ...    positions 0 1 2 | 3 ...
                                                      0  0  b1 | m1 ...              0 0 0 | 1 ...
    A real token attends to real tokens at or before it (mask over cached + new slots); a pad token attends only
    to itself, so no row of the attention is empty (an all-masked row would turn into NaN keys/values).

    Sliding window (Mistral): the decoder's own window mask assumes slot s holds position s, which left padding
    breaks (row b's slot s holds position s - pad_b, so the decoder would let it see pad_b keys too many). Every
    real token of row b is shifted by the same pad_b, so the distance between a query and a key is their slot
    distance: the window is applied here, in slots, and the decoder's looser mask ANDed on top changes nothing.

    ``recorder`` (a TapRecorder over B rows and P + max_new_tokens slots) keeps the taps of every forward; the last
    answer tokens, which generation alone never feeds back, get one more decode step, so every position of
    prompt + answer has its features (``recorder.rows``: row b's are slots [P - len(prompt_b), P + len(answer_b))).
    """
    assert prompts and all(len(p) > 0 for p in prompts), "regenerate: every prompt needs at least one token"
    B, P = len(prompts), max(len(p) for p in prompts)
    S = P + max_new_tokens
    device = target.device
    taps = recorder.taps if recorder is not None else ()
    pad_B = torch.tensor([P - len(p) for p in prompts], device=device)
    tokens_BP = torch.zeros(B, P, dtype=torch.long, device=device)
    valid_BS = torch.zeros(B, S, dtype=torch.bool, device=device)
    for b, prompt in enumerate(prompts):
        tokens_BP[b, P - len(prompt):] = torch.as_tensor(list(prompt), device=device)
        valid_BS[b, P - len(prompt):P] = True
    positions_BP = (torch.arange(P, device=device)[None] - pad_B[:, None]).clamp(min=0)
    window_SS = slot_window(S, target.config.sliding_window, device)
    eye_PP = torch.eye(P, dtype=torch.bool, device=device)
    mask_BPP = (window_SS[None, :P, :P] & valid_BS[:, None, :P]) | eye_PP[None]
    cache = target.new_cache(B, S)
    logits_BTV, hidden = target(tokens_BP, positions_BP, cache, mask=mask_BPP, logits_slice=slice(-1, None),
                                taps=taps)
    if recorder is not None:
        recorder.record(0, hidden)

    eos = set(eos_token_ids)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        next_B = _pick(logits_BTV[:, -1], temperature, top_p, generator)
        for b, token in enumerate(next_B.tolist()):
            if not done[b]:
                out[b].append(token)
                done[b] = token in eos
        last = all(done) or step + 1 == max_new_tokens
        if last and recorder is None:
            break
        valid_BS[:, P + step] = True
        positions_B1 = (P + step - pad_B)[:, None]
        span = P + step + 1
        mask_B1S = valid_BS[:, None, :span] & window_SS[None, span - 1:span, :span]
        logits_BTV, hidden = target(next_B[:, None], positions_B1, cache, mask=mask_B1S, taps=taps)
        if recorder is not None:
            recorder.record(P + step, hidden, logits_BTV)
        if last:
            break
    return out


def slot_window(num_slots: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[S, S] causal mask over slots, limited to the last ``window`` slots when the target has a sliding window:
    query slot i sees key slot j iff j <= i and i - j < window (window 3: row 4 of the mask is 0 0 1 1 1)."""
    query_S1 = torch.arange(num_slots, device=device)[:, None]
    key_1S = torch.arange(num_slots, device=device)[None, :]
    mask_SS = key_1S <= query_S1
    if window is not None:
        mask_SS &= (query_S1 - key_1S) < window
    return mask_SS


def _pick(logits_BV: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
          ) -> torch.Tensor:
    if temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = process_logits(logits_BV.float(), temperature, top_p)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


def response_row(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> dict[str, list[int]]:
    """One parquet row: the drafter learns the response tokens, never the prompt."""
    return {"prompt_ids": list(prompt_ids), "response_ids": list(response_ids),
            "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids)}


def corpus_chunks(stream: Sequence[int], chunk_tokens: int, num_chunks: int) -> list[dict[str, list[int]]]:
    """Rows from consecutive ``chunk_tokens`` windows of a packed token stream (EAGLE-1's fixed data): every token
    but the first (which has no left context) is a prediction target."""
    rows = []
    for start in range(0, len(stream) - chunk_tokens + 1, chunk_tokens):
        if len(rows) == num_chunks:
            break
        chunk = list(stream[start:start + chunk_tokens])
        rows.append({"prompt_ids": [], "response_ids": chunk, "loss_mask": [0] + [1] * (len(chunk) - 1)})
    return rows


# ---------------------------------------------------------------- shards


def shard_path(directory: Path, split: str, index: int) -> Path:
    return Path(directory) / split / f"shard-{index:05d}.parquet"


def num_shards(num_sequences: int, shard_size: int) -> int:
    return -(-num_sequences // shard_size)


def write_shard(path: Path, rows: list[dict[str, list[int]]]) -> None:
    """Write atomically (temp file + rename), so a killed job never leaves a half shard that a rerun would skip."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8()))])
    for row in rows:
        assert len(row["loss_mask"]) == len(row["prompt_ids"]) + len(row["response_ids"]), "loss_mask length"
    table = pa.Table.from_pylist(rows, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def read_rows(directory: Path, split: str) -> list[dict[str, list[int]]]:
    """Every row of ``split``, shards in order. A missing split is an error that says how to build it."""
    files = sorted((Path(directory) / split).glob("shard-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{Path(directory) / split}: no parquet shards; build the data set first, e.g. "
                                f"`python -m jobs.generate_data --config jobs/configs/data-tiny.yaml`")
    rows: list[dict[str, list[int]]] = []
    for file in files:
        rows += read_shard(file)
    check_complete(Path(directory), split, len(rows))
    return rows


def read_shard(file: Path) -> list[dict[str, list[int]]]:
    """One shard's rows, or a ShardError naming the file (a truncated file has no parquet footer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file, columns=list(COLUMNS)).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise ShardError(f"{file}: cannot read this parquet shard ({err}); it is truncated, corrupt or not a "
                         f"shard: {REBUILD}") from None


def shard_is_complete(file: Path) -> bool:
    """Whether ``file`` is a whole, readable shard (a rerun builds the others again)."""
    try:
        read_shard(file)
    except ShardError:
        return False
    return True


def check_complete(directory: Path, split: str, num_rows: int) -> None:
    """A data set jobs.generate_data built says in data.json whether the build finished and how many rows each
    split has; shards written by other means (tests, tools) have no data.json to compare with."""
    meta_file = directory / META_FILE
    if not meta_file.is_file():
        return
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise ShardError(f"{meta_file}: not valid JSON ({err}); {REBUILD}") from None
    if meta.get("complete") is False and split not in (meta.get("readable") or {}):
        raise ShardError(f"{meta_file}: this data set's build has not finished (it is running, or it was killed); "
                         f"{REBUILD}")
    recorded = (meta.get("rows") or meta.get("readable") or {}).get(split)
    if recorded is not None and recorded != num_rows:
        raise ShardError(f"{directory / split}: its shards hold {num_rows} rows but {meta_file} records {recorded}; "
                         f"shards are missing or were changed since: {REBUILD}")


# ---------------------------------------------------------------- batches


def collate(rows: Sequence[dict[str, list[int]]], max_len: int, pad_id: int = 0) -> TrainBatch:
    """Right-pad prompt + response to the longest row (cut at ``max_len``)."""
    seqs = [(row["prompt_ids"] + row["response_ids"])[:max_len] for row in rows]
    masks = [row["loss_mask"][:max_len] for row in rows]
    T = max(len(s) for s in seqs)
    input_ids_BT = torch.full((len(rows), T), pad_id, dtype=torch.long)
    loss_mask_BT = torch.zeros(len(rows), T, dtype=torch.long)
    valid_BT = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (seq, mask) in enumerate(zip(seqs, masks)):
        input_ids_BT[b, :len(seq)] = torch.as_tensor(seq)
        loss_mask_BT[b, :len(seq)] = torch.as_tensor(mask)
        valid_BT[b, :len(seq)] = 1
    return TrainBatch(input_ids_BT=input_ids_BT, loss_mask_BT=loss_mask_BT, valid_BT=valid_BT)


def to_device(batch: TrainBatch, device: torch.device | str) -> TrainBatch:
    return TrainBatch(input_ids_BT=batch.input_ids_BT.to(device), loss_mask_BT=batch.loss_mask_BT.to(device),
                      valid_BT=batch.valid_BT.to(device))


@dataclass(frozen=True)
class DataPosition:
    """Where training stands: the next batch to run is batch ``batch`` of epoch ``epoch`` (both from 0)."""

    epoch: int = 0
    batch: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, int]) -> "DataPosition":
        return cls(int(raw["epoch"]), int(raw["batch"]))


class SequenceDataset:
    """One split of a generated data set, with deterministic per-epoch, per-rank batches."""

    def __init__(self, directory: str | Path, split: str = "train", max_len: int = 256, pad_id: int = 0,
                 limit: int | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: must be one of {list(SPLITS)}")
        self.directory, self.split, self.max_len, self.pad_id = Path(directory), split, max_len, pad_id
        self.rows = read_rows(self.directory, split)[:limit]

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: Sequence[int]) -> TrainBatch:
        return collate([self.rows[i] for i in indices], self.max_len, self.pad_id)

    def epoch_indices(self, epoch: int, seed: int, rank: int, world_size: int, batch_size: int,
                      fixed_ranks: bool = False) -> list[list[int]]:
        """This rank's batches of sequence indices in ``epoch``.

        One permutation per (seed, epoch), shared by all ranks; rank r takes positions r, r + W, r + 2W, ... of
        the first W * floor(N / W) entries, so every rank runs the same number of steps (a collective per step
        must not wait for a rank that has run out). E.g. N=10, W=2, perm [3 7 0 9 4 1 8 2 6 5]:
        rank 0 -> [3 0 4 8 6], rank 1 -> [7 9 1 2 5]; batch_size 2 -> [[3 0] [4 8] [6]].
        fixed_ranks: every rank keeps the sequences of epoch 0's split and only reorders them each epoch, so a
        per-worker feature cache (FeatureCache "memory") is hit for every sequence after the first epoch.
        """
        per_rank = len(self) // world_size
        if per_rank == 0:
            raise ValueError(f"{self.directory / self.split}: {len(self)} sequences cannot feed {world_size} "
                             f"workers; generate more data or lower scaling.num_workers")
        split_epoch = 0 if fixed_ranks else epoch
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed * 1_000_003 + split_epoch))
        mine = order[: per_rank * world_size][rank::world_size]
        if fixed_ranks and epoch > 0:
            reorder = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_009 + rank)
            mine = mine[torch.randperm(per_rank, generator=reorder)]
        mine = mine.tolist()
        return [mine[i:i + batch_size] for i in range(0, per_rank, batch_size)]

    def num_batches(self, world_size: int, batch_size: int) -> int:
        return -(-(len(self) // world_size) // batch_size)

    def batches(self, epoch: int, seed: int, rank: int, world_size: int, batch_size: int, start: int = 0,
                fixed_ranks: bool = False) -> Iterator[tuple[list[int], TrainBatch]]:
        """(sequence indices, batch) from batch ``start`` of ``epoch`` on (resume skips what was trained)."""
        for indices in self.epoch_indices(epoch, seed, rank, world_size, batch_size, fixed_ranks)[start:]:
            yield indices, self.batch(indices)

def token_counts(rows: Sequence[dict[str, list[int]]], vocab_size: int) -> torch.Tensor:
    """How often each token id is a prediction target (loss_mask 1) in ``rows``: the input of a reduced draft
    vocabulary (EAGLE-3 ``draft_vocab_size``)."""
    ids = [t for row in rows for t, m in zip(row["prompt_ids"] + row["response_ids"], row["loss_mask"]) if m]
    return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]


def vocab_counts(row_sets: Sequence[Sequence[dict[str, list[int]]]], vocab_size: int) -> torch.Tensor:
    """What chooses a draft vocabulary: ``token_counts`` of one set of rows; of several (the training data and
    ``drafter.vocab_data``'s), the sum of every set's frequencies, each set normalised to 1."""
    counts = [token_counts(rows, vocab_size) for rows in row_sets]
    if len(counts) == 1:
        return counts[0]
    return sum(c.double() / max(1, int(c.sum())) for c in counts)
