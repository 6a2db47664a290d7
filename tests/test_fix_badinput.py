"""`fix --write` leaves a file it cannot fix byte-for-byte unchanged, and says why."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tfmigrate.cli import app

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
    monkeypatch.setattr("tfmigrate.fixer.os.access", lambda p, mode: False)
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
