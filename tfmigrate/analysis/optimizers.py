"""Optimizers of the project's own that update the variables themselves.

`tf.train.Optimizer.apply_gradients`, run in a replica, hands the gradients to the strategy,
which sums them across the replicas before any variable changes (a `merge_call` into
`_distributed_apply`). A class of the project that overrides `apply_gradients` (or `minimize`)
with its own update (google-research/bert's `AdamWeightDecayOptimizer`:
`param.assign(param - learning_rate * update)`) skips that: run by each replica, it updates
each replica's copy of a weight from that replica's gradients alone. A class that overrides
only the per-variable `_apply_dense`/`_resource_apply_dense` is fine: those run after the sum.

The optimizer is followed from the receiver of the update call (`opt`, `self.optimizer`) to
what the module assigns it, through a factory function (`create_optimizer(...)`) to what it
returns, into the module or another module of the project (:mod:`.project_imports`).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from tfmigrate.analysis.project_imports import project_definition
from tfmigrate.cst.codegen import code
from tfmigrate.cst.names import ImportTable
from tfmigrate.cst.traversal import assignments, find

__all__ = ["HandWritten", "hand_written_update"]

_UPDATES = ("apply_gradients", "minimize")
_LIBRARIES = ("tensorflow", "keras", "tf_keras")


@dataclass(frozen=True)
class HandWritten:
    """A project optimizer class whose own update skips the strategy."""

    name: str  # the class
    method: str  # the update it overrides
    node: cst.FunctionDef  # that method's def
    where: str | None  # its file (None: the module being checked)


@dataclass(frozen=True)
class _Where:
    """A module definitions are looked up in: the one being checked, or another of the project
    (``file``). ``path`` and ``read_paths`` are what :func:`project_definition` reads from a
    rule context."""

    module: cst.Module
    imports: ImportTable
    path: str
    read_paths: set[str]
    file: str | None = None


def hand_written_update(context, receiver: cst.BaseExpression) -> HandWritten | None:
    """The project's own optimizer class that the optimizer ``receiver`` is made by, if it
    overrides the update without handing it to the strategy, else None (a TensorFlow
    optimizer, or one the module does not show)."""
    here = _Where(context.module, context.imports, context.path, context.read_paths)
    for node in assignments(context).get(code(receiver), []):
        found = _made_by(here, node.value, depth=0)
        if found is not None:
            return found
    return None


def _made_by(where: _Where, value: cst.BaseExpression, depth: int) -> HandWritten | None:
    if not isinstance(value, cst.Call) or depth > 2:
        return None
    definition, home = _definition(where, value.func)
    if isinstance(definition, cst.ClassDef):
        method = next((s for s in definition.body.body if isinstance(s, cst.FunctionDef)
                       and s.name.value in _UPDATES and not _calls_super(s)), None)
        return None if method is None else HandWritten(name=definition.name.value, method=method.name.value,
                                                       node=method, where=home.file)
    if isinstance(definition, cst.FunctionDef):  # a factory: what it returns, or the name it returns
        for returned in find(definition.body, cst.Return):
            values = [returned.value]
            if isinstance(returned.value, cst.Name):
                values = [a.value for a in find(definition.body, cst.Assign)
                          if any(code(t.target) == returned.value.value for t in a.targets)]
            for candidate in values:
                found = _made_by(home, candidate, depth + 1)
                if found is not None:
                    return found
    return None


def _definition(where: _Where, func: cst.BaseExpression):
    """(The def or class ``func`` names, the module it is in), from this module or the project."""
    name = (where.imports.resolve(func) or "") if isinstance(func, (cst.Name, cst.Attribute)) else ""
    if name.split(".", 1)[0] in _LIBRARIES:
        return None, where
    if isinstance(func, cst.Name):
        local = next((s for s in where.module.body if isinstance(s, (cst.FunctionDef, cst.ClassDef))
                      and s.name.value == func.value), None)
        if local is not None:
            return local, where
    if "." not in name:
        return None, where
    module_name, _, attribute = name.rpartition(".")
    found = project_definition(where, module_name, 0, attribute)
    if found is None:
        return None, where
    home = _Where(found.tree, found.imports, str(found.path), where.read_paths, file=str(found.path))
    return found.definition, home


def _calls_super(method: cst.FunctionDef) -> bool:
    """Whether the override hands the update on to the base class (`super().apply_gradients(...)`)."""
    return any(isinstance(c.func, cst.Attribute) and c.func.attr.value == method.name.value
               and isinstance(c.func.value, cst.Call) and code(c.func.value.func) == "super"
               for c in find(method, cst.Call))
