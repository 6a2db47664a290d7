"""`fix --write` leaves a file it cannot fix byte-for-byte unchanged, and says why."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tfmigrate.cli.main import app

FIXABLE = "import tensorflow as tf\nit = dataset.make_one_shot_iterator()\n"  # a safe TFM305 fix

BAD = {
    "python2.py": (FIXABLE + "print 'hello'\n").encode(),
    "syntax_error.py": (FIXABLE + "def broken(:\n    pass\n").encode(),
    "undecodable.py": FIXABLE.encode() + b"name = '\xff\xfe'\n",
}


def _invoke(args):
    return CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_file_is_left_unchanged(tmp_path: Path, name: str):
    path = tmp_path / name
    path.write_bytes(BAD[name])
    result = _invoke(["fix", "--write", "--unsafe-fixes", str(path)])
    assert result.exit_code == 2
    assert name in result.stderr and "error" in result.stderr
    assert path.read_bytes() == BAD[name]
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left behind


def test_read_only_file_is_left_unchanged(tmp_path: Path, monkeypatch):
    path = tmp_path / "read_only.py"
    path.write_bytes(FIXABLE.encode())
    # Tests run as root, which can write anything: simulate what os.access says for 0o444.
    monkeypatch.setattr("tfmigrate.engine.fixer.os.access", lambda p, mode: False)
    result = _invoke(["fix", "--write", str(path)])
    assert result.exit_code == 2 and "read-only" in result.stderr
    assert path.read_bytes() == FIXABLE.encode()


def test_bad_file_does_not_stop_the_others(tmp_path: Path):
    bad = tmp_path / "a_bad.py"
    bad.write_bytes(BAD["syntax_error.py"])
    good = tmp_path / "b_good.py"
    good.write_text(FIXABLE)
    result = _invoke(["fix", "--write", str(bad), str(good)])
    assert result.exit_code == 2
    assert bad.read_bytes() == BAD["syntax_error.py"]
    assert "tf.compat.v1.data.make_one_shot_iterator(dataset)" in good.read_text()


# --- issue 16: symlink loops, deep nesting, crashed workers ------------------------------------
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

FIXED = "import tensorflow as tf\nit = tf.compat.v1.data.make_one_shot_iterator(dataset)\n"
# Python refuses more than 200 nested brackets; LibCST's parser crashed (SIGSEGV) past ~1,500.
DEEP_BRACKETS = FIXABLE + "x = " + "(" * 3000 + "1" + ")" * 3000 + "\n"
# Python accepts it (one BoolOp); LibCST nests it 20,000 deep: it crashed on an 8 MB stack.
DEEP_AND = FIXABLE + "x = " + " and ".join(["a"] * 20000) + "\n"
DEEP_UNARY = FIXABLE + "x = " + "-" * 10000 + "1\n"  # Python's own parser gives up (MemoryError)


def _tfmigrate(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tfmigrate", *args], capture_output=True, text=True, cwd=cwd,
        env={**os.environ, "TFMIGRATE_CACHE_DIR": str(cwd / ".cache")},
    )


@pytest.mark.skipif(sys.platform == "win32", reason="symlinks")
def test_symlink_loops_in_a_folder_are_skipped_with_one_line(tmp_path: Path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "good.py").write_text(FIXABLE)
    (tree / "self.py").symlink_to("self.py")  # points at itself
    (tree / "a.py").symlink_to("b.py")  # a loop of two
    (tree / "b.py").symlink_to("a.py")
    (tree / "sub").mkdir()
    (tree / "sub" / "loop").symlink_to("loop")
    (tree / "pyproject.toml").write_text('[tool.tfmigrate]\nexclude = ["*_pb2.py"]\n')  # resolves paths
    check = _tfmigrate(["check", "tree"], tmp_path)
    assert check.returncode == 1 and "Traceback" not in check.stderr
    assert "tree/good.py:2:6: TFM305" in check.stdout and "1 file checked" in check.stdout
    for name in ("tree/self.py", "tree/a.py", "tree/b.py", "tree/sub/loop"):
        [line] = [line for line in check.stderr.splitlines() if line.startswith(name + ":")]
        assert line == f"{name}: warning: Too many levels of symbolic links (a symlink loop); skipped"
    fix = _tfmigrate(["fix", "--write", "tree"], tmp_path)
    assert fix.returncode == 0 and (tree / "good.py").read_text() == FIXED, fix.stderr
    assert "4 files skipped (4 symlink loop)" in fix.stderr


@pytest.mark.parametrize("text, reason", [
    (DEEP_BRACKETS, "syntax error at line 3, column 205: too many nested parentheses"),
    (DEEP_AND, "too deeply nested to check"),
    (DEEP_UNARY, "too deeply nested: Python's own parser gives up (MemoryError)"),
])
def test_a_deeply_nested_file_is_one_error_not_a_crash(tmp_path: Path, text: str, reason: str):
    (tmp_path / "deep.py").write_text(text)
    (tmp_path / "good.py").write_text(FIXABLE)
    check = _tfmigrate(["check", "deep.py", "good.py"], tmp_path)
    assert check.returncode == 2, check.stderr  # was: SIGSEGV, exit 139, no message
    assert f"deep.py: error: {reason}" in check.stderr and "good.py:2:6: TFM305" in check.stdout
    fix = _tfmigrate(["fix", "--write", "deep.py", "good.py"], tmp_path)
    assert fix.returncode == 2 and f"deep.py: error: {reason}" in fix.stderr
    assert (tmp_path / "deep.py").read_text() == text and (tmp_path / "good.py").read_text() == FIXED


def test_deeply_nested_files_among_many_others_in_worker_processes(tmp_path: Path):
    """Among 200 files checked by worker processes (was: BrokenProcessPool, nothing fixed)."""
    for n in range(200):
        (tmp_path / f"m{n:03}.py").write_text(FIXABLE)
    (tmp_path / "m050.py").write_text(DEEP_BRACKETS)
    (tmp_path / "m150.py").write_text(DEEP_AND)
    check = _tfmigrate(["check", "--jobs", "2", "--no-cache", "-q", "."], tmp_path)
    assert check.returncode == 2 and check.stdout.count("TFM305") == 198, check.stderr
    fix = _tfmigrate(["fix", "--write", "--jobs", "2", "."], tmp_path)
    assert fix.returncode == 2, fix.stderr
    assert "Fixed 198 findings in 198 files." in fix.stderr
    assert "2 files skipped (1 syntax error, 1 too deeply nested)" in fix.stderr
    assert sum((tmp_path / f"m{n:03}.py").read_text() == FIXED for n in range(200)) == 198


def _crash_on_marker(monkeypatch) -> None:
    """Make a file holding CRASH_ME kill the process that analyses it (a segfault, as LibCST's
    parser did on deep nesting); worker processes are forked, so they inherit this."""
    from tfmigrate.engine import fixer, runner

    original = runner.analyze_source

    def analyze(source, config):
        if "CRASH_ME" in source.text:
            import faulthandler

            faulthandler.disable()  # pytest's, inherited: no traceback dump in the test's output
            os.kill(os.getpid(), signal.SIGSEGV)
        return original(source, config)

    monkeypatch.setattr(runner, "analyze_source", analyze)
    monkeypatch.setattr(fixer, "analyze_source", analyze)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers inherit the patch")
def test_a_crashed_worker_costs_only_its_own_file(tmp_path: Path, monkeypatch):
    _crash_on_marker(monkeypatch)
    for n in range(120):
        (tmp_path / f"m{n:03}.py").write_text(FIXABLE)
    for n in (7, 50, 51):
        (tmp_path / f"m{n:03}.py").write_text(FIXABLE + "# CRASH_ME\n")
    result = _invoke(["check", "--jobs", "2", "--no-cache", "-q", str(tmp_path)])
    assert result.exit_code == 2 and result.stdout.count("TFM305") == 117
    for n in (7, 50, 51):
        assert f"m{n:03}.py: error: the process checking it died (killed by SIGSEGV); not checked" in result.stderr
    result = _invoke(["fix", "--write", "--jobs", "2", str(tmp_path)])
    assert result.exit_code == 2
    assert "Fixed 117 findings in 117 files." in result.stderr  # the crash loses no finished file's result
    assert "3 files skipped (3 worker process crashed)" in result.stderr
    assert "m050.py: error: the process fixing it died (killed by SIGSEGV); file left untouched" in result.stderr
    assert sum((tmp_path / f"m{n:03}.py").read_text() == FIXED for n in range(120)) == 117
