"""Which files a run checks: default folder excludes, configured excludes, .gitignore files."""

from __future__ import annotations

import os

import pytest

from tfmigrate.engine.config import Config
from tfmigrate.engine.discovery import discover

FILES = [
    "a.py", "build/x.py", "src/build/y.py", "src/build.py", "src/pkg.egg-info/z.py", "src/m/__pycache__/c.py",
    "venv/lib/q.py", "src/venvs/ok.py", "docs/gen/a.py", "docs/keep.py", "tests/fixtures/f.py", "tests/t.py",
    "src/notes.ipynb", "src/stub.pyi", "src/data/skip_me.py", "node_modules/n.py", "deep/a/b/.tox/t.py",
]
# Walking ".": the default folders (build/, *.egg-info/, __pycache__/, venv/, node_modules/,
# .tox/ at any depth) and src/.gitignore's data/ and *.pyi are left out.
WALKED = [
    "a.py", "docs/gen/a.py", "docs/keep.py", "src/build.py", "src/notes.ipynb", "src/venvs/ok.py",
    "tests/fixtures/f.py", "tests/t.py",
]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    for name in FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "src" / ".gitignore").write_text("data/\n*.pyi\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def found(tree, paths, exclude=(), force_exclude=False) -> list[str]:
    files = discover(paths, Config(root=tree, exclude=list(exclude)), force_exclude=force_exclude).files
    return sorted(path.replace(os.sep, "/") for path in files)


def test_default_folders_and_gitignore(tree):
    assert found(tree, ["."]) == WALKED


@pytest.mark.parametrize(("exclude", "gone"), [
    (["docs/gen/"], ["docs/gen/a.py"]),
    (["tests/fixtures/", "*.ipynb"], ["src/notes.ipynb", "tests/fixtures/f.py"]),
    (["keep.py"], ["docs/keep.py"]),
    (["# a comment", "", "docs/  "], ["docs/gen/a.py", "docs/keep.py"]),  # trailing blanks do not count
])
def test_configured_excludes(tree, exclude, gone):
    assert found(tree, ["."], exclude) == [f for f in WALKED if f not in gone]


def test_a_configured_negation_brings_a_default_folder_back(tree):
    assert found(tree, ["."], ["!build/", "docs/"]) == sorted(
        [f for f in WALKED if not f.startswith("docs/")] + ["build/x.py", "src/build/y.py"]
    )


def test_named_files_are_checked_unless_force_exclude(tree):
    named = ["build/x.py", "src/pkg.egg-info/z.py", "docs/keep.py", "a.py"]
    assert found(tree, named, ["docs/"]) == sorted(named)
    assert found(tree, named, ["docs/"], force_exclude=True) == ["a.py"]
    assert found(tree, [str(tree / f) for f in named], ["docs/"], force_exclude=True) == [str(tree / "a.py").replace(os.sep, "/")]
