"""Reading and writing source files without losing a byte of them.

A file is read once, as bytes. We remember its encoding, BOM, dominant line ending and
permissions so that a fix can write it back exactly as it was outside the edited statements.
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import io
import os
import queue
import re
import signal
import stat
import tempfile
import threading
import time
import tokenize
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import libcst as cst


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def split_lines(text: str) -> list[str]:
    """Lines as Python and LibCST count them. ``str.splitlines`` also splits at form feeds,
    vertical tabs, \\x1c-\\x1e, \\x85 and \\u2028, which old files have in comments and strings:
    every line number after one would be off."""
    lines = _LINE_BREAK.split(text)
    return lines[:-1] if lines and lines[-1] == "" else lines


class SourceError(Exception):
    """A file that cannot be checked; the message is one line naming the reason."""


@dataclass
class SourceFile:
    path: str
    raw: bytes
    text: str
    encoding: str
    bom: bool
    # Python's own syntax tree of ``text``, kept by ``parse_source`` (which must run Python's
    # parser anyway) for the positions, which pair its statements with LibCST's.
    python_tree: ast.Module | None = field(default=None, repr=False, compare=False)

    @property
    def lines(self) -> list[str]:
        return split_lines(self.text)

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
        # O_NONBLOCK: opening a FIFO named like a source file must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with open(fd, "rb") as handle:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            if not stat.S_ISREG(mode):
                raise SourceError("not a regular file")
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
    lines = split_lines(text)
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
    """Python's parser on the file (in C, guarded against deep nesting: more than 200 nested
    brackets are a SyntaxError, a deeper expression a RecursionError or MemoryError); the tree
    it makes is kept in ``source.python_tree``."""
    try:
        source.python_tree = compile(source.text, source.path, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        return exc
    except (RecursionError, MemoryError) as exc:
        raise SourceError(f"too deeply nested: Python's own parser gives up ({type(exc).__name__})") from None
    except ValueError:
        pass
    return None


# LibCST's parser (Rust) recurses once per nesting level on the C stack, a few hundred bytes
# to a few kilobytes each: on the main thread's 8 MB it crashes the process (SIGSEGV) past
# ~1,500 nested brackets or ~10,000 chained `and`s. It runs on a thread with this much stack
# (address space only; the pages are touched as the recursion goes).
PARSER_STACK_BYTES = 512 << 20


class _ParserThread:
    """One long-lived thread with a deep stack that runs every ``libcst.parse_module`` of the
    process. A new thread per file cost 6-12 ms of CPU each (as much as half the parse of a
    150-line file: the native parser sets up its per-thread state again), so it is started once
    and fed through a queue; a forked child (a worker process) starts its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue | None = None
        if hasattr(os, "register_at_fork"):  # POSIX
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:  # the thread did not survive the fork
        self._lock = threading.Lock()
        self._jobs = None

    def _start(self) -> queue.SimpleQueue | None:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        with _STACK_LOCK:
            previous = threading.stack_size()
            try:
                threading.stack_size(PARSER_STACK_BYTES)
                threading.Thread(target=self._serve, args=(jobs,), name="tfmigrate-parse", daemon=True).start()
            except (ValueError, RuntimeError, MemoryError):  # no such stack here: parse in place
                return None
            finally:
                threading.stack_size(previous)
        return jobs

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        import libcst as cst

        while True:
            text, done, outcome = jobs.get()
            try:
                outcome.append(cst.parse_module(text))
            except BaseException as exc:  # handed to the caller's thread
                outcome.append(exc)
            done.set()

    def parse(self, text: str) -> cst.Module:
        import libcst as cst

        with self._lock:
            if self._jobs is None:
                self._jobs = self._start()
            jobs = self._jobs
        if jobs is None:
            return cst.parse_module(text)
        done, outcome = threading.Event(), []
        jobs.put((text, done, outcome))
        done.wait()  # interruptible: Ctrl-C is not held up by a long parse
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]


_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide
_PARSER = _ParserThread()


