"""Build a target (or a small draft LM): tokenizer + Llama causal LM trained with Ray Train on the corpus or chat data.

    python -m jobs.train_target --config jobs/configs/target-tiny.yaml [--force] [section.key=value ...]
    ray job submit --working-dir . -- python -m jobs.train_target --config jobs/configs/target-micro.yaml

(under ``ray job submit`` the driver runs in an unpacked copy of the working dir: pass ``EYAS_HOME`` and
``MLFLOW_TRACKING_URI`` as absolute paths in ``--runtime-env-json '{"env_vars": {...}}'`` to keep the results)

Output: ``$EYAS_HOME/targets/<name>/`` holding a Hugging Face checkpoint (config.json, model.safetensors, float32)
plus the tokenizer, so ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` both load it,
and ``meta.json`` (held-out loss, config, timings, greedy samples). ``meta.json`` is written last and marks a
complete build: a second call reuses the directory unless ``--force``.

Tokenizer: trained once into ``$EYAS_HOME/tokenizers/<name>/`` and reused while its config is unchanged
(``--force`` retrains the model, not the tokenizer). A draft LM sets ``tokenizer_from: <target name or dir>`` and
reuses that target's tokenizer and its special ids, so target and draft share one vocabulary; ``meta.json`` records
the tokenizer's SHA-256.

Data (``eyas.train.target_lm_data``): the embedded corpus (``train.corpus``), or a data set jobs.generate_data wrote
(``train.data: data-smollm2``: the target's chat prompts and its own answers; ``train.loss_on`` response or all).

Training: ``TorchTrainer`` with ``num_workers`` CPU workers (gloo DDP via ``prepare_model``). Each step every worker
samples ``batch_size`` random windows of ``seq_len + 1`` tokens from the packed train stream (documents joined as
``<bos> doc <eos>``, or data rows one after another); AdamW, GPT-2 residual init scaling, linear warmup then cosine decay over
``num_steps`` or over the wall-time budget ``max_minutes``, whichever ends first (a loaded machine trains on fewer
tokens instead of taking longer; meta.json says how many steps ran). Rank 0 reports the loss every ``log_every`` steps
and saves the checkpoint; the held-out loss is computed by all ranks on disjoint windows and all-reduced. The driver
logs params, the loss curve and the held-out loss to MLflow (experiment ``eyas-targets``).

Shape legend: B batch (sequences), T tokens per sequence, V vocab, N tokens of a packed stream, W eval windows.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from transformers import LlamaForCausalLM

from eyas import track
from eyas.config import eyas_home, flatten, from_dict, resolve_path, to_dict
from eyas.tokenizer import load_tokenizer, save_tokenizer
from eyas.train.target_lm import (ModelConfig, TargetJobConfig, TrainConfig, Vocab,  # noqa: F401
                                  causal_lm_loss, distributed_heldout_loss, greedy_samples, llama_config, lr_at,
                                  num_parameters, sample_windows, scale_residual_init, target_dir)
from eyas.train.target_lm_data import (heldout_streams, prepare_tokenizer, sample_prompts, sha256_file,
                                       tokenizer_vocab, train_stream)
from eyas.progress import Progress
from eyas.threads import configure_threads
from eyas_ray.cluster import init_ray
from jobs.common import job_argparser, load_job_config

# ModelConfig, TrainConfig, TargetJobConfig and the Ray-free helpers live in eyas.train.target_lm (re-exported:
# docs and tests name jobs.train_target:TargetJobConfig)

META_FILE = "meta.json"
HISTORY_FILE = "train_history.json"


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker: DDP training, then the all-reduced held-out loss; rank 0 saves."""
    cfg = from_dict(TargetJobConfig, loop_config["config"])
    train = cfg.train
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    configure_threads(cpu_budget=train.cpus_per_worker)  # the policy within the worker's CPUs (eyas.threads)
    torch.manual_seed(train.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
    train_data = ray.get(loop_config["train_stream"])
    heldout_data = {kind: ray.get(ref) for kind, ref in loop_config["heldout_streams"].items()}

    model = LlamaForCausalLM(llama_config(cfg, loop_config["vocab"]))
    scale_residual_init(model, cfg.model.num_layers)
    model = ray.train.torch.prepare_model(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices; norms (1-d) get no weight decay
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=train.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng([train.seed, rank])
    progress = Progress(f"train {cfg.name}", total=train.num_steps, every_s=15.0) if rank == 0 else None
    history: list[dict[str, float]] = []
    start = time.monotonic()
    window = {"loss": 0.0, "steps": 0, "start": start}

    def log_window(step: int, lr: float) -> None:
        """Report the mean loss since the last report (every rank calls this at the same steps)."""
        now = time.monotonic()
        tokens = window["steps"] * train.batch_size * train.seq_len * world_size
        record = {"step": step, "loss": window["loss"] / window["steps"], "lr": lr,
                  "tokens_per_s": tokens / max(now - window["start"], 1e-9), "elapsed_s": now - start}
        history.append(record)
        if progress is not None:
            progress.update(step, loss=record["loss"], lr=lr, tok_s=round(record["tokens_per_s"]))
        ray.train.report(record)
        window.update(loss=0.0, steps=0, start=now)

    budget_s = 60 * train.max_minutes if train.max_minutes is not None else None
    time_fraction_1 = torch.zeros(1, dtype=torch.float64)
    model.train()
    step, lr = 0, train.lr
    while step < train.num_steps and time_fraction_1.item() < 1.0:
        if budget_s is not None:  # every rank must use the same LR and stop together: rank 0's clock decides
            time_fraction_1.fill_((time.monotonic() - start) / budget_s)
            dist.broadcast(time_fraction_1, src=0)
        lr = lr_at(step, train, time_fraction_1.item())
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs_BT, labels_BT = sample_windows(train_data, rng, train.batch_size, train.seq_len)
        loss = causal_lm_loss(model, inputs_BT, labels_BT)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        step += 1
        window["loss"] += loss.item()
        window["steps"] += 1
        if step % train.log_every == 0:
            log_window(step, lr)
    if window["steps"]:
        log_window(step, lr)
    stopped_early = step < train.num_steps
    if stopped_early and rank == 0:
        print(f"[train {cfg.name}] time budget train.max_minutes={train.max_minutes} reached at step {step} "
              f"of {train.num_steps}", flush=True)
    train_seconds = time.monotonic() - start

    base_model = model.module if hasattr(model, "module") else model
    heldout = distributed_heldout_loss(base_model, heldout_data, train, rank, world_size)
    final = {"step": step, "train_seconds": train_seconds,
             "stopped_early": float(stopped_early), **heldout}
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            base_model.save_pretrained(tmp, safe_serialization=True)
            Path(tmp, HISTORY_FILE).write_text(json.dumps({"history": history, "final": final}, indent=1))
            ray.train.report(final, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    else:
        ray.train.report(final)


# ---------------------------------------------------------------- driver


def run_trainer(cfg: TargetJobConfig, tokenizer_dir: Path, vocab: Vocab) -> Path:
    """Tokenize, train with TorchTrainer, copy the final checkpoint into a staging dir; returns that dir."""
    train = cfg.train
    needed = train.num_workers * train.cpus_per_worker
    available = ray.cluster_resources().get("CPU", 0)
    if available < needed:
        raise RuntimeError(
            f"train.num_workers={train.num_workers} x train.cpus_per_worker={train.cpus_per_worker} needs {needed} "
            f"CPUs but the Ray cluster has {available:g}; lower them with overrides, e.g. train.num_workers=1"
        )
    start = time.monotonic()
    train_data = train_stream(cfg, tokenizer_dir, vocab)
    heldout_data = heldout_streams(cfg, tokenizer_dir, vocab)
    print(f"[data] {len(train_data):,} train tokens ({train_data.num_targets:,} learned), held-out "
          f"{ {k: v.num_targets for k, v in heldout_data.items()} } in {time.monotonic() - start:.1f}s", flush=True)

    storage = resolve_path(train.storage_path) if train.storage_path else eyas_home() / "ray_results"
    run_name = f"train_target-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": to_dict(cfg),
            "vocab": vocab,
            "train_stream": ray.put(train_data),
            "heldout_streams": {kind: ray.put(stream) for kind, stream in heldout_data.items()},
        },
        scaling_config=ScalingConfig(num_workers=train.num_workers, use_gpu=False,
                                     resources_per_worker={"CPU": train.cpus_per_worker}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=run_name, storage_path=str(storage)),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"training {cfg.name} finished without a checkpoint (see the worker logs above)")
    staging = target_dir(cfg.name).with_name(f".{cfg.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    result.checkpoint.to_directory(str(staging))
    shutil.rmtree(storage / run_name, ignore_errors=True)  # the weights now live in staging
    return staging


def build(cfg: TargetJobConfig, force: bool = False) -> Path:
    """Build ``$EYAS_HOME/targets/<name>`` (or reuse it); returns the directory."""
    out = target_dir(cfg.name)
    if (out / META_FILE).is_file() and not force:
        meta = json.loads((out / META_FILE).read_text())
        changed = sorted(k for k, v in flatten(cfg).items() if flatten(meta.get("config", {})).get(k) != v)
        note = f" (config differs in {changed}: rebuild with --force)" if changed else ""
        print(f"[{cfg.name}] reusing {out}, heldout_loss={meta.get('heldout_loss')}{note}", flush=True)
        return out

    build_start = time.monotonic()
    tokenizer_dir = prepare_tokenizer(cfg)
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = tokenizer_vocab(tokenizer_dir)
    init_ray(preload_allocator=True)
    with track.start_run(cfg.experiment, run_name=cfg.name, params=flatten(cfg),
                         tags={"eyas.kind": "draft" if cfg.tokenizer_from else "target"}) as run:
        track.log_params_flat({"vocab_size": vocab.size, "tokenizer_dir": str(tokenizer_dir)})
        staging = run_trainer(cfg, tokenizer_dir, vocab)
        record = json.loads((staging / HISTORY_FILE).read_text())
        for row in record["history"]:
            track.log_metrics({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        final = record["final"]
        track.log_metrics(final, step=int(final["step"]))

        save_tokenizer(tokenizer, staging)  # also keeps the chat template in tokenizer_config.json
        samples = greedy_samples(staging, sample_prompts(cfg, tokenizer_dir), cfg.sample_tokens) \
            if cfg.num_samples else []
        for sample in samples:
            print(f"----- prompt\n{sample['prompt']}----- greedy continuation\n{sample['continuation']}\n", flush=True)
        meta = {
            "name": cfg.name,
            "kind": "draft" if cfg.tokenizer_from else "target",
            "config": to_dict(cfg),
            "vocab_size": vocab.size,
            "num_parameters": num_parameters(staging),
            "tokenizer_from": cfg.tokenizer_from,
            "tokenizer_sha256": sha256_file(staging / "tokenizer.json"),
            "heldout_loss": final["heldout_loss"],
            **{k: v for k, v in final.items() if k.startswith("heldout_loss_")},
            "steps": final["step"],
            "stopped_early": bool(final["stopped_early"]),
            "train_seconds": final["train_seconds"],
            "build_seconds": time.monotonic() - build_start,
            "mlflow_run_id": run.info.run_id,
            "python": sys.version.split()[0],
            "samples": samples,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        track.log_metrics({"build_seconds": meta["build_seconds"], "num_parameters": meta["num_parameters"]})
        track.log_dict(meta, META_FILE)
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.replace(out)
    print(f"[{cfg.name}] built {out} in {meta['build_seconds']:.0f}s: heldout_loss={meta['heldout_loss']:.4f} "
          f"({meta['num_parameters']:,} parameters, {meta['steps']} steps)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = job_argparser(__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if the target directory is complete")
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required, e.g. --config jobs/configs/target-tiny.yaml")
    build(load_job_config(TargetJobConfig, args), force=args.force)
    return 0


if __name__ == "__main__":
    # Run through the importable module, not __main__: Ray workers must import train_loop_per_worker and the
    # config classes by name (cloudpickle would ship __main__'s classes by value, without their module globals).
    from jobs.train_target import main as importable_main

    raise SystemExit(importable_main())
