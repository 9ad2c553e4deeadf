"""Typed configuration: frozen dataclasses, YAML <-> dataclass, dotted overrides.

Every component owns a frozen dataclass that validates itself in ``__post_init__`` and raises ``ValueError``
naming the field. A YAML file is an instance of such a dataclass (nested sections are nested dataclasses), never a
second schema. ``section.key=value`` overrides are parsed with YAML rules and type-checked; an unknown key is an
error that lists the known ones.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A user mistake in a config file or override: the message says which key and why.

    ``field`` is the key the message blames. A dataclass names its own fields (``block_size``, or ``dflash.block_size``
    in its own words); ``from_dict`` rewrites that to the path the user typed (``drafter.config.block_size``)."""

    def __init__(self, message: str, field: str | None = None, located: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.located = located


def eyas_home() -> Path:
    """Where built artifacts live: ``targets/<name>/``, ``drafters/<name>/``, ``data/`` (DESIGN.md)."""
    return Path(os.environ.get("EYAS_HOME", Path.home() / ".cache" / "eyas")).expanduser()


def resolve_path(path: str | os.PathLike) -> Path:
    """Expand ``~``, environment variables and a leading ``$EYAS_HOME``."""
    text = os.path.expandvars(str(path))
    if "$EYAS_HOME" in text or "${EYAS_HOME}" in text:  # EYAS_HOME unset: use the default
        text = text.replace("${EYAS_HOME}", str(eyas_home())).replace("$EYAS_HOME", str(eyas_home()))
    return Path(text).expanduser()


def require(condition: bool, field: str, value: Any, why: str) -> None:
    """Raise ConfigError naming the field and the bad value unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{field}={value!r}: {why}", field)


def located(err: ConfigError, prefix: str, field_names) -> ConfigError:
    """``err`` with the field it blames renamed to ``prefix`` + the field's own name, when that names one of
    ``field_names`` (a dataclass's fields): the YAML path the user typed. Other errors pass unchanged."""
    if not prefix or err.field is None or err.located:
        return err
    leaf = err.field.rsplit(".", 1)[-1]
    if leaf not in field_names:
        return err
    message = str(err).replace(err.field, prefix + leaf, 1)
    own_prefix = err.field[:-len(leaf)]  # "tree." in "tree.top_k": the dataclass's name for its other fields too
    if own_prefix:
        for name in field_names:
            message = message.replace(own_prefix + name + "=", prefix + name + "=")
    return ConfigError(message, prefix + leaf, located=True)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check (and gently coerce int->float, list->tuple) a YAML value against a dataclass field type."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise ConfigError(f"{where}: null is not allowed here (expected {getattr(tp, '__name__', tp)})")
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}={value!r}: must be one of {list(choices)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r}: expected a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected true or false")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected a string")
        return str(value)
    return value


def from_dict(cls: type[C], data: dict[str, Any], prefix: str = "") -> C:
    """Build dataclass ``cls`` from a mapping; unknown keys are errors that list the known ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {[prefix + k for k in unknown]} for {cls.__name__}; known keys: {sorted(fields)}"
        )
    kwargs = {name: _coerce(value, hints[name], prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{cls.__name__}: {err}") from None
    except ConfigError as err:  # the dataclass's own check: name the key as the user typed it
        raise located(err, prefix, fields) from None


def to_dict(config: Any) -> dict[str, Any]:
    """Dataclass -> plain dict (tuples become lists) that YAML can write and ``from_dict`` reads back."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(config)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 3e-4, ...}``: the flat view MLflow params and Tune search spaces use."""
    out: dict[str, Any] = {}
    for key, value in to_dict(config).items() if dataclasses.is_dataclass(config) else config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def as_number(value: Any) -> Any:
    """A string that spells a float (``5e-3``, which YAML 1.1 leaves a string) as that float; anything else as is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_scalar(raw: str) -> Any:
    """YAML rules, except that ``5e-3`` is a number."""
    return as_number(yaml.safe_load(raw))


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a raw mapping (values parsed as YAML). Types are checked later."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {key!r} is not a section")
        node[keys[-1]] = parse_scalar(raw)
    return data


def read_yaml_mapping(path: str | os.PathLike | None) -> dict[str, Any]:
    """The top-level mapping of a YAML config file ({} for no file); a clear error when it is missing or not one."""
    if path is None:
        return {}
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a mapping")
    return data


def load_config(cls: type[C], path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """Read YAML ``path`` (or start from defaults), apply dotted overrides, validate as ``cls``."""
    data = apply_overrides(read_yaml_mapping(path), list(overrides))
    try:
        return from_dict(cls, data)
    except ConfigError as err:
        where = f" in {path}" if path else ""
        raise ConfigError(f"{err}{where}") from None


def save_config(config: Any, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def replace(config: C, **changes: Any) -> C:
    """``dataclasses.replace`` that re-validates."""
    return dataclasses.replace(config, **changes)
