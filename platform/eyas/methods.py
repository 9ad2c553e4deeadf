"""The one method table: a method name (DESIGN.md) -> its drafter family, default tree, the settings it reads, and
the builder of its drafters. Plus ``SpecConfig`` (a method and its settings: the ``spec:`` section that
``jobs.generate``, ``jobs.bench``, the Tune sweep's best config and the serving config all carry) and the one
checkpoint resolver (paths, ``models:/NAME@ALIAS``, ``runs:/``).

Adding a drafter family: its module in drafters/ (model, config, Drafter), one ``registry.FAMILIES`` entry (how its
checkpoints are built and wrapped), and one ``METHODS`` entry per method name below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eyas import track
from eyas.config import ConfigError, eyas_home, from_dict, require, resolve_path, to_dict
from eyas.decoding import costs
from eyas.drafters import registry
from eyas.drafters.datastore import Datastore
from eyas.drafters.draft_lm import DraftLMConfig, DraftLMDrafter
from eyas.drafters.hybrid import RETRIEVAL_PRIOR, HybridDrafter
from eyas.drafters.ngram import NgramConfig, NgramDrafter
from eyas.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixIndex
from eyas.drafters.trees import MODE_SETTINGS, TREE_MODES, TreeSpec
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.models.decoder import Decoder
from eyas.models.loading import load_target
from eyas.train.config import data_path, drafter_path
from eyas.train.data import read_rows

TREES = TREE_MODES
TREE_SETTINGS = ("tree", "depth", "top_k", "num_nodes")
DrafterFactory = Callable[[], Any]  # () -> a fresh Drafter (per-sequence state), sharing loaded weights


@dataclass(frozen=True)
class SpecConfig:
    """A method and its settings. A setting left null takes the method's default; a setting the method does not
    read is an error (e.g. spec.top_k for dflash, whose block drafts one chain)."""
    method: str = "vanilla"
    drafter: str | None = None      # trained drafter: checkpoint dir, models:/NAME@ALIAS or runs:/ID/PATH
    draft_model: str | None = None  # draft-lm: an HF checkpoint dir with the target's tokenizer
    tree: str | None = None         # the tree mode, over the method's default (one of TREES)
    depth: int | None = None        # chain / dynamic / best-first depth; dflash: block positions drafted
    top_k: int | None = None        # children per expanded node
    num_nodes: int | None = None    # node budget N (drafted nodes, root excluded; ngram: num_draft * max_matches;
                                    # suffix: 16; hybrid: the merged tree's, default the learned tree's)
    num_draft: int | None = None    # chain length for ngram / draft-lm (default 4); suffix: the tree depth (8)
    max_matches: int | None = None  # ngram: distinct continuations kept, the tree width (default 4)
    datastore: tuple[str, ...] | None = None  # ngram, suffix: data sets of jobs.generate_data to retrieve from
    proposers: tuple[str, ...] | None = None  # hybrid: a retrieval proposer and a learned drafter (ngram, eagle3)
    min_match: int | None = None    # suffix: the shortest context suffix that drafts (default 1)
    min_prob: float | None = None   # suffix: a node's least share of the matched occurrences (default 0.1)
    retrieval_prior: float | None = None  # hybrid: the prior acceptance rate of retrieval nodes per depth (0.6)
    learned_below: float | None = None  # hybrid: run the learned drafter only in cycles whose retrieval depth-1
                                        # value is below this (null: every cycle)
    cost_cut: bool | None = None  # hybrid: keep the nodes that maximise expected tokens per second of this
                                  # machine's verify forward, measured at start (default: false, the whole budget)

    def __post_init__(self) -> None:
        require(self.method in METHODS, "spec.method", self.method, f"must be one of {sorted(METHODS)}")
        method = METHODS[self.method]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "method" and value is not None and field.name not in method.settings:
                require(False, f"spec.{field.name}", value, f"does not apply to method {self.method} (it reads "
                        f"{list(method.settings) or 'no settings'})")
        require(self.datastore is None or len(self.datastore) > 0, "spec.datastore", self.datastore,
                "name at least one data set, or leave it null")
        for name in ("num_draft", "max_matches", "num_nodes", "min_match"):
            require(getattr(self, name) is None or getattr(self, name) >= 1, f"spec.{name}", getattr(self, name),
                    "must be >= 1")
        require(self.min_prob is None or 0.0 <= self.min_prob <= 1.0, "spec.min_prob", self.min_prob,
                "must be in [0, 1]")
        require(self.retrieval_prior is None or 0.0 < self.retrieval_prior < 1.0, "spec.retrieval_prior",
                self.retrieval_prior, "must be in (0, 1)")
        require(self.learned_below is None or 0.0 < self.learned_below <= 1.0, "spec.learned_below",
                self.learned_below, "must be in (0, 1] (or null: the learned drafter runs every cycle)")
        if method.tree is not None:
            self.tree_spec  # noqa: B018 (validate the tree now: a bad one fails at load time, named spec.*)
        if method.parts is not None:
            method.parts(self)  # a composite method's parts are SpecConfigs: their checks run now

    @property
    def tree_spec(self) -> TreeSpec | None:
        """The method's default tree with this spec's tree settings over it (None: the method has no tree)."""
        default = METHODS[self.method].tree
        if default is None:
            return None
        options = {"mode": self.tree, "depth": self.depth, "top_k": self.top_k, "num_nodes": self.num_nodes}
        tree = tree_over(default, {k: v for k, v in options.items() if v is not None}, prefix="spec.")
        modes = registry.family(METHODS[self.method].family).tree_modes
        require(tree.mode in modes, "spec.tree", tree.mode, f"a {self.method} drafter drafts one of {list(modes)}")
        return tree

    def setting(self, name: str) -> Any:
        """A ngram / draft-lm setting, or its default."""
        value = getattr(self, name)
        return value if value is not None else CHAIN_DEFAULTS[name]


CHAIN_DEFAULTS = {"num_draft": 4, "max_matches": 4}


def tree_over(default: TreeSpec, options: dict[str, Any], prefix: str = "tree.") -> TreeSpec:
    """``options`` (TreeSpec fields; errors named ``prefix`` + field) over ``default``: the same mode keeps the
    default's settings, another mode starts from that mode's own defaults."""
    if options.get("mode", default.mode) == default.mode:
        options = {**{k: v for k, v in to_dict(default).items() if v is not None}, **options}
    return from_dict(TreeSpec, options, prefix=prefix)


@dataclass(frozen=True)
class Method:
    family: str | None             # the drafter family whose checkpoint it reads (registry.FAMILIES); None: none
    tree: TreeSpec | None          # the default tree (None: no tree settings: vanilla, ngram, draft-lm)
    settings: tuple[str, ...]      # the SpecConfig fields it reads besides ``method``
    factory: Callable[[Decoder, SpecConfig], DrafterFactory] | None  # None: vanilla (no drafter)
    parts: Callable[[SpecConfig], tuple[SpecConfig, ...]] | None = None  # a composite method: its proposers' specs
    # its factory takes a serving replica's shared index of finished answers (factory(target, spec, history))
    reads_history: bool = False

    @property
    def speculates(self) -> bool:
        return self.factory is not None

    @property
    def trained(self) -> bool:
        return self.family is not None


def default_draft_model() -> str:
    return str(eyas_home() / "targets" / "draft-tiny")


def _ngram(target: Decoder, spec: SpecConfig) -> DrafterFactory:
    config = NgramConfig(num_draft=spec.setting("num_draft"), max_matches=spec.setting("max_matches"),
                         num_nodes=spec.num_nodes)
    datastore = load_datastore(spec.datastore, target.config.vocab_size) if spec.datastore else None  # read once
    return lambda: NgramDrafter(config, datastore)


def load_datastore(data_sets: tuple[str, ...], vocab_size: int) -> Datastore:
    """``spec.datastore``: the train splits of data sets made by ``jobs.generate_data`` (each a name under
    ``$EYAS_HOME/data`` or a path: prompts and the target's answers) as one datastore; their tokens must be the
    target's (ids below ``vocab_size``)."""
    sequences = datastore_sequences(data_sets)
    store = Datastore(sequences, source=",".join(map(str, data_sets)))
    _check_vocab(store.max_token_id, store.source, vocab_size)
    return store


def datastore_sequences(data_sets: tuple[str, ...]) -> list[list[int]]:
    """The prompt + answer of every train row of the named data sets (``spec.datastore``)."""
    sequences: list[list[int]] = []
    for data in data_sets:
        directory = data_path(str(data))
        try:
            rows = read_rows(directory, "train")
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"spec.datastore: {directory}: {err}") from None
        sequences += [row["prompt_ids"] + row["response_ids"] for row in rows]
    return sequences


