"""Reading and writing source files without losing a byte of them.

A file is read once, as bytes. We remember its encoding, BOM, dominant line ending and
permissions so that a fix can write it back exactly as it was outside the edited statements.
"""

from __future__ import annotations

import ast
import codecs
import io
import os
import re
import tempfile
import tokenize
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import libcst as cst


class SourceError(Exception):
    """A file that cannot be checked; the message is one line naming the reason."""


@dataclass
class SourceFile:
    path: str
    raw: bytes
    text: str
    encoding: str
    bom: bool

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def encode(self, text: str) -> bytes:
        data = text.encode(self.encoding)
        if self.bom:
            data = codecs.BOM_UTF8 + data
        return data


def decode_source(path: str, raw: bytes) -> SourceFile:
    bom = raw.startswith(codecs.BOM_UTF8)
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as exc:
        if "invalid or missing encoding declaration" not in str(exc):
            # an unknown coding cookie, or one that contradicts the BOM
            raise SourceError(f"cannot decode: {exc}") from None
        encoding = "utf-8"  # the first lines are not UTF-8: say where, below
    if encoding == "utf-8-sig":
        encoding = "utf-8"
    body = raw[len(codecs.BOM_UTF8):] if bom else raw
    try:
        text = body.decode(encoding)
    except UnicodeDecodeError as exc:
        line = body[: exc.start].count(b"\n") + 1
        raise SourceError(
            f"cannot decode as {encoding} (line {line}, byte 0x{body[exc.start]:02x}); "
            "add a coding cookie or re-save the file as UTF-8"
        ) from None
    if "\x00" in text:
        raise SourceError("file contains NUL bytes; is it binary?")
    return SourceFile(path=path, raw=raw, text=text, encoding=encoding, bom=bom)


def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise SourceError("no such file") from None
    except IsADirectoryError:
        raise SourceError("is a directory") from None
    except PermissionError:
        raise SourceError("permission denied") from None
    except OSError as exc:
        raise SourceError(exc.strerror or str(exc)) from None


def read_source(path: str) -> SourceFile:
    return decode_source(path, read_bytes(path))


# Python 2 constructs that are the usual reason an old TensorFlow script does not parse.
_PY2_PATTERNS = [
    (re.compile(r"^\s*print\s+(?![\s=(.,)\[]|$)"), "print statement"),
    (re.compile(r"^\s*print\s*$"), "print statement"),
    (re.compile(r"^\s*except\s+[\w.]+\s*,\s*\w+\s*:"), "'except E, e' clause"),
    (re.compile(r"^\s*exec\s+[\"'\w]"), "exec statement"),
    (re.compile(r"^\s*raise\s+[\w.]+\s*,"), "'raise E, msg' statement"),
    (re.compile(r"(?<![\w.])0[0-7]+(?![\w.])"), "octal literal without 0o"),
    (re.compile(r"`[^`\n]+`"), "backtick repr"),
    (re.compile(r"(?<![\w\"'])ur[\"']"), "ur'' string prefix"),
    (re.compile(r"\d+[lL](?!\w)"), "long integer literal"),
    (re.compile(r"<>"), "'<>' operator"),
]


def python2_reason(text: str, line: int) -> str | None:
    """If the failing line looks like Python 2, name the construct."""
    lines = text.splitlines()
    candidates = [line] + [n for n in range(1, len(lines) + 1) if n != line]
    for number in candidates:
        if not 1 <= number <= len(lines):
            continue
        code = lines[number - 1].split("#", 1)[0]
        for pattern, what in _PY2_PATTERNS:
            if pattern.search(code):
                return f"{what} at line {number}"
    return None


def _python_syntax_error(source: SourceFile) -> SyntaxError | None:
    try:
        compile(source.text, source.path, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        return exc
    except (ValueError, RecursionError, MemoryError):
        pass
    return None


def _syntax_failure(source: SourceFile, line: int, column: int, message: str) -> SourceError:
    python2 = python2_reason(source.text, line)
    if python2:
        return SourceError(f"Python 2 syntax ({python2}): run it through 2to3 first")
    return SourceError(f"syntax error at line {line}, column {column}: {message}")


def parse_source(source: SourceFile) -> cst.Module:
    """Parse with LibCST; the file must also be valid Python 3 for the running interpreter.

    LibCST's parser accepts a few things Python 3 does not (``except E, e:``), and Python's own
    parser words errors better ("expected ':'"), so its verdict is the one reported.
    """
    import libcst as cst  # here, not at the top: a run whose files the prefilter skips never needs it

    try:
        module = cst.parse_module(source.text)
    except cst.ParserSyntaxError as exc:
        error = _python_syntax_error(source)
        if error is not None:
            raise _syntax_failure(source, error.lineno or exc.raw_line, error.offset or 1, error.msg) from None
        raise _syntax_failure(source, exc.raw_line, exc.raw_column + 1, "invalid syntax") from None
    except RecursionError:
        raise SourceError("too deeply nested to parse") from None
    error = _python_syntax_error(source)
    if error is not None:
        raise _syntax_failure(source, error.lineno or 1, error.offset or 1, error.msg) from None
    return module


def write_atomic(path: str, data: bytes, expected_original: bytes | None = None) -> None:
    """Replace ``path`` with ``data`` in one step, keeping its permissions.

    The new content goes to a temporary file in the same folder, is flushed to disk, and then
    renamed over the original: a reader (or a crash) sees the old file or the new one, never a
    mix. When ``expected_original`` is given, the file is re-read first and left alone if it
    changed since it was read. A symlink is followed, so the link stays a link.
    """
    target = os.path.realpath(path)
    if expected_original is not None:
        try:
            with open(target, "rb") as handle:
                current = handle.read()
        except FileNotFoundError:
            raise SourceError("file was deleted while tfmigrate was working; skipped") from None
        if current != expected_original:
            raise SourceError("file changed while tfmigrate was working; skipped")
    folder = os.path.dirname(target) or "."
    mode = os.stat(target).st_mode & 0o7777
    fd, temp = tempfile.mkstemp(prefix=".tfmigrate-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
