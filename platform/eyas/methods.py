"""Method names (DESIGN.md) -> how to build the drafter and which tree it drafts.

``SpecConfig`` is the one place a method and its tree settings live; ``jobs.generate``, ``jobs.bench``, the Tune
sweep's best-config YAML and the serving config all carry it as their ``spec:`` section.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eyas.config import ConfigError, eyas_home, require, resolve_path
from eyas.models.decoder import Decoder

TREES = ("chain", "static", "dynamic", "best-first", "block", "ddtree")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "vanilla"
    drafter: str | None = None      # trained drafter: checkpoint dir or models:/NAME@ALIAS
    draft_model: str | None = None  # draft-lm: an HF checkpoint dir with the target's tokenizer
    tree: str | None = None         # override the method's default tree shape (one of TREES)
    depth: int = 5                  # dynamic / best-first / chain depth
    top_k: int = 4                  # children per expanded node
    num_nodes: int = 24             # node budget N (drafted nodes, root excluded)
    num_draft: int = 4              # chain length for ngram / draft-lm
    max_matches: int = 4            # ngram: distinct continuations kept (tree width)

    def __post_init__(self) -> None:
        require(self.method in METHODS, "spec.method", self.method, f"must be one of {sorted(METHODS)}")
        require(self.tree is None or self.tree in TREES, "spec.tree", self.tree, f"must be one of {list(TREES)}")
        for name in ("depth", "top_k", "num_nodes", "num_draft", "max_matches"):
            require(getattr(self, name) >= 1, f"spec.{name}", getattr(self, name), "must be >= 1")
        require(self.top_k <= self.num_nodes, "spec.top_k", self.top_k,
                f"cannot exceed the node budget spec.num_nodes={self.num_nodes}")


@dataclass(frozen=True)
class Method:
    build: Callable[[Decoder, SpecConfig], object] | None  # (target, spec) -> Drafter; None for vanilla
    default_tree: str | None
    needs_drafter: bool = False


def default_draft_model() -> str:
    return str(eyas_home() / "targets" / "draft-tiny")


def _ngram(target: Decoder, spec: SpecConfig):
    from eyas.drafters.ngram import NgramConfig, NgramDrafter

    return NgramDrafter(NgramConfig(num_draft=spec.num_draft, max_matches=spec.max_matches))


def _draft_lm(target: Decoder, spec: SpecConfig):
    from eyas.drafters.draft_lm import DraftLMConfig, DraftLMDrafter
    from eyas.models.loading import load_target

    path = resolve_path(spec.draft_model or default_draft_model())
    draft = load_target(path, dtype=target.dtype, device=target.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"spec.draft_model={path}: vocab {draft.config.vocab_size} differs from the target's "
                          f"{target.config.vocab_size}; a draft LM must share the target's tokenizer")
    return DraftLMDrafter(draft, DraftLMConfig(num_draft=spec.num_draft),
                          max_len=target.config.max_position_embeddings)


def _trained(target: Decoder, spec: SpecConfig, default_tree: str):
    if not spec.drafter:
        raise ConfigError(f"spec.method={spec.method} needs a trained drafter: set spec.drafter (or --drafter) to "
                          "a checkpoint directory or models:/NAME@ALIAS")
    from eyas.drafters.registry import load_drafter

    return load_drafter(resolve_drafter(spec.drafter), target, method=spec.method, tree=spec.tree or default_tree,
                        depth=spec.depth, top_k=spec.top_k, num_nodes=spec.num_nodes)


def resolve_drafter(location: str):
    """A local checkpoint directory for ``location``: a path, or ``models:/NAME@ALIAS`` fetched from MLflow."""
    if location.startswith("models:/"):
        from eyas import track  # MLflow is imported only inside track.py, and only when a registry URI is used

        return track.resolve_model(location)
    path = resolve_path(location)
    if not path.is_dir():
        raise ConfigError(f"spec.drafter={location}: no drafter checkpoint directory there (train one with "
                          "python -m jobs.train_drafter --config jobs/configs/<family>-tiny.yaml)")
    return path


def _trained_method(tree: str) -> Method:
    return Method(lambda target, spec: _trained(target, spec, tree), tree, needs_drafter=True)


METHODS: dict[str, Method] = {
    "vanilla": Method(None, None),
    "ngram": Method(_ngram, "chain"),
    "draft-lm": Method(_draft_lm, "chain"),
    "eagle1": _trained_method("static"),
    "eagle2": _trained_method("dynamic"),
    "eagle3": _trained_method("dynamic"),
    "medusa": _trained_method("static"),
    "dflash": _trained_method("block"),
    "dflash-ddtree": _trained_method("ddtree"),
}


def build_drafter(target: Decoder, spec: SpecConfig):
    """The drafter ``spec`` asks for (None for vanilla)."""
    method = METHODS[spec.method]
    return method.build(target, spec) if method.build is not None else None
