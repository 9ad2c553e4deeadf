"""llama.cpp as a peer engine: its build, GGUF files from eyas checkpoints, and a llama-server to talk to.

    make tools-llamacpp      # builds .venv-tools/llama.cpp (bin/llama-server, bin/llama-bench, src/convert_hf_to_gguf.py)

- ``convert_to_gguf(HF_DIR, OUT.gguf, "f32"|"bf16"|"f16"|"q8_0")``: a target (any HF checkpoint eyas loads) through
  llama.cpp's own converter; ``convert_drafter_to_gguf`` does the same for an eyas EAGLE-3 or DFlash drafter exported
  in vLLM's layout (``jobs.export --to vllm``), with ``--target-model-dir`` for the target's tokenizer and sizes.
  ``python -m jobs.export --to gguf`` does both steps for a trained drafter.
- ``with llama_server(model_gguf, threads, draft_gguf, eagle3_spec_args(3)) as base_url:`` runs llama-server on a
  free local port, waits for /health and always stops it (jobs.peers.server.running). ``complete`` sends one greedy request by token ids, so
  every engine sees the very prompt tokens eyas decodes, and returns the tokens and llama-server's own ``timings``.
- Per-position acceptance: with ``LLAMA_TRACE=1`` llama-server logs ``accepted A/N draft tokens`` once per verify
  step; ``draft_steps`` reads them from the server's log and ``accepted_per_position`` counts, per draft position,
  the steps that accepted it (jobs.peers.acceptance's definition, vLLM's).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eyas.config import ConfigError
from eyas.threads import OPENMP_KNOBS
from jobs.peers.server import running

REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMACPP_DIR_ENV = "EYAS_LLAMACPP_DIR"  # a llama.cpp build laid out as `make tools-llamacpp` lays it out
GGUF_OUTTYPES = ("f32", "bf16", "f16", "q8_0")
ACCEPT_LINE = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")
DEFAULT_CTX_SIZE = 4096
NGRAM_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # no draft model


def llamacpp_dir() -> Path:
    return Path(os.environ.get(LLAMACPP_DIR_ENV) or REPO_ROOT / ".venv-tools" / "llama.cpp")


def _tool(relative: str) -> Path:
    path = llamacpp_dir() / relative
    if not path.is_file():
        raise ConfigError(f"llama.cpp: {path} does not exist. Build llama.cpp with `make tools-llamacpp` (about 7 "
                          f"minutes on 2 cores), or point {LLAMACPP_DIR_ENV} at a directory laid out like its "
                          ".venv-tools/llama.cpp (bin/llama-server, src/convert_hf_to_gguf.py, src/gguf-py, pylib)")
    return path


def llama_server_bin() -> Path:
    return _tool("bin/llama-server")


def llama_bench_bin() -> Path:
    return _tool("bin/llama-bench")


def converter_script() -> Path:
    return _tool("src/convert_hf_to_gguf.py")


def convert_command(model_dir: str | Path, out_file: str | Path, outtype: str,
                    target_model_dir: str | Path | None = None, python: str = sys.executable) -> list[str]:
    """llama.cpp's converter on an HF directory; ``target_model_dir`` for a drafter (EAGLE-3, DFlash) that takes
    its tokenizer and the target's sizes from its target."""
    if outtype not in GGUF_OUTTYPES:
        raise ConfigError(f"GGUF outtype {outtype!r}: must be one of {GGUF_OUTTYPES}")
    command = [python, str(converter_script()), str(model_dir), "--outfile", str(out_file), "--outtype", outtype]
    if target_model_dir is not None:
        command += ["--target-model-dir", str(target_model_dir)]
    return command


def converter_env() -> dict[str, str]:
    """The environment the converter runs in: the gguf package bundled with the llama.cpp source comes first, so
    the converter and its gguf library are always the same version, then pylib/ (sentencepiece, which the converter
    imports for every Llama)."""
    env = dict(os.environ)
    first = (str(llamacpp_dir() / "src" / "gguf-py"), str(llamacpp_dir() / "pylib"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, env.get("PYTHONPATH")) if p)
    return env


