"""The documents hold together: README.md stays short, relative links lead to files that exist, and every
Markdown file the code names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150

# Documents whose relative links are checked; one that does not exist (yet) is skipped.
LINKED_DOCS = ["README.md", "services/README.md", "services/ARCHITECTURE.md",
               *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "services" / "docs").glob("*.md"))]

# Where the code is searched for Markdown files it names.
CODE_DIRS = ["services", "tests", "protos", "deploy"]
CODE_SUFFIXES = {".py", ".c", ".h", ".sh"}

_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_MD_TOKEN = re.compile(r"(?<![\w./-])([\w][\w./-]*\.md)\b(?![\w-])")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (their brackets are code, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _relative_links(doc: Path) -> list[str]:
    links = []
    for target in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s), mailto: and in-page anchors
        links.append(target)
    return links


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}"


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_relative_links_resolve(doc):
    path = ROOT / doc
    if not path.exists():
        pytest.skip(f"{doc} does not exist yet")
    broken = []
    for target in _relative_links(path):
        file_part = target.split("#", 1)[0]
        if file_part and not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{doc}: links to missing files: {broken}"


def _code_files():
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in CODE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                yield path


def test_markdown_files_named_by_the_code_exist():
    missing = []
    for path in _code_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for name in _MD_TOKEN.findall(line):
                bases = (ROOT, path.parent, ROOT / "services")
                if not any((base / name).exists() for base in bases):
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    assert not missing, "Markdown files named in the code that do not exist:\n" + "\n".join(missing)