def _check_vocab(max_token_id: int, source: str, vocab_size: int) -> None:
    if max_token_id >= vocab_size:
        raise ConfigError(f"spec.datastore: {source}: token id {max_token_id} is outside the target's "
                          f"vocabulary of {vocab_size}; build the data sets with this target's tokenizer")


def suffix_config(spec: SpecConfig) -> SuffixConfig:
    """The suffix proposer's settings from ``spec`` (a field left null: SuffixConfig's default)."""
    given = {"depth": spec.num_draft, "num_nodes": spec.num_nodes, "min_match": spec.min_match,
             "min_prob": spec.min_prob}
    return SuffixConfig(**{name: value for name, value in given.items() if value is not None})


def _suffix(target: Decoder, spec: SpecConfig, history: SuffixIndex | None = None) -> DrafterFactory:
    config = suffix_config(spec)
    datastore = None
    if spec.datastore:  # indexed once, shared read-only by every row's drafter
        datastore = SuffixIndex(config.anchors)
        sequences = datastore_sequences(spec.datastore)
        for sequence in sequences:
            datastore.add(sequence)
        _check_vocab(max((max(s) for s in sequences if s), default=0), ",".join(map(str, spec.datastore)),
                     target.config.vocab_size)
    return lambda: SuffixDrafter(config, datastore, history)


