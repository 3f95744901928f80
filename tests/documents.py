"""The documents the tests hold to the code: the README and every page of the documentation site.

docs/incoming/ is left out: it holds notes other branches write for the pages, outside the site
(mkdocs.yml `exclude_docs`) until they are folded in. CHANGELOG.md is history: the files it names
may have moved since, as it says."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
INCOMING = DOCS / "incoming"


def documents() -> list[Path]:
    """README.md and docs/**/*.md, in a stable order."""
    pages = [p for p in DOCS.rglob("*.md") if INCOMING not in p.parents]
    return [ROOT / "README.md", *sorted(pages)]
