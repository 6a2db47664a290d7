"""Which names a run of statements reads before binding them again.

The tower rewrite shares with the code after the loop only the names whose tower values that
code reads (`loss` printed after the loop), not those it binds afresh first (`grads = []` of an
averaging loop that reuses the name): a shared name can be overwritten by another replica
while the first waits at a cross-replica step, so the fewer the better.

Statements are taken in the order they run; a loop's body once (it may also not run); a name
bound in only some branches of an `if`, a loop or a `try` is still unbound after it. Reads
inside nested functions and classes count, at the point they are defined (they may run later):
a function's reads of names it binds itself first are its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import libcst as cst

from tfmigrate.cst.traversal import find, free_names

__all__ = ["first_reader", "reads_first"]


def reads_first(statements: Iterable[cst.CSTNode], names: set[str]) -> set[str]:
    """The ``names`` that ``statements`` read before binding them again."""
    read: set[str] = set()
    _scan(list(statements), set(names), read)
    return read


def first_reader(statements: Iterable[cst.CSTNode], pending: set[str]) -> cst.CSTNode | None:
    """The first of ``statements`` that reads one of the ``pending`` names before binding it
    again, else None. ``pending`` loses the names they bind first, so that a caller can go on
    with the statements after the block around them."""
    for statement in statements:
        if not pending:
            return None
        read: set[str] = set()
        _statement(statement, pending, read)
        if read:
            return statement
    return None


def _scan(statements: Sequence[cst.CSTNode], pending: set[str], read: set[str]) -> None:
    for statement in statements:
        if not pending:
            return
        _statement(statement, pending, read)


def _statement(node: cst.CSTNode, pending: set[str], read: set[str]) -> None:
    if isinstance(node, cst.SimpleStatementLine):
        for small in node.body:
            _small(small, pending, read)
    elif isinstance(node, cst.If):
        _reads(node.test, pending, read)
        orelse = node.orelse
        other = [] if orelse is None else ([orelse] if isinstance(orelse, cst.If) else list(orelse.body.body))
        _branches([list(node.body.body), other], pending, read)
    elif isinstance(node, cst.For):
        _reads(node.iter, pending, read)
        body = [cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(node.target)], cst.Name("None"))]),
                *node.body.body]  # the target is bound only when the body runs
        _branches([body, []], pending, read)
        if node.orelse is not None:
            _branches([list(node.orelse.body.body), []], pending, read)
    elif isinstance(node, cst.While):
        _reads(node.test, pending, read)
        _branches([list(node.body.body), []], pending, read)
    elif isinstance(node, cst.With):
        for item in node.items:
            _reads(item.item, pending, read)
            if item.asname is not None:
                _bind(item.asname.name, pending, read)
        _scan(list(node.body.body), pending, read)
    elif isinstance(node, cst.Try):
        handlers = [list(handler.body.body) for handler in node.handlers]
        main = list(node.body.body) + (list(node.orelse.body.body) if node.orelse is not None else [])
        _branches([main, *handlers], pending, read)
        if node.finalbody is not None:
            _scan(list(node.finalbody.body.body), pending, read)
    elif isinstance(node, cst.FunctionDef):
        # Defaults and decorators run now; the body, when called, reads what it does not bind.
        for part in (*node.decorators, node.params):
            _reads(part, pending, read)
        parameters = {param.name.value for param in find(node.params, cst.Param)}
        _scan(list(node.body.body), pending - parameters, read)
        pending.discard(node.name.value)
    elif isinstance(node, cst.ClassDef):
        _reads(node, pending, read)
        pending.discard(node.name.value)
    else:
        _reads(node, pending, read)


def _small(small: cst.CSTNode, pending: set[str], read: set[str]) -> None:
    if isinstance(small, cst.Assign):
        _reads(small.value, pending, read)
        for target in small.targets:
            _bind(target.target, pending, read)
    elif isinstance(small, cst.AnnAssign):
        if small.value is not None:
            _reads(small.value, pending, read)
            _bind(small.target, pending, read)
    else:  # `x += 1` reads `x`; anything else reads what it names
        _reads(small, pending, read)


def _bind(target: cst.CSTNode, pending: set[str], read: set[str]) -> None:
    if isinstance(target, cst.Name):
        pending.discard(target.value)
    elif isinstance(target, (cst.Tuple, cst.List)):
        for element in target.elements:
            _bind(element.value, pending, read)
    elif isinstance(target, cst.StarredElement):
        _bind(target.value, pending, read)
    else:  # `x.a = ...`, `x[i] = ...` read `x`
        _reads(target, pending, read)


def _reads(node: cst.CSTNode, pending: set[str], read: set[str]) -> None:
    read |= free_names(node, keywords=False) & pending  # `f(x=1)` does not read `x`


def _branches(branches: list[list[cst.CSTNode]], pending: set[str], read: set[str]) -> None:
    """Run each branch from the same state; what any leaves unbound stays unbound."""
    after: set[str] = set()
    for branch in branches:
        state = set(pending)
        _scan(branch, state, read)
        after |= state
    pending.intersection_update(after)
