"""eyas.config: typed YAML -> dataclass, unknown keys and bad types refused, dotted overrides, and errors that name
the YAML path the user typed."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from eyas.config import (ConfigError, apply_overrides, as_number, flatten, from_dict, load_config, require, to_dict)


@dataclass(frozen=True)
class Block:
    block_size: int = 4
    decay: float = 1.0

    def __post_init__(self) -> None:
        require(self.block_size >= 2, "dflash.block_size", self.block_size, "must be >= 2")  # its own name for it


@dataclass(frozen=True)
class Section:
    type: str = "dflash"
    config: Block = field(default_factory=Block)
    taps: tuple[int, ...] = (1, 2)


@dataclass(frozen=True)
class Top:
    name: str = "x"
    drafter: Section = field(default_factory=Section)
    lr: float = 1e-3


def test_round_trip_and_coercion():
    top = from_dict(Top, {"name": "a", "drafter": {"config": {"block_size": 8, "decay": 2}, "taps": [3]}, "lr": 1})
    assert top == Top("a", Section("dflash", Block(8, 2.0), (3,)), 1.0)
    assert from_dict(Top, to_dict(top)) == top
    assert flatten(top) == {"name": "a", "drafter.type": "dflash", "drafter.config.block_size": 8,
                            "drafter.config.decay": 2.0, "drafter.taps": [3], "lr": 1.0}


@pytest.mark.parametrize("data, message", [
    ({"bogus": 1}, r"unknown key\(s\) \['bogus'\] for Top"),
    ({"drafter": {"config": {"blocksize": 8}}}, r"unknown key\(s\) \['drafter.config.blocksize'\]"),
    ({"lr": "fast"}, r"lr='fast': expected a number"),
    ({"drafter": {"config": {"block_size": 2.5}}}, r"drafter.config.block_size=2.5: expected an integer"),
    ({"drafter": {"taps": 3}}, r"drafter.taps: expected a list"),
    ({"drafter": "dflash"}, r"drafter: expected a mapping for section Section"),
    ({"name": None}, r"name: null is not allowed"),
    # the dataclass calls it dflash.block_size; the user typed drafter.config.block_size
    ({"drafter": {"config": {"block_size": 1}}}, r"^drafter.config.block_size=1: must be >= 2$"),
])
def test_errors_name_the_yaml_path(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Top, data)


def test_overrides_are_parsed_and_checked(tmp_path):
    path = tmp_path / "top.yaml"
    path.write_text("name: a\ndrafter:\n  config:\n    block_size: 8\n")
    top = load_config(Top, path, ["lr=5e-3", "drafter.config.decay=0.5", "drafter.taps=[4, 5]"])
    assert top.lr == 5e-3 and top.drafter.config == Block(8, 0.5) and top.drafter.taps == (4, 5)
    with pytest.raises(ConfigError, match=r"drafter.config.block_size=1: must be >= 2 in .*top.yaml"):
        load_config(Top, path, ["drafter.config.block_size=1"])
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        apply_overrides({}, ["lr"])
    with pytest.raises(ConfigError, match="'name' is not a section"):
        apply_overrides({"name": "a"}, ["name.x=1"])
    with pytest.raises(ConfigError, match="config file .* does not exist"):
        load_config(Top, tmp_path / "missing.yaml")
    assert as_number("5e-3") == 5e-3 and as_number("abc") == "abc" and as_number(3) == 3