def _draft_lm(target: Decoder, spec: SpecConfig) -> DrafterFactory:
    path = resolve_checkpoint(spec.draft_model or default_draft_model(), "spec.draft_model")
    draft = load_target(path, dtype=target.dtype, device=target.device)  # loaded once; each drafter its own cache
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"spec.draft_model={path}: vocab {draft.config.vocab_size} differs from the target's "
                          f"{target.config.vocab_size}; a draft LM must share the target's tokenizer")
    config = DraftLMConfig(num_draft=spec.setting("num_draft"))
    return lambda: DraftLMDrafter(draft, config, max_len=target.config.max_position_embeddings)


def _trained(target: Decoder, spec: SpecConfig) -> DrafterFactory:
    if not spec.drafter:
        raise ConfigError(f"spec.method={spec.method} needs a trained drafter: set spec.drafter (or --drafter) to "
                          "a checkpoint directory or models:/NAME@ALIAS")
    return checkpoint_factory(resolve_checkpoint(spec.drafter, "spec.drafter", drafter=True), target, spec.method, spec.tree_spec)


def _trained_method(family: str, tree: TreeSpec) -> Method:
    return Method(family, tree, ("drafter",) + TREE_SETTINGS, _trained)


RETRIEVAL_PROPOSERS = ("ngram", "suffix")
LEARNED_PROPOSERS = ("draft-lm", "eagle1", "eagle2", "eagle3", "medusa", "dflash", "dflash-ddtree", "eagle3.1",
                     "peagle")
HYBRID_PROPOSERS = ("ngram", "eagle3")  # spec.proposers' default
HYBRID_OWN = ("method", "proposers", "num_nodes", "retrieval_prior", "learned_below", "cost_cut")  # the hybrid's own settings


def hybrid_parts(spec: SpecConfig) -> tuple[SpecConfig, SpecConfig]:
    """A hybrid spec's (retrieval, learned) proposer specs. Each part gets the hybrid's settings it reads; num_nodes
    is the hybrid's node budget, and the learned tree's own budget where its mode has one (it drafts up to the
    budget, the merge keeps the best). A setting neither part reads is an error."""
    proposers = tuple(spec.proposers or HYBRID_PROPOSERS)
    retrieval = [p for p in proposers if p in RETRIEVAL_PROPOSERS]
    learned = [p for p in proposers if p in LEARNED_PROPOSERS]
    require(len(proposers) == 2 and len(retrieval) == 1 and len(learned) == 1, "spec.proposers", list(proposers),
            f"name one retrieval proposer of {list(RETRIEVAL_PROPOSERS)} and one learned drafter of "
            f"{list(LEARNED_PROPOSERS)}")
    require(spec.num_nodes is None or spec.num_nodes < MAX_TREE_NODES, "spec.num_nodes", spec.num_nodes,
            f"a tree may draft at most {MAX_TREE_NODES - 1} nodes")
    tree = METHODS[learned[0]].tree  # the learned tree reads num_nodes where its mode has a budget
    budgeted = tree is not None and "num_nodes" in MODE_SETTINGS.get(spec.tree or tree.mode, ())
    reads = {name: tuple(k for k in METHODS[name].settings if k != "num_nodes" or (name in learned and budgeted))
             for name in (retrieval[0], learned[0])}
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name not in HYBRID_OWN and value is not None \
                and not any(field.name in names for names in reads.values()):
            require(False, f"spec.{field.name}", value, f"is read by neither of the proposers {list(proposers)}")
    return tuple(SpecConfig(method=name, **{k: getattr(spec, k) for k in names}) for name, names in reads.items())