def convert_to_gguf(model_dir: str | Path, out_file: str | Path, outtype: str = "f32",
                    target_model_dir: str | Path | None = None) -> Path:
    """Write ``out_file`` (a GGUF) from the HF checkpoint in ``model_dir``; raises with the converter's last lines
    when it refuses the checkpoint."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"{model_dir}: no config.json; give an HF checkpoint directory")
    out = Path(out_file)
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(convert_command(model_dir, out, outtype, target_model_dir), env=converter_env(),
                          capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise ConfigError(f"convert_hf_to_gguf.py failed on {model_dir} (exit {done.returncode}):\n{tail}")
    return out


def convert_drafter_to_gguf(export_dir: str | Path, target_dir: str | Path, out_file: str | Path,
                            outtype: str = "f32") -> Path:
    """A drafter exported in vLLM's layout (``jobs.export --to vllm``) to GGUF, read beside its target."""
    return convert_to_gguf(export_dir, out_file, outtype, target_model_dir=target_dir)


def eagle3_spec_args(num_draft: int) -> tuple[str, ...]:
    """llama-server's EAGLE-3 chain of ``num_draft`` tokens. p-min 0: every step drafts the whole chain, as eyas's
    chain does, so per-position acceptance compares like with like."""
    if num_draft < 1:
        raise ConfigError(f"num_draft {num_draft}: must be >= 1")
    return ("--spec-type", "draft-eagle3", "--spec-draft-n-max", str(num_draft), "--spec-draft-p-min", "0")


def dflash_spec_args(num_draft: int) -> tuple[str, ...]:
    """llama-server's DFlash: one block of up to ``num_draft`` tokens a draft step (clamped to the drafter's block
    size), every position drafted (p-min 0)."""
    if num_draft < 1:
        raise ConfigError(f"num_draft {num_draft}: must be >= 1")
    return ("--spec-type", "draft-dflash", "--spec-draft-n-max", str(num_draft), "--spec-draft-p-min", "0")


def ngram_spec_args(size_n: int = 3, size_m: int = 4, spec_type: str = "ngram-simple") -> tuple[str, ...]:
    """llama-server's draftless speculation of ``spec_type`` (one of NGRAM_SPEC_TYPES, its docs/speculative.md):
    look up the last ``size_n`` tokens in the history, draft up to ``size_m``.

    - ngram-simple, ngram-map-k, ngram-map-k4v: their own ``--spec-ngram-<type>-size-n/-m`` (map-k drafts what
      followed the key, map-k4v the most frequent of four continuations);
    - ngram-mod: a rolling hash of ``size_n`` tokens (``n-match``), drafts of 1 to ``size_m`` tokens (its ``n-min``
      default of 48 would draft nothing shorter);
    - ngram-cache: its own n-gram statistics (fixed sizes), drafts of ``size_m`` (``--spec-draft-n-max``)."""
    if spec_type not in NGRAM_SPEC_TYPES:
        raise ConfigError(f"spec_type {spec_type!r}: llama-server's draftless types are {NGRAM_SPEC_TYPES}")
    if size_n < 1 or size_m < 1:
        raise ConfigError(f"size_n {size_n}, size_m {size_m}: must be >= 1")
    if spec_type == "ngram-mod":
        sizes = ("--spec-ngram-mod-n-match", str(size_n), "--spec-ngram-mod-n-min", "1",
                 "--spec-ngram-mod-n-max", str(size_m))
    elif spec_type == "ngram-cache":
        sizes = ("--spec-draft-n-max", str(size_m))
    else:
        flag = f"--spec-{spec_type}"
        sizes = (f"{flag}-size-n", str(size_n), f"{flag}-size-m", str(size_m))
    return ("--spec-type", spec_type, *sizes)


def spec_type(spec_args: tuple[str, ...]) -> str | None:
    """The ``--spec-type`` value in ``spec_args`` (None: none given)."""
    args = list(spec_args)
    return args[args.index("--spec-type") + 1] if "--spec-type" in args[:-1] else None


