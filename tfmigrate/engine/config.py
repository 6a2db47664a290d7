"""``[tool.tfmigrate]`` in the nearest pyproject.toml, merged with the command line."""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

TARGETS = ("compat", "tf2")
# What the compat target does with the towers' input: keep the program's own (feeds, splits,
# queues), or move fed batches to a distributed tf.data pipeline (the tf2 target always does).
TOWER_INPUTS = ("keep", "dataset")


class ConfigError(Exception):
    pass


@dataclass
class Config:
    root: Path  # folder of the pyproject.toml (or the working directory); excludes are relative to it
    select: list[str] = field(default_factory=lambda: ["TFM"])
    ignore: list[str] = field(default_factory=list)
    per_file_ignores: dict[str, list[str]] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    target: str = "compat"
    tower_input: str = "keep"
    source: Path | None = None  # the pyproject.toml read, if any

    def enabled(self, code: str, path: str | None = None) -> bool:
        """ruff's rule: the most specific matching prefix of select/ignore wins."""
        best_select = max((len(p) for p in self.select if code.startswith(p.upper())), default=-1)
        ignores = list(self.ignore)
        if path is not None:
            ignores += self.ignores_for(path)
        best_ignore = max((len(p) for p in ignores if code.startswith(p.upper())), default=-1)
        return best_select >= 0 and best_select > best_ignore

    def ignores_for(self, path: str) -> list[str]:
        if not self.per_file_ignores:
            return []  # (resolving the path is most of a cache lookup's time)
        relative = _relative(path, self.root)
        codes: list[str] = []
        for pattern, ignored in self.per_file_ignores.items():
            if fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(os.path.basename(path), pattern):
                codes += ignored
        return codes


def _relative(path: str, root: Path) -> str:
    try:
        return Path(os.path.abspath(path)).relative_to(root.resolve()).as_posix()
    except ValueError:
        return Path(path).as_posix()


def find_pyproject(start: Path) -> Path | None:
    start = start.resolve()
    if start.is_file():
        start = start.parent
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def _codes(value, key: str, where: Path) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: [tool.tfmigrate] {key} must be a list of codes")
    return [v.strip().upper() for v in value]


def load_config(paths: list[str], config_file: str | None = None) -> Config:
    """Read the pyproject.toml nearest to the common folder of ``paths``."""
    if config_file:
        pyproject: Path | None = Path(config_file)
        if not pyproject.is_file():
            raise ConfigError(f"{config_file}: no such config file")
    else:
        existing = [os.path.abspath(p) for p in paths if os.path.exists(p)]
        start = Path(os.path.commonpath(existing)) if existing else Path.cwd()
        pyproject = find_pyproject(start) or find_pyproject(Path.cwd())
    if pyproject is None:
        return Config(root=Path.cwd())
    if sys.version_info >= (3, 11):  # here: a tree without a pyproject.toml never loads it
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with open(pyproject, "rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{pyproject}: {exc}") from None
    section = data.get("tool", {}).get("tfmigrate", {})
    config = Config(root=pyproject.parent, source=pyproject)
    known = {"select", "ignore", "per-file-ignores", "exclude", "target", "tower-input"}
    unknown = set(section) - known
    if unknown:
        raise ConfigError(f"{pyproject}: unknown [tool.tfmigrate] keys: {', '.join(sorted(unknown))}")
    if "select" in section:
        config.select = _codes(section["select"], "select", pyproject)
    if "ignore" in section:
        config.ignore = _codes(section["ignore"], "ignore", pyproject)
    if "per-file-ignores" in section:
        table = section["per-file-ignores"]
        if not isinstance(table, dict):
            raise ConfigError(f"{pyproject}: [tool.tfmigrate] per-file-ignores must be a table")
        config.per_file_ignores = {k: _codes(v, f"per-file-ignores.{k}", pyproject) for k, v in table.items()}
    if "exclude" in section:
        exclude = section["exclude"]
        if not isinstance(exclude, list) or not all(isinstance(v, str) for v in exclude):
            raise ConfigError(f"{pyproject}: [tool.tfmigrate] exclude must be a list of patterns")
        config.exclude = list(exclude)
    if "target" in section:
        if section["target"] not in TARGETS:
            raise ConfigError(f"{pyproject}: [tool.tfmigrate] target must be one of {', '.join(TARGETS)}")
        config.target = section["target"]
    if "tower-input" in section:
        if section["tower-input"] not in TOWER_INPUTS:
            raise ConfigError(f"{pyproject}: [tool.tfmigrate] tower-input must be one of {', '.join(TOWER_INPUTS)}")
        config.tower_input = section["tower-input"]
    return config
