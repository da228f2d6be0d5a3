"""scripts/ is a shelf of measurement tools: at most 8 files, each with a row in the index
(docs/benchmarks-tools.md), and nothing outside BENCHMARKS.md's history names a script that is not
there; serve_bench.py refuses too few images in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "docs" / "benchmarks-tools.md"
SCRIPT_REFERENCE = re.compile(r"scripts/([\w.-]+\.(?:py|sh))\b")


def index_rows() -> tuple[set[str], set[str]]:
    """The scripts the index's first table names (kept) and those its "Removed scripts" table names."""
    kept, removed = set(), set()
    table = kept
    for line in INDEX.read_text().splitlines():
        if line.startswith("## Removed scripts"):
            table = removed
        match = re.match(r"\| `([\w.-]+)` \|", line)
        if match:
            table.add(match.group(1))
    return kept, removed


def shelf() -> set[str]:
    return {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()}


def test_every_script_has_a_row_in_the_index():
    kept, removed = index_rows()
    assert len(shelf()) <= 8
    assert shelf() == kept
    assert not removed & kept


def test_no_file_names_a_script_that_is_not_there():
    """README, docs, Makefile, CI, the package, the tests and the scripts themselves (BENCHMARKS.md's
    history names removed scripts beside the commit that ran them)."""
    sources = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run"]
    for folder, pattern in (("docs", "*.md"), ("lantern_rt", "*.py"), ("tests", "*.py"), ("scripts", "*")):
        sources += sorted((ROOT / folder).rglob(pattern))
    missing = {
        f"{path.relative_to(ROOT)}: scripts/{name}"
        for path in sources
        if path.is_file()
        for name in SCRIPT_REFERENCE.findall(path.read_text(errors="replace"))
        if name not in shelf()
    }
    assert not missing, sorted(missing)


def test_serve_bench_refuses_fewer_images_than_its_classes():
    """It spreads --images over 8 classes: fewer would ask ``lantern generate`` for 0 per class."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "serve_bench.py"), "--images", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--images must be at least 8" in run.stderr
    assert "Traceback" not in run.stderr
