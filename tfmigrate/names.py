"""Resolving what a name refers to, from the module's own import table.

LibCST's ``QualifiedNameProvider`` answers this exactly but needs full scope analysis, which
costs ten times the parse on typical files. Legacy TensorFlow code binds its modules with plain
imports (``import tensorflow as tf``, ``from tensorflow.compat import v1``), so a table of the
module's imports answers the same question for the names rules care about. The trade-off,
documented in the README: a local variable that shadows an imported module name is not seen.
"""

from __future__ import annotations

import libcst as cst

# Spellings of the same API, mapped to one canonical spelling so that rules list each API once.
# Order matters: compat prefixes first, then Keras.
_CANONICAL_PREFIXES = (
    ("tensorflow.compat.v1.", "tensorflow."),
    ("tensorflow.compat.v2.", "tensorflow."),
    ("tensorflow._api.v1.", "tensorflow."),
    ("tensorflow._api.v2.", "tensorflow."),
    ("tensorflow.python.keras.", "keras."),
    ("tensorflow.contrib.keras.", "keras."),
    ("tensorflow.keras.", "keras."),
    ("tf_keras.", "keras."),
    ("tensorflow.train.queue_runner.", "tensorflow.train."),
    ("tensorflow.python.training.queue_runner_impl.", "tensorflow.train."),
    ("tensorflow.python.training.input.", "tensorflow.train."),
    ("tensorflow.python.training.coordinator.", "tensorflow.train."),
    ("tensorflow.contrib.slim.", "slim."),
    ("tf_slim.", "slim."),
)


def canonical(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix, replacement in _CANONICAL_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                changed = True
    return name


def dotted_name(node: cst.CSTNode) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        parts.append(node.value)
        return ".".join(reversed(parts))
    return None


class ImportTable(cst.CSTVisitor):
    """Maps each name bound by an import anywhere in the module to what it imports.

    Imports inside functions, ``try`` blocks and ``if`` branches count too: legacy code often
    imports ``multi_gpu_model`` conditionally. A later import of the same name wins.
    """

    def __init__(self) -> None:
        self.bindings: dict[str, str] = {}
        self.star_modules: list[str] = []

    @classmethod
    def from_module(cls, module: cst.Module) -> "ImportTable":
        table = cls()
        module.visit(table)
        return table

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            full = dotted_name(alias.name)
            if full is None:
                continue
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self.bindings[alias.asname.name.value] = full
            else:
                head = full.split(".", 1)[0]
                self.bindings[head] = head
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.relative or node.module is None:
            return False
        module = dotted_name(node.module)
        if module is None:
            return False
        if isinstance(node.names, cst.ImportStar):
            self.star_modules.append(module)
            return False
        for alias in node.names:
            imported = dotted_name(alias.name)
            if imported is None:
                continue
            bound = imported
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                bound = alias.asname.name.value
            self.bindings[bound] = f"{module}.{imported}"
        return False

    # The table is all we want; do not descend into expressions.
    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return any(isinstance(s, (cst.Import, cst.ImportFrom)) for s in node.body)

    def resolve(self, node: cst.CSTNode) -> str | None:
        """The canonical qualified name of a Name/Attribute chain, or None if not imported."""
        dotted = dotted_name(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        target = self.bindings.get(head)
        if target is None:
            if not self.star_modules:
                return None
            target = f"{self.star_modules[-1]}.{head}"
        full = f"{target}.{rest}" if rest else target
        return canonical(full)

    def is_bound(self, name: str) -> bool:
        return name in self.bindings

    def aliases_of(self, module: str) -> list[str]:
        """Local names bound to exactly ``module`` (canonicalised), e.g. ['tf'] for tensorflow."""
        return [n for n, t in self.bindings.items() if canonical(t + ".")[:-1] == module]
