"""The frozen target's features per training sequence, computed once and reused: in later epochs (a memory
cache), and across trainings, trials and ``ray job submit`` copies of the working dir (a disk cache under
``$EYAS_HOME``, see ``open_feature_dir``). Everything is named by content: a cache by the target's weights and
its taps, a row by its token ids, so a data set that grows (jobs.generate_data with more prompts) or is reordered
computes only the sequences it has not seen. Features come from a float32 or a bfloat16 forward of the target
(``train.feature_dtype``): bfloat16 halves the feature pass on a CPU with AVX512-BF16 / AMX, and its caches are
kept apart from float32 ones (a bfloat16 run reads a float32 cache where one exists, not the other way round)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from eyas.models.decoder import Decoder
from eyas.models.dtypes import torch_dtype
from eyas.models.features import TargetFeatures, TrainBatch, target_features

ARGMAX = "argmax"  # a row's key for the target's greedy next tokens (its taps are keyed by layer number)


def right_padded(rows_T: Sequence[torch.Tensor], T: int) -> torch.Tensor:
    """[B, T, ...]: each row's values (its own length first) zero-padded on the right to ``T``."""
    out_BT = rows_T[0].new_zeros(len(rows_T), T, *rows_T[0].shape[1:])
    for b, row_T in enumerate(rows_T):
        out_BT[b, :row_T.shape[0]] = row_T
    return out_BT


def target_fingerprint(target: Decoder) -> str:
    """The loaded target's weights, named by content (not by a path or a file time, which change when a job's
    working dir is a copy): every tensor's name, shape, dtype and float64 sum, plus a strided sample of ~1024 of
    its values. Cheap for a large target (one pass per tensor) and different for any retrained one."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(target.state_dict().items()):
            flat = tensor.detach().flatten()
            sample = flat[:: max(1, flat.numel() // 1024)].float().cpu().numpy().tobytes()
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{flat.double().sum().item():.10e}|".encode())
            digest.update(sample)
    return digest.hexdigest()


def sequence_key(ids_T: torch.Tensor) -> str:
    """A sequence's name in a cache: its token ids by content (the target is causal, so the features of a position
    depend on the ids up to it and nothing else: not the row's index, its data set or its batch)."""
    return hashlib.sha256(ids_T.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:32]


MANIFEST = "cache.json"  # in each disk cache: what it holds, so a drafter with fewer taps can read it
LAYOUT = "by-sequence"    # rows named by sequence_key (caches of index-named rows are not read: they recompute)


def cache_base(target: Decoder) -> str:
    """What every cache of this target shares, whatever taps it keeps: the weights by content and the layout."""
    return hashlib.sha256(json.dumps([LAYOUT, target_fingerprint(target)]).encode()).hexdigest()[:16]


def stored_taps(target: Decoder, taps: Sequence[int]) -> tuple[int, ...]:
    """What a cache keeps for a drafter reading ``taps``: those and the final-normed state (the LM head's input)."""
    return tuple(sorted(set(taps) | {target.config.num_layers}))


def cache_name(base: str, stored: Sequence[int], dtype: str) -> str:
    """A cache's directory name: the target (``base``), the taps it stores and the dtype of the forward."""
    key = [base, list(stored)] + ([dtype] if dtype != "float32" else [])  # float32 caches keep their older key
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def own_feature_dir(root: Path, base: str, stored: Sequence[int], dtype: str) -> Path:
    """``root/<key>``, the cache of features computed by a ``dtype`` forward of the target ``base`` (``cache_base``)
    holding the taps ``stored`` (``stored_taps``), made with its manifest when new. The trainer opens it through
    ``open_feature_dir``; jobs.generate_data writes the features it keeps (``keep_taps``) into it."""
    own = Path(root) / cache_name(base, stored, dtype)
    own.mkdir(parents=True, exist_ok=True)
    if not (own / MANIFEST).is_file():
        tmp = own / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"base": base, "taps": list(stored), "layout": LAYOUT, "dtype": dtype}))
        tmp.replace(own / MANIFEST)
    return own


def open_feature_dir(root: Path, target: Decoder, taps: Sequence[int],
                     dtype: str = "float32") -> tuple[Path, tuple[int, ...], str]:
    """(directory, the taps it stores, the dtype of its forward) for a drafter reading ``taps`` computed by a
    ``dtype`` forward: its own cache (``own_feature_dir``) when that exists, else a cache of the same target whose
    taps include these, in the same dtype or in float32 (EAGLE-1 and Medusa read the final state that EAGLE-3's and
    DFlash's caches keep as well; a bfloat16 run reads float32 features, never the reverse; jobs.generate_data's
    ``keep_taps`` cache is one of these), else a new own cache. Sequences a reused cache lacks are computed with all
    of its taps and its dtype, so it stays whole for the drafter that made it."""
    torch_dtype(dtype, "train.feature_dtype")  # a name the target loads in, or ValueError
    base = cache_base(target)
    wanted = stored_taps(target, taps)
    own = root / cache_name(base, wanted, dtype)
    if not own.is_dir() and root.is_dir():
        for manifest in sorted(root.glob(f"*/{MANIFEST}")):
            held = json.loads(manifest.read_text())
            held_dtype = held.get("dtype", "float32")  # manifests before bfloat16 features: float32
            if (held.get("base") == base and set(wanted) <= set(held.get("taps", ()))
                    and held_dtype in (dtype, "float32")):
                return manifest.parent, tuple(held["taps"]), held_dtype
    return own_feature_dir(root, base, wanted, dtype), wanted, dtype


