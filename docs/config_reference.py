"""The configuration reference, docs/configuration.md, generated from the config dataclasses themselves.

    python docs/config_reference.py            print the reference (Markdown)
    python docs/config_reference.py --write    rewrite docs/configuration.md

A docs tool, not a job: it reads the configs of the library and of every app (jobs/, tune/, serving/), which the
apps themselves never import from each other. tests/unit/test_config_reference.py fails when the page and the
dataclasses drift apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import typing
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "configuration.md"
HEADER = """# Configuration reference

Generated from the config dataclasses by `python docs/config_reference.py --write`; edit the dataclasses (a field's
trailing comment is its meaning here), not this page. Every YAML file is an instance of one of these classes, and
every key takes a dotted override on the command line (`train.lr=3e-4`, type-checked; an unknown key is an error).
"""

# (YAML file family, "module:Class") in the order the reference shows them
SECTIONS = (
    ("`spec:` section (jobs.generate --config, jobs.bench --spec, tune.sweep output, serving)", "eyas.methods:SpecConfig"),
    ("jobs/configs/target-*.yaml, draft-*.yaml (jobs.train_target)", "eyas.train.target_lm:TargetJobConfig"),
    ("jobs/configs/data-*.yaml (jobs.generate_data)", "eyas.train.config:DataConfig"),
    ("jobs/configs/<drafter>-*.yaml (jobs.train_drafter)", "eyas.train.config:TrainConfig"),
    ("drafter.config for eagle1", "eyas.drafters.eagle1:Eagle1Config"),
    ("drafter.config for eagle3", "eyas.drafters.eagle3:Eagle3Config"),
    ("drafter.config for dflash", "eyas.drafters.dflash:DFlashConfig"),
    ("drafter.config for dspark", "eyas.drafters.dspark:DSparkConfig"),
    ("drafter.config for dflash2", "eyas.drafters.dflash2:DFlash2Config"),
    ("drafter.config for medusa", "eyas.drafters.medusa:MedusaConfig"),
    ("drafter.config for eagle3.1 (eagle3's fields; fc_norm and norm_output default to true)",
     "eyas.drafters.eagle3:Eagle31Config"),
    ("drafter.config for peagle", "eyas.drafters.peagle:PEagleConfig"),
    ("tune/configs/*.yaml (tune.sweep)", "tune.config:SweepConfig"),
    ("serving/configs/*.yaml: applications[].args", "eyas_ray.serve_config:ServeArgs"),
    ("serving/configs/*.yaml: deployments[].user_config (changed in place)", "eyas_ray.serve_config:LiveSettings"),
)


def load(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def field_comments(cls) -> dict[str, str]:
    """Trailing ``# comments`` on the field lines of a dataclass body and of the dataclasses it extends (a subclass's
    own comment wins)."""
    comments: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for line in source.splitlines():
            match = re.match(r"\s+(\w+)\s*:\s*[^#]*#\s*(.+)$", line)
            if match:
                comments[match.group(1)] = match.group(2).strip()
    return comments


def type_name(tp) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", None) or str(tp)
    return str(text).replace("typing.", "").replace("NoneType", "None").replace(" | ", " or ")


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    return f"`{value!r}`"


def table(cls, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows, nested = [], []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        tp = hints.get(field.name, field.type)
        if dataclasses.is_dataclass(tp):
            nested.append((prefix + field.name + ".", tp))
            continue
        rows.append(f"| `{prefix}{field.name}` | {type_name(tp)} | {default_text(field)} | "
                    f"{comments.get(field.name, '').replace('|', '/')} |")
    for sub_prefix, sub_cls in nested:
        rows += table(sub_cls, sub_prefix)
    return rows


def reference() -> str:
    lines = [HEADER]
    for title, spec in SECTIONS:
        cls = load(spec)
        lines += [f"## {title}", "", f"`{spec.replace(':', '.')}`", "", "| key | type | default | meaning |",
                  "|---|---|---|---|", *table(cls), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    if args.write:
        temp = PAGE.with_name(PAGE.name + ".tmp")
        temp.write_text(reference())
        temp.replace(PAGE)  # atomic: a failed run never leaves half a page
        print(f"wrote {PAGE}")
    else:
        print(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
