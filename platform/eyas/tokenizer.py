"""Byte-level BPE tokenizer trained on the corpus train split, saved as a Hugging Face tokenizer directory.

The saved directory (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) loads with
``transformers.AutoTokenizer.from_pretrained(dir)``.

Special tokens, with fixed ids (the first ids of the vocabulary, in this order):
    0 ``<|bos|>``  prepended by the tokenizer's post-processor: ``tok(text).input_ids`` starts with it,
                   ``tok(text, add_special_tokens=False)`` does not.
    1 ``<|eos|>``  ends every training document; generation stops on it.
    2 ``<|pad|>``  padding only (masked out of every loss).
    3 ``<|mask|>`` the placeholder a DFlash drafter fills in a block of future positions.

Chat template: the target is a *base* model trained on raw code and prose, so the template renders a conversation
as plain text: ``<|bos|>`` then every message's content, messages separated by a blank line, with no role markers
and nothing added for the generation prompt. A single user message ``"def f(x):"`` becomes
``"<|bos|>def f(x):"``, so chat serving continues the user's text exactly as the completions endpoint would.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from eyas import corpus
from eyas.config import require

BOS, EOS, PAD, MASK = "<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, MASK)
BOS_ID, EOS_ID, PAD_ID, MASK_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"  # an expression: trim_blocks would eat a literal newline
    "{{ message['content'] }}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class TokenizerConfig:
    """How the tokenizer is trained. ``max_chars`` caps the training text (tests use a small slice)."""

    vocab_size: int = 4096
    min_frequency: int = 2
    model_max_length: int = 512
    corpus: str = "all"  # 'all', 'code' or 'prose' train documents
    max_chars: int | None = None

    def __post_init__(self) -> None:
        require(self.vocab_size >= 256 + len(SPECIAL_TOKENS), "tokenizer.vocab_size", self.vocab_size,
                f"must be at least {256 + len(SPECIAL_TOKENS)} (256 byte symbols + special tokens)")
        require(self.min_frequency >= 1, "tokenizer.min_frequency", self.min_frequency, "must be >= 1")
        require(self.model_max_length >= 1, "tokenizer.model_max_length", self.model_max_length, "must be >= 1")
        require(self.corpus in ("all", "code", "prose"), "tokenizer.corpus", self.corpus,
                "must be 'all', 'code' or 'prose'")
        require(self.max_chars is None or self.max_chars > 0, "tokenizer.max_chars", self.max_chars,
                "must be positive or null")


def train_bpe(documents: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Train a raw ``tokenizers.Tokenizer`` (byte-level BPE, special tokens first, BOS post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown token needed
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    for token, token_id in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tokenizer


def build_tokenizer(config: TokenizerConfig, out_dir: str | Path, documents: list[str] | None = None):
    """Train on ``documents`` (default: the corpus train split of ``config.corpus``), save to ``out_dir``,
    return the ``transformers`` tokenizer."""
    from transformers import PreTrainedTokenizerFast

    docs = corpus.slice_documents(
        documents if documents is not None else corpus.train_documents(config.corpus), config.max_chars
    )
    raw = train_bpe(docs, config.vocab_size, config.min_frequency)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=PAD, mask_token=MASK,
        model_max_length=config.model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    save_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_tokenizer(tokenizer, out_dir: str | Path) -> None:
    """``save_pretrained`` plus the chat template inside tokenizer_config.json (older transformers read it there;
    transformers 5 reads chat_template.jinja): the tokenizer's own (a target's, for a draft LM), else eyas's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    config_file = out / "tokenizer_config.json"
    data = json.loads(config_file.read_text())
    data.setdefault("chat_template", tokenizer.chat_template or CHAT_TEMPLATE)
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def is_tokenizer_dir(path: str | Path) -> bool:
    return (Path(path) / "tokenizer.json").is_file() and (Path(path) / "tokenizer_config.json").is_file()


def load_tokenizer(path: str | Path):
    """``AutoTokenizer`` from a directory written by ``build_tokenizer`` (or any HF model directory)."""
    from transformers import AutoTokenizer

    if not is_tokenizer_dir(path):
        raise FileNotFoundError(
            f"{path} is not a tokenizer directory (no tokenizer.json / tokenizer_config.json); "
            "build one with `python -m jobs.train_target --config jobs/configs/target-tiny.yaml`"
        )
    return AutoTokenizer.from_pretrained(str(path))
