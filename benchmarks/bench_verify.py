"""Train every fixture pair side by side with `tfmigrate verify` and print one table.

Pairs: the hand-migrated references (fixtures/programs/legacy_* vs migrated_*), and every
issue-5 tower program against its automatic migration (`tfmigrate fix --write --unsafe-fixes`
into a temporary folder). For each: verdict, max relative loss difference per step, final
losses, examples/s of both and the NEW/OLD ratio. On a machine with K GPUs verify uses them;
otherwise K logical CPU devices.

    .venv/bin/python benchmarks/bench_verify.py [--steps 40] [--devices 2] [--warmup 5] [--only general_]

`--only TEXT` keeps the pairs whose name contains TEXT; with it, the median NEW/OLD ratio and
its range are printed too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "fixtures" / "programs"
HAND_PAIRS = [("legacy_towers", "migrated_towers"), ("legacy_keras_mgpu", "migrated_keras_strategy")]
AUTO = [
    "legacy_towers", "towers_cifar", "towers_feed_dict", "towers_assign_to_device", "towers_layers",
    "parallel_make_parallel", "parallel_inline_split", "towers_dataset_shard", "towers_keras",
    "towers_variables",
    # The general rewrite (issue 14): every fixtures/programs/general_*.py, programs in the style
    # of public TF1 code (one the rewrite refuses shows as "error": nothing to compare).
    *sorted(path.stem for path in PROGRAMS.glob("general_*.py")),
]
TF2 = ["towers_keras", "towers_variables"]


def tfmigrate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfmigrate", *args], cwd=cwd, capture_output=True, text=True)


def verify(old: Path, new: Path, report: Path, args) -> dict:
    tfmigrate("verify", str(old), str(new), "--steps", str(args.steps), "--devices", str(args.devices),
              "--warmup", str(args.warmup), "--json", str(report), "-q", cwd=ROOT)
    return json.loads(report.read_text()) if report.exists() else {"verdict": "error"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default="", help="keep the pairs whose name contains this text")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tfmigrate-bench-verify-"))
    rows = []
    for old, new in [(o, n) for o, n in HAND_PAIRS if args.only in o]:
        rows.append((f"{old} -> {new} (by hand)", verify(PROGRAMS / f"{old}.py", PROGRAMS / f"{new}.py",
                                                         work / f"{new}.json", args)))
    for name in [n for n in AUTO if args.only in n]:
        migrated = work / f"{name}.py"
        shutil.copy(PROGRAMS / f"{name}.py", migrated)
        tfmigrate("fix", "--write", "--unsafe-fixes", migrated.name, cwd=work)
        rows.append((f"{name} -> tfmigrate fix", verify(PROGRAMS / f"{name}.py", migrated, work / f"{name}.json", args)))
    for name in [n for n in TF2 if args.only in n]:
        migrated = work / f"{name}_tf2.py"
        shutil.copy(PROGRAMS / f"{name}.py", migrated)
        tfmigrate("fix", "--write", "--unsafe-fixes", "--target", "tf2", migrated.name, cwd=work)
        rows.append((f"{name} -> tfmigrate fix --target tf2",
                     verify(PROGRAMS / f"{name}.py", migrated, work / f"{name}_tf2.json", args)))

    first = next((r for _, r in rows if r.get("devices")), {})
    devices = first.get("devices", {})
    print(f"devices: {devices.get('count')} x {devices.get('kind')}; TensorFlow "
          f"{first.get('versions', {}).get('tensorflow')}; {args.steps} steps, {args.warmup} warm-up")
    header = f"{'pair':58} {'verdict':8} {'max rel diff':>12} {'final OLD':>10} {'final NEW':>10} {'OLD ex/s':>10} {'NEW ex/s':>10} {'NEW/OLD':>8}"
    print(header)
    print("-" * len(header))
    for label, report in rows:
        comparison = report.get("comparison", {})
        final = comparison.get("final") or {}
        rates = report.get("throughput") or {}
        old_rate = (rates.get("old") or {}).get("examples_per_s")
        new_rate = (rates.get("new") or {}).get("examples_per_s")
        print(f"{label:58} {report.get('verdict', '?'):8} "
              f"{comparison.get('max_rel_diff', float('nan')):12.2e} {final.get('old', float('nan')):10.5f} "
              f"{final.get('new', float('nan')):10.5f} {old_rate or 0:10.0f} {new_rate or 0:10.0f} "
              f"{rates.get('ratio') or 0:8.2f}")
    ratios = sorted((r.get("throughput") or {}).get("ratio") or 0 for _, r in rows)
    if args.only and ratios:
        middle = len(ratios) // 2
        median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
        print(f"NEW/OLD over {len(ratios)} pairs: median {median:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
