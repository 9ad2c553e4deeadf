"""The embedded corpus: stable, disjoint splits and well-formed prompts (no Ray, a few seconds)."""
from __future__ import annotations

import ast
import hashlib

import pytest

from eyas import corpus


def test_stable_fraction_is_sha256_not_salted_hash():
    # a fixed value: the split must not depend on PYTHONHASHSEED or the machine
    expected = int.from_bytes(hashlib.sha256(b"code:abc").digest()[:8], "big") / 2**64
    assert corpus.stable_fraction("code:abc") == expected
    assert 0.0 <= corpus.stable_fraction("prose:if") < 1.0


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_splits_are_disjoint_nonempty_and_deterministic(kind):
    train, heldout = corpus.train_documents(kind), corpus.heldout_documents(kind)
    assert train and heldout
    assert not set(train) & set(heldout)
    assert len(heldout) < len(train)
    corpus.code_files.cache_clear()
    corpus.prose_topics.cache_clear()
    assert corpus.train_documents(kind) == train and corpus.heldout_documents(kind) == heldout


def test_all_is_code_then_prose():
    assert corpus.train_documents("all") == corpus.train_documents("code") + corpus.train_documents("prose")


def test_code_files_skip_site_packages_tests_and_prose_source():
    paths = [rel for rel, _ in corpus.code_files()]
    assert paths == sorted(paths)
    assert "ast.py" in paths
    for rel in paths:
        parts = rel.split("/")
        assert not set(parts[:-1]) & {"site-packages", "test", "tests", "idle_test", "pydoc_data"}, rel
        assert not parts[-1].startswith("_sysconfigdata"), rel


@pytest.mark.parametrize("suite", ["code", "prose", "all"])
def test_heldout_prompts_nonempty_deterministic_and_unseen(suite):
    prompts = corpus.heldout_prompts(suite, 12)
    assert len(prompts) == 12
    assert all(p.strip() for p in prompts)
    assert len(set(prompts)) == len(prompts)
    assert corpus.heldout_prompts(suite, 12) == prompts
    assert corpus.heldout_prompts(suite, 5) == prompts[:5]
    train_text = "\n".join(corpus.train_documents())
    assert not any(p in train_text for p in prompts[:6])


def test_code_prompts_are_signature_docstring_and_first_lines():
    for prompt in corpus.heldout_prompts("code", 20):
        assert prompt.startswith(("def ", "async def ")), prompt
        assert prompt == prompt.rstrip()  # no trailing newline: the model writes "\n" + indentation as one token
        assert len(prompt) <= corpus.MAX_PROMPT_CHARS
        # the first statement of the body is a docstring
        header, body = prompt.split("\n", 1)
        assert body.lstrip().startswith(('"', "'", "r'", 'r"', "u'", 'u"', "b'")), prompt


def test_prose_prompts_have_heading_and_sentence():
    for prompt in corpus.heldout_prompts("prose", 20):
        heading, rule, blank, *text = prompt.split("\n")
        assert heading and set(rule) <= set("*=-~^") and len(rule) >= 3 and blank == ""
        assert text and text[-1].rstrip()[-1] in ".!?:"


def test_all_alternates_code_and_prose():
    mixed = corpus.heldout_prompts("all", 6)
    code, prose = corpus.heldout_prompts("code", 3), corpus.heldout_prompts("prose", 3)
    assert mixed == [code[0], prose[0], code[1], prose[1], code[2], prose[2]]


def test_train_prompts_same_shape_from_train_split():
    # prose only: train code prompts parse every train file (~10 s on a loaded 2-core box); same code path
    train = corpus.train_prompts(8, suite="prose")
    assert len(train) == 8 and all(p.split("\n")[2] == "" for p in train)
    assert not set(corpus.train_prompts(suite="prose")) & set(corpus.heldout_prompts("prose"))
    assert len(corpus.train_prompts(suite="prose")) > len(corpus.heldout_prompts("prose"))


def test_function_prompts_from_source():
    source = (
        "def add(a, b):\n"
        '    """Add two numbers."""\n'
        "    total = a + b\n"
        "    total += 0\n"
        "    return total\n"
        "def nodoc(x):\n"
        "    return x\n"
    )
    [(key, prompt)] = corpus.function_prompts("m.py", source)
    assert key == "code:m.py:1:add"
    assert prompt == 'def add(a, b):\n    """Add two numbers."""\n    total = a + b\n    total += 0'
    ast.parse(prompt + "\n    return total\n")  # the prompt is a prefix of valid code


@pytest.mark.parametrize("bad", [{"suite": "poetry"}, {"num": -1}])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        corpus.heldout_prompts(**{"suite": "code", "num": 1, **bad})


def test_docstring_prompts_have_humaneval_shape():
    """HumanEval's form: def line(s) + the whole docstring, ending in a newline after the closing quotes."""
    source = (
        "def add(a, b):\n"
        '    """Add two numbers.\n'
        "\n"
        "    >>> add(1, 2)\n"
        "    3\n"
        '    """\n'
        "    total = a + b\n"
        "    return total\n"
        "def short(x):\n"
        '    """One statement after the docstring: too little body to learn from."""\n'
        "    return x\n"
    )
    [(key, prompt)] = corpus.docstring_prompts("m.py", source)
    assert key == "docstring:m.py:1:add"
    assert prompt == 'def add(a, b):\n    """Add two numbers.\n\n    >>> add(1, 2)\n    3\n    """\n'
    ast.parse(prompt + "    return a + b\n")
    heldout = corpus.heldout_prompts("docstring", 24)
    assert len(heldout) == 24 and len(set(heldout)) == 24
    for prompt in heldout:
        assert prompt.startswith(("def ", "async def ")) and prompt.endswith(('"""\n', "'''\n")), prompt
        ast.parse(prompt + "    pass\n")
    assert any(">>>" in prompt for prompt in corpus.heldout_prompts("docstring"))  # examples are kept
    code_files = {p.split("\n", 1)[0] for p in corpus.heldout_prompts("code")}
    assert {p.split("\n", 1)[0] for p in heldout} & code_files  # the code suite's held-out files
