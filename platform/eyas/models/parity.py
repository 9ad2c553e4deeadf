"""Parity: eyas's native decoder against transformers on the same checkpoint, float32.

The check a converted target passes (``jobs.fetch_target`` runs it, tests run it on tiny models):
- logits: max |eyas - transformers| over every position of a few prompts is at most ``atol`` (1e-4), with eyas's
  linears on the plain ``F.linear`` kernels transformers uses (``packing.plain_layout``): this checks the conversion
  and the model's arithmetic. The packed layout every loaded target runs (eyas.models.packing) sums in another
  order; its difference is reported beside (``max_logit_diff_packed``; 1.3e-4 on smollm2-135m), not held to 1e-4;
- greedy: ``num_new_tokens`` (128) greedy tokens after each held-out chat prompt are identical, on the packed
  target as users run it.

Greedy runs ignore EOS on both sides (128 tokens are compared every time). eyas's side is a plain prefill + one
token per step loop over the decoder and its cache: this checks the model, below the speculative engine (and
``models`` never imports ``decoding``); transformers' side is ``generate``.

Shape legend: B batch, T tokens, V vocab.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from eyas.models.decoder import Decoder
from eyas.models.loading import load_target, load_tokenizer
from eyas.models.packing import plain_layout

LOGIT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Speculative decoding makes a large language model faster because",
)
# held out: none of them is a logit prompt; rendered with the chat template when the tokenizer has one
GREEDY_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
)
NUM_NEW_TOKENS = 128
ATOL = 1e-4


@dataclass(frozen=True)
class ParityReport:
    max_logit_diff: float  # over every position and vocab entry of the logit prompts
    num_logit_prompts: int
    num_logit_positions: int
    num_greedy_prompts: int
    num_new_tokens: int
    first_mismatch: tuple[int | None, ...]  # per greedy prompt: first differing new-token index, None if identical
    atol: float
    seconds: float
    max_logit_diff_packed: float | None = None  # the same, on the packed layout (reported, not held to atol)

    @property
    def greedy_identical(self) -> bool:
        return all(index is None for index in self.first_mismatch)

    @property
    def passed(self) -> bool:
        return self.max_logit_diff <= self.atol and self.greedy_identical

    def summary(self) -> str:
        greedy = ("identical" if self.greedy_identical else
                  "differ at " + ", ".join(f"prompt {i} token {m}" for i, m in enumerate(self.first_mismatch)
                                           if m is not None))
        packed = ("" if self.max_logit_diff_packed is None else
                  f"; {self.max_logit_diff_packed:.2e} with packed weights, reported")
        return (f"max logit diff {self.max_logit_diff:.2e} (limit {self.atol:.0e}, {self.num_logit_prompts} prompts, "
                f"{self.num_logit_positions} positions{packed}); greedy {self.num_new_tokens} tokens on "
                f"{self.num_greedy_prompts} held-out prompts: {greedy}")

    def to_dict(self) -> dict:
        return {**asdict(self), "first_mismatch": list(self.first_mismatch),
                "greedy_identical": self.greedy_identical, "passed": self.passed}


def max_logit_diff(target: Decoder, hf_model, tokens_BT: torch.Tensor) -> float:
    """max |logits_BTV(eyas) - logits_BTV(transformers)| over one causal forward of ``tokens_BT``."""
    B, T = tokens_BT.shape
    with torch.no_grad():
        ours_BTV, _ = target(tokens_BT, torch.arange(T).expand(B, T), target.new_cache(B, T))
        theirs_BTV = hf_model(tokens_BT).logits
    assert ours_BTV.shape == theirs_BTV.shape, (tuple(ours_BTV.shape), tuple(theirs_BTV.shape))
    return float((ours_BTV.float() - theirs_BTV.float()).abs().max())


def greedy_native(target: Decoder, prompt_ids: Sequence[int], num_new: int) -> list[int]:
    """``num_new`` argmax tokens from the decoder alone: one prefill, then one forward per token."""
    cache = target.new_cache(1, len(prompt_ids) + num_new)
    tokens_BT = torch.tensor([list(prompt_ids)], device=target.device)
    positions_BT = torch.arange(len(prompt_ids), device=target.device)[None]
    out: list[int] = []
    with torch.no_grad():
        while len(out) < num_new:
            logits_BTV, _ = target(tokens_BT, positions_BT, cache, logits_slice=slice(-1, None))
            out.append(int(logits_BTV[0, -1].argmax()))
            tokens_BT = torch.tensor([[out[-1]]], device=target.device)
            positions_BT = torch.tensor([[len(prompt_ids) + len(out) - 1]], device=target.device)
    return out


def greedy_hf(hf_model, prompt_ids: Sequence[int], num_new: int) -> list[int]:
    """``num_new`` greedy tokens from transformers' ``generate``, never stopping (or masking) at EOS."""
    # eos_token_id=[]: an empty stop list (None would fall back to the model's generation_config and stop there)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([list(prompt_ids)]), attention_mask=torch.ones(1, len(prompt_ids),
                                dtype=torch.long), do_sample=False, max_new_tokens=num_new, eos_token_id=[],
                                pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return index
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def compare(target: Decoder, hf_model, logit_prompts: Sequence[Sequence[int]],
            greedy_prompts: Sequence[Sequence[int]], num_new_tokens: int = NUM_NEW_TOKENS, atol: float = ATOL,
            log: Callable[[str], None] = lambda line: None, plain: Decoder | None = None) -> ParityReport:
    """Parity of two already loaded float32 models on token-id prompts. ``plain``: the same target loaded in
    ``plain_layout()``, whose logits are held to ``atol`` (``target``'s are then reported beside)."""
    start = time.perf_counter()
    diffs = [max_logit_diff(plain or target, hf_model, torch.tensor([list(ids)])) for ids in logit_prompts]
    log(f"logits: max diff {max(diffs):.2e} over {len(diffs)} prompts")
    packed = None
    if plain is not None:
        packed = max(max_logit_diff(target, hf_model, torch.tensor([list(ids)])) for ids in logit_prompts)
        log(f"logits with the packed weights: max diff {packed:.2e} (another summation order; reported)")
    mismatches = []
    for i, ids in enumerate(greedy_prompts):
        ours, theirs = greedy_native(target, ids, num_new_tokens), greedy_hf(hf_model, ids, num_new_tokens)
        mismatches.append(first_difference(ours, theirs))
        log(f"greedy prompt {i + 1}/{len(greedy_prompts)}: "
            f"{'identical' if mismatches[-1] is None else f'differs at token {mismatches[-1]}'}")
    return ParityReport(max_logit_diff=max(diffs), num_logit_prompts=len(diffs),
                        num_logit_positions=sum(len(ids) for ids in logit_prompts),
                        num_greedy_prompts=len(mismatches), num_new_tokens=num_new_tokens,
                        first_mismatch=tuple(mismatches), atol=atol, seconds=time.perf_counter() - start,
                        max_logit_diff_packed=packed)


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``; a user turn through the chat template (with the generation prompt) when ``chat``."""
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer(text).input_ids


def check_checkpoint(directory: str | Path, logit_prompts: Sequence[str] = LOGIT_PROMPTS,
                     greedy_prompts: Sequence[str] = GREEDY_PROMPTS, num_new_tokens: int = NUM_NEW_TOKENS,
                     atol: float = ATOL, log: Callable[[str], None] = lambda line: None) -> ParityReport:
    """Load ``directory`` with eyas and with transformers (float32) and compare them on text prompts."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory).expanduser()
    target = load_target(directory)
    with plain_layout():
        plain = load_target(directory)
    tokenizer = load_tokenizer(directory)
    hf_model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                    local_files_only=True).eval()
    return compare(target, hf_model, [encode(tokenizer, p, chat=False) for p in logit_prompts],
                   [encode(tokenizer, p, chat=True) for p in greedy_prompts], num_new_tokens, atol, log, plain)
