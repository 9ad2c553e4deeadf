"""Build a drafter training set: prompts answered by the target itself, written as parquet shards.

    python -m jobs.generate_data --config jobs/configs/data-tiny.yaml [--force] [key=value ...]
    ray job submit --working-dir . -- python -m jobs.generate_data --config jobs/configs/data-micro.yaml

Output: ``$EYAS_HOME/data/<name>/{train,heldout}/shard-NNNNN.parquet`` (prompt_ids, response_ids, loss_mask; see
eyas/train/data.py) and ``data.json`` (what produced them, counts, timings): written first with ``"complete": false``
(readers refuse the data set until the build ends, but for the splits the build leaves as they are, listed in
``readable``: a growing train split's held-out one), then again at the end.

source=regenerate: train prompts from ``eyas.corpus`` (held-out prompts for the held-out split) are tokenized on the
driver (cut to ``max_prompt_tokens``) and continued by the target, ``batch_size`` prompts per batched forward, on
Ray actors (one per CPU, or per GPU with ``use_gpu``; jobs.data_actors); each actor loads the target once and
answers whole shards.
source=sharegpt: the same, with ShareGPT first human turns (``eyas.datasets``, train / held-out split by a hash of
the conversation id) rendered with the target's chat template; prompts over ``max_prompt_tokens`` are skipped, and
the loss mask covers the target's answer only (the template's system, user and assistant-header tokens are
prompt). The target answers in ``dtype`` (``auto``: bfloat16 on a GPU or a CPU with AVX512_BF16, where its batched
decode runs 4-6x float32's with AMX tiles; float32 elsewhere). source=corpus: fixed chunks of the packed train /
held-out documents (EAGLE-1's fixed-data setting), cut on the driver; no target forward is needed.
source=mix: the rows of ``parts``, built data sets of the same target, joined part after part (train into train,
held-out into held-out); no target forward. A mix is rebuilt whole on every run, into a temp directory renamed
into place at the end (its feature cache kept, and its parts' feature caches hard-linked into it: the features are
named by sequence), so it always holds its parts' current rows.

keep_taps (regenerate, sharegpt): the Regenerators also keep the target's hidden states at those taps, its
final-normed state and its greedy next token at every position of prompt + answer, from the very forwards that
answer (the prefill, each decode step, and one more step that feeds the last answer tokens), and write them into the
disk feature cache a drafter trainer opens (``$EYAS_HOME/data/<name>/features/<key>/<sequence>.safetensors``, named
as eyas.train.feature_cache names them: by the target's float32 weights, the taps, the answering dtype, and each
sequence's token ids), so a training with ``train.feature_cache: disk`` on taps among these runs no target forward.
A shard's features are written before the shard itself: a shard on disk has all of its features, and a rerun that
skips a shard skips its features too. Progress and ``data.json`` report positions/s (prompt + answer positions
written per second).

Shards are the unit of work and of restart: shard i of a split holds sequences [i * shard_size, (i+1) * shard_size)
and is written atomically, so a rerun skips the shards already on disk and builds missing or unreadable ones. A
rerun with a larger ``num_prompts`` grows the data set: it builds the new shards and again the one the earlier plan
cut short (``covered`` in data.json); a smaller one keeps the rows there and says so.
``data.json`` pins what decides a shard's content (target, source, sampling, lengths, seed, shard size); a rerun with
a different one stops with an error unless ``--force`` (which starts over).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from eyas import corpus
from eyas.config import ConfigError, to_dict
from eyas.models import load_tokenizer
from eyas.models.config import ModelConfig
from eyas.train.config import DataConfig, data_path, target_path
from eyas.train.data import (ShardError, check_complete, corpus_chunks, num_shards, read_rows, shard_is_complete,
                             shard_path, write_shard)
from eyas.train.feature_cache import MANIFEST
from jobs.common import job_argparser, load_job_config
from jobs.data_actors import KEPT_TMP_TAG, plan_kept_features, regenerate_shards, report_unkept, split_plan

DATA_FILE = "data.json"


def check_target(cfg: DataConfig) -> Path:
    directory = target_path(cfg.target)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"target={cfg.target!r}: {directory} holds no checkpoint; build it first, e.g. "
                                "`python -m jobs.train_target --config jobs/configs/target-tiny.yaml`")
    model = ModelConfig.from_file(directory / "config.json")
    context = model.max_position_embeddings
    if any(tap > model.num_layers for tap in cfg.keep_taps):
        raise ConfigError(f"keep_taps={list(cfg.keep_taps)}: the target has {model.num_layers} layers (taps 0 to "
                          f"{model.num_layers}, {model.num_layers} being the final-normed state)")
    if cfg.source != "corpus" and cfg.max_prompt_tokens + cfg.max_new_tokens > context:
        raise ConfigError(f"max_prompt_tokens={cfg.max_prompt_tokens} + max_new_tokens={cfg.max_new_tokens} exceeds "
                          f"the target's context of {context} tokens")
    return directory


def check_stamp(cfg: DataConfig, out: Path, force: bool) -> dict[str, Any]:
    """Reuse shards only when they were produced under the same content key; the earlier stamp ({} when none)."""
    stamp = out / DATA_FILE
    if force and out.exists():
        print(f"[data] --force: removing {out}", flush=True)
        shutil.rmtree(out)
    if not stamp.is_file():
        return {}
    try:
        meta = json.loads(stamp.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{stamp}: not valid JSON ({err}); rerun with --force to build the data set again") from None
    old = meta.get("content_key")
    if old != cfg.content_key():
        changed = sorted(k for k in cfg.content_key() if (old or {}).get(k) != cfg.content_key()[k])
        raise ConfigError(f"{out} was generated with different settings ({changed}); rerun with --force to "
                          f"regenerate it, or choose another name=...")
    return meta


def covered_plan(out: Path, meta: dict[str, Any]) -> dict[str, int]:
    """How many prompts of each split the shards on disk were planned for: the largest plan of the earlier builds
    (``meta``: the earlier stamp), kept through unfinished ones; {} when new. A data set stamped before eyas kept
    this: its config's counts, or the rows on disk where a smaller rerun stamped it."""
    if not meta:
        return {}
    if "covered" in meta:
        return meta["covered"]
    config, rows = meta.get("config") or {}, count_rows(out)
    return {"train": max(config.get("num_prompts", 0), rows["train"]),
            "heldout": max(config.get("num_heldout_prompts", 0), rows["heldout"])}


