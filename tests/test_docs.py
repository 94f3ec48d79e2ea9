"""The documentation's own rules: README.md stays short and opens with the fresh-machine commands, the summary
tables stay readable (short cells), DESIGN-NOTES.md stays a map and an index of docs/, no document points
outside the repository, and every relative link resolves."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
MAX_CELL = 160
LINKED_DOCS = ["README.md", "BENCHMARKS.md", "DESIGN-NOTES.md", "RELIABILITY.md", "DEVELOPERS.md"]
SKIP_DIRS = {".venv", ".git", "node_modules", "build", "dist", "__pycache__"}


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if marker:
            if fence is None:
                fence = marker.group(1)[0] * len(marker.group(1))
            elif marker.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            out.append((n, line))
    return out


def _code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks, in order."""
    return [m.group(2) for m in re.finditer(r"^(`{3,})[^\n]*\n(.*?)^\1\s*$", text, re.M | re.S)]


def _cells(row: str) -> list[str]:
    """The cells of a table row, split at unescaped pipes (as GitHub does, code spans included)."""
    body = row.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def _tables(text: str) -> list[list[tuple[int, list[str]]]]:
    """Every markdown table outside code blocks: a list of (line number, cells) per row."""
    tables: list[list[tuple[int, list[str]]]] = []
    last = None
    for n, line in _prose(text):
        if not line.lstrip().startswith("|"):
            continue
        if last is None or n != last + 1:
            tables.append([])
        tables[-1].append((n, _cells(line)))
        last = n
    return tables


def _long_cells(table: list[tuple[int, list[str]]]) -> list[str]:
    return [f"line {n}: {len(c)} characters: {c[:80]}..." for n, r in table for c in r if len(c) > MAX_CELL]


def test_readme_is_short_and_opens_with_the_fresh_machine_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, f"README.md has {len(text.splitlines())} lines (at most 150)"
    blocks = _code_blocks(text)
    assert len(blocks) >= 2
    demo, tests = (b.strip() for b in blocks[:2])
    # the first block sets up a fresh machine and runs the demo; the second, the same set-up and the tests
    assert "\n" not in demo and demo.startswith("python3 -m venv .venv && ") and demo.endswith("fspec demo")
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if " -m pytest " in ln]
    assert len(ci) == 1 and tests.endswith(ci[0].strip())  # the command .ci/run runs as the README's
    assert demo.rsplit(" && ", 1)[0] == tests.rsplit(" && ", 1)[0]  # one set-up for both


def test_benchmarks_summary_table_has_short_cells():
    tables = _tables((ROOT / "BENCHMARKS.md").read_text())
    assert tables, "BENCHMARKS.md: no table"
    summary = tables[0]
    assert [c.lower() for c in summary[0][1]] == ["what", "target", "measured", "status"], summary[0][1]
    assert len(summary) > 5
    assert _long_cells(summary) == []


def test_reliability_tables_have_short_cells():
    tables = _tables((ROOT / "RELIABILITY.md").read_text())
    assert len(tables) >= 3
    assert [cell for table in tables for cell in _long_cells(table)] == []


def test_design_notes_is_the_map_and_an_index_of_docs():
    text = (ROOT / "DESIGN-NOTES.md").read_text()
    assert len(text.splitlines()) <= 120, f"DESIGN-NOTES.md has {len(text.splitlines())} lines (at most 120)"
    assert "## Layout (the map)" in text
    tree = next((b for b in _code_blocks(text) if b.startswith("fspec/")), None)
    assert tree is not None, "DESIGN-NOTES.md: no layout tree (a code block starting with fspec/)"
    rooms = ("core/", "ops/", "models/", "heads/", "draft.py", "compile/", "serve/", "train/", "kernels/")
    assert [r for r in rooms if r not in tree] == []
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert {"core.md", "ops-and-kernels.md", "models.md", "draft-and-compile.md", "serve.md"} <= set(docs)
    assert [d for d in docs if f"(docs/{d})" not in text] == []  # every room's notes linked from the index


def _markdown_files() -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".md")]
    return sorted(found)


def test_no_document_points_outside_the_repository():
    files = _markdown_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "core.md" in files
    outside = re.compile(r"\.\./shared|COMPILE-FACTS\.md|(?<![\w-])DESIGN\.md|/work/")
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {m.group(0)}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for m in outside.finditer(line)
    ]
    assert hits == []


LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def _links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and link definition outside code."""
    out = []
    for n, line in _prose(text):
        line = re.sub(r"(`+).*?\1", "", line)  # code spans
        out += [(n, m.group(1)) for m in LINK.finditer(line)]
        d = DEFINITION.match(line)
        if d:
            out.append((n, d.group(1)))
    return out


def _is_relative(target: str) -> bool:
    return not (re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith(("#", "//")))


def test_every_relative_link_resolves():
    files = [ROOT / name for name in LINKED_DOCS] + sorted((ROOT / "docs").glob("*.md"))
    assert all(p.exists() for p in files), [str(p) for p in files if not p.exists()]
    broken = []
    for p in files:
        for n, target in _links(p.read_text()):
            if not _is_relative(target):
                continue
            path = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if not path:
                continue
            resolved = ROOT / path.lstrip("/") if path.startswith("/") else p.parent / path
            if not resolved.exists():
                broken.append(f"{p.relative_to(ROOT)}:{n}: {target}")
    assert broken == []


def test_the_helpers_read_tables_links_and_code_as_github_renders_them():
    md = "a\n\n| x | `a \\| b` |\n|---|---|\n\n```\n| not | a table |\n[no](link)\n```\n"
    md += "[y](docs/z.md#h) `[c](d)`\n"
    assert [[cells for _, cells in t] for t in _tables(md)] == [[["x", "`a \\| b`"], ["---", "---"]]]
    assert _links(md) == [(10, "docs/z.md#h")]
    assert _code_blocks(md) == ["| not | a table |\n[no](link)\n"]
    assert not _is_relative("https://x.org/a") and not _is_relative("#anchor") and _is_relative("a/b.md")
