"""A read-only walk over a LibCST tree, several times cheaper than ``node.visit(visitor)``.

``CSTNode.visit`` rebuilds every node it passes (``_visit_and_replace_children`` constructs
and validates a copy even for a read-only visitor, which then throws it away): a LibCST walk
costs more than the parse. The analyses here only read the tree, so :func:`visit_read_only`
reads each node's child fields directly, in the order LibCST's own walk visits them, and calls
the visitor's ``on_visit``/``on_leave`` on the same (original) nodes, in the same order: a
``visit_X`` that returns False skips the node's children, as with LibCST.

Two differences, both checked: per-field hooks (``visit_Call_func``) are not called (a visitor
that defines one is refused), and nodes that hold nothing but whitespace, comments and
punctuation are not entered unless the visitor has a method for one of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def child_fields(cls: type) -> tuple[str, ...]:
    """The fields LibCST's walk descends into, in its order.

    ``_visit_and_replace_children`` names each field it visits as a string constant
    (``visit_required(self, "func", self.func, visitor)``), in the order it visits them, so the
    constants of its code object, in order of first appearance, are that order.
    """
    order = _CHILD_FIELDS.get(cls)
    if order is None:
        fields = {f.name for f in dataclasses.fields(cls)}
        seen: list[str] = []
        for constant in cls._visit_and_replace_children.__code__.co_consts:
            if isinstance(constant, str) and constant in fields and constant not in seen:
                seen.append(constant)
        order = _CHILD_FIELDS[cls] = tuple(seen)
    return order


@functools.lru_cache(maxsize=None)
def trivia_types() -> frozenset:
    """Nodes that hold nothing but whitespace, comments and punctuation (a third of a tree)."""
    import libcst as cst

    def subclasses(base: type) -> set:
        found = set()
        for sub in base.__subclasses__():
            found |= {sub} | subclasses(sub)
        return found

    types = {
        cst.SimpleWhitespace, cst.ParenthesizedWhitespace, cst.TrailingWhitespace, cst.EmptyLine, cst.Newline,
        cst.Comment, cst.Comma, cst.Dot, cst.LeftParen, cst.RightParen, cst.LeftSquareBracket,
        cst.RightSquareBracket, cst.LeftCurlyBrace, cst.RightCurlyBrace, cst.Colon, cst.Semicolon,
        cst.AssignEqual, cst.ImportStar,
    }
    for base in (cst.BaseBinaryOp, cst.BaseBooleanOp, cst.BaseCompOp, cst.BaseUnaryOp, cst.BaseAugOp):
        types |= subclasses(base)
    return frozenset(t for t in types if not t.__name__.startswith("_"))


@functools.lru_cache(maxsize=None)
def visitor_method_names(cls: type) -> tuple[str, ...]:
    """The visit_/leave_ methods a visitor class really defines (not LibCST's no-op stubs).

    LibCST's ``visit_batched`` finds them with ``inspect.getmembers`` on every visitor instance
    of every file; over the hundreds of stubs of a visitor class that took 12 ms per rule per
    file, more than parsing. A class's methods do not change: look once per class.
    """
    # Only the classes of the hierarchy that are not LibCST's own are read: dir() over the
    # stubs took 3 ms a rule class, a tenth of a one-file run. Sorted, as dir() gives them.
    names = {
        name
        for klass in cls.__mro__ if not klass.__module__.startswith("libcst.")
        for name in vars(klass) if name.startswith(("visit_", "leave_"))
    }
    return tuple(
        name for name in sorted(names)
        if callable(getattr(cls, name)) and not getattr(getattr(cls, name), "_is_no_op", False)
    )


def is_attribute_hook(name: str) -> bool:
    """``visit_Call_func`` (called around one field's children), as opposed to ``visit_Call``:
    node class names have no underscore."""
    return "_" in name.split("_", 1)[1]


def skipped_types(method_names) -> frozenset:
    """The trivia types a walk may skip: none if a method is about one of them."""
    skip = trivia_types()
    wanted = {name.split("_", 1)[1] for name in method_names}
    return frozenset() if any(t.__name__ in wanted for t in skip) else skip


def walk(root: Any, on_visit: Callable[[Any], Any], on_leave: Callable[[Any], Any], skip: frozenset) -> None:
    """Depth first, LibCST's order: ``on_visit(node)`` (False: not into its children), the
    children, ``on_leave(node)``."""
    import libcst as cst

    # Whether a value is a node to walk into, by type (isinstance on LibCST's abstract node
    # classes is slow, and a tree has few distinct types).
    walkable: dict[type, bool] = {tuple: False, list: False, str: False}
    fields_of = _CHILD_FIELDS

    def is_walkable(kind: type) -> bool:
        walkable[kind] = answer = issubclass(kind, cst.CSTNode) and kind not in skip
        return answer

    def step(node) -> None:
        if on_visit(node) is not False:
            cls = type(node)
            for field_name in fields_of.get(cls) or child_fields(cls):
                value = getattr(node, field_name)
                kind = type(value)
                if kind is tuple or kind is list:
                    for child in value:
                        child_kind = type(child)
                        answer = walkable.get(child_kind)
                        if answer or (answer is None and is_walkable(child_kind)):
                            step(child)
                else:
                    answer = walkable.get(kind)
                    if answer or (answer is None and is_walkable(kind)):
                        step(value)
        on_leave(node)

    step(root)


def visit_read_only(root: Any, visitor: Any) -> None:
    """``root.visit(visitor)`` for a visitor that only reads the tree (see the module doc)."""
    names = visitor_method_names(type(visitor))
    hooks = [name for name in names if is_attribute_hook(name)]
    if hooks:
        raise TypeError(f"{type(visitor).__name__}.{hooks[0]}: per-field hooks need LibCST's own walk")
    walk(root, visitor.on_visit, visitor.on_leave, skipped_types(names))
