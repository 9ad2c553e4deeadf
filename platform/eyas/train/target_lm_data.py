"""The target-LM trainer's inputs (eyas.train.target_lm), Ray-free: its tokenizer (trained, or a target's via
``tokenizer_from``) with that tokenizer's special ids, and the packed token streams it trains and evaluates on:
the embedded corpus (documents framed by the tokenizer's BOS and EOS, cached in ``$EYAS_HOME/data/tokens/``) or a
jobs.generate_data data set (``train.data``, read with the drafter trainer's reader, ``eyas.train.data``).

Shape legend: N tokens of a packed stream.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from eyas import corpus
from eyas.config import ConfigError, eyas_home, resolve_path, to_dict
from eyas.tokenizer import build_tokenizer, is_tokenizer_dir, load_tokenizer
from eyas.train.config import data_path
from eyas.train.data import read_rows
from eyas.train.target_lm import IGNORE_INDEX, TargetJobConfig, TokenStream, TrainConfig, Vocab, target_dir


def tokenizer_source(tokenizer_from: str) -> Path:
    """``smollm2-135m`` -> ``$EYAS_HOME/targets/smollm2-135m``; a path (with ``/``) is used as is."""
    return resolve_path(tokenizer_from) if "/" in tokenizer_from else target_dir(tokenizer_from)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def prepare_tokenizer(cfg: TargetJobConfig) -> Path:
    """The tokenizer directory: ``tokenizer_from``'s target dir, or our own (trained now unless cached)."""
    if cfg.tokenizer_from is not None:
        source = tokenizer_source(cfg.tokenizer_from)
        if not is_tokenizer_dir(source):
            raise FileNotFoundError(
                f"tokenizer_from={cfg.tokenizer_from!r}: {source} holds no tokenizer; build or fetch that target "
                f"first, e.g. `python -m jobs.train_target --config jobs/configs/target-{cfg.tokenizer_from}.yaml` "
                f"or `python -m jobs.fetch_target {cfg.tokenizer_from}`"
            )
        return source
    out = eyas_home() / "tokenizers" / cfg.name
    stamp = out / "eyas_tokenizer.json"
    wanted = to_dict(cfg.tokenizer)
    if is_tokenizer_dir(out) and stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        print(f"[tokenizer] reusing {out}", flush=True)
        return out
    start = time.monotonic()
    shutil.rmtree(out, ignore_errors=True)
    build_tokenizer(cfg.tokenizer, out)
    stamp.write_text(json.dumps(wanted, indent=2, sort_keys=True))
    print(f"[tokenizer] trained vocab={cfg.tokenizer.vocab_size} in {time.monotonic() - start:.1f}s -> {out}",
          flush=True)
    return out


def tokenizer_vocab(tokenizer_dir: Path) -> Vocab:
    """The tokenizer's own special ids (eyas's tokenizer: 0/1/2; SmolLM2: <|im_start|> 1, <|im_end|> 2). The size
    is the target's embedding rows when the directory is a model (they may exceed the tokenizer's entries, and a
    draft LM must match them), else the tokenizer's length."""
    tokenizer = load_tokenizer(tokenizer_dir)
    size = len(tokenizer)
    config_file = Path(tokenizer_dir) / "config.json"
    if config_file.is_file():
        size = max(size, int(json.loads(config_file.read_text()).get("vocab_size") or 0))
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{tokenizer_dir}: the tokenizer names no eos_token; a causal LM needs one to end text",
                          "tokenizer_from")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Vocab(size, tokenizer.bos_token_id, tokenizer.eos_token_id, pad_id)


