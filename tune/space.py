"""A sweep's search space: each searched key is a list of values or a range (``{low, high, step?, log?}``);
``search.space`` in a tune/configs/*.yaml file maps keys to them (tune/config.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from eyas.config import ConfigError, as_number, require


@dataclass(frozen=True)
class Param:
    """One searched key: an explicit list of ``values``, or a range ``low..high`` (``step``, ``log`` optional)."""

    key: str
    values: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False

    @property
    def is_int(self) -> bool:
        return all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high)) and \
            (self.step is None or isinstance(self.step, int))

    @property
    def enumerable(self) -> bool:
        return self.values is not None or self.is_int or self.step is not None

    def grid_values(self) -> list[Any]:
        """Every value a grid visits (ranges: low, low + step, ... <= high; ints step 1 by default)."""
        if self.values is not None:
            return list(self.values)
        if not self.enumerable:
            raise ConfigError(f"search.space.{self.key}: a continuous range {{low: {self.low}, high: {self.high}}} "
                              "cannot be gridded; give a step, a list of values, or search.algorithm=optuna")
        step = self.step if self.step is not None else 1
        count = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
        values = [self.low + i * step for i in range(count)]
        return values if self.is_int else [round(v, 12) for v in values]

    def check_values(self) -> list[Any]:
        """Values that validation builds: all of a list or a small int range, else the range's two ends."""
        if self.values is not None:
            return list(self.values)
        if self.is_int and (self.high - self.low) // (self.step or 1) < 64:
            return self.grid_values()
        return [self.low, self.high]


def parse_param(key: str, raw: Any) -> Param:
    where = f"search.space.{key}"
    if isinstance(raw, (list, tuple)):
        raw = [as_number(v) for v in raw]
        require(len(raw) > 0, where, raw, "empty list: give at least one value")
        require(len(set(map(repr, raw))) == len(raw), where, raw, "values repeat")
        return Param(key, values=tuple(raw))
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - {"low", "high", "step", "log"})
        require(not unknown, where, raw, f"unknown range key(s) {unknown}; a range has low, high, step, log")
        require("low" in raw and "high" in raw, where, raw, "a range needs both low and high")
        low, high, step = (as_number(raw.get(name)) for name in ("low", "high", "step"))
        log = raw.get("log", False)
        for name, value in (("low", low), ("high", high), ("step", step)):
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            require(is_number or (name == "step" and value is None), f"{where}.{name}", value, "expected a number")
        require(isinstance(log, bool), f"{where}.log", log, "expected true or false")
        require(low <= high, where, raw, f"empty range: low={low} is above high={high}")
        require(step is None or step > 0, f"{where}.step", step, "must be > 0")
        require(not log or low > 0, f"{where}.low", low, "a log range needs low > 0")
        require(not (log and step is not None), where, raw, "a range is either log or stepped, not both")
        return Param(key, low=low, high=high, step=step, log=log)
    raise ConfigError(f"{where}={raw!r}: expected a list of values or a range {{low: ..., high: ...}}")
