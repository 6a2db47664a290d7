"""Resolving what a name refers to, from the module's own import table.

LibCST's ``QualifiedNameProvider`` answers this exactly but needs full scope analysis, which
costs ten times the parse on typical files. Legacy TensorFlow code binds its modules with plain
imports (``import tensorflow as tf``, ``from tensorflow.compat import v1``), so a table of the
module's imports answers the same question for the names rules care about. The trade-off,
documented in the README: a local variable that shadows an imported module name is not seen.

Besides imports, the table knows plain module aliases made by assignment (``slim =
tf.contrib.slim``, ``v1 = tf.compat.v1``): a name assigned a dotted name whose head is itself
imported, and assigned nothing else anywhere in the module. Names the module binds itself
(functions, classes, parameters, assignment and loop targets) are never resolved through a
star import.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.walker import visit_read_only

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
    # Keras 2.0.x/2.1.x homes of multi_gpu_model.
    ("keras.utils.training_utils.", "keras.utils."),
    ("keras.utils.multi_gpu_utils.", "keras.utils."),
    ("tensorflow.train.queue_runner.", "tensorflow.train."),
    ("tensorflow.python.training.queue_runner_impl.", "tensorflow.train."),
    ("tensorflow.python.training.input.", "tensorflow.train."),
    ("tensorflow.python.training.coordinator.", "tensorflow.train."),
    ("tensorflow.python.training.queue_runner.", "tensorflow.train."),
    ("tensorflow.python.training.supervisor.", "tensorflow.train."),
    ("tensorflow.contrib.slim.", "slim."),
    ("tf_slim.", "slim."),
    # Keras 1/2's TensorFlow backend re-exports TensorFlow itself: `K.tf.device('/gpu:0')`.
    ("keras.backend.tensorflow_backend.", "keras.backend."),
    ("keras.backend.tf.", "tensorflow."),
)


def _blocks_in(statement: cst.CSTNode) -> list[cst.CSTNode]:
    """The statements directly inside a compound statement, in source order (a one-line
    body, ``if x: import y``, as its SimpleStatementSuite)."""
    found: list = []

    def add(suite) -> None:
        if isinstance(suite, cst.IndentedBlock):
            found.extend(suite.body)
        else:
            found.append(suite)  # SimpleStatementSuite

    body = getattr(statement, "body", None)
    if isinstance(body, cst.BaseSuite):
        add(body)
    for clause in (*getattr(statement, "handlers", ()), *getattr(statement, "cases", ())):
        add(clause.body)
    orelse = getattr(statement, "orelse", None)
    if isinstance(orelse, cst.If):  # elif
        found.append(orelse)
    elif orelse is not None:
        add(orelse.body)
    finalbody = getattr(statement, "finalbody", None)
    if finalbody is not None:
        add(finalbody.body)
    return found


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
    imports ``multi_gpu_model`` conditionally. A later import of the same name wins for
    ``resolve``; ``resolve_all`` answers every import of the name (both arms of a
    ``try``/``except ImportError``).
    """

    def __init__(self) -> None:
        self.bindings: dict[str, str] = {}
        self.all_bindings: dict[str, list[str]] = {}
        self.star_modules: list[str] = []
        #: ``slim = tf.contrib.slim``: name -> full dotted target (kept apart from imports).
        self.aliases: dict[str, str] = {}
        self._reassigned: set[str] = set()
        self._local_defs: set[str] = set()

    @classmethod
    def from_module(cls, module: cst.Module) -> "ImportTable":
        table = cls()
        # Everything the table reads is a statement (or a function's parameters), so only
        # statements are walked. The exception is a lambda's parameters, which only matter
        # beside a star import: then the whole tree is walked.
        table._statements(module.body)
        if table.star_modules:
            table = cls()
            visit_read_only(module, table)
        for name in table._reassigned:
            table.aliases.pop(name, None)
        return table

    def _statements(self, statements) -> None:
        """The table's visit_X methods over ``statements`` and the statements in them, in
        the order of a walk of the tree."""
        for statement in statements:
            kind = type(statement)
            if kind is cst.SimpleStatementLine or kind is cst.SimpleStatementSuite:
                for small in statement.body:
                    visit = _SMALL_STATEMENT_VISITS.get(type(small))
                    if visit is not None:
                        visit(self, small)
                continue
            if kind is cst.FunctionDef:
                self.visit_FunctionDef(statement)
                params = statement.params
                for param in (*params.posonly_params, *params.params, params.star_arg, *params.kwonly_params,
                              params.star_kwarg):
                    if isinstance(param, cst.Param):
                        self.visit_Param(param)
            elif kind is cst.ClassDef:
                self.visit_ClassDef(statement)
            elif kind is cst.For:
                self.visit_For(statement)
            for named in (*getattr(statement, "items", ()), *getattr(statement, "handlers", ())):
                # `with ... as x`, `except ... as x`
                as_name = getattr(named, "asname", None) or getattr(named, "name", None)
                if isinstance(as_name, cst.AsName):
                    self.visit_AsName(as_name)
            self._statements(_blocks_in(statement))

    def _bind(self, name: str, target: str) -> None:
        self.bindings[name] = target
        seen = self.all_bindings.setdefault(name, [])
        if target not in seen:
            seen.append(target)

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            full = dotted_name(alias.name)
            if full is None:
                continue
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self._bind(alias.asname.name.value, full)
            else:
                head = full.split(".", 1)[0]
                self._bind(head, head)
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
            self._bind(bound, f"{module}.{imported}")
        return False

    def visit_Assign(self, node: cst.Assign) -> bool:
        target = node.targets[0].target if len(node.targets) == 1 else None
        if isinstance(target, cst.Name) and isinstance(node.value, (cst.Name, cst.Attribute)):
            value = self._full(node.value)
            earlier = self.aliases.get(target.value)
            if value is not None and earlier is not None and canonical(value) != canonical(earlier):
                self._reassigned.add(target.value)  # two different aliases: trust neither
            elif value is not None:
                self.aliases[target.value] = value
                return False
        for assign_target in node.targets:
            self._note_assigned(assign_target.target)
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> bool:
        self._note_assigned(node.target)
        return False

    def visit_AugAssign(self, node: cst.AugAssign) -> bool:
        self._note_assigned(node.target)
        return False

    def _note_assigned(self, target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name):
            self._reassigned.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._note_assigned(element.value)
        elif isinstance(target, cst.StarredElement):
            self._note_assigned(target.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._local_defs.add(node.name.value)
        return True

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._local_defs.add(node.name.value)
        return True

    def visit_Param(self, node: cst.Param) -> bool:
        self._local_defs.add(node.name.value)
        return False

    def visit_For(self, node: cst.For) -> bool:
        self._note_assigned(node.target)
        return True

    def visit_AsName(self, node: cst.AsName) -> bool:
        self._note_assigned(node.name)  # with ... as x, except ... as x (imports return early)
        return False

    # The table is all we want; do not descend into expressions.
    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return any(
            isinstance(s, (cst.Import, cst.ImportFrom, cst.Assign, cst.AnnAssign, cst.AugAssign))
            for s in node.body
        )

    def _target(self, head: str) -> str | None:
        target = self.aliases.get(head)
        if target is None:
            target = self.bindings.get(head)
        return target

    def _full(self, node: cst.CSTNode) -> str | None:
        """The dotted name a chain refers to, not yet canonicalised; None if not imported."""
        dotted = dotted_name(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        target = self._target(head)
        if target is None:
            if not self.star_modules or head in self._local_defs or head in self._reassigned:
                return None
            target = f"{self.star_modules[-1]}.{head}"
        return f"{target}.{rest}" if rest else target

    def resolve(self, node: cst.CSTNode) -> str | None:
        """The canonical qualified name of a Name/Attribute chain, or None if not imported."""
        full = self._full(node)
        return None if full is None else canonical(full)

    def resolve_all(self, node: cst.CSTNode) -> list[str]:
        """Every canonical name the chain may refer to: one per import of its head (the
        ``try``/``except ImportError`` arms), else per star import; ``[]`` if not imported."""
        dotted = dotted_name(node)
        if dotted is None:
            return []
        head, _, rest = dotted.partition(".")
        if head in self.aliases:
            targets = [self.aliases[head]]
        elif head in self.all_bindings:
            targets = list(self.all_bindings[head])
        elif head in self._local_defs or head in self._reassigned:
            targets = []
        else:
            targets = [f"{module}.{head}" for module in self.star_modules]
        found: list[str] = []
        for target in targets:
            name = canonical(f"{target}.{rest}" if rest else target)
            if name not in found:
                found.append(name)
        return found

    def is_bound(self, name: str) -> bool:
        return name in self.bindings or name in self.aliases

    def aliases_of(self, module: str) -> list[str]:
        """Local names bound to exactly ``module`` (canonicalised), e.g. ['tf'] for tensorflow."""
        return [n for n, t in self.bindings.items() if canonical(t + ".")[:-1] == module]


_SMALL_STATEMENT_VISITS = {
    cst.Import: ImportTable.visit_Import, cst.ImportFrom: ImportTable.visit_ImportFrom,
    cst.Assign: ImportTable.visit_Assign, cst.AnnAssign: ImportTable.visit_AnnAssign,
    cst.AugAssign: ImportTable.visit_AugAssign,
}