def _hybrid(target: Decoder, spec: SpecConfig, history: SuffixIndex | None = None) -> DrafterFactory:
    retrieval, learned = (METHODS[part.method].factory(target, part, history) if METHODS[part.method].reads_history
                          else METHODS[part.method].factory(target, part) for part in hybrid_parts(spec))
    prior = retrieval_prior(spec.retrieval_prior)
    curve = costs.verify_curve(target, (spec.num_nodes or MAX_TREE_NODES - 1) + 1) if spec.cost_cut else None
    return lambda: HybridDrafter(retrieval(), learned(), spec.num_nodes, prior, spec.learned_below, curve)


def retrieval_prior(mean: float | None) -> tuple[float, float]:
    """The hybrid's Beta prior of retrieval acceptance per depth: ``mean`` (default RETRIEVAL_PRIOR's), worth
    RETRIEVAL_PRIOR's number of verdicts."""
    weight = sum(RETRIEVAL_PRIOR)
    if mean is None:
        return RETRIEVAL_PRIOR
    return (mean * weight, (1.0 - mean) * weight)


def history_index(spec: SpecConfig, max_tokens: int) -> SuffixIndex | None:
    """An empty shared index of finished answers (at most ``max_tokens``, FIFO) for ``spec``'s suffix proposer;
    None when ``spec`` has none."""
    if not reads_history(spec):
        return None
    parts = METHODS[spec.method].parts(spec) if METHODS[spec.method].parts is not None else (spec,)
    suffix = next(part for part in parts if METHODS[part.method].reads_history)
    return SuffixIndex(suffix_config(suffix).anchors, max_tokens)


def reads_history(spec: SpecConfig) -> bool:
    """Whether ``spec``'s drafters draft from a serving replica's shared index of finished answers."""
    if METHODS[spec.method].parts is not None:
        return any(METHODS[part.method].reads_history for part in METHODS[spec.method].parts(spec))
    return METHODS[spec.method].reads_history


METHODS: dict[str, Method] = {
    "vanilla": Method(None, None, (), None),
    "ngram": Method(None, None, ("num_draft", "max_matches", "num_nodes", "datastore"), _ngram),
    # SuffixDecoding: the most frequent continuations of the longest matching suffix (drafters/suffix.py)
    "suffix": Method(None, None, ("num_draft", "num_nodes", "min_match", "min_prob", "datastore"), _suffix,
                     reads_history=True),
    "draft-lm": Method(None, None, ("draft_model", "num_draft"), _draft_lm),
    "eagle1": _trained_method("eagle1", TreeSpec(mode="static")),
    "eagle2": _trained_method("eagle1", TreeSpec(mode="dynamic")),
    "eagle3": _trained_method("eagle3", TreeSpec(mode="dynamic")),
    "medusa": _trained_method("medusa", TreeSpec(mode="static")),
    "dflash": _trained_method("dflash", TreeSpec(mode="block")),
    "dflash-ddtree": _trained_method("dflash", TreeSpec(mode="ddtree")),
    "dspark": _trained_method("dspark", TreeSpec(mode="block")),
    "dflash2": _trained_method("dflash2", TreeSpec(mode="block")),
    "eagle3.1": _trained_method("eagle3.1", TreeSpec(mode="dynamic")),
    "peagle": _trained_method("peagle", TreeSpec(mode="block")),  # spec.tree=ddtree: a tree over its K positions
    # a retrieval proposer and a learned drafter in one tree under one node budget (drafters/hybrid.py)
    "hybrid": Method(None, None, HYBRID_OWN[1:] + ("drafter", "draft_model", "num_draft", "max_matches", "datastore",
                                                   "min_match", "min_prob", "tree", "depth", "top_k"),
                     _hybrid, hybrid_parts,
                     reads_history=True),
}
# a family's own method: what a checkpoint of that family runs when no method is named
FAMILY_METHOD = {"eagle1": "eagle1", "eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash",
                 "dspark": "dspark", "dflash2": "dflash2", "eagle3.1": "eagle3.1", "peagle": "peagle"}


