"""Which files to check: the paths given, folders walked with .gitignore and ``exclude`` honoured."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tfmigrate.engine.config import Config

if TYPE_CHECKING:
    import pathspec

SOURCE_SUFFIXES = (".py", ".pyi", ".ipynb")
# Folders never worth walking into (ruff skips the same ones by default), as gitignore patterns.
DEFAULT_EXCLUDES = [
    ".git/", ".hg/", ".svn/", ".venv/", "venv/", ".tox/", ".nox/", "__pycache__/",
    "node_modules/", "site-packages/", "build/", "dist/", ".eggs/", "*.egg-info/",
    ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", ".tfmigrate_cache/", ".ipynb_checkpoints/",
]
# The same, matched by folder name (what these patterns mean), without pathspec.
_DEFAULT_FOLDERS = frozenset(p.rstrip("/") for p in DEFAULT_EXCLUDES if "*" not in p)
_DEFAULT_SUFFIXES = tuple(p.rstrip("/").lstrip("*") for p in DEFAULT_EXCLUDES if p.startswith("*"))


def _default_excluded(folder_name: str) -> bool:
    return folder_name in _DEFAULT_FOLDERS or folder_name.endswith(_DEFAULT_SUFFIXES)


@dataclass
class Discovery:
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    # (path, why) of what a folder's walk met and left alone: a symlink loop, a folder it may not read
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _spec(patterns: list[str]) -> pathspec.PathSpec:
    import pathspec  # only for a configured exclude or a .gitignore

    return pathspec.GitIgnoreSpec.from_lines(patterns)


def _folders_only(patterns: list[str]) -> bool:
    """Whether gitignore patterns can only match folders (and so what is inside them): then a
    file found in a folder that was not excluded cannot be excluded itself."""
    lines = [p.strip() for p in patterns if p.strip() and not p.strip().startswith("#")]
    return all(line.endswith("/") for line in lines)


def discover(paths: list[str], config: Config, force_exclude: bool = False, virtual: bool = False) -> Discovery:
    """Files in a stable order. A file named explicitly is checked even if excluded, unless
    ``force_exclude`` (what pre-commit passes) is set, as ruff does. ``virtual``: the paths
    are names standard input stands for, not looked up on disk (only excluded or not)."""
    result = Discovery()
    # The default folders by name, and the configured patterns with pathspec; a configured
    # negation (`!build/`) may bring a default folder back: then all go to pathspec together.
    negates = any(p.strip().startswith("!") for p in config.exclude)
    patterns = DEFAULT_EXCLUDES + config.exclude if negates else config.exclude
    configured = _spec(patterns) if patterns else None
    by_name = _default_excluded if not negates else (lambda name: False)
    files_can_match = configured is not None and not _folders_only(patterns)
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

    def relative_to_root(path: Path) -> str:
        try:
            return resolved(path).relative_to(root).as_posix()
        except ValueError:
            return path.name

    def is_excluded(path: Path, is_dir: bool) -> bool:
        """A folder or file met while walking (its folder was not excluded)."""
        if is_dir and by_name(path.name):
            return True
        if configured is None or not (is_dir or files_can_match):
            return False
        return configured.match_file(relative_to_root(path) + ("/" if is_dir else ""))

    def is_excluded_file(path: Path) -> bool:
        """A file named on the command line: excluded by its own path or a folder on it."""
        relative = relative_to_root(path)
        if any(by_name(folder) for folder in relative.split("/")[:-1]):
            return True
        return configured is not None and configured.match_file(relative)

    def add(path: str) -> None:
        key = os.path.normpath(path)
        if key not in seen:
            seen.add(key)
            result.files.append(key)

    for given in paths:
        path = Path(given)
        if virtual:
            if not (force_exclude and is_excluded_file(path)):
                result.files.append(given)
        elif not os.path.lexists(given):
            result.missing.append(given)
        elif path.is_dir():
            for file in _walk(path, is_excluded, result.skipped):
                add(str(file))
        elif not (force_exclude and is_excluded_file(path)):
            add(given)
    return result


def _walk(top: Path, is_excluded, skipped: list[tuple[str, str]]) -> list[Path]:
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
        except OSError as exc:
            if folder != top:
                skipped.append((str(folder), f"cannot read this folder ({exc.strerror or exc}); skipped"))
            continue
        subfolders = []
        for entry in entries:
            path = Path(entry.path)
            try:
                is_dir = entry.is_dir()
            except OSError as exc:  # a link to itself, or links in a loop (ELOOP)
                skipped.append((str(path), f"{exc.strerror or exc} (a symlink loop); skipped"))
                continue
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
