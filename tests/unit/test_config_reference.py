"""The configuration reference (docs/configuration.md) is generated from the config dataclasses and must match them."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
config_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_reference)


def test_reference_page_matches_the_dataclasses():
    assert config_reference.PAGE.is_file(), "run `python docs/config_reference.py --write`"
    assert config_reference.PAGE.read_text() == config_reference.reference(), (
        "docs/configuration.md is stale: run `python docs/config_reference.py --write`")


def test_every_section_lists_fields():
    text = config_reference.reference()
    for title, _ in config_reference.SECTIONS:
        assert f"## {title}" in text
    assert "| `num_nodes` | int or None | `None` |" in text  # SpecConfig fields, typed, with defaults
