"""Runs at the same time: two `check`s sharing one cache, a `check` during a `fix --write`.

Both must give the results a lone, uncached run gives, and leave a cache that a later run can
use and that agrees with ``--no-cache``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOWER = "import tensorflow as tf\n\nfor i in range(2):\n    with tf.device('/gpu:%d' % i):\n        out = model(x)\n"
ITERATOR = "import tensorflow as tf\n\n# file {n}\nit = ds{n}.make_one_shot_iterator()\n"
BROKEN = "import tensorflow as tf\nwith tf.device('/gpu:0')\n    x = 1\n"


def _tree(folder: Path, files: int = 60) -> None:
    folder.mkdir()
    for n in range(files):
        text = [TOWER, ITERATOR.format(n=n), "x = 1\n"][n % 3]
        (folder / f"m{n:02}.py").write_text(text)
    (folder / "zz_broken.py").write_text(BROKEN)


def _start(args: list[str], folder: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "TFMIGRATE_CACHE_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "tfmigrate", *args], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


def _check(folder: Path, cache: Path, *extra: str) -> tuple[int, list, str]:
    code, out, err = _finish(_start(["check", "--format", "json", "--jobs", "2", *extra, "."], folder, cache))
    assert "Traceback" not in err
    return code, json.loads(out), err


def _key(findings: list) -> list:
    return sorted((f["filename"], f["code"], f["location"]["row"], f["location"]["column"]) for f in findings)


def _cache_entries_are_whole(cache: Path) -> int:
    """How many files the cache holds results for; every pack reads back whole."""
    count = 0
    for pack in cache.rglob("packs/*.json"):
        count += len(json.loads(pack.read_text())["files"])  # never half a pack
    assert not [p for p in cache.rglob("*.tmp")]
    return count


def test_two_checks_share_the_cache(tmp_path):
    folder, cache = tmp_path / "repo", tmp_path / "cache"
    _tree(folder)
    baseline = _check(folder, tmp_path / "unused", "--no-cache")
    first = _start(["check", "--format", "json", "--jobs", "2", "."], folder, cache)
    second = _start(["check", "--format", "json", "--jobs", "2", "."], folder, cache)
    for code, out, err in (_finish(first), _finish(second)):
        assert (code, _key(json.loads(out))) == (baseline[0], _key(baseline[1])), err
        assert err == baseline[2]
    assert _cache_entries_are_whole(cache) >= 60
    cached = _check(folder, cache)  # from the cache the two runs filled
    assert (cached[0], _key(cached[1]), cached[2]) == (baseline[0], _key(baseline[1]), baseline[2])


def test_check_during_fix_write(tmp_path):
    folder, cache = tmp_path / "repo", tmp_path / "cache"
    _tree(folder, files=90)
    before = _check(folder, tmp_path / "unused", "--no-cache")
    fixing = _start(["fix", "--write", "--jobs", "2", "."], folder, cache)
    code, findings, err = _check(folder, cache)  # while the fix runs
    fix_code, _, fix_err = _finish(fixing)
    assert fix_code == 2 and "zz_broken.py: error: syntax error" in fix_err  # the broken file, only
    assert code == 2 and err.count("error:") == 1
    # Each file was seen whole, before or after its fix: its TFM305 finding or none.
    iterator_files = {str(Path(".") / f"m{n:02}.py") for n in range(90) if n % 3 == 1}
    seen = {(Path(f["filename"]).name, f["code"]) for f in findings}
    assert {name for name, c in seen if c == "TFM101"} == {f"m{n:02}.py" for n in range(90) if n % 3 == 0}
    assert {name for name, c in seen if c == "TFM305"} <= {Path(p).name for p in iterator_files}
    # Afterwards the shared cache agrees with a run without it.
    after = _check(folder, tmp_path / "unused", "--no-cache")
    cached = _check(folder, cache)
    assert (cached[0], _key(cached[1])) == (after[0], _key(after[1]))
    assert not [f for f in after[1] if f["code"] == "TFM305"]
    assert len(after[1]) == len(before[1]) - 30
    _cache_entries_are_whole(cache)
