"""Configs of drafter training: ``DataConfig`` (jobs.generate_data) and ``TrainConfig`` (jobs.train_drafter).

Each YAML file in ``jobs/configs/data-*.yaml`` is a ``DataConfig``; each ``<family>-*.yaml`` is a ``TrainConfig``
(nested sections are the dataclasses below). Paths may use ``$EYAS_HOME``; a bare name (no ``/``) is looked up
under ``$EYAS_HOME/targets/`` (targets) or ``$EYAS_HOME/data/`` (data sets).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eyas.config import eyas_home, require, resolve_path
from eyas.datasets import SHAREGPT

SUITES = ("all", "code", "docstring", "prose")  # eyas.corpus prompt suites (docstring: HumanEval's shape)
MEASURE_SUITES = SUITES + ("chat",)  # held-out prompts training measures tau on (chat: held-out ShareGPT)


def suite_names(suites: str) -> tuple[str, ...]:
    """``code,chat`` -> ("code", "chat"): one or more suites joined by commas, each once."""
    return tuple(dict.fromkeys(name.strip() for name in suites.split(",") if name.strip()))


def home_path(ref: str, kind: str) -> Path:
    """A bare name -> ``$EYAS_HOME/<kind>/<name>``; a path (with ``/``) is used as is ($EYAS_HOME and ~ expand)."""
    return resolve_path(ref) if "/" in ref else eyas_home() / kind / ref


def target_path(target: str) -> Path:
    """``tiny`` -> ``$EYAS_HOME/targets/tiny``; a path (with ``/``) is used as is."""
    return home_path(target, "targets")


def data_path(data: str) -> Path:
    """``data-tiny`` -> ``$EYAS_HOME/data/data-tiny``; a path (with ``/``) is used as is."""
    return home_path(data, "data")


# the drafters eyas ships for its default target (README "Shipped drafters"): serving/drafters/<name>/ in the repository
SHIPPED_DRAFTERS = Path(__file__).resolve().parents[3] / "serving" / "drafters"


def shipped_drafter(name: str) -> Path | None:
    """The shipped drafter ``name`` (``serving/drafters/<name>``), or None where eyas ships none of that name."""
    directory = SHIPPED_DRAFTERS / name
    return directory if "/" not in name and (directory / "config.json").is_file() else None


def drafter_path(drafter: str) -> Path:
    """``eagle3-tiny`` -> ``$EYAS_HOME/drafters/eagle3-tiny`` (where jobs.train_drafter publishes); where that holds
    no checkpoint and eyas ships a drafter of that name, the shipped one (``serving/drafters/<name>``); a path (with
    ``/``) is used as is."""
    path = home_path(drafter, "drafters")
    shipped = shipped_drafter(drafter)
    return shipped if shipped is not None and not (path / "config.json").is_file() else path


def _name(value: str, field_name: str) -> None:
    require(bool(value) and "/" not in value and not value.startswith("."), field_name, value,
            "must be a plain name (it becomes a directory under $EYAS_HOME)")


@dataclass(frozen=True)
class DataConfig:
    """``jobs.generate_data``: prompts -> target responses -> parquet shards under ``$EYAS_HOME/data/<name>/``.

    source=regenerate: train prompts (eyas.corpus) continued by the target itself, so the drafter learns the
    target's own distribution (EAGLE-3, DFlash, Medusa-2 practice). source=sharegpt: ShareGPT first human turns
    (eyas.datasets), rendered with the target's chat template and answered by the target, as SpecForge and EAGLE-3
    regenerate their chat data; the loss covers the answer only. ``suite`` does not apply to it, and prompts over
    ``max_prompt_tokens`` are skipped rather than cut (a cut chat prompt would lose the assistant header).
    source=corpus: fixed raw-text chunks of the train documents, as EAGLE-1 trained on a fixed data set.
    source=mix: every train and held-out row of ``parts`` (data sets built for this target), part after part, e.g.
    chat and code answers for one drafter; the prompt and sampling fields do not apply.
    """

    name: str
    target: str = "tiny"
    source: Literal["regenerate", "corpus", "sharegpt", "mix"] = "regenerate"
    parts: tuple[str, ...] = ()      # source=mix: the data sets to join (names under $EYAS_HOME/data or paths)
    suite: str = "all"               # prompts / documents: code, docstring (HumanEval's shape), prose or all
    num_prompts: int = 512           # train sequences (regenerated prompts or corpus chunks); more on a rerun grows it
    num_heldout_prompts: int = 32    # held-out sequences (from held-out files / topics) for evaluation
    max_prompt_tokens: int = 128     # longer prompts are cut to their first max_prompt_tokens tokens
    max_new_tokens: int = 128        # response budget per prompt (regenerate)
    chunk_tokens: int = 256          # tokens per chunk (corpus)
    temperature: float = 0.0         # 0 = greedy responses
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8              # prompts per batched target forward
    shard_size: int = 64             # sequences per parquet shard (the unit a rerun skips or redoes)
    num_workers: int = 0             # Ray actors; 0 = one per CPU (one per GPU with use_gpu)
    use_gpu: bool = False
    # Not part of the content key: the dtypes give the same answers up to near-ties, so a rerun in another dtype
    # keeps the shards it has (data.json's last_run says which dtype answered)
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"  # while answering; auto: bfloat16 on GPU, AVX512_BF16 CPU
    # drop prompts that share a function with HumanEval (the bench's code suite, never trained on); fetches it
    exclude_humaneval: bool = False
    # written as the disk feature cache under <name>/features/ that train.feature_cache: disk reads, so training runs
    # no target forward; the union of several drafters' taps serves each. Stored in the answering dtype (a float32
    # training, train.feature_dtype float32, needs dtype: float32)
    keep_taps: tuple[int, ...] = ()  # target taps kept from the answering forwards, e.g. [2, 15, 27]; [] = none

    def __post_init__(self) -> None:
        _name(self.name, "name")
        require(self.suite in SUITES, "suite", self.suite, f"must be one of {list(SUITES)}")
        for key in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "chunk_tokens", "batch_size",
                    "shard_size"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        require(self.num_heldout_prompts >= 0, "num_heldout_prompts", self.num_heldout_prompts, "must be >= 0")
        require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0 (0 = greedy)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        require(self.num_workers >= 0, "num_workers", self.num_workers, "must be >= 0 (0 = one per CPU/GPU)")
        require((self.source == "mix") == bool(self.parts), "parts", list(self.parts),
                "source: mix needs the data sets to join (parts: [a, b]), and only source: mix takes them")
        require(self.name not in self.parts, "parts", list(self.parts),
                f"must not include the mix itself ({self.name})")
        require(all(tap >= 0 for tap in self.keep_taps) and len(set(self.keep_taps)) == len(self.keep_taps),
                "keep_taps", list(self.keep_taps), "must be distinct layer numbers >= 0")
        require(not self.keep_taps or self.source in ("regenerate", "sharegpt"), "keep_taps", list(self.keep_taps),
                f"only a source the target answers (regenerate, sharegpt) keeps its taps, not source: {self.source} "
                "(training computes them)")

    def content_key(self) -> dict[str, Any]:
        """The fields that decide what a shard holds: a rerun may only reuse shards written under the same key."""
        key = {"target": str(target_path(self.target)), "source": self.source, "suite": self.suite,
               "max_prompt_tokens": self.max_prompt_tokens, "max_new_tokens": self.max_new_tokens,
               "chunk_tokens": self.chunk_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "seed": self.seed, "shard_size": self.shard_size}
        if self.source == "sharegpt":  # only here, so the stamps of existing corpus data sets stay valid
            key["dataset"] = SHAREGPT.requirement
        if self.source == "mix":  # the parts' own stamps are checked as it is built (jobs.generate_data.mix)
            key = {"target": key["target"], "source": "mix", "parts": [str(data_path(p)) for p in self.parts],
                   "shard_size": self.shard_size}
        return key


@dataclass(frozen=True)
class DrafterSection:
    """Which drafter to train: a registry family and its config (``eyas.drafters.<family>`` validates the fields,
    tap layers included, e.g. ``config: {taps: [2, 16, 29]}`` for EAGLE-3 on a 32-layer target)."""

    type: str = "eagle3"                     # registry family: eagle1 | eagle3 | medusa | dflash
    config: dict[str, Any] = field(default_factory=dict)  # the family config's fields; {} = its defaults
    # warm start: a checkpoint of this family to train on from (a name under $EYAS_HOME/drafters, a path,
    # models:/NAME@ALIAS, or an SGLang / vLLM / speculators directory); `config` then overrides its fields
    init_from: str | None = None
    # a draft vocabulary (`config.draft_vocab_size`) is the most frequent prediction targets of the training data
    # and of these data sets (names under $EYAS_HOME/data or paths), every set weighted equally: a drafter trained
    # on chat can still propose the code tokens HumanEval asks for
    vocab_data: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        require(bool(self.type), "drafter.type", self.type, "must name a drafter family (eagle1, eagle3, ...)")
        require(self.init_from is None or bool(str(self.init_from).strip()), "drafter.init_from", self.init_from,
                "must name a drafter checkpoint (or be null: a fresh drafter)")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1        # cosine / linear decay to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0           # max gradient norm; 0 = off
    # lr of the drafter's own LM head (parameters named lm_head.*: EAGLE-3's, DFlash's or Medusa's draft-vocabulary
    # head) as a multiple of lr; 0 freezes it at its initial weights (the target's readout rows)
    head_lr_multiplier: float = 1.0

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        require(self.head_lr_multiplier >= 0, "optim.head_lr_multiplier", self.head_lr_multiplier,
                "must be >= 0 (0 = a frozen head)")
        require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", self.betas,
                "must be two numbers in [0, 1)")
        require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        require(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0 (0 = off)")


@dataclass(frozen=True)
class LoopConfig:
    """The training loop (the ``train:`` section)."""

    num_epochs: int = 1
    batch_size: int = 4              # sequences per worker per step
    max_len: int = 256               # tokens per sequence; longer sequences are cut
    max_steps: int | None = None     # stop after this many steps in total (null = all epochs)
    # an epoch is at most this many steps (a fresh draw of the data each time; null = the whole data set): a sweep's
    # rungs (one report per epoch) then stay short on a large data set
    epoch_steps: int | None = None
    seed: int = 0
    eval_every: int = 20             # steps between held-out evaluations (acc_j, simulated tau)
    eval_sequences: int = 16         # held-out sequences in the evaluation batch
    log_every: int = 5               # steps between logged training losses
    checkpoint_every: int | None = None  # checkpoint every N steps too (always at each epoch end)
    # held-out evaluation per suite: {label: data set}, each data set's held-out split (its first eval_sequences
    # rows) evaluated apart (heldout_<label>_acc_1, ...) and the mean over labels as heldout_acc_1, ...; {} = the
    # training data's own held-out split, unlabelled
    heldout_data: dict[str, str] = field(default_factory=dict)
    # reuse target features across epochs: "memory" per worker (each worker then keeps its share of the data and
    # reshuffles only within it), "disk" under <data>/features/ (shared by the workers, global reshuffling; read
    # from the files each step, so a worker's memory stays flat however large the data set)
    feature_cache: Literal["none", "memory", "disk"] = "none"
    # the drafter's forward and loss: bfloat16 autocast over float32 weights and optimizer state (2-4x faster steps
    # on a CPU with AMX / AVX512-BF16, and on GPUs; docs/training.md "Precision")
    precision: Literal["float32", "bfloat16", "auto"] = "float32"  # float32, bfloat16 (autocast) or auto (bfloat16 where native)
    # the target forward that makes the features: float32, bfloat16 (a bfloat16 copy of the target, loaded on the first
    # sequence to compute: ~1.6x faster on an AVX512-BF16 CPU, features within ~1% of float32's) or auto (as the
    # drafter's resolved precision). A bfloat16 run reads a float32 disk cache of its taps where one exists
    feature_dtype: Literal["float32", "bfloat16", "auto"] = "auto"  # float32, bfloat16 or auto (as precision)
    fail_at_step: int | None = None  # testing: rank `fail_rank` dies once at this step (a marker file guards)
    hold_at_step: int | None = None  # testing: rank `fail_rank` waits there once, for a test to kill driver or node
    fail_rank: int = 1

    def __post_init__(self) -> None:
        for key in ("num_epochs", "batch_size", "max_len", "eval_every", "eval_sequences", "log_every"):
            require(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "must be >= 1")
        for key in ("max_steps", "epoch_steps"):
            require(getattr(self, key) is None or getattr(self, key) >= 1, f"train.{key}", getattr(self, key),
                    "must be >= 1 or null")
        require(self.checkpoint_every is None or self.checkpoint_every >= 1, "train.checkpoint_every",
                self.checkpoint_every, "must be >= 1 or null")
        for key in ("fail_at_step", "hold_at_step"):
            require(getattr(self, key) is None or getattr(self, key) >= 1, f"train.{key}", getattr(self, key),
                    "must be >= 1 or null")
        for label, data in self.heldout_data.items():
            require(bool(label) and label.isidentifier(), "train.heldout_data", label,
                    "labels name metrics (heldout_<label>_acc_1): use letters, digits and _")
            require(isinstance(data, str) and bool(data), f"train.heldout_data.{label}", data, "must name a data set")


PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]  # Ray's placement group strategies


@dataclass(frozen=True)
class ScalingSection:
    num_workers: int = 2
    use_gpu: bool = False            # NCCL on GPU, gloo on CPU
    cpus_per_worker: int = 1         # also each worker's torch thread count
    strategy: Literal["ddp", "zero1", "zero2"] = "ddp"  # DDP, or DeepSpeed ZeRO stage 1 / 2
    max_failures: int = 1            # worker failures to recover from (from the last checkpoint)
    placement_strategy: PlacementStrategy = "PACK"  # PACK fills a node first; SPREAD a node per worker where it can
    num_to_keep: int | None = 2      # Ray Train checkpoints kept
    storage_path: str = "$EYAS_HOME/ray_results"

    def __post_init__(self) -> None:
        require(self.num_workers >= 1, "scaling.num_workers", self.num_workers, "must be >= 1")
        require(self.cpus_per_worker >= 1, "scaling.cpus_per_worker", self.cpus_per_worker, "must be >= 1")
        require(self.max_failures >= -1, "scaling.max_failures", self.max_failures, "must be >= -1 (-1 = forever)")
        require(self.num_to_keep is None or self.num_to_keep >= 1, "scaling.num_to_keep", self.num_to_keep,
                "must be >= 1 or null (keep all)")


@dataclass(frozen=True)
class MeasureConfig:
    """tau measured at each epoch end by running eyas generate (greedy) with the drafter on held-out prompts."""

    num_prompts: int = 4             # per suite; 0 = skip the measurement
    max_new_tokens: int = 32
    # held-out prompts: a suite of MEASURE_SUITES or several joined by commas (docstring,chat): tau_<suite> each,
    # and tau over all of them
    suite: str = "all"
    method: str | None = None        # registry method (eagle2 for an eagle1 drafter...); null = the family's own
    tree: dict[str, Any] = field(default_factory=dict)  # tree options over the method's defaults

    def __post_init__(self) -> None:
        require(self.num_prompts >= 0, "measure.num_prompts", self.num_prompts, "must be >= 0")
        names = suite_names(self.suite)
        require(bool(names) and all(n in MEASURE_SUITES for n in names), "measure.suite", self.suite,
                f"must be one or more of {list(MEASURE_SUITES)}, joined by commas")
        require(self.max_new_tokens >= 1, "measure.max_new_tokens", self.max_new_tokens, "must be >= 1")


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True             # MLflow logging (rank 0 only)
    experiment: str = "eyas-drafters"
    register: bool = True            # register the final drafter as model `name`
    alias: str = "champion"          # moved to the new version: models:/<name>@<alias> ("latest" is reserved by MLflow)


@dataclass(frozen=True)
class TrainConfig:
    """``jobs.train_drafter``: one YAML file per family and size in ``jobs/configs/``."""

    name: str                        # output: $EYAS_HOME/drafters/<name>, MLflow model <name>
    target: str = "tiny"      # target checkpoint: a name under $EYAS_HOME/targets or a path
    data: str = "data-tiny"          # generate_data output: a name under $EYAS_HOME/data or a path
    drafter: DrafterSection = field(default_factory=DrafterSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        _name(self.name, "name")
        hooked = self.train.fail_at_step is not None or self.train.hold_at_step is not None
        require(not hooked or self.train.fail_rank < self.scaling.num_workers,
                "train.fail_rank", self.train.fail_rank, f"must be < scaling.num_workers={self.scaling.num_workers}")

    @property
    def output_dir(self) -> Path:
        return eyas_home() / "drafters" / self.name
