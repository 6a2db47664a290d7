"""Mutation fuzzing: every fixture, broken in seeded random ways, through `check` and `fix --write`.

Each fixture ``.py`` file gets ``MUTANTS`` mutants, each with one to three mutations: a line
deleted or duplicated, two tokens swapped, the file truncated, odd bytes injected (NUL, 0xff,
a lone surrogate encoded as UTF-8, a cut multi-byte sequence, CR, form feed, tab), a line
mis-indented, a Python 2 line added. The mutants are the same on every run (seeded by the
fixture's name). Both commands run once over the whole tree, as a user would run them on a
repository, and must:

- never print a traceback nor an ``internal error`` (a crash in the engine or a rule);
- report a file they cannot handle in one line, ``path: error: reason``;
- exit 0, 1 or 2;
- leave every file Python cannot compile byte-for-byte unchanged, and write only files that
  compile, and that a second `fix` leaves alone.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = sorted(p for p in (ROOT / "fixtures").rglob("*.py"))
MUTANTS = int(os.environ.get("TFMIGRATE_FUZZ_MUTANTS", "4"))

INJECTED = [b"\x00", b"\xff", b"\xed\xa0\x80", b"\xc3", b"\r", b"\x0c", b"\t", b"\\", b"'", b'"""', b"(", b":"]
PY2_LINES = [b"print 'hello'\n", b"except Exception, e:\n", b"x = 0777\n", b"exec 'x = 1'\n", b"y = `x`\n", b"n = 10L\n"]
TOKEN = re.compile(rb"\w+|[^\w\s]")


def _line_starts(data: bytes) -> list[int]:
    return [0] + [m.end() for m in re.finditer(rb"\n", data) if m.end() < len(data)]


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One mutation, and its name."""
    lines = data.splitlines(keepends=True) or [b""]
    kind = rng.choice(["delete", "duplicate", "swap", "truncate", "inject", "misindent", "python2"])
    if kind == "delete":
        del lines[rng.randrange(len(lines))]
    elif kind == "duplicate":
        index = rng.randrange(len(lines))
        lines.insert(index, lines[index])
    elif kind == "misindent":
        index = rng.randrange(len(lines))
        line = lines[index]
        lines[index] = rng.choice([b" ", b"\t", b"    ", b""]) + (line[1:] if rng.random() < 0.5 else line)
    elif kind == "python2":
        lines.insert(rng.randrange(len(lines) + 1), rng.choice(PY2_LINES))
    else:
        if kind == "truncate":
            return data[: rng.randrange(len(data) + 1)], kind
        if kind == "inject":
            at = rng.randrange(len(data) + 1)
            return data[:at] + rng.choice(INJECTED) + data[at:], kind
        tokens = list(TOKEN.finditer(data))
        if len(tokens) < 2:
            return data, kind
        a, b = sorted(rng.sample(tokens, 2), key=lambda m: m.start())
        if a.end() > b.start():
            return data, kind
        return data[: a.start()] + b.group() + data[a.end(): b.start()] + a.group() + data[b.end():], kind
    return b"".join(lines), kind


def mutants() -> dict[str, bytes]:
    """Relative file name -> mutated bytes, deterministic."""
    out = {}
    for fixture in FIXTURES:
        original = fixture.read_bytes()
        relative = fixture.relative_to(ROOT / "fixtures")
        for number in range(MUTANTS):
            rng = random.Random(f"{relative}#{number}")  # str seeds are hashed with SHA-512: stable
            data, kinds = original, []
            for _ in range(rng.randint(1, 3)):
                data, kind = mutate(data, rng)
                kinds.append(kind)
            name = str(relative.with_suffix("")).replace(os.sep, "__")
            out[f"{name}__{number}_{'_'.join(kinds)}.py"] = data
    return out


def compiles(data: bytes) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(data, "<mutant>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, UnicodeDecodeError, MemoryError, RecursionError):
        return False
    return True


def tfmigrate(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TFMIGRATE_CACHE_DIR": str(cwd.parent / "cache"), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "tfmigrate", *args], cwd=cwd, capture_output=True, text=True,
                          errors="replace", env=env, timeout=600)


ERROR_LINE = re.compile(r"^(?P<path>\S+\.py): (?P<kind>error|note): (?P<message>.+)$")
SUMMARY = re.compile(r"^(Fixed|Would fix) \d+ findings? in \d+ files?\.$|^\d+ remain \(|^\d+ files? skipped \(")
REFUSAL = re.compile(r"^\S+\.py:\d+:\d+: TFM\d+ no automatic fix: .+$")  # why a finding was left


def assert_clean_stderr(stderr: str, names: set[str]) -> dict[str, str]:
    """Every stderr line is a one-line error or note about a known file, or the summary;
    return file -> error."""
    assert "Traceback" not in stderr
    errors = {}
    for line in stderr.splitlines():
        if not line.strip() or SUMMARY.match(line) or REFUSAL.match(line):
            continue
        match = ERROR_LINE.match(line)
        assert match, f"not a one-line per-file message: {line!r}"
        assert match["path"] in names, line
        if match["kind"] == "error":
            assert match["path"] not in errors, f"two errors for one file: {line!r}"
            errors[match["path"]] = match["message"]
    crashes = [f"{path}: {message}" for path, message in errors.items() if "internal error" in message]
    assert not crashes, "internal errors:\n" + "\n".join(crashes)
    return errors


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    folder = tmp_path_factory.mktemp("fuzz") / "repo"
    folder.mkdir()
    files = mutants()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder, files


def test_mutants_are_varied(tree):
    _, files = tree
    assert len(files) == MUTANTS * len(FIXTURES) >= 100
    broken = sum(not compiles(data) for data in files.values())
    assert 0.2 * len(files) < broken < 0.9 * len(files)  # both kinds, plenty of each


def test_check_never_crashes(tree):
    folder, files = tree
    result = tfmigrate(["check", "--no-cache", "--jobs", "2", "."], folder)
    assert result.returncode in (0, 1, 2), result.stderr[-2000:]
    errors = assert_clean_stderr(result.stderr, set(files))
    # A file Python compiles is never reported as a syntax error (LibCST's tokenizer rejects
    # a few tab/space mixes CPython accepts: that is said as such).
    wrong = [name for name, message in errors.items() if compiles(files[name]) and "syntax" in message]
    assert not wrong, wrong
    assert "Traceback" not in result.stdout


def test_fix_write_never_crashes_and_never_writes_a_broken_file(tree):
    folder, files = tree
    result = tfmigrate(["fix", "--write", "--unsafe-fixes", "--jobs", "2", "."], folder)
    assert result.returncode in (0, 1, 2), result.stderr[-2000:]
    errors = assert_clean_stderr(result.stderr, set(files))
    written = {}
    for name, before in files.items():
        after = (folder / name).read_bytes()
        if not compiles(before):
            assert after == before, f"{name}: a file that does not compile was changed"
        elif after != before:
            assert compiles(after), f"{name}: the fixed file does not compile"
            assert name not in errors
            written[name] = after
    assert written  # the mutants that still parse were fixed
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    again = tfmigrate(["fix", "--write", "--unsafe-fixes", "--jobs", "2", *sorted(written)], folder)
    assert_clean_stderr(again.stderr, set(files))
    changed = [name for name, data in written.items() if (folder / name).read_bytes() != data]
    assert not changed, f"a second fix changed: {changed}"
