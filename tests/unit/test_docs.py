"""The README and the guides in docs/ stay short, linked and true to what generates them.

- README.md is at most 300 lines, names the two commands and the four user paths, and links every guide;
- every relative link (and #anchor) in README.md and docs/*.md points to a file (and heading) that exists, and
  every config file a command there names exists;
- the README's results table and docs/results.md are what jobs.bench_report renders from the bench JSON they name
  (regenerate: python -m jobs.bench --from ... --report docs/results.md --update-tables README.md), and docs/ keeps
  no bench JSON the results page does not cite; a peer bench page (docs/bench-peers-NAME.md) is what jobs.bench_peers
  renders from its runs' JSON (bench-peers-NAME.json, then bench-peers-NAME-*.json), a side-by-side serving page (docs/load-peers-*.md) what jobs.load_peers renders.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jobs import bench_report

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CONFIG = re.compile(r"\b((?:jobs|tune|serving)/configs/[\w./-]+\.yaml)\b")
GUIDES = ("training", "sweeps", "serving", "mlflow", "export-import", "clusters", "faults", "threads-and-dtypes",
          "findings", "results", "configuration")


def prose(path: Path) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for line in prose(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_readme_is_short_and_shows_the_commands_and_paths():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, "README.md: at most 300 lines; move the detail into a guide in docs/"
    for command in ("make test", "make demo", "make mlflow-ui", "ray job submit", "python -m jobs.train_drafter",
                    "python -m tune.sweep", "serve run serving/configs/", "python -m jobs.bench --from"):
        assert command in text, f"README.md does not show `{command}`"
    for guide in GUIDES:
        assert f"(docs/{guide}.md" in text, f"README.md does not link docs/{guide}.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{target}: no file {path}")
            elif anchor and path.suffix == ".md" and anchor not in set(anchors(path)):
                broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_config_files_exist(page):
    named = {c for c in CONFIG.findall(page.read_text()) if not Path(c).stem.isupper()}  # X.yaml: a placeholder
    missing = sorted(c for c in named if not (ROOT / c).is_file())
    assert not missing, f"{page.name} names config files that do not exist: {missing}"


def test_readme_results_table_is_the_rendered_json():
    text = README.read_text()
    blocks = bench_report.BLOCK.findall(text)
    assert blocks, "README.md has no <!-- bench-table JSON --> results block"
    assert bench_report.update_tables(text, ROOT) == text, (
        "README.md's results table differs from its bench JSON: run python -m jobs.bench --from ... "
        "--update-tables README.md")


def test_results_page_is_the_rendered_json(monkeypatch):
    monkeypatch.chdir(ROOT)  # the page names its sources from the repository root
    text = (ROOT / "docs" / "results.md").read_text()
    match = re.search(r"python -m jobs\.bench --from (\S+) --report (\S+)", text)
    assert match and match.group(2) == "docs/results.md", "docs/results.md does not say how it was generated"
    sources = match.group(1).split(",")
    assert bench_report.page(sources, "docs/results.md") == text, (
        f"docs/results.md is stale: run python -m jobs.bench --from {match.group(1)} --report docs/results.md")
    cited = {Path(s).name for s in sources}
    kept = {p.name for p in (ROOT / "docs").glob("bench-*.json") if not p.name.startswith("bench-peers-")}
    assert kept == cited, f"docs/ keeps bench JSON the results page does not cite: {sorted(kept - cited)}"


def peer_page_sources(page: Path) -> list[Path]:
    """The runs docs/bench-peers-NAME.md renders: bench-peers-NAME.json, then each bench-peers-NAME-*.json that has
    no page of its own (e.g. -spec.json, the speculative run), in name order."""
    more = [p for p in sorted(page.parent.glob(f"{page.stem}-*.json")) if not p.with_suffix(".md").is_file()]
    return [page.with_suffix(".json"), *more]


def test_peer_pages_are_the_rendered_json():
    """docs/bench-peers-*.md is what jobs.bench_peers renders from its runs' JSON (peer_page_sources), and every
    run's JSON is on a page."""
    from jobs.bench_peers_report import markdown

    pages = sorted(p for p in (ROOT / "docs").glob("bench-peers-*.md"))
    rendered: set[Path] = set()
    for page in pages:
        sources = peer_page_sources(page)
        names = ",".join(f"docs/{s.name}" for s in sources)
        assert sources[0].is_file(), f"{page.name} has no {sources[0].name}"
        assert page.read_text() == "\n".join(markdown(json.loads(s.read_text())) for s in sources), (
            f"{page.name} is stale: python -m jobs.bench_peers --from {names} --report docs/{page.name}")
        rendered.update(sources)
    for source in sorted((ROOT / "docs").glob("bench-peers-*.json")):
        assert source in rendered, f"{source.name} is on no page: name it docs/bench-peers-NAME[-RUN].json"


def test_side_by_side_serving_pages_are_the_rendered_json():
    """docs/load-peers-*.md is what jobs.load_peers renders from the JSON beside it."""
    from jobs.load_peers_report import markdown

    for source in sorted((ROOT / "docs").glob("load-peers-*.json")):
        page = source.with_suffix(".md")
        assert page.is_file(), f"{source.name} has no page: python -m jobs.load_peers --from {source} --report {page}"
        assert page.read_text() == markdown(json.loads(source.read_text())), (
            f"{page.name} is stale: python -m jobs.load_peers --from docs/{source.name} --report docs/{page.name}")
