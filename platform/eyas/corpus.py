"""The embedded corpus: this interpreter's standard-library source (code) and ``pydoc_data.topics`` (prose).

Nothing is downloaded, so every machine running the same Python gets the same corpus and the same splits.

What is in it
- code: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, except
  ``site-packages/`` (installed third-party code, differs per machine), test directories (``test/``, ``tests/``,
  ``idle_test/``: large, repetitive, full of deliberately odd encodings and fixtures), ``pydoc_data/`` (its
  ``topics.py`` *is* the prose half, so keeping it would leak held-out topics into the code half),
  ``_sysconfigdata_*`` (build-machine specific) and files that are not valid UTF-8.
- prose: the values of ``pydoc_data.topics.topics`` (the language reference rendered as plain English text).

Split
A document is held out when a stable hash (SHA-256, never the salted builtin ``hash()``) of its key
(``code:<relative/posix/path>`` or ``prose:<topic name>``) falls below ``HELDOUT_FRACTION``. The split is by
whole file / whole topic, so a held-out prompt never shares a document with training data.

Prompts (same shape for both splits; the held-out ones feed benchmarks, the train ones data regeneration)
- ``code``: a function that has a docstring and at least two statements: its ``def`` line(s), the docstring and
  the first ``NUM_BODY_LINES`` source lines after it, dedented, with no trailing newline (see ``function_prompts``).
- ``docstring``: HumanEval's shape: a function's ``def`` line(s) and its whole docstring (doctest examples
  included, where it has them), dedented, ending at the newline after the closing quotes; the model writes the whole
  body (see ``docstring_prompts``). Functions whose body has fewer than ``MIN_DOCSTRING_BODY`` statements after the
  docstring are skipped. The split is the code suite's (by file).
- ``prose``: a section heading and the first ``NUM_PROSE_SENTENCES`` sentences of a prose paragraph under it
  (every paragraph of at least ``MIN_PARAGRAPH_WORDS`` words), original line wrapping kept.
Prompts are ordered by a stable hash of their key (so the first N mix many files) and ``"all"`` alternates code and
prose.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import re
import sysconfig
import textwrap
from pathlib import Path
from typing import Literal

HELDOUT_FRACTION = 0.1
NUM_BODY_LINES = 2  # source lines after the docstring that a code prompt keeps
NUM_PROSE_SENTENCES = 2
MAX_PROMPT_CHARS = 1200  # longer code prompts are skipped: they would crowd a 512-token context

SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"})

MIN_DOCSTRING_BODY = 2  # statements after the docstring that a docstring prompt's function must have

Kind = Literal["all", "code", "prose"]
PROMPT_SUITES = ("all", "code", "docstring", "prose")
Split = Literal["train", "heldout"]


def stable_fraction(key: str) -> float:
    """Map ``key`` to [0, 1) with SHA-256: identical on every machine and every run."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def is_heldout(key: str) -> bool:
    return stable_fraction(key) < HELDOUT_FRACTION


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def code_files() -> tuple[tuple[str, str], ...]:
    """``(relative posix path, text)`` of every corpus source file, sorted by path."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            files.append((rel.as_posix(), text))
    return tuple(files)


@functools.lru_cache(maxsize=1)
def prose_topics() -> tuple[tuple[str, str], ...]:
    """``(topic name, text)`` of every pydoc topic, sorted by name."""
    from pydoc_data.topics import topics

    return tuple((name, topics[name]) for name in sorted(topics) if topics[name].strip())


def _keyed(kind: Kind) -> list[tuple[str, str]]:
    """``(split key, text)`` pairs, code (by path) then prose (by topic name)."""
    if kind not in ("all", "code", "prose"):
        raise ValueError(f"kind={kind!r}: must be one of 'all', 'code', 'prose'")
    out = []
    if kind in ("all", "code"):
        out += [(f"code:{rel}", text) for rel, text in code_files()]
    if kind in ("all", "prose"):
        out += [(f"prose:{name}", text) for name, text in prose_topics()]
    return out


def documents(split: Split, kind: Kind = "all") -> list[str]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: must be 'train' or 'heldout'")
    want_heldout = split == "heldout"
    return [text for key, text in _keyed(kind) if is_heldout(key) == want_heldout]


def slice_documents(documents: list[str], max_chars: int | None) -> list[str]:
    """The first ``max_chars`` characters of ``documents`` (all when None), cutting the last document short."""
    if max_chars is None:
        return list(documents)
    out, total = [], 0
    for doc in documents:
        if total >= max_chars:
            break
        out.append(doc[: max_chars - total])
        total += len(out[-1])
    return out


def train_documents(kind: Kind = "all") -> list[str]:
    """Whole files / topics of the train split, sorted (code by path, then prose by topic name)."""
    return documents("train", kind)


def heldout_documents(kind: Kind = "all") -> list[str]:
    """Whole files / topics that no training split touches."""
    return documents("heldout", kind)


# ---------------------------------------------------------------- prompts


def function_prompts(rel: str, text: str) -> list[tuple[str, str]]:
    """``(key, prompt)`` for every function in one file that has a docstring and something after it."""
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a few stdlib files target other Python versions
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        if ast.get_docstring(node, clean=False) is None:
            continue
        doc_end = node.body[0].end_lineno  # 1-based line of the docstring's last line
        stop = min(doc_end + NUM_BODY_LINES, node.end_lineno - 1)  # leave at least one line to continue
        if stop <= doc_end:
            continue
        # no trailing newline: byte-level BPE merges a newline with the next line's indentation ("\n        "),
        # so a prompt ending in a bare "\n" token is a sequence training never shows (the model then emits blank
        # lines); ending at the last character lets the model produce the newline + indentation token itself
        prompt = textwrap.dedent("".join(lines[node.lineno - 1 : stop])).rstrip()
        if len(prompt) <= MAX_PROMPT_CHARS and prompt:
            out.append((f"code:{rel}:{node.lineno}:{node.name}", prompt))
    return out


def docstring_prompts(rel: str, text: str) -> list[tuple[str, str]]:
    """``(key, prompt)`` in HumanEval's form for every function of one file with a docstring and a body after it:
    the ``def`` line(s) and the docstring, dedented, ending in ``\n`` right after the closing quotes, as HumanEval's
    prompts end (``    \"\"\"\n``), so the drafter learns from the very token sequence the bench starts from."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if (not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                or len(node.body) < 1 + MIN_DOCSTRING_BODY or ast.get_docstring(node, clean=False) is None):
            continue
        doc_end = node.body[0].end_lineno
        if not lines[doc_end - 1].rstrip().endswith(('"""', "'''")) or node.body[1].lineno <= doc_end:
            continue  # something shares the docstring's last line
        prompt = textwrap.dedent("".join(lines[node.lineno - 1:doc_end])).rstrip() + "\n"
        if len(prompt) <= MAX_PROMPT_CHARS:
            out.append((f"docstring:{rel}:{node.lineno}:{node.name}", prompt))
    return out


_HEADING_RULE = re.compile(r"^([*=\-~^])\1{2,}$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(“])")
_VERSION_NOTE = re.compile(r"^(Changed|Added|New|Deprecated) in version|^See also")
_CODE_HINT = re.compile(r"::=|>>>|^\.\.\.|[{};]\s*$|^\s*(def|class|import|for|if|return)\b", re.M)
MIN_PARAGRAPH_WORDS = 12


def topic_prompts(name: str, text: str) -> list[tuple[str, str]]:
    """``(key, prompt)``: section heading + opening sentences of every prose paragraph of one pydoc topic.

    Paragraphs keep their original line wrapping (the model is trained on wrapped text) but are dedented. Grammar
    and example blocks, version notes and short fragments (signatures, "is equivalent to") are skipped.
    """
    out = []
    for heading, start, paragraph in _paragraphs(text.splitlines()):
        if len(paragraph.split()) < MIN_PARAGRAPH_WORDS or _VERSION_NOTE.match(paragraph) or _CODE_HINT.search(paragraph):
            continue
        ends = [m.start() for m in _SENTENCE_END.finditer(paragraph)]
        opening = paragraph[: ends[NUM_PROSE_SENTENCES - 1]] if len(ends) >= NUM_PROSE_SENTENCES else paragraph
        if opening.rstrip()[-1:] in (".", "!", "?", ":") and len(opening) <= MAX_PROMPT_CHARS:
            out.append((f"prose:{name}:{start}", f"{heading}\n\n{opening.rstrip()}"))
    return out


def _paragraphs(lines: list[str]) -> list[tuple[str, int, str]]:
    """``(heading with its underline, first line index, dedented paragraph)`` of every block of lines that share one
    indentation (method descriptions are indented too, so indentation alone does not mark code)."""
    out: list[tuple[str, int, str]] = []
    heading, para, start, indent = "", [], 0, -1
    for i, line in enumerate(lines + [""]):
        next_is_rule = bool(i + 1 < len(lines) and _HEADING_RULE.match(lines[i + 1].strip()) and line.strip())
        line_indent = len(line) - len(line.lstrip(" "))
        if para and (next_is_rule or not line.strip() or line_indent != indent):
            out.append((heading, start, "\n".join(para)))
            para = []
        if next_is_rule:
            heading = f"{line.strip()}\n{lines[i + 1].strip()}"
        if next_is_rule or not line.strip() or _HEADING_RULE.match(line.strip()):
            continue
        if not para:
            start, indent = i, line_indent
        para.append(line.strip())
    return out


@functools.lru_cache(maxsize=6)
def _prompts(split: Split, suite: Literal["code", "docstring", "prose"]) -> tuple[str, ...]:
    want_heldout = split == "heldout"
    keyed: list[tuple[str, str]] = []
    if suite in ("code", "docstring"):
        extract = function_prompts if suite == "code" else docstring_prompts
        for rel, text in code_files():
            if is_heldout(f"code:{rel}") == want_heldout:
                keyed += extract(rel, text)
    else:
        for name, text in prose_topics():
            if is_heldout(f"prose:{name}") == want_heldout:
                keyed += topic_prompts(name, text)
    keyed.sort(key=lambda item: (hashlib.sha256(item[0].encode()).hexdigest(), item[0]))
    return tuple(dict.fromkeys(prompt for _, prompt in keyed))  # drop repeated prompts, keep the order


def prompts(split: Split, suite: str, num: int | None = None) -> list[str]:
    """Up to ``num`` prompts (all when None) in a fixed order; fewer when the suite has fewer."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: must be 'train' or 'heldout'")
    if suite not in PROMPT_SUITES:
        raise ValueError(f"suite={suite!r}: must be one of {list(PROMPT_SUITES)}")
    if num is not None and num < 0:
        raise ValueError(f"num={num!r}: must be >= 0")
    if suite == "all":
        code, prose = _prompts(split, "code"), _prompts(split, "prose")
        merged = [p for pair in zip(code, prose) for p in pair]
        shorter = min(len(code), len(prose))
        merged += list(code[shorter:]) + list(prose[shorter:])
    else:
        merged = list(_prompts(split, suite))
    return merged if num is None else merged[:num]


def heldout_prompts(suite: str = "all", num: int | None = None) -> list[str]:
    """Benchmark prompts from held-out files / topics: ``suite`` is 'code', 'docstring', 'prose' or 'all' (code and
    prose alternating)."""
    return prompts("heldout", suite, num)


def train_prompts(num: int | None = None, suite: str = "all") -> list[str]:
    """Prompts of the same shape from the train split (for regenerating drafter training data)."""
    return prompts("train", suite, num)
