"""The speculative methods jobs.bench_peers runs on each engine, and why an engine refused one.

- eyas: jobs.bench's method labels (vanilla, ngram, suffix, eagle3, hybrid, ``<trained>@shipped``, ...), each built
  by jobs.bench.spec_for from the ``--spec`` YAMLs jobs.bench reads (jobs/configs/bench-smollm2/ by default), so a row
  here is the very configuration of the README's table.
- llama.cpp: llama-server's own speculation (``--spec-type``): its draftless types (jobs.peers.llamacpp
  NGRAM_SPEC_TYPES) and ``eagle3``, the same EAGLE-3 drafter eyas reads, exported to GGUF (``draft-eagle3``).
- vLLM: ``speculative_config`` methods ``ngram``, ``eagle3`` (the drafter exported in vLLM's layout) and ``suffix``
  (its suffix decoding, which needs the arctic-inference package).

``PeerSizes`` are the peers' draft sizes, one set for every draftless type. A method an engine will not run (its
server exits or never gets healthy) is a refused row with the engine's own reason (``refusal_reason``), not a gap.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eyas.config import ConfigError, require
from jobs.peers import llamacpp, vllm

VANILLA = "vanilla"
EYAS_METHODS = ("vanilla", "ngram", "suffix", "eagle3", "hybrid")
LLAMACPP_METHODS = (VANILLA, *llamacpp.NGRAM_SPEC_TYPES, "eagle3")
VLLM_METHODS = (VANILLA, "ngram", "eagle3", "suffix")
PEER_METHODS = {"llamacpp": LLAMACPP_METHODS, "vllm": VLLM_METHODS}
DRAFTER_FORMAT = {"llamacpp": "gguf", "vllm": "vllm"}  # jobs.export --to, for a peer's eagle3


@dataclass(frozen=True)
class PeerSizes:
    """How much the peers draft: a draftless method looks up ``ngram_match`` tokens and drafts up to
    ``ngram_draft``; eagle3 drafts a chain of ``num_draft``."""
    ngram_match: int = 3
    ngram_draft: int = 8
    num_draft: int = 1

    def __post_init__(self) -> None:
        for name in ("ngram_match", "ngram_draft", "num_draft"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")


def llamacpp_spec_args(method: str, sizes: PeerSizes) -> tuple[str, ...]:
    """llama-server's speculative flags for ``method`` (vanilla: none; eagle3 also needs the drafter's GGUF)."""
    if method == VANILLA:
        return ()
    if method == "eagle3":
        return llamacpp.eagle3_spec_args(sizes.num_draft)
    if method in llamacpp.NGRAM_SPEC_TYPES:
        return llamacpp.ngram_spec_args(sizes.ngram_match, sizes.ngram_draft, method)
    raise ConfigError(f"llama.cpp method {method!r}: known {LLAMACPP_METHODS}")


def vllm_speculative_config(method: str, sizes: PeerSizes, export: Callable[[], Path]) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``method`` (None: vanilla); ``export()`` gives the drafter in vLLM's
    layout, called only for eagle3."""
    if method == VANILLA:
        return None
    if method == "ngram":
        return vllm.ngram_config(sizes.ngram_draft, sizes.ngram_match)
    if method == "eagle3":
        return vllm.eagle3_config(export(), sizes.num_draft)
    if method == "suffix":
        return vllm.suffix_config()
    raise ConfigError(f"vLLM method {method!r}: known {VLLM_METHODS}")


def peer_settings(engine: str, method: str, sizes: PeerSizes) -> str:
    """What the report says a peer's method ran with: its flags or its speculative_config."""
    if engine == "llamacpp":
        return " ".join(llamacpp_spec_args(method, sizes)) or "-"
    config = vllm_speculative_config(method, sizes, lambda: Path("<drafter exported for vLLM>"))
    return "-" if config is None else ", ".join(f"{k} {v}" for k, v in config.items())


# an engine's error line: first the ones that say why (Python's ValueError / NotImplementedError, pydantic's "Value
# error, ...", "not supported", "is required"), else any (llama.cpp's "error:", "... failed", a RuntimeError)
SPECIFIC = re.compile(r"(ValueError|Value error|NotImplementedError|ImportError|not supported|unsupported|"
                      r"is required|invalid argument|unknown)", re.IGNORECASE)
GENERIC = re.compile(r"(\w*Error\b|\berror\b|failed|invalid)", re.IGNORECASE)
NOISE = re.compile(r"^(\[[^\]]*\]\s*|\(\w+ pid=\d+\)\s*|(INFO|WARNING|ERROR)\s+\S+ \S+ \[[^\]]*\]\s*)+")


def refusal_reason(log_text: str, max_chars: int = 300) -> str:
    """The engine's own reason, from the log of a server that exited (or never got healthy) at start-up: the last
    line that says why, else the last error line, else the last line; log prefixes dropped."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    if not lines:
        return "the server exited without a word"
    lines = [line for line in lines if not line.startswith(("Traceback", "File ", "^"))] or lines
    chosen = ([line for line in lines if SPECIFIC.search(line)] or [line for line in lines if GENERIC.search(line)]
              or lines)[-1]
    return NOISE.sub("", chosen).strip()[:max_chars]
