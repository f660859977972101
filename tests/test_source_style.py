"""Two habits of the project's text, read from the files (nothing run): the formatter's output is
the style (no `# fmt: skip` or `# fmt: off` anywhere in the project's Python), and the docs speak
of the library as it is, not of the rounds of work that built it."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON_FOLDERS = ("src", "tests", "benchmarks", "examples", ".ci")
FORMATTER_ESCAPE = re.compile(r"#\s*fmt:\s*(skip|off)")
HISTORY = re.compile(
    r"\b(in|this|last|next|previous|earlier) (round|session)s?\b|\bround \d|\bgrew (out of|from)\b", re.IGNORECASE
)


def python_files():
    for folder in PYTHON_FOLDERS:
        yield from (ROOT / folder).rglob("*.py")


def test_no_formatter_escapes():
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in python_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FORMATTER_ESCAPE.search(line) and path.name != "test_source_style.py"
    ]
    assert found == [], f"`# fmt: skip`/`# fmt: off` at {found}: let `ruff format` lay the code out"


def test_the_docs_do_not_speak_of_rounds_of_work():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    found = [
        f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in HISTORY.finditer(line)
    ]
    assert found == [], f"the docs speak of the work's history at {found}"
