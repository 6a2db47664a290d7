"""Which files to check: the paths given, folders walked with .gitignore and ``exclude`` honoured."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

from tfmigrate.config import Config

SOURCE_SUFFIXES = (".py", ".pyi", ".ipynb")
# Folders never worth walking into (ruff skips the same ones by default).
DEFAULT_EXCLUDES = [
    ".git/", ".hg/", ".svn/", ".venv/", "venv/", ".tox/", ".nox/", "__pycache__/",
    "node_modules/", "site-packages/", "build/", "dist/", ".eggs/", "*.egg-info/",
    ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", ".tfmigrate_cache/", ".ipynb_checkpoints/",
]


@dataclass
class Discovery:
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def _spec(patterns: list[str]) -> pathspec.PathSpec:
    return pathspec.GitIgnoreSpec.from_lines(patterns)


def discover(paths: list[str], config: Config, force_exclude: bool = False) -> Discovery:
    """Files in a stable order. A file named explicitly is checked even if excluded, unless
    ``force_exclude`` (what pre-commit passes) is set, as ruff does."""
    result = Discovery()
    excluded = _spec(DEFAULT_EXCLUDES + config.exclude)
    root = config.root.resolve()
    seen: set[str] = set()

    resolved_folders: dict[Path, Path] = {}

    def resolved(path: Path) -> Path:
        # One realpath per folder, not per file (a third of a warm run over a big tree); a
        # link is resolved itself, as before.
        if path.is_symlink():
            return path.resolve()
        parent = path.parent
        if parent not in resolved_folders:
            resolved_folders[parent] = parent.resolve()
        return resolved_folders[parent] / path.name

    def is_excluded(path: Path, is_dir: bool) -> bool:
        try:
            relative = resolved(path).relative_to(root).as_posix()
        except ValueError:
            relative = path.name
        if is_dir:
            relative += "/"
        return excluded.match_file(relative)

    def add(path: str) -> None:
        key = os.path.normpath(path)
        if key not in seen:
            seen.add(key)
            result.files.append(key)

    for given in paths:
        path = Path(given)
        if not os.path.lexists(given):
            result.missing.append(given)
        elif path.is_dir():
            for file in _walk(path, is_excluded):
                add(str(file))
        elif not (force_exclude and is_excluded(path, False)):
            add(given)
    return result


def _walk(top: Path, is_excluded) -> list[Path]:
    found: list[Path] = []
    # Stack of (folder, gitignore specs in force with the folder each is relative to).
    stack: list[tuple[Path, list[tuple[Path, pathspec.PathSpec]]]] = [(top, [])]
    while stack:
        folder, ignores = stack.pop()
        gitignore = folder / ".gitignore"
        if gitignore.is_file():
            try:
                lines = gitignore.read_text(encoding="utf-8", errors="replace").splitlines()
                ignores = ignores + [(folder, _spec(lines))]
            except OSError:
                pass
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        subfolders = []
        for entry in entries:
            path = Path(entry.path)
            is_dir = entry.is_dir()
            if _git_ignored(path, is_dir, ignores) or is_excluded(path, is_dir):
                continue
            if is_dir:
                if not entry.is_symlink():  # a linked folder could loop; its files are not ours
                    subfolders.append((path, ignores))
            elif entry.name.endswith(SOURCE_SUFFIXES):
                found.append(path)
        stack.extend(reversed(subfolders))
    return sorted(found)


def _git_ignored(path: Path, is_dir: bool, ignores: list[tuple[Path, pathspec.PathSpec]]) -> bool:
    for base, spec in ignores:
        relative = path.relative_to(base).as_posix() + ("/" if is_dir else "")
        if spec.match_file(relative):
            return True
    return False
