"""What a bench reads besides the target: its prompts (``--suite`` / ``--prompts-file``) and the ``--spec`` YAMLs
that set its methods; jobs.bench and jobs.bench_peers read them alike."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import yaml

from eyas import datasets
from eyas.config import ConfigError, resolve_path


def prompts_file(path: Path) -> list[str]:
    """A --prompts-file's prompts: one {"prompt": ...} JSON object a line (blank lines skipped)."""
    if not path.is_file():
        raise ConfigError(f"--prompts-file {path}: file does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f'{path}:{n}: expected one JSON object {{"prompt": "..."}} per line') from None
    if not prompts:
        raise ConfigError(f"--prompts-file {path}: no prompts (one {{\"prompt\": ...}} a line)")
    return prompts


def load_prompts(args: argparse.Namespace, tokenizer=None, max_prompt_tokens: int | None = None
                 ) -> dict[str, list[str]]:
    if args.prompts_file:
        prompts = prompts_file(Path(args.prompts_file))
        return {"custom": prompts[: args.num_prompts] if args.num_prompts else prompts}
    try:
        return {s: datasets.suite_prompts(s, args.num_prompts, tokenizer, max_prompt_tokens)
                for s in datasets.bench_suites(args.suite, tokenizer)}
    except datasets.DatasetError as err:  # a registry that cannot be reached: the message says what to do
        raise ConfigError(str(err)) from None


def spec_overrides(files: Sequence[str]) -> dict[str, dict]:
    """method -> the ``spec:`` section of each --spec YAML (a later file for the same method wins)."""
    overrides: dict[str, dict] = {}
    for file in files:
        path = resolve_path(file)
        if not path.is_file():
            raise ConfigError(f"--spec {file}: no such file")
        spec_data = (yaml.safe_load(path.read_text()) or {}).get("spec") or {}
        if "method" not in spec_data:
            raise ConfigError(f"--spec {file}: the spec section names no method")
        overrides[spec_data["method"]] = spec_data
    return overrides
