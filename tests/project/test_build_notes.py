"""BUILD_NOTES.md is a decision record, not a diary (issue 40 item 6).

* at most 1,200 lines;
* no Markdown heading names a session (no per-session sections, no "Suite time (session N)");
* every Python module of `tf_twobranch/`, `experiments/` and `benchmarks/` (but `__init__.py` files and
  `benchmarks/results/`) appears in its "Layout" section as its repository-relative path in backticks.
"""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTES = ROOT / "BUILD_NOTES.md"
MODULE_FOLDERS = ("tf_twobranch", "experiments", "benchmarks")
MAX_LINES = 1200

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_BACKTICKED = re.compile(r"`([^`\n]+)`")


def _lines() -> list[str]:
    return NOTES.read_text(encoding="utf-8").splitlines()


def headings(lines: list[str]) -> list[tuple[int, int, str]]:
    """(line index, level, text) of every Markdown heading outside fenced code blocks."""
    found, in_fence = [], False
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if match:
            found.append((i, len(match.group(1)), match.group(2)))
    return found


def layout_section(lines: list[str]) -> str:
    """The text of the level-2 heading that names "Layout", up to the next heading of level 1 or 2
    (its sub-headings and sub-bullets included)."""
    marks = headings(lines)
    starts = [(i, level) for i, level, text in marks if level <= 2 and re.search(r"\blayout\b", text, re.I)]
    assert starts, "BUILD_NOTES.md has no '## Layout' section"
    start, level = starts[0]
    end = next((i for i, lv, _ in marks if i > start and lv <= level), len(lines))
    return "\n".join(lines[start:end])


def package_modules() -> list[str]:
    modules = []
    for folder in MODULE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if path.name == "__init__.py" or relative.parts[:2] == ("benchmarks", "results"):
                continue
            if "__pycache__" in relative.parts:
                continue
            modules.append(relative.as_posix())
    return sorted(modules)


def test_build_notes_has_at_most_1200_lines():
    count = len(_lines())
    assert count <= MAX_LINES, f"BUILD_NOTES.md has {count} lines (at most {MAX_LINES}): update in place, don't append"


def test_no_heading_names_a_session():
    bad = [f"line {i + 1}: {'#' * level} {text}" for i, level, text in headings(_lines())
           if re.search(r"\bsessions?\b", text, re.I) or "suite time (session" in text.lower()]
    assert not bad, ("headings of BUILD_NOTES.md name a session (git history holds the story; "
                     "update the decision's section instead):\n" + "\n".join(bad))


def test_every_module_is_in_the_layout():
    named = set(_BACKTICKED.findall(layout_section(_lines())))
    modules = package_modules()
    assert modules, "no modules found: wrong repository root?"
    missing = [m for m in modules if m not in named]
    assert not missing, ("modules missing from BUILD_NOTES.md's Layout section (add one line each, the "
                         "repository-relative path in backticks):\n" + "\n".join(missing))


def test_the_checks_see_what_they_should():
    lines = ["# Notes", "## Layout", "- `a/b.py` — x", "### More", "- `a/c.py`", "## Session 3", "```",
             "## Session 4 (in a code block)", "```", "- `a/d.py`"]
    assert [t for _, _, t in headings(lines)] == ["Notes", "Layout", "More", "Session 3"]
    section = layout_section(lines)
    assert "`a/b.py`" in section and "`a/c.py`" in section and "a/d.py" not in section