def drafter_factory(target: Decoder, spec: SpecConfig, history: SuffixIndex | None = None
                    ) -> DrafterFactory | None:
    """Makes the drafters ``spec`` asks for, one per sequence (drafters hold per-sequence state), with the weights
    loaded once and shared; None for vanilla. ``history``: a serving replica's shared index of finished answers,
    read by the suffix proposer (``reads_history(spec)``). A bad spec fails here, before any request."""
    method = METHODS[spec.method]
    if method.factory is None:
        return None
    factory = method.factory(target, spec, history) if method.reads_history else method.factory(target, spec)
    factory()  # build one now: its checks (tree modes, sizes, checkpoint fit) run before the first request
    return factory


def build_drafter(target: Decoder, spec: SpecConfig):
    """One drafter for ``spec`` (None for vanilla)."""
    factory = drafter_factory(target, spec)
    return factory() if factory is not None else None


def checkpoint_factory(path: str | Path, target: Decoder, method: str | None, tree: TreeSpec | None
                       ) -> DrafterFactory:
    """Drafters of ``method`` (default: the checkpoint family's own) over the checkpoint at ``path``, whose weights
    are read once; ``tree`` defaults to the method's."""
    model = registry.load_model(path, target)
    if hasattr(model, "pack_linears"):  # read from a checkpoint for drafting only: its weights are final
        model.pack_linears()
    method = method or FAMILY_METHOD[model.drafter_type]
    require(method in METHODS and METHODS[method].trained, "method", method,
            f"a trained drafter runs one of {sorted(m for m in METHODS if METHODS[m].trained)}")
    if METHODS[method].family != model.drafter_type:
        raise ConfigError(f"method {method!r} needs a {METHODS[method].family} drafter, but {path} holds a "
                          f"{model.drafter_type} checkpoint")
    make = registry.family(model.drafter_type).make_drafter
    tree = tree or METHODS[method].tree
    return lambda: make(model, target, tree, method)


def _method_tree(model_type: str, method: str | None, tree: dict[str, Any] | None, where: str
                 ) -> tuple[str, TreeSpec | None]:
    method = method or FAMILY_METHOD.get(model_type, model_type)
    require(method in METHODS, f"{where.rsplit('tree.', 1)[0]}method", method, f"must be one of {sorted(METHODS)}")
    default = METHODS[method].tree
    return method, tree_over(default, dict(tree or {}), prefix=where) if default is not None else None


def load_drafter(path: str | Path, target: Decoder, method: str | None = None,
                 tree: dict[str, Any] | None = None, where: str = "tree.") -> Any:
    """One drafter over the checkpoint at ``path`` (tests, tools): ``method`` defaults to the family's own,
    ``tree`` holds tree options over the method's default tree (errors named ``where`` + field)."""
    method, spec = _method_tree(registry.read_meta(path)[1]["drafter_type"], method, tree, where)
    return checkpoint_factory(path, target, method, spec)()


def wrap_model(model: Any, target: Decoder, method: str | None = None, tree: dict[str, Any] | None = None,
               where: str = "tree.") -> Any:
    """One drafter over an in-memory drafter model (training-time evaluation drafts with the live weights, no
    checkpoint round trip); ``method`` and ``tree`` as in ``load_drafter``."""
    method, spec = _method_tree(model.drafter_type, method, tree, where)
    require(METHODS[method].trained, "method", method,
            f"a trained drafter runs one of {sorted(m for m in METHODS if METHODS[m].trained)}")
    if METHODS[method].family != model.drafter_type:
        raise ConfigError(f"method {method!r} needs a {METHODS[method].family} drafter, not a "
                          f"{model.drafter_type} model")
    return registry.family(model.drafter_type).make_drafter(model, target, spec or METHODS[method].tree, method)


def resolve_checkpoint(location: str | Path, field: str, drafter: bool = False) -> Path:
    """The one checkpoint resolver: a local directory for a path ($EYAS_HOME and ~ expand) or an MLflow URI
    (``models:/NAME@ALIAS``, ``runs:/RUN_ID/PATH``, downloaded once). With ``drafter``, a bare name (no ``/``) is a
    drafter's name: ``$EYAS_HOME/drafters/<name>``, else the shipped one (eyas.train.config.drafter_path).
    ``field`` names the setting in errors."""
    text = str(location)
    if text.startswith(("models:/", "runs:/")):
        return track.download_model(text)
    path = drafter_path(text) if drafter and "/" not in text and not Path(text).is_dir() else resolve_path(text)
    if not path.exists():
        raise ConfigError(f"{field}={text}: no checkpoint there (a drafter is trained with python -m "
                          "jobs.train_drafter --config jobs/configs/<family>-tiny.yaml; a target with "
                          "jobs.train_target or jobs.fetch_target)")
    return path
