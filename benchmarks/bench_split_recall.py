"""Recall and false positives of batch-split detection (TFM105 / TFM111) on annotated code.

A line whose comment says `batch-split` is a batch cut into one piece per device (the ground
truth, written by hand in the fixtures; the golden `*.before.py` / `*.after.py` pairs, whose
text the fix goldens fix, are left out). It counts as found when a TFM105 or TFM111 finding is
on that line, or names it ("split at line 14", "sliced at lines 5, 6"). Every other TFM105 /
TFM111 finding, in the annotated files and in the files given with `--clean` (modern code, the
negative fixtures, the examples), is a false positive.

    .venv/bin/python benchmarks/bench_split_recall.py            # the default sets below
    .venv/bin/python benchmarks/bench_split_recall.py FILE... --clean DIR...
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tfmigrate.engine.config import Config  # noqa: E402
from tfmigrate.engine.runner import check_text  # noqa: E402

CODES = ("TFM105", "TFM111")
MARK = re.compile(r"#.*\bbatch-split\b")
NAMED = re.compile(r"(?:split|sliced) at lines? (\d+(?:, \d+)*)")
ANNOTATED = ["fixtures/TFM105", "fixtures/TFM111"]
CLEAN = ["fixtures/negative", "examples"]


def python_files(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for name in paths:
        path = ROOT / name if not Path(name).is_absolute() else Path(name)
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [p for p in found if not p.name.endswith((".before.py", ".after.py"))]


def findings(path: Path) -> list:
    config = Config(root=ROOT, select=list(CODES))
    return check_text(path.read_text(encoding="utf-8"), config)


def lines_named(finding) -> set[int]:
    """The line of a finding and the split lines its message names."""
    named = {finding.start.row}
    for group in NAMED.findall(finding.message):
        named |= {int(n) for n in group.split(", ")}
    return named


def survey(annotated: list[Path], clean: list[Path]) -> dict:
    result = {"splits": 0, "found": 0, "missed": [], "false": []}
    for path in annotated:
        text = path.read_text(encoding="utf-8")
        marked = {n for n, line in enumerate(text.splitlines(), start=1) if MARK.search(line)}
        reported = findings(path)
        covered = set().union(*(lines_named(f) for f in reported)) if reported else set()
        result["splits"] += len(marked)
        result["found"] += len(marked & covered)
        result["missed"] += [f"{path.relative_to(ROOT)}:{n}" for n in sorted(marked - covered)]
        result["false"] += [f"{path.relative_to(ROOT)}:{f.start.row} {f.code}" for f in reported
                            if not lines_named(f) & marked]
    for path in clean:
        result["false"] += [f"{path.relative_to(ROOT)}:{f.start.row} {f.code}" for f in findings(path)]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("annotated", nargs="*", default=ANNOTATED)
    parser.add_argument("--clean", nargs="*", default=CLEAN)
    args = parser.parse_args(argv)
    annotated, clean = python_files(args.annotated), python_files(args.clean)
    result = survey(annotated, clean)
    recall = result["found"] / result["splits"] if result["splits"] else 1.0
    print(f"annotated files: {len(annotated)}; batch splits: {result['splits']}; "
          f"found: {result['found']} (recall {recall:.0%})")
    print(f"clean files: {len(clean)}; false positives: {len(result['false'])}")
    for line in result["missed"]:
        print(f"  missed {line}")
    for line in result["false"]:
        print(f"  false positive {line}")
    return 0 if not result["missed"] and not result["false"] else 1


if __name__ == "__main__":
    sys.exit(main())
