"""How many tower loops (or queue pipelines, ...) `fix` rewrites, on any folder of code.

For every Python file under the folders given: the findings of one rule `check` finds (TFM101
tower loops unless `--code` says another: TFM303 for queue batching calls), how many of them
the unsafe fix rewrites, how many it refuses and why (a histogram of the reasons, with line
numbers and names taken out so that like counts with like), and whether every fixed file still
parses and compiles. Fixture and example folders are walked too (the project's own `exclude`
setting is not applied).

    .venv/bin/python benchmarks/bench_fix_coverage.py fixtures/ examples/ [--target tf2] [--code TFM303]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tfmigrate.engine.config import Config  # noqa: E402
from tfmigrate.engine.fixer import fix_text  # noqa: E402
from tfmigrate.engine.runner import check_text  # noqa: E402

WHAT = {"TFM101": "tower loops", "TFM201": "multi_gpu_model calls", "TFM303": "queue batching calls"}


def reason_key(reason: str) -> str:
    """A refusal reason without what varies from file to file (line numbers, quoted names)."""
    reason = re.sub(r"^line \d+: ", "", reason)
    reason = re.sub(r"\b(lines?) \d+(?:(?:, | and )\d+)*", r"\1 N", reason)
    reason = re.sub(r"`[^`]*`", "`…`", reason)
    return re.sub(r"\[[^\]]*\]", "[…]", reason)


def refusal(finding) -> str:
    """Why ``finding`` has no fix: its refusal, else the reason its message gives (`no automatic
    fix: ...`, or `no automatic fix here: ...` where the fix is another rule's)."""
    reason = re.search(r"no automatic fix(?: here)?: (.*)", finding.message, re.S)
    return finding.refusal or (reason.group(1).rstrip(")") if reason else "") or "no reason given"


def survey(paths: list[Path], config: Config, code: str) -> dict:
    totals = {"files": 0, "unreadable": 0, "loops": 0, "rewritten": 0, "broken": [], "reasons": Counter()}
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
            findings = [f for f in check_text(text, config, path=str(path)) if f.code == code]
        except Exception:  # Python 2, syntax errors, bad bytes: not this benchmark's subject
            totals["unreadable"] += 1
            continue
        totals["files"] += 1
        totals["loops"] += len(findings)
        totals["rewritten"] += sum(f.fixable for f in findings)
        totals["reasons"].update(reason_key(refusal(f)) for f in findings if not f.fixable)
        if any(f.fixable for f in findings):
            fixed = fix_text(text, config, unsafe=True, path=str(path))
            try:
                compile(fixed, str(path), "exec")
            except SyntaxError:
                totals["broken"].append(str(path))
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--target", default="compat", choices=["compat", "tf2"])
    parser.add_argument("--code", default="TFM101", help="the rule whose findings are counted")
    args = parser.parse_args()
    config = Config(root=ROOT, target=args.target)
    paths = sorted(p for folder in args.folders for p in ([folder] if folder.is_file() else folder.rglob("*.py")))
    totals = survey(paths, config, args.code)
    loops, rewritten = totals["loops"], totals["rewritten"]
    share = f"{rewritten / loops:.0%}" if loops else "n/a"
    print(f"files: {totals['files']} read ({totals['unreadable']} unreadable)")
    print(f"{WHAT.get(args.code, 'findings')} ({args.code}): {loops}; rewritten: {rewritten} ({share}); refused: {loops - rewritten}")
    print(f"fixed files that do not compile: {len(totals['broken'])}")
    for path in totals["broken"]:
        print(f"  {path}")
    if totals["reasons"]:
        print("refusal reasons:")
        width = max(len(str(n)) for n in totals["reasons"].values())
        for reason, count in totals["reasons"].most_common():
            print(f"  {count:>{width}}  {'#' * min(count, 40)}  {reason}")


if __name__ == "__main__":
    main()
