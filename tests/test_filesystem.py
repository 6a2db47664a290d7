"""`fix --write` against the file system's faults and oddities: nothing is lost, nothing crashes.

Tests run as root, which can write anything: read-only files and folders are simulated by
making ``os.access``, ``tempfile.mkstemp`` or ``os.replace`` say no, as they would.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tfmigrate.engine.fixer
import tfmigrate.engine.source
from tfmigrate.cli.main import app
from tfmigrate.engine.source import SourceError, SourceFile, decode_source

FIXABLE = "import tensorflow as tf\nit = dataset.make_one_shot_iterator()\n"  # a safe TFM305 fix
FIXED = "import tensorflow as tf\nit = tf.compat.v1.data.make_one_shot_iterator(dataset)\n"


def fix(*args: str):
    return CliRunner().invoke(app, ["fix", "--write", *args], catch_exceptions=False)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def fixable(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(FIXABLE)
    return path


# ----------------------------------------------------------------------------- cannot write


def test_read_only_file(fixable, monkeypatch):
    monkeypatch.setattr("tfmigrate.engine.fixer.os.access", lambda path, mode: False)
    result = fix(str(fixable))
    assert result.exit_code == 2
    assert f"{fixable}: error: file is read-only; not fixed" in result.stderr
    assert "1 file skipped (1 read-only)" in result.stderr
    assert "Fixed 0 findings in 0 files." in result.stderr
    assert fixable.read_text() == FIXABLE


def test_read_only_folder(fixable, monkeypatch):
    def no_temp_files(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tfmigrate.engine.source.tempfile.mkstemp", no_temp_files)
    result = fix(str(fixable))
    assert result.exit_code == 2
    assert "could not write (Permission denied); file left untouched" in result.stderr
    assert "1 file skipped (1 could not write)" in result.stderr
    assert fixable.read_text() == FIXABLE and listing(fixable.parent) == ["train.py"]


def test_rename_refused(fixable, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr("tfmigrate.engine.source.os.replace", refuse)
    result = fix(str(fixable))
    assert result.exit_code == 2 and "could not write (Operation not permitted)" in result.stderr
    assert fixable.read_text() == FIXABLE and listing(fixable.parent) == ["train.py"]  # temp file removed


class _FullDisk:
    """A file object whose writes fail as on a full disk."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def write(self, data):
        self.handle.write(data[: len(data) // 2])  # part of it made it to the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.handle, name)


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_disk_full(fixable, monkeypatch, where):
    if where == "write":
        real_fdopen = os.fdopen
        monkeypatch.setattr("tfmigrate.engine.source.os.fdopen", lambda fd, mode: _FullDisk(real_fdopen(fd, mode)))
    else:  # some file systems only say so when the data is flushed
        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("tfmigrate.engine.source.os.fsync", full)
    result = fix(str(fixable))
    assert result.exit_code == 2 and "could not write (No space left on device)" in result.stderr
    assert fixable.read_text() == FIXABLE
    assert listing(fixable.parent) == ["train.py"]  # no temporary file left behind


# ----------------------------------------------------------------- changed under our feet


def _while_fixing(monkeypatch, action):
    """Run ``action(path)`` after the file was read and fixed in memory, before the write."""
    real = tfmigrate.engine.fixer.fix_source

    def fix_then_act(source, config, **kwargs):
        result = real(source, config, **kwargs)
        action(Path(source.path))
        return result

    monkeypatch.setattr("tfmigrate.engine.fixer.fix_source", fix_then_act)


def test_file_changed_between_read_and_write(fixable, monkeypatch):
    edited = FIXABLE + "x = 1  # the user's edit\n"
    _while_fixing(monkeypatch, lambda path: path.write_text(edited))
    result = fix(str(fixable))
    assert result.exit_code == 2
    assert "file changed while tfmigrate was working; skipped" in result.stderr
    assert "1 file skipped (1 changed on disk)" in result.stderr
    assert fixable.read_text() == edited  # the user's edit survives


def test_file_deleted_between_read_and_write(fixable, monkeypatch):
    _while_fixing(monkeypatch, lambda path: path.unlink())
    result = fix(str(fixable))
    assert result.exit_code == 2
    assert "file was deleted while tfmigrate was working; skipped" in result.stderr
    assert "1 file skipped (1 deleted on disk)" in result.stderr
    assert listing(fixable.parent) == []  # not brought back


def test_other_files_are_fixed_when_one_fails(tmp_path, monkeypatch):
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text(FIXABLE)
    monkeypatch.setattr("tfmigrate.engine.fixer.os.access", lambda path, mode: not str(path).endswith("b.py"))
    result = fix(str(tmp_path))
    assert result.exit_code == 2
    assert "Fixed 2 findings in 2 files." in result.stderr and "1 file skipped (1 read-only)" in result.stderr
    assert [(tmp_path / n).read_text() == FIXED for n in ("a.py", "b.py", "c.py")] == [True, False, True]


# ----------------------------------------------------------------- modes, owners, links


@pytest.mark.parametrize("mode", [0o755, 0o700, 0o640, 0o4755])
def test_mode_is_kept(fixable, mode):
    os.chmod(fixable, mode)
    assert fix(str(fixable)).exit_code == 0
    assert fixable.read_text() == FIXED
    assert stat.S_IMODE(os.stat(fixable).st_mode) == mode


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root can give a file away")
def test_owner_is_kept(fixable):
    os.chown(fixable, 12345, 23456)
    assert fix(str(fixable)).exit_code == 0
    info = os.stat(fixable)
    assert (info.st_uid, info.st_gid) == (12345, 23456) and fixable.read_text() == FIXED


def test_symlink_named_with_its_target_is_fixed_once(tmp_path):
    target = tmp_path / "real.py"
    target.write_text(FIXABLE)
    link = tmp_path / "link.py"
    link.symlink_to(target.name)  # a relative link
    result = fix(str(link), str(target))
    assert result.exit_code == 0 and "Fixed 1 finding in 1 file." in result.stderr
    assert link.is_symlink() and os.readlink(link) == "real.py"
    assert target.read_text() == FIXED


def test_symlink_found_in_a_folder_is_fixed_once(tmp_path):
    (tmp_path / "real.py").write_text(FIXABLE)
    (tmp_path / "a_link.py").symlink_to("real.py")
    result = fix(str(tmp_path))
    assert result.exit_code == 0 and "Fixed 1 finding in 1 file." in result.stderr
    assert (tmp_path / "a_link.py").is_symlink() and (tmp_path / "real.py").read_text() == FIXED


def test_symlink_out_of_the_given_paths_is_not_followed(tmp_path):
    """The decision (README, RELIABILITY.md): a link found in a folder we were given that
    points outside every path given is reported, not fixed; its target is not ours."""
    outside = tmp_path / "elsewhere" / "shared.py"
    outside.parent.mkdir()
    outside.write_text(FIXABLE)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "shared.py").symlink_to(outside)
    (repo / "own.py").write_text(FIXABLE)
    result = fix(str(repo))
    assert result.exit_code == 1  # the link's finding remains
    assert f"{repo / 'shared.py'}: note: symlink to {outside}, outside the paths given; not fixed" in result.stderr
    assert "1 file skipped (1 symlink outside the paths given)" in result.stderr
    assert outside.read_text() == FIXABLE and (repo / "own.py").read_text() == FIXED
    assert (repo / "shared.py").is_symlink()
    # Named explicitly, the link is the user's choice: its target is fixed.
    assert fix(str(repo / "shared.py")).exit_code == 0
    assert outside.read_text() == FIXED and (repo / "shared.py").is_symlink()


def test_dangling_symlink_is_a_one_line_error(tmp_path):
    (tmp_path / "gone.py").symlink_to(tmp_path / "nowhere.py")
    result = fix(str(tmp_path))
    assert result.exit_code == 2 and "gone.py: error: no such file" in result.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("command", [["fix", "--write"], ["check"]])
def test_fifo_named_like_a_source_file_does_not_hang(tmp_path, command):
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "ok.py").write_text(FIXABLE)
    env = {"TFMIGRATE_CACHE_DIR": str(tmp_path / ".cache")}
    result = CliRunner(env=env).invoke(app, [*command, str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 2 and "pipe.py: error: not a regular file" in result.stderr


# ------------------------------------------------------------------ stale temporary files


def test_stale_temp_files_are_removed_by_the_next_write(fixable):
    folder = fixable.parent
    stale, fresh = folder / ".tfmigrate-abc123.tmp", folder / ".tfmigrate-def456.tmp"
    stale.write_bytes(b"half a file")
    fresh.write_bytes(b"another run, writing now")
    old = time.time() - tfmigrate.engine.source.STALE_TEMP_SECONDS - 60
    os.utime(stale, (old, old))
    assert CliRunner().invoke(app, ["fix", str(fixable)]).exit_code == 1  # a preview removes nothing
    assert stale.exists()
    assert fix(str(fixable)).exit_code == 0
    assert listing(folder) == [".tfmigrate-def456.tmp", "train.py"]


# ------------------------------------------------------------------------ encodings, bytes


@pytest.mark.parametrize(
    "before, after",
    [
        pytest.param(FIXABLE.replace("\n", "\r\n").encode(), FIXED.replace("\n", "\r\n").encode(), id="crlf"),
        pytest.param(
            b"import tensorflow as tf\r\nx = 1\nit = dataset.make_one_shot_iterator()\r\n\ry = 2\n",
            b"import tensorflow as tf\r\nx = 1\nit = tf.compat.v1.data.make_one_shot_iterator(dataset)\r\n\ry = 2\n",
            id="mixed-endings",
        ),
        pytest.param(b"\xef\xbb\xbf" + FIXABLE.encode(), b"\xef\xbb\xbf" + FIXED.encode(), id="utf8-bom"),
        pytest.param(
            "#!/usr/bin/env python\n# -*- coding: latin-1 -*-\ns = 'd\u00e9j\u00e0'\nit = ds.make_one_shot_iterator()\n"
            .encode("latin-1"),
            "#!/usr/bin/env python\n# -*- coding: latin-1 -*-\nimport tensorflow as tf\n\ns = 'd\u00e9j\u00e0'\n"
            "it = tf.compat.v1.data.make_one_shot_iterator(ds)\n".encode("latin-1"),
            id="latin1-cookie",
        ),
        pytest.param(
            b"import tensorflow as tf\n\x0c\ndef f():\n\tit = ds.make_one_shot_iterator()  # tab\n\x0c\n\tif x:\n"
            b"\t\ty = '\x0c\t'\n",
            b"import tensorflow as tf\n\x0c\ndef f():\n\tit = tf.compat.v1.data.make_one_shot_iterator(ds)  # tab\n"
            b"\x0c\n\tif x:\n\t\ty = '\x0c\t'\n",
            id="form-feeds-and-tabs",
        ),
    ],
)
def test_bytes_outside_the_fix_are_kept(tmp_path, before, after):
    path = tmp_path / "a.py"
    path.write_bytes(before)
    result = fix(str(path))
    assert result.exit_code == 0, result.stderr
    assert path.read_bytes() == after
    assert fix(str(path)).exit_code == 0 and path.read_bytes() == after  # idempotent


def test_form_feed_starting_a_statement_is_not_rewritten(tmp_path):
    """LibCST 1.x drops a form feed that begins a statement's line; writing its output would
    change a line the fix never meant to touch, so the file is left alone, with the reason."""
    data = b"import tensorflow as tf\ndef f():\n    it = ds.make_one_shot_iterator()\n\x0c    return it\n"
    path = tmp_path / "a.py"
    path.write_bytes(data)
    result = fix(str(path))
    assert result.exit_code == 2
    assert "cannot rewrite this file without changing line 4 (a form feed starts it)" in result.stderr
    assert "1 file skipped (1 not reproducible by LibCST)" in result.stderr
    assert path.read_bytes() == data


def test_text_that_cannot_be_saved_in_the_files_encoding_is_refused():
    source = decode_source("a.py", "# -*- coding: latin-1 -*-\nx = 1\n".encode("latin-1"))
    with pytest.raises(SourceError, match="would not read back as iso-8859-1"):
        tfmigrate.engine.fixer._encoded(source, "# -*- coding: latin-1 -*-\nx = '\u20ac'\n")
    moved = SourceFile(path="a.py", raw=b"", text="", encoding="iso-8859-1", bom=False)
    with pytest.raises(SourceError):  # a cookie pushed below line 2 would no longer be read
        tfmigrate.engine.fixer._encoded(moved, "import tensorflow as tf\n\n# -*- coding: latin-1 -*-\nx = '\u00e9'\n")


def test_a_file_python_refuses_to_compile_is_not_fixed(tmp_path):
    """Found by the mutation fuzzer: a repeated keyword argument parses (ast.parse accepts
    it) but does not compile; the fix used to remove the duplicate along with the rest."""
    data = b"opt.minimize(loss, colocate_gradients_with_ops=True, colocate_gradients_with_ops=True)\n"
    path = tmp_path / "a.py"
    path.write_bytes(data)
    result = fix(str(path))
    assert result.exit_code == 2 and "keyword argument repeated" in result.stderr
    assert path.read_bytes() == data


def test_suppression_after_a_form_feed_in_a_string(tmp_path):
    """Line numbers were counted with str.splitlines, which also splits at form feeds: a
    suppression comment below one applied to the wrong line."""
    path = tmp_path / "a.py"
    path.write_text("import tensorflow as tf\ns = 'a\x0cb'\nit = ds.make_one_shot_iterator()  # tfmigrate: ignore\n")
    result = CliRunner().invoke(app, ["check", "--no-cache", str(path)])
    assert result.exit_code == 0, result.stdout


# --------------------------------------------------------------------------------- big files


def _big_source(size: int) -> str:
    chunk = "\n\ndef f{n}(x, y=1):\n    # a comment\n    z = [x * i for i in range(y)]\n    return {{'a': z, 'b': (x, y)}}\n"
    parts, total, n = [FIXABLE], len(FIXABLE), 0
    while total < size:
        part = chunk.format(n=n)
        parts.append(part)
        total += len(part)
        n += 1
    return "".join(parts)


def _fix_seconds(tmp_path: Path, size: int) -> float:
    path = tmp_path / f"big_{size}.py"
    text = _big_source(size)
    path.write_text(text)
    start = time.perf_counter()
    result = fix(str(path))
    elapsed = time.perf_counter() - start
    assert result.exit_code == 0, result.stderr
    assert path.read_text() == text.replace(FIXABLE, FIXED, 1)
    return elapsed


def test_big_file_time_grows_linearly(tmp_path):
    """LibCST rewrites about 15 KB a second here (a 2 MB file takes minutes, see the test
    below); doubling the size must not much more than double the time. Loose on purpose."""
    small = _fix_seconds(tmp_path, 60_000)
    large = _fix_seconds(tmp_path, 120_000)
    assert large < 4 * small + 1


@pytest.mark.skipif(not os.environ.get("TFMIGRATE_BIG_FILES"), reason="minutes: set TFMIGRATE_BIG_FILES=1")
def test_two_megabyte_file(tmp_path):
    one = _fix_seconds(tmp_path, 1_000_000)
    two = _fix_seconds(tmp_path, 2_000_000)
    print(f"1 MB: {one:.1f} s, 2 MB: {two:.1f} s", file=sys.stderr)
    assert two < 4 * one + 1
