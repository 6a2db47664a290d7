"""Functions a module imports from its own project, read from the files beside it.

A tower loop's helpers often live in another module of the same project (`from utils import
average_gradients`, `from .model_utils import average_grads`): whether such a helper averages
or sums the towers' gradients is a question about that file, which a rewrite can only answer
by reading it. Only the project's own Python files are read: the module named by the import,
looked up from the importing file's folder and up to :data:`_LEVELS_UP` folders above it (a
package root), or the folder a relative import names. Each file is parsed once per content
(its size and modification time stand for it); a file that cannot be read or parsed answers
nothing. Each file read is noted in the rule context (``read_paths``), and a result that
depends on one is not cached.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from tfmigrate.cst.names import ImportTable, dotted_name

__all__ = ["ProjectDefinition", "project_definition", "project_function"]

_LEVELS_UP = 3
_MAX_BYTES = 2_000_000  # a generated or vendored file this large is no helper module


@dataclass(frozen=True)
class ProjectDefinition:
    """A module-level function or class of another module of the project, with that module's
    imports."""

    definition: cst.FunctionDef | cst.ClassDef
    imports: ImportTable
    path: Path
    module: str  # as the import names it (`utils`; `model_utils` of `.model_utils`)
    level: int  # the dots of a relative import (0: absolute)
    tree: cst.Module  # the module it is defined in


def project_function(context, name: str) -> ProjectDefinition | None:
    """The function the module binds to ``name`` by importing it from a module of its own
    project (`from utils import average_grads [as avg]`), else None."""
    origin = _origin(context.module, name)
    found = project_definition(context, *origin) if origin is not None else None
    return found if found is not None and isinstance(found.definition, cst.FunctionDef) else None


def project_definition(context, module_name: str, level: int, name: str) -> ProjectDefinition | None:
    """The top-level def or class ``name`` of the project module ``module_name`` (imported
    with ``level`` dots), read from its file, else None."""
    if not context.path or not os.path.isfile(context.path):
        return None
    for path in _candidates(Path(context.path).resolve().parent, module_name, level):
        parsed = _parsed(str(path))
        if parsed is None:
            continue
        module, imports = parsed
        context.read_paths.add(str(path))
        for statement in module.body:
            if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and statement.name.value == name:
                return ProjectDefinition(statement, imports, path, module_name, level, module)
        return None  # the module is found, and it does not define the name itself
    return None


def _origin(module: cst.Module, name: str) -> tuple[str, int, str] | None:
    """(The module, its relative-import level, the function's name there) of the top-level
    `from <module> import <function> [as <name>]` that binds ``name``."""
    for statement in module.body:
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) and statement.body else None
        if not isinstance(small, cst.ImportFrom) or isinstance(small.names, cst.ImportStar):
            continue
        for alias in small.names:
            bound = alias.asname.name if alias.asname is not None else alias.name
            if isinstance(bound, cst.Name) and bound.value == name and isinstance(alias.name, cst.Name):
                source = dotted_name(small.module) if small.module is not None else ""
                return (source or "", len(small.relative), alias.name.value) if source is not None else None
    return None


def _candidates(folder: Path, module_name: str, level: int) -> list[Path]:
    """The files `module_name` may be, most likely first."""
    parts = [part for part in module_name.split(".") if part]
    folders = [folder, *folder.parents]  # the importing file's own, then each one above it
    if level:  # `from .utils import f` (level 1) is the importing file's own folder
        roots = folders[level - 1:level]
    else:
        roots = folders[:_LEVELS_UP + 1]
    found = []
    for root in roots:
        if not parts:  # `from . import utils`-style imports name a module, not a function
            continue
        found += [root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")]
    return found


def _parsed(path: str) -> tuple[cst.Module, ImportTable] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    if info.st_size > _MAX_BYTES:
        return None
    return _parse(path, info.st_mtime_ns, info.st_size)


@functools.lru_cache(maxsize=64)
def _parse(path: str, mtime_ns: int, size: int) -> tuple[cst.Module, ImportTable] | None:
    try:
        module = cst.parse_module(Path(path).read_bytes())
    except (OSError, cst.ParserSyntaxError, UnicodeDecodeError, RecursionError, ValueError):
        return None
    return module, ImportTable.from_module(module)