def libcst_parse(text: str) -> cst.Module:
    """``libcst.parse_module`` on the parser thread, whose stack is deep enough for deep
    nesting (see PARSER_STACK_BYTES); on the calling thread where such a thread cannot be had."""
    return _PARSER.parse(text)


def compile_error(text: str, path: str) -> SyntaxError | None:
    """Python's verdict on the whole file: parsing, and the checks of the compiler proper that
    a parse alone does not make (a repeated keyword argument, ``return`` outside a function,
    ``nonlocal`` at module level...). `fix` writes only files that pass it, before and after.
    Top-level ``await`` is allowed (notebooks); warnings are not printed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(text, path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as exc:
        return exc
    except (ValueError, RecursionError, MemoryError) as exc:
        return SyntaxError(str(exc) or type(exc).__name__)
    return None


def compile_failure(source: SourceFile) -> SourceError | None:
    """``compile_error`` worded like a parse error; None when the file compiles."""
    error = compile_error(source.text, source.path)
    if error is None:
        return None
    return _syntax_failure(source, error.lineno or 1, error.offset or 1, error.msg)


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

    # Python's parser first: it words errors better, and it turns away (as a SyntaxError) the
    # deep nesting that would crash LibCST's.
    error = _python_syntax_error(source)
    if error is not None:
        raise _syntax_failure(source, error.lineno or 1, error.offset or 1, error.msg) from None
    try:
        module = libcst_parse(source.text)
    except cst.ParserSyntaxError as exc:
        # Python compiles it: a limit of LibCST's parser (some mixes of tabs and spaces CPython
        # accepts), not an error in the file. Its position is often meaningless (1:1).
        reason = (exc.message or "invalid syntax").splitlines()[0]
        raise SourceError(
            f"LibCST cannot parse this file though Python can ({reason}); not checked, please report it"
        ) from None
    except RecursionError:
        raise SourceError("too deeply nested to parse") from None
    return module


TEMP_PREFIX, TEMP_SUFFIX = ".tfmigrate-", ".tmp"
# A temporary file this old was left by a run that was killed between writing and renaming it
# (a write takes milliseconds): a later `fix --write` removes it.
STALE_TEMP_SECONDS = 600


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C (SIGINT) during the block takes effect when it ends: a file being written is
    finished, never abandoned between its temporary file and the rename. Only on the main
    thread (where Python runs signal handlers); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        # Delivered even when the block failed (a file changed meanwhile): Ctrl-C is never lost.
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


def write_atomic(path: str, data: bytes, expected_original: bytes | None = None) -> None:
    """Replace ``path`` with ``data`` in one step, keeping its permissions and owner.

    The new content goes to a temporary file in the same folder, is flushed to disk, and then
    renamed over the original: a reader (or a crash) sees the old file or the new one, never a
    mix. When ``expected_original`` is given, the file is re-read first and left alone if it
    changed since it was read. A symlink is followed, so the link stays a link. Ctrl-C waits
    for the write to end (see :func:`interrupts_held`).
    """
    with interrupts_held():
        _write_atomic(path, data, expected_original)


def _write_atomic(path: str, data: bytes, expected_original: bytes | None) -> None:
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
    try:
        info = os.stat(target)
    except FileNotFoundError:
        raise SourceError("file was deleted while tfmigrate was working; skipped") from None
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if hasattr(os, "chown") and (info.st_uid, info.st_gid) != (os.geteuid(), os.getegid()):
            try:  # root fixing someone else's file: the file stays theirs
                os.chown(temp, info.st_uid, info.st_gid)
            except OSError:
                pass
        os.chmod(temp, stat.S_IMODE(info.st_mode))
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def remove_stale_temp_files(folder: str, older_than: float = STALE_TEMP_SECONDS) -> list[str]:
    """Remove the temporary files a killed `fix --write` left in ``folder``; return their paths.

    Only ``.tfmigrate-*.tmp`` files last modified more than ``older_than`` seconds ago are
    removed, so a run writing into the same folder right now keeps its own.
    """
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(TEMP_SUFFIX)):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and now - entry.stat(follow_symlinks=False).st_mtime > older_than:
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            pass
    return removed
