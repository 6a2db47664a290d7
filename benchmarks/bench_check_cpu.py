"""CPU time of `check`'s work in one process, for comparing two checkouts of tfmigrate.

Generates the realistic corpus (`realistic_corpus.py`, 400 files by default) in a temporary
folder and times ``check_file`` over it in this process (no start-up, no worker pool), the
minimum of ``--repeat`` runs, with the part spent in LibCST's parse. Run it from each checkout
(its own ``tfmigrate`` and rules are the ones timed), alternating, on a quiet machine: the
figures move by about 5% from run to run.

Usage: python benchmarks/bench_check_cpu.py [--files 400] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(CHECKOUT / "benchmarks"))


def _own_rules() -> None:
    """This checkout's rules, whatever an installed tfmigrate maps `tfmigrate.rules` to."""
    spec = importlib.util.spec_from_file_location(
        "tfmigrate.rules", CHECKOUT / "rules" / "__init__.py", submodule_search_locations=[str(CHECKOUT / "rules")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["tfmigrate.rules"] = package
    spec.loader.exec_module(package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    _own_rules()
    import realistic_corpus
    from tfmigrate.engine import source
    from tfmigrate.engine.config import Config
    from tfmigrate.engine.registry import all_rules
    from tfmigrate.engine.runner import check_file

    parse_seconds = [0.0]
    parse = source.libcst_parse

    def timed_parse(text):
        start = time.process_time()
        try:
            return parse(text)
        finally:
            parse_seconds[0] += time.process_time() - start

    source.libcst_parse = timed_parse
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        realistic_corpus.generate(root, args.files, seed=1)
        files = sorted(str(p) for p in root.rglob("*.py"))
        config = Config(root=root)
        all_rules()
        check_file(files[0], config)  # imports what the rules import
        runs = []
        for _ in range(args.repeat):
            parse_seconds[0] = 0.0
            start = time.process_time()
            for path in files:
                check_file(path, config)
            runs.append((time.process_time() - start, parse_seconds[0]))
    total, parsing = min(runs)
    print(f"{CHECKOUT}: {len(files)} files, check {total:.2f} s CPU (min of {args.repeat}; spread "
          f"{max(r[0] for r in runs) - total:.2f}), of which LibCST's parse {parsing:.2f} s; "
          f"{total * 1000 / len(files):.1f} ms a file")


if __name__ == "__main__":
    main()