def row_file(directory: Path, key: str) -> Path:
    """Where a cache keeps the features of the sequence named ``key`` (``sequence_key``)."""
    return Path(directory) / f"{key}.safetensors"


def write_row(directory: Path, key: str, row: dict[int | str, torch.Tensor], tag: str | None = None) -> None:
    """One sequence's features (taps by layer, ``ARGMAX``) as ``row_file``, atomically (a temp file renamed into
    place: a reader or a rerun never sees half of one). ``tag`` names the temp file's writer (default: the pid)."""
    from safetensors.torch import save_file

    file = row_file(directory, key)
    tmp = file.with_name(f".{file.name}.{tag or os.getpid()}.tmp")
    save_file({str(t): v.contiguous().cpu() for t, v in row.items()}, str(tmp))
    tmp.replace(file)


def as_float32(features: TargetFeatures) -> TargetFeatures:
    """Features of a bfloat16 forward as the float32 a drafter's inputs are (unchanged when they are)."""
    return TargetFeatures({t: h.float() for t, h in features.taps.items()}, features.logits_BTV.float())


class FeatureCache:
    """The frozen target's features per sequence, computed once and reused in later epochs.

    mode "none": computed for every batch (online). "memory": kept per sequence in this worker. "disk": written to
    ``directory/<sequence_key>.safetensors`` (atomic rename), so other workers, later epochs, resumed runs and
    trainings on a grown data set read them instead of running the target; a disk cache reads a row's file each
    time it is asked for (the OS's page cache keeps the hot ones) and holds none in the worker, whose memory would
    otherwise grow to every row's features (9 GB per worker on 2,688 smollm2 sequences with EAGLE-3's taps).

    ``source`` gives the model the features come from (called on the first sequence to compute, so a run that finds
    every row cached loads nothing): the target itself by default, or a bfloat16 copy of it (Trainer). Rows are
    stored in its dtype and handed to the drafter in float32.

    A row holds the requested taps, the final-normed state (tap ``num_layers``) and the target's greedy next tokens
    (``ARGMAX``, from the forward's own logits). Logits are not stored: they are the LM head on the final-normed
    state, re-derived only when a loss reads them (``TargetFeatures.logits_BTV``: the soft-target losses), as that
    product over the whole vocabulary costs more than the rest of an argmax-target step's inputs together. Files
    written before ``ARGMAX`` was stored read as before (their argmax re-derived).
    """

    def __init__(self, target: Decoder, taps: Sequence[int], mode: str = "none", directory: Path | None = None,
                 keep_taps: Sequence[int] = (), source: Callable[[], Decoder] | None = None) -> None:
        if mode not in ("none", "memory", "disk"):
            raise ValueError(f"feature cache mode {mode!r}: must be none, memory or disk")
        if mode == "disk" and directory is None:
            raise ValueError("feature cache mode 'disk' needs a directory")
        self.target, self.taps, self.mode = target, tuple(taps), mode
        self.stored_taps = stored_taps(target, (*self.taps, *keep_taps))  # keep_taps: a shared cache's others
        self.directory = Path(directory) if directory is not None else None
        self.source = source or (lambda: target)
        self.memory: dict[str, dict[int | str, torch.Tensor]] = {}
        self.hits = self.misses = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def features(self, batch: TrainBatch) -> TargetFeatures:
        if self.mode == "none":
            return as_float32(target_features(self.source(), batch.input_ids_BT, self.taps))
        lengths = batch.valid_BT.sum(-1).tolist()
        keys = [sequence_key(ids_T[:length]) for ids_T, length in zip(batch.input_ids_BT, lengths)]
        rows = [self._lookup(key) for key in keys]
        missing = [b for b, row in enumerate(rows) if row is None]
        self.hits += len(rows) - len(missing)
        self.misses += len(missing)
        if missing:
            T = max(lengths[b] for b in missing)
            computed = target_features(self.source(), batch.input_ids_BT[missing, :T], self.stored_taps)
            for j, b in enumerate(missing):
                rows[b] = {t: computed.taps[t][j, :lengths[b]].clone() for t in self.stored_taps}
                rows[b][ARGMAX] = computed.argmax_BT[j, :lengths[b]].clone()
                self._store(keys[b], rows[b])
        return self._assemble(rows, batch.input_ids_BT.shape[1])

    def _assemble(self, rows: list[dict[int | str, torch.Tensor] | None], T: int) -> TargetFeatures:
        taps = {t: right_padded([row[t] for row in rows], T).float() for t in self.stored_taps}
        final_BTE = taps[self.target.config.num_layers]

        def logits_from(index: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
            return self.target.lm_head(final_BTE if index is None else final_BTE[index])

        if all(ARGMAX in row for row in rows):
            argmax_BT = right_padded([row[ARGMAX] for row in rows], T)
            return TargetFeatures({t: taps[t] for t in self.taps}, argmax_BT=argmax_BT, logits_from=logits_from)
        with torch.no_grad():  # an older disk cache without ARGMAX
            return TargetFeatures({t: taps[t] for t in self.taps}, logits_from(None))

    def _lookup(self, key: str) -> dict[int | str, torch.Tensor] | None:
        if key in self.memory:
            return self.memory[key]
        if self.directory is not None:
            file = row_file(self.directory, key)
            if file.is_file():
                from safetensors.torch import load_file

                row = {(k if k == ARGMAX else int(k)): v.to(self.target.device)
                       for k, v in load_file(str(file)).items()}
                return row
        return None

    def _store(self, key: str, row: dict[int | str, torch.Tensor]) -> None:
        if self.mode == "memory":
            self.memory[key] = row
        if self.directory is not None:
            write_row(self.directory, key, row)