def pending_shards(cfg: DataConfig, out: Path, covered: dict[str, int]) -> list[tuple[str, int]]:
    """The shards a run must build: missing ones, ones a crash or a bad copy left unreadable (truncated), and the
    one an earlier, smaller plan cut short, when this plan grows past it (``covered``: see ``covered_plan``)."""
    todo = []
    for split, count in split_plan(cfg).items():
        before = covered.get(split, count)
        cut_short = before // cfg.shard_size if before < count and before % cfg.shard_size else None
        for index in range(num_shards(count, cfg.shard_size)):
            path = shard_path(out, split, index)
            if index == cut_short and path.is_file():
                print(f"[data] {path}: the end of the earlier {before} {split} prompts; building it again, whole",
                      flush=True)
            elif path.is_file() and shard_is_complete(path):
                continue
            elif path.is_file():
                print(f"[data] {path}: unreadable (truncated or corrupt); building it again", flush=True)
            todo.append((split, index))
    return todo


# ---------------------------------------------------------------- corpus: fixed chunks, on the driver


def corpus_shards(cfg: DataConfig, out: Path, target_dir: Path, todo: list[tuple[str, int]]) -> dict[str, int]:
    """Pack documents as ``<bos> doc <eos>`` with the target's tokenizer and cut consecutive chunks."""
    tokenizer = load_tokenizer(target_dir)
    tokenizer.model_max_length = 10**9  # whole documents are tokenized, then cut into chunks
    totals = {"prompts": 0, "rows": 0, "skipped": 0, "new_tokens": 0, "positions": 0}
    for split, count in split_plan(cfg).items():
        indices = [index for s, index in todo if s == split]
        if not indices or count == 0:
            continue
        stream: list[int] = []
        for doc in corpus.documents(split, cfg.suite):
            if len(stream) >= count * cfg.chunk_tokens:
                break
            bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            stream += bos + tokenizer(doc, add_special_tokens=False).input_ids + eos
        rows = corpus_chunks(stream, cfg.chunk_tokens, count)
        for index in indices:
            shard = rows[index * cfg.shard_size:(index + 1) * cfg.shard_size]
            if shard:
                write_shard(shard_path(out, split, index), shard)
                totals["rows"] += len(shard)
                totals["positions"] += sum(len(row["response_ids"]) for row in shard)
        print(f"[data] {split}: {len(rows)} chunks of {cfg.chunk_tokens} tokens", flush=True)
    return totals


