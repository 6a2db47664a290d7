"""The fix engine, driven by small rules defined here (the real rules' fixes have their own tests)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import libcst as cst
import pytest
from libcst.codemod.visitors import ImportItem
from typer.testing import CliRunner

import tfmigrate.engine.runner
from tfmigrate.cli.main import app
from tfmigrate.engine.config import Config
from tfmigrate.engine.fixer import fix_text
from tfmigrate.rule import Edit, FixSafety, Rule
from tfmigrate.engine.source import SourceError, write_atomic


class RenameOldApi(Rule):
    """`old_api(x)` -> `tf.new_api(x)`: a safe fix that needs the tensorflow import."""

    code, name, summary, triggers = "TFM901", "toy-rename", "toy", ("old_api",)
    fix_safety = FixSafety.SAFE

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value == "old_api":
            new = node.with_changes(func=cst.parse_expression("tf.new_api"))
            self.report(node, "old_api is gone", edit=Edit(
                {node: new}, "use tf.new_api", add_imports=[ImportItem("tensorflow", alias="tf")]
            ))


class UnsafeDrop(Rule):
    """`risky()` statements removed: an unsafe fix."""

    code, name, summary, triggers = "TFM902", "toy-unsafe", "toy", ("risky",)
    fix_safety = FixSafety.UNSAFE

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        if cst.ensure_type(node.body[0], cst.Expr) if isinstance(node.body[0], cst.Expr) else False:
            call = node.body[0].value
            if isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "risky":
                self.report(node, "risky", edit=Edit({node: cst.RemovalSentinel.REMOVE}, "drop it"))


class Broken(Rule):
    """A buggy rule whose fix does not parse."""

    code, name, summary, triggers = "TFM903", "toy-broken", "toy", ("breakme",)
    fix_safety = FixSafety.SAFE

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == "breakme":
            # `if` is a valid identifier to LibCST's node validation but not to the parser.
            self.report(node, "broken", edit=Edit({node: cst.Name("if")}, "break"))


@pytest.fixture(autouse=True)
def toy_rules(monkeypatch):
    monkeypatch.setattr(tfmigrate.engine.runner, "all_rules", lambda: (RenameOldApi, UnsafeDrop, Broken))
    monkeypatch.setattr("tfmigrate.cli.main._known_prefix", lambda code: True)


def config() -> Config:
    return Config(root=Path.cwd())


def test_fix_adds_the_import_once_and_keeps_comments():
    before = "# header\nx = old_api(1)  # keep me\n\n\ny = old_api(2)\n"
    after = fix_text(before, config())
    assert after == "# header\nimport tensorflow as tf\n\nx = tf.new_api(1)  # keep me\n\n\ny = tf.new_api(2)\n"
    assert fix_text(after, config()) == after


def test_existing_tensorflow_import_is_reused():
    before = "import tensorflow as tf\nx = old_api(1)\n"
    assert fix_text(before, config()) == "import tensorflow as tf\nx = tf.new_api(1)\n"


def test_nested_edits_are_applied_over_several_passes():
    assert fix_text("import tensorflow as tf\nx = old_api(old_api(1))\n", config()) == (
        "import tensorflow as tf\nx = tf.new_api(tf.new_api(1))\n"
    )


def test_unsafe_fix_needs_the_flag():
    before = "risky()\nkeep()\n"
    assert fix_text(before, config()) == before
    assert fix_text(before, config(), unsafe=True) == "keep()\n"


def test_a_fix_that_would_not_parse_leaves_the_file_untouched(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("breakme = 1\nx = old_api(1)\n")
    original = path.read_bytes()
    result = _invoke(["fix", "--write", str(path)])
    assert result.exit_code == 2
    assert "TFM903" in result.stderr and "would not parse" in result.stderr
    assert path.read_bytes() == original


def _invoke(args):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_preview_is_a_diff_and_writes_nothing(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("x = old_api(1)\n")
    result = _invoke(["fix", str(path)])
    assert result.exit_code == 1
    assert result.stdout == (
        f"--- {path}\n+++ {path}\n@@ -1 +1,3 @@\n-x = old_api(1)\n+import tensorflow as tf\n+\n+x = tf.new_api(1)\n"
    )
    assert path.read_text() == "x = old_api(1)\n"
    assert "Would fix 1 finding in 1 file." in result.stderr
    assert _invoke(["fix", "--diff", str(path)]).stdout == result.stdout


def test_write_keeps_encoding_bom_line_endings_and_mode(tmp_path):
    path = tmp_path / "a.py"
    original = "\ufeff# caf\u00e9\r\nx = old_api(1)\r\n".encode("utf-8")
    path.write_bytes(original)
    os.chmod(path, 0o754)
    result = _invoke(["fix", "--write", str(path)])
    assert result.exit_code == 0, result.stderr
    data = path.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf# caf\xc3\xa9\r\n")
    assert b"x = tf.new_api(1)\r\n" in data and b"\n" not in data.replace(b"\r\n", b"")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o754
    assert "Fixed 1 finding in 1 file." in result.stderr
    # Idempotent: a second run finds nothing to do.
    again = _invoke(["fix", "--write", str(path)])
    assert again.exit_code == 0 and path.read_bytes() == data


def test_latin1_file_with_cookie_stays_latin1(tmp_path):
    path = tmp_path / "a.py"
    path.write_bytes("# -*- coding: latin-1 -*-\ns = 'd\u00e9j\u00e0'\nx = old_api(1)\n".encode("latin-1"))
    assert _invoke(["fix", "--write", str(path)]).exit_code == 0
    assert "s = 'd\u00e9j\u00e0'".encode("latin-1") in path.read_bytes()


def test_exit_non_zero_on_fix(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("x = old_api(1)\n")
    assert _invoke(["fix", "--write", "--exit-non-zero-on-fix", str(path)]).exit_code == 1
    assert _invoke(["fix", "--write", "--exit-non-zero-on-fix", str(path)]).exit_code == 0


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root ignores file modes")
def test_read_only_file_is_left_alone(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("x = old_api(1)\n")
    os.chmod(path, 0o444)
    result = _invoke(["fix", "--write", str(path)])
    assert result.exit_code == 2 and "read-only" in result.stderr
    assert path.read_text() == "x = old_api(1)\n"


def test_read_only_file_is_left_alone_even_as_root(tmp_path, monkeypatch):
    # Root can write anything, so simulate what os.access reports for a read-only file.
    path = tmp_path / "a.py"
    path.write_text("x = old_api(1)\n")
    monkeypatch.setattr("tfmigrate.engine.fixer.os.access", lambda p, mode: False)
    result = _invoke(["fix", "--write", str(path)])
    assert result.exit_code == 2 and "read-only" in result.stderr
    assert path.read_text() == "x = old_api(1)\n"


def test_write_atomic_refuses_a_file_changed_since_it_was_read(tmp_path):
    path = tmp_path / "a.py"
    path.write_bytes(b"new content\n")
    with pytest.raises(SourceError, match="changed while"):
        write_atomic(str(path), b"fixed\n", expected_original=b"old content\n")
    assert path.read_bytes() == b"new content\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.py"]  # no temp file left behind


def test_symlink_stays_a_link(tmp_path):
    target = tmp_path / "real.py"
    target.write_text("x = old_api(1)\n")
    link = tmp_path / "link.py"
    link.symlink_to(target)
    assert _invoke(["fix", "--write", str(link), str(target)]).exit_code == 0
    assert link.is_symlink()
    assert target.read_text() == "import tensorflow as tf\n\nx = tf.new_api(1)\n"


def test_fix_in_worker_processes(tmp_path):
    # More files than the pool threshold: the (forked) workers see the toy rules too.
    paths = [tmp_path / f"m{i:02}.py" for i in range(45)]
    for path in paths:
        path.write_text("x = old_api(1)\n")
    result = _invoke(["fix", "--write", "--jobs", "2", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert "Fixed 45 findings in 45 files." in result.stderr
    assert all(p.read_text() == "import tensorflow as tf\n\nx = tf.new_api(1)\n" for p in paths)
