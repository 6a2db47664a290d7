"""Where a `multi_gpu_model` call sits, and the guards whose fallback is its template.

Keras programs guard the parallel model: `try: parallel = multi_gpu_model(model) except
ValueError: parallel = model`, `if gpus > 1: model = multi_gpu_model(model)`. With fewer GPUs
they train the template, which is what a MirroredStrategy over one device does, so such a guard
can go with the call. :class:`StatementBlocks` records the block of every statement and call.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import single_small

__all__ = ["StatementBlocks", "fallback_guards", "is_call_line", "single_assign"]


def single_assign(statement: cst.BaseStatement) -> tuple[str, cst.BaseExpression] | None:
    """``name = value`` (or ``self.name = value``) as the only statement of a line: (name, value)."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    small = statement.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1 and dotted_name(small.targets[0].target) is not None:
        return dotted_name(small.targets[0].target), small.value
    if isinstance(small, cst.AnnAssign) and dotted_name(small.target) is not None and small.value is not None:
        return dotted_name(small.target), small.value
    return None


def is_call_line(statement: cst.BaseStatement) -> bool:
    """A line that is one call (`print(...)`, `logger.info(...)`)."""
    small = single_small(statement)
    return isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)


class StatementBlocks(cst.CSTVisitor):
    """For every call: the statement it is in, as (the statements of its block, index)."""

    def __init__(self) -> None:
        self.of_call: dict[int, tuple[tuple[cst.BaseStatement, ...], int]] = {}
        # id(the one statement of a `try:` or `if:` body) -> the try or if
        self.guarded: dict[int, cst.Try | cst.If] = {}
        self._where: dict[int, tuple[tuple[cst.BaseStatement, ...], int]] = {}
        self._stack: list[tuple[tuple[cst.BaseStatement, ...], int]] = []

    def where(self, statement: cst.BaseStatement) -> tuple[tuple[cst.BaseStatement, ...], int] | None:
        """The statements of the block ``statement`` is in, and its index there."""
        return self._where.get(id(statement))

    def visit_Try(self, node: cst.Try) -> None:
        self._guard(node)

    def visit_If(self, node: cst.If) -> None:
        self._guard(node)  # `if gpus > 1: model = multi_gpu_model(...)`

    def _guard(self, node: cst.Try | cst.If) -> None:
        # The call alone, or with log lines around it (`print("[INFO] training with 2 GPUs...")`).
        others = [s for s in node.body.body if not is_call_line(s)]
        if len(others) == 1:
            self.guarded[id(others[0])] = node
        elif not others:  # the call is itself a call line (`model = ...` is not; `fit(...)` would be)
            self.guarded[id(node.body.body[0])] = node

    def _record(self, body) -> None:
        for index, statement in enumerate(body):
            self._where[id(statement)] = (tuple(body), index)

    def visit_Module(self, node: cst.Module) -> None:
        self._record(node.body)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._record(node.body)

    def on_visit(self, node: cst.CSTNode) -> bool:
        if id(node) in self._where:
            self._stack.append(self._where[id(node)])
        if isinstance(node, cst.Call) and self._stack:
            self.of_call[id(node)] = self._stack[-1]
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if id(original_node) in self._where:
            self._stack.pop()
        super().on_leave(original_node)


def fallback_guards(module: cst.Module, blocks: StatementBlocks, statement: cst.BaseStatement, target: str | None,
                    model: str) -> list[cst.Try | cst.If]:
    """The guards around the call's statement, innermost first, each the only statement of
    the next, whose fallback is the template (`try: p = multi_gpu_model(m) except ValueError:
    p = m`; `if gpus > 1: m = multi_gpu_model(m)`; a Kaggle kernel's `try` inside `if gpus > 1:`):
    with fewer GPUs the program trains the template, which a MirroredStrategy does anyway."""
    guards: list[cst.Try | cst.If] = []
    guard = blocks.guarded.get(id(statement))
    while guard is not None and _falls_back_to_template(module, guard, target, model) and blocks.where(guard):
        guards.append(guard)
        guard = blocks.guarded.get(id(guard))
    return guards


def _falls_back_to_template(module: cst.Module, guard: cst.Try | cst.If, target: str | None, model: str) -> bool:
    if isinstance(guard, cst.If):
        return _otherwise_template(module, guard, target, model)
    return _excepts_to_template(module, guard, target, model)


def _otherwise_template(module: cst.Module, guard: cst.If, target: str | None, model: str) -> bool:
    """`if gpus > 1: target = multi_gpu_model(model, ...)` whose `else` (if any) sets `target =
    model` and otherwise only logs: with one GPU the program trains the template, which is
    what a MirroredStrategy over one device does; with more, what the parallel model did.
    Without an `else`, only where the parallel model takes the template's name."""
    if target is None or isinstance(guard.orelse, cst.If):
        return False
    if guard.orelse is None:
        return target == model
    statements = guard.orelse.body.body
    assigns = [single_assign(s) for s in statements]
    sets_template = any(a is not None and a[0] == target and _code(module, a[1]) == model for a in assigns)
    return (sets_template or target == model) and all(
        (a is not None and a[0] == target and _code(module, a[1]) == model) or is_call_line(s)
        for a, s in zip(assigns, statements))


def _excepts_to_template(module: cst.Module, guard: cst.Try, target: str | None, model: str) -> bool:
    """`try: target = multi_gpu_model(model, ...)` whose every `except` (ValueError, Exception
    or bare: fewer GPUs than asked) sets `target = model` (or, where the target is the model's
    own name, passes) and otherwise only logs."""
    if target is None or guard.orelse is not None or guard.finalbody is not None or not guard.handlers:
        return False
    for handler in guard.handlers:
        caught = _code(module, handler.type) if handler.type is not None else "Exception"
        if not any(name in caught for name in ("ValueError", "Exception")):
            return False
        statements = handler.body.body
        assigns = [single_assign(s) for s in statements]
        # `try: model = multi_gpu_model(model) except: pass` keeps the template under its own name.
        kept = target == model and all(isinstance(single_small(s), cst.Pass) or is_call_line(s) for s in statements)
        if not kept and not any(a is not None and a[0] == target and _code(module, a[1]) == model for a in assigns):
            return False
        if not kept and not all(a is not None or is_call_line(s) for a, s in zip(assigns, statements)):
            return False
    return True


def _code(module: cst.Module, node: cst.CSTNode) -> str:
    return module.code_for_node(node).strip()