# ---------------------------------------------------------------- mix: built data sets joined


def mix(cfg: DataConfig, out: Path) -> dict[str, Any]:
    """Join the parts' rows into ``out`` (see the module docstring); what each part was and the row count, for
    data.json's last_run."""
    parts = []
    for name in cfg.parts:
        directory = data_path(name)
        meta_file = directory / DATA_FILE
        if not meta_file.is_file():
            raise FileNotFoundError(f"parts: {name!r}: {directory} is not a built data set (no {DATA_FILE}); build "
                                    "it first with python -m jobs.generate_data --config <its config>")
        meta = json.loads(meta_file.read_text())
        if meta.get("complete") is not True:
            raise ShardError(f"parts: {name!r}: {meta_file} says its build has not finished; rerun it first")
        if meta["content_key"]["target"] != cfg.content_key()["target"]:
            raise ConfigError(f"parts: {name!r} holds answers of {meta['content_key']['target']}, not of this "
                              f"mix's target {cfg.content_key()['target']}")
        parts.append((name, directory, meta))
    building, old = out.with_name(f".{out.name}.building"), out.with_name(f".{out.name}.old")
    for stale in (building, old):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    building.mkdir(parents=True)
    counts = {}
    for split in ("train", "heldout"):
        rows = []
        for name, directory, meta in parts:
            if (directory / split).is_dir():
                part_rows = read_rows(directory, split)
                check_complete(directory, split, len(part_rows))
                rows += part_rows
        for index in range(num_shards(len(rows), cfg.shard_size)):
            write_shard(shard_path(building, split, index), rows[index * cfg.shard_size:(index + 1) * cfg.shard_size])
        counts[split] = len(rows)
    write_meta(building, json.loads((out / DATA_FILE).read_text()))  # "complete": false, as build() pinned it
    if (out / "features").is_dir():
        (out / "features").rename(building / "features")
    for _, directory, _ in parts:
        link_features(directory / "features", building / "features")
    out.rename(old)
    building.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    print(f"[data] {out}: " + " + ".join(f"{name} ({meta['rows']['train']})" for name, _, meta in parts), flush=True)
    return {"parts": {name: {"content_key": meta["content_key"], "rows": meta["rows"]} for name, _, meta in parts},
            "rows": counts["train"] + counts["heldout"]}


def link_features(part: Path, mix_features: Path) -> None:
    """A part's feature caches (kept by its build, ``keep_taps``, or computed by a training on it) into the mix's:
    rows are named by sequence and caches by target, taps and dtype, so the part's files are the mix's rows'
    features. Hard links (a copy where the file system has none); rows the mix has already are kept."""
    for manifest in sorted(part.glob(f"*/{MANIFEST}")):
        cache = mix_features / manifest.parent.name
        cache.mkdir(parents=True, exist_ok=True)
        for file in [manifest, *manifest.parent.glob("*.safetensors")]:
            if not (cache / file.name).exists():
                try:
                    os.link(file, cache / file.name)
                except OSError:
                    shutil.copy2(file, cache / file.name)


def count_rows(out: Path, splits: tuple[str, ...] | list[str] = ("train", "heldout")) -> dict[str, int]:
    import pyarrow.parquet as pq

    return {split: sum(pq.ParquetFile(f).metadata.num_rows for f in (out / split).glob("shard-*.parquet"))
            for split in splits}


