"""The pre-commit hooks, driven through real `pre-commit` in a temporary git repository.

The hook repository is a snapshot of this checkout (its committed and uncommitted files, as a
fresh one-commit git repository), so the test exercises the working tree's
.pre-commit-hooks.yaml exactly as a user's `repo:` entry would. pre-commit builds the hook's
environment with pip (`language: python`): that needs the package index, as CI has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRE_COMMIT = Path(sys.executable).with_name("pre-commit")
GIT = shutil.which("git")

pytestmark = pytest.mark.skipif(
    GIT is None or not PRE_COMMIT.exists(), reason="needs git and pre-commit (the dev extra)"
)

TOWER = """\
import tensorflow as tf

for i in range(2):
    with tf.device('/gpu:%d' % i):
        out = model(x)
"""


def git(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([GIT, *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)


def environment(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "PRE_COMMIT", "VIRTUAL_ENV"))}
    env.update({
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path),
    })
    return env


def snapshot(target: Path, env: dict) -> str:
    """This checkout as a one-commit repository; returns the commit."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a deleted but still tracked file is skipped
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    git("init", "-q", cwd=target, env=env)
    git("add", "-A", cwd=target, env=env)
    git("commit", "-q", "--no-verify", "-m", "snapshot", cwd=target, env=env)
    return git("rev-parse", "HEAD", cwd=target, env=env).stdout.strip()


def test_manifest_is_valid():
    out = subprocess.run([str(PRE_COMMIT), "validate-manifest", str(ROOT / ".pre-commit-hooks.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_commit_with_a_tower_loop_is_blocked_and_a_clean_one_passes(tmp_path):
    env = environment(tmp_path)
    hooks, project = tmp_path / "hooks", tmp_path / "project"
    hooks.mkdir()
    project.mkdir()
    rev = snapshot(hooks, env)
    git("init", "-q", cwd=project, env=env)
    (project / ".pre-commit-config.yaml").write_text(
        f"repos:\n- repo: {hooks}\n  rev: {rev}\n  hooks:\n  - id: tfmigrate-check\n  - id: tfmigrate-fix\n"
    )
    subprocess.run([str(PRE_COMMIT), "install"], cwd=project, env=env, check=True, capture_output=True)

    (project / "clean.py").write_text("import tensorflow as tf\nstrategy = tf.distribute.MirroredStrategy()\n")
    git("add", "-A", cwd=project, env=env)
    clean = subprocess.run([GIT, "commit", "-m", "clean"], cwd=project, env=env, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    output = clean.stdout + clean.stderr  # git shows the hooks' output on stderr
    assert "tfmigrate check" in output and "Passed" in output

    (project / "train.py").write_text(TOWER)
    git("add", "train.py", cwd=project, env=env)
    blocked = subprocess.run([GIT, "commit", "-m", "towers"], cwd=project, env=env, capture_output=True, text=True)
    output = blocked.stdout + blocked.stderr
    assert blocked.returncode != 0
    assert "train.py:3:1: TFM101" in output
    assert "Failed" in output
    # Nothing was committed, and tfmigrate-fix left the file alone (a tower loop has no safe fix).
    assert git("log", "--format=%s", cwd=project, env=env).stdout.split() == ["clean"]
    assert (project / "train.py").read_text() == TOWER