def pack_documents(tokenizer_dir: Path, documents: list[str], vocab: Vocab) -> np.ndarray:
    """One int32 stream ``<bos> doc <eos> <bos> doc <eos> ...`` (documents in the given order)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    bos = [vocab.bos_id] if vocab.bos_id is not None else []
    pieces = [np.asarray([*bos, *enc.ids, vocab.eos_id], dtype=np.int32) for enc in encodings]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def token_stream(tokenizer_dir: Path, split: str, kind: str, max_chars: int | None, vocab: Vocab) -> np.ndarray:
    """The packed stream of one corpus split, cached in ``$EYAS_HOME/data/tokens/`` by tokenizer hash."""
    key = f"{sha256_file(tokenizer_dir / 'tokenizer.json')[:16]}-{split}-{kind}-{max_chars}"
    if (vocab.bos_id, vocab.eos_id) != (0, 1):  # eyas's own ids keep their old cache names
        key += f"-bos{vocab.bos_id}-eos{vocab.eos_id}"
    cache = eyas_home() / "data" / "tokens" / f"{key}.npy"
    if cache.is_file():
        return np.load(cache)
    ids = pack_documents(tokenizer_dir, corpus.slice_documents(corpus.documents(split, kind), max_chars), vocab)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{time.time_ns()}.tmp.npy")
    np.save(tmp, ids)
    tmp.replace(cache)
    return ids


def data_stream(train: TrainConfig, split: str, vocab: Vocab, loss_on: str) -> TokenStream:
    """A generated data set's split packed row after row (prompt + response; the rows already hold the chat
    template and the target's EOS), learning the responses only or every token (``loss_on``)."""
    directory = data_path(train.data)
    try:
        rows = read_rows(directory, split)
    except FileNotFoundError as err:
        hint = " (its data config needs num_heldout_prompts > 0)" if split == "heldout" else ""
        raise ConfigError(f"train.data={train.data!r}: {err}{hint}", "train.data") from err
    ids_N = np.asarray([t for row in rows for t in row["prompt_ids"] + row["response_ids"]], dtype=np.int32)
    if len(ids_N) and int(ids_N.max()) >= vocab.size:
        raise ConfigError(f"train.data={train.data!r}: token id {int(ids_N.max())} is outside the vocabulary of "
                          f"{vocab.size}; the data set was made with another target's tokenizer", "train.data")
    if loss_on == "all":
        return TokenStream(ids_N)
    mask_N = np.asarray([m for row in rows for m in row["loss_mask"]], dtype=bool)
    return TokenStream(ids_N, np.where(mask_N, ids_N, IGNORE_INDEX).astype(np.int64))


def check_data_tokenizer(train: TrainConfig, tokenizer_dir: Path) -> None:
    """The data set must have been made by a target with this tokenizer (data.json names that target)."""
    meta_file = data_path(train.data) / "data.json"
    if not meta_file.is_file():
        return
    made_by = Path(json.loads(meta_file.read_text()).get("content_key", {}).get("target", ""))
    if (made_by / "tokenizer.json").is_file() and \
            sha256_file(made_by / "tokenizer.json") != sha256_file(Path(tokenizer_dir) / "tokenizer.json"):
        raise ConfigError(f"train.data={train.data!r} was made with the tokenizer of {made_by}, not that of "
                          f"tokenizer_from ({tokenizer_dir}): point tokenizer_from at the data's target",
                          "train.data")


def train_stream(cfg: TargetJobConfig, tokenizer_dir: Path, vocab: Vocab) -> TokenStream:
    """What trains: the data set's train split, or the corpus's (cut to ``max_train_chars``)."""
    train = cfg.train
    if train.data is not None:
        check_data_tokenizer(train, tokenizer_dir)
        stream = data_stream(train, "train", vocab, train.loss_on)
    else:
        stream = TokenStream(token_stream(tokenizer_dir, "train", train.corpus, train.max_train_chars, vocab))
    if len(stream) < train.seq_len + 2:
        where = f"train.data={train.data!r}" if train.data else f"train.max_train_chars={train.max_train_chars}"
        raise ConfigError(f"{where}: only {len(stream)} tokens, fewer than one window of "
                          f"train.seq_len={train.seq_len}", "train.data" if train.data else "train.max_train_chars")
    return stream


def heldout_streams(cfg: TargetJobConfig, tokenizer_dir: Path, vocab: Vocab) -> dict[str, TokenStream]:
    """The held-out loss's streams by kind: the corpus's code and prose, or the data set's heldout split scored on
    the target's answers alone (what a draft LM proposes), whatever ``train.loss_on`` trains on, so that runs with
    either setting compare on one number."""
    train = cfg.train
    if train.data is not None:
        return {data_path(train.data).name: data_stream(train, "heldout", vocab, "response")}
    kinds = ("code", "prose") if train.corpus == "all" else (train.corpus,)
    # a held-out slice big enough for eval_tokens (about 3.5 characters per token), not the whole split
    return {kind: TokenStream(token_stream(tokenizer_dir, "heldout", kind, train.eval_tokens * 8, vocab))
            for kind in kinds}


def sample_prompts(cfg: TargetJobConfig, tokenizer_dir: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) of the ``num_samples`` prompts whose greedy continuations meta.json keeps: held-out code, or
    the data set's first held-out chat prompts (rendered by the chat template)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    if cfg.train.data is not None:
        rows = read_rows(data_path(cfg.train.data), "heldout")[:cfg.num_samples]
        return [(tokenizer.decode(row["prompt_ids"]), row["prompt_ids"]) for row in rows]
    return [(text, tokenizer(text).input_ids) for text in corpus.heldout_prompts("code", cfg.num_samples)]