def server_command(model_gguf: str | Path, threads: int, port: int, draft_gguf: str | Path | None = None,
                   spec_args: tuple[str, ...] = (), ctx_size: int = DEFAULT_CTX_SIZE, slots: int = 1) -> list[str]:
    """``slots`` sequences decoded together (one by default), ``ctx_size`` tokens of context each, ``threads`` for
    decode and prefill (the draft model too), bound to localhost."""
    if threads < 1 or slots < 1:
        raise ConfigError(f"threads {threads}, slots {slots}: must be >= 1")
    if draft_gguf is None and any(t.startswith("draft-") for t in (spec_type(spec_args) or "").split(",")):
        raise ConfigError(f"spec_args {' '.join(spec_args)}: a draft-model speculation needs draft_gguf")
    command = [str(llama_server_bin()), "-m", str(model_gguf), "-t", str(threads), "-tb", str(threads),
               "-np", str(slots), "-c", str(ctx_size * slots), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if draft_gguf is not None:
        command += ["-md", str(draft_gguf), "-td", str(threads), "-tbd", str(threads)]
    return command + list(spec_args)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(trace: bool = False, environ: dict[str, str] | None = None) -> dict[str, str]:
    """llama-server's environment: this one without the OpenMP variables that eyas.threads sets for eyas's own
    torch (OMP_WAIT_POLICY=PASSIVE), so the peer runs at its own defaults, as a user would run it; LLAMA_TRACE=1
    with ``trace``. The wait policy matters: ggml's threads meet at a barrier after every op. llama-bench bf16 at 2
    threads on a quiet 2-core EPYC: 93 tok/s at its default (spinning), 42 passive; with another process busy
    the other way round (3.9 against 65), so time it on a quiet machine."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in OPENMP_KNOBS}
    if trace:
        env["LLAMA_TRACE"] = "1"
    return env


@contextmanager
def llama_server(model_gguf: str | Path, threads: int, draft_gguf: str | Path | None = None,
                 spec_args: tuple[str, ...] = (), port: int | None = None, log_path: str | Path | None = None,
                 trace: bool = False, timeout_s: float = 300.0, slots: int = 1,
                 ctx_size: int = DEFAULT_CTX_SIZE) -> Iterator[str]:
    """A llama-server for the ``with`` block; yields its base URL once /health answers and always stops it. Its
    output goes to ``log_path`` (default: a temporary file); ``trace`` logs each verify step's acceptance there."""
    port = port or free_port()
    command = server_command(model_gguf, threads, port, draft_gguf, spec_args, ctx_size, slots)
    with running(command, server_env(trace), f"http://127.0.0.1:{port}", "llama-server", timeout_s,
                 Path(log_path) if log_path else None) as base_url:
        yield base_url


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    timings: dict       # llama-server's: prompt_n, prompt_ms, predicted_n, predicted_ms, draft_n, draft_n_accepted
    wall_s: float       # the HTTP request, client side

    @property
    def server_s(self) -> float:
        """Prefill plus decode as the server timed them (no HTTP): what eyas's in-process timing covers."""
        return (self.timings["prompt_ms"] + self.timings["predicted_ms"]) / 1000.0


def completion_request(prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One greedy request by token ids; nothing cached from a previous request, so each one prefills its prompt."""
    return {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def complete(base_url: str, prompt_ids: list[int], max_new_tokens: int, timeout_s: float = 600.0) -> Completion:
    """POST /completion on a fresh connection (llama-server drops a second request on a kept-alive one)."""
    body = json.dumps(completion_request(prompt_ids, max_new_tokens)).encode()
    request = urllib.request.Request(f"{base_url}/completion", data=body,
                                     headers={"Content-Type": "application/json", "Connection": "close"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer = json.loads(response.read())
    wall_s = time.perf_counter() - start
    return Completion(token_ids=[int(t) for t in answer["tokens"]], timings=answer["timings"], wall_s=wall_s)


def draft_steps(log_text: str) -> list[tuple[int, int]]:
    """(accepted, drafted) per verify step, from a llama-server log written with ``LLAMA_TRACE=1``."""
    return [(int(a), int(n)) for a, n in ACCEPT_LINE.findall(log_text)]


def accepted_per_position(steps: list[tuple[int, int]]) -> list[int]:
    """Per draft position k (0-based), the steps whose k-th drafted token was accepted: the unconditional counts
    that jobs.peers.acceptance (vLLM's definition) divides by the number of steps."""
    width = max((drafted for _, drafted in steps), default=0)
    return [sum(accepted > k for accepted, _ in steps) for k in range(width)]
