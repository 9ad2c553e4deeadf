"""The README's configuration reference is generated from the config dataclasses and must match them."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
config_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_reference)


def test_readme_reference_matches_the_dataclasses():
    readme = config_reference.README.read_text()
    assert config_reference.START in readme, "README lacks the generated configuration reference"
    assert config_reference.rewrite(readme) == readme, (
        "README's configuration reference is stale: run `python docs/config_reference.py --write`")


def test_every_section_lists_fields():
    text = config_reference.reference()
    for title, _ in config_reference.SECTIONS:
        assert f"#### {title}" in text
    assert "| `num_nodes` | int or None | `None` |" in text  # SpecConfig fields, typed, with defaults
