from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tfmigrate.engine.config import Config
from tfmigrate.engine.runner import check_text

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
EXPECT = re.compile(r"#\s*expect:\s*(TFM\d+(?:\s*,\s*TFM\d+)*)")


def run_check(code: str, **config) -> list:
    """Findings for a snippet (dedented; line 1 is its first non-blank line), every rule enabled
    unless ``config`` says otherwise."""
    return check_text(textwrap.dedent(code).strip("\n") + "\n", Config(root=ROOT, **config))


def expected_markers(text: str) -> set[tuple[int, str]]:
    """(line, code) pairs declared by `# expect: TFM101, TFM103` comments in a fixture."""
    found = set()
    for number, line in enumerate(text.splitlines(), start=1):
        match = EXPECT.search(line)
        if match:
            found |= {(number, code.strip()) for code in match.group(1).split(",")}
    return found


@pytest.fixture
def check():
    return run_check


def run_verify(old: Path, new: Path, tmp_path: Path, steps: int = 20, rtol: float = 1e-4,
               loss_regex: str | None = None) -> tuple[int, dict]:
    """`tfmigrate verify OLD NEW` on 2 logical devices: (exit status, the JSON report). With
    ``loss_regex`` the values compared are read from the programs' printed lines."""
    from typer.testing import CliRunner

    from tfmigrate.cli.main import app

    report = tmp_path / f"{new.stem}.json"
    # In this process (verify's own process imports no TensorFlow), so that the preload servers
    # it starts (tfmigrate/verify/preload.py) serve every verify this test worker runs.
    result = CliRunner().invoke(app, [
        "verify", str(old), str(new), "--steps", str(steps), "--devices", "2", "--timeout", "180",
        "--json", str(report), "--rtol", str(rtol),
        *(["--warmup", "0", "--loss-regex", loss_regex] if loss_regex else [])])
    assert report.exists(), result.output
    return result.exit_code, json.loads(report.read_text())


def run_program(path: Path, args: tuple = (), env: dict | None = None, timeout: float = 120,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python PATH ARGS` in ``env``: forked from a preload server that has imported TensorFlow
    (tfmigrate/verify/preload.py; an import is 3 to 4 s of CPU, more than most programs' run),
    else a plain subprocess. Its output as ``subprocess.run(..., capture_output=True)`` gives it."""
    from tfmigrate.verify import preload

    env = dict(os.environ if env is None else env)
    command = [sys.executable, str(path), *args]
    if preload.enabled():
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            forked = preload.start(list(args), str(out), env, script=str(Path(cwd or ".", path).resolve()),
                                   errors=str(err), cwd=str(cwd) if cwd else None)
            if forked is not None:
                try:
                    status = forked.wait(timeout)
                except subprocess.TimeoutExpired:
                    forked.kill()
                    forked.wait()  # the server's answer for the killed run, before the next request
                    raise
                return subprocess.CompletedProcess(command, status, out.read_text(), err.read_text())
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def replaced(text: str, *replacements: tuple[str, str]) -> str:
    """``text`` with each (old, new) replaced; every ``old`` must be there."""
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    return text


def unsafe_fix(text: str, **config) -> str:
    """`fix --unsafe-fixes` of ``text`` (every rule enabled unless ``config`` says otherwise); the
    result must parse, compile and be a fixed point."""
    import libcst as cst

    from tfmigrate.engine.fixer import fix_text

    result = fix_text(text, Config(root=ROOT, **config), unsafe=True)
    cst.parse_module(result)
    compile(result, "<fixed>", "exec")
    assert fix_text(result, Config(root=ROOT, **config), unsafe=True) == result, "a second fix changed the file"
    return result