def build_missing_shards(cfg: DataConfig, out: Path, target_dir: Path, todo: list[tuple[str, int]],
                         kept: dict[str, Any] | None) -> dict[str, Any]:
    if kept:
        report_unkept(out, kept, todo)
    if not todo:
        print(f"[data] {out}: every shard is already there", flush=True)
        return {}
    done = sum(num_shards(n, cfg.shard_size) for n in split_plan(cfg).values()) - len(todo)
    print(f"[data] {out}: {len(todo)} shards to build ({done} already done)", flush=True)
    if cfg.source == "corpus":
        return corpus_shards(cfg, out, target_dir, todo)
    return regenerate_shards(cfg, out, target_dir, todo, kept)


def build(cfg: DataConfig, force: bool = False) -> Path:
    out = data_path(cfg.name)
    target_dir = check_target(cfg)
    earlier = check_stamp(cfg, out, force)
    covered = {} if cfg.source == "mix" else covered_plan(out, earlier)
    out.mkdir(parents=True, exist_ok=True)
    todo = [] if cfg.source == "mix" else pending_shards(cfg, out, covered)
    # pinned before any shard is written: a rerun after a kill checks its settings, and readers refuse the data set,
    # all but the splits this build leaves as they are (``readable``: a growing train split's held-out one, which a
    # running sweep may be evaluating on)
    untouched = [split for split in ("train", "heldout") if all(split != s for s, _ in todo)]
    readable = {split: n for split, n in count_rows(out, untouched).items() if n} if earlier.get("complete") else {}
    write_meta(out, {"name": cfg.name, "config": to_dict(cfg), "content_key": cfg.content_key(), "complete": False,
                     **({"covered": covered} if covered else {}), **({"readable": readable} if readable else {})})
    kept = plan_kept_features(cfg, out, target_dir)
    start = time.monotonic()
    totals = mix(cfg, out) if cfg.source == "mix" else build_missing_shards(cfg, out, target_dir, todo, kept)
    seconds = time.monotonic() - start
    # temp files of a process killed while writing them: a shard's, or a kept feature row's
    for stale in [*out.glob("*/.shard-*.tmp"), *out.glob(f"features/*/.*.{KEPT_TMP_TAG}*.tmp")]:
        stale.unlink()
    counts = count_rows(out)
    if "positions" in totals:
        totals["positions_per_s"] = round(totals["positions"] / max(seconds, 1e-9), 1)
    meta = {"name": cfg.name, "config": to_dict(cfg), "content_key": cfg.content_key(), "rows": counts,
            "complete": True, "last_run": {**totals, "seconds": seconds},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if kept:
        meta["kept_features"] = {**kept, "directory": str(Path(kept["directory"]).relative_to(out))}
    if cfg.source != "mix":
        meta["covered"] = {}
        for split, count in split_plan(cfg).items():
            meta["covered"][split] = max(covered.get(split, 0), count)
            if counts[split] > count:
                print(f"[data] {out}: {counts[split]} {split} sequences, more than the {count} asked for: an earlier, "
                      f"larger build's, kept (--force builds exactly {count})", flush=True)
    write_meta(out, meta)
    rate = f", {totals['positions_per_s']:.0f} positions/s" if totals.get("positions") else ""
    print(f"[data] {out}: {counts['train']} train + {counts['heldout']} held-out sequences "
          f"({seconds:.1f}s this run{rate})", flush=True)
    return out


def write_meta(out: Path, meta: dict[str, Any]) -> None:
    """data.json, atomically (temp file + rename): a reader never sees half of it."""
    partial = out / f".{DATA_FILE}.tmp"
    partial.write_text(json.dumps(meta, indent=2) + "\n")
    partial.replace(out / DATA_FILE)


def main(argv: list[str] | None = None) -> int:
    parser = job_argparser(__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="delete the data set and generate it again")
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required, e.g. --config jobs/configs/data-tiny.yaml")
    build(load_job_config(DataConfig, args), force=args.force)
    return 0


if __name__ == "__main__":
    # Through the importable module, so that what it defines is jobs.generate_data's, never __main__'s.
    from jobs.generate_data import main as importable_main

    raise SystemExit(importable_main())
