"""Generic, read-only CST traversal: children, walk, find, parents, the names an expression reads.

`CSTNode.visit` rebuilds every node it passes (a full walk costs about as much as parsing),
and matcher `findall` adds more on top. The analysis and the rewrites only read the tree, so
this walks the dataclass fields directly and skips whitespace and punctuation.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from typing import Callable, Iterator

import libcst as cst

from tfmigrate.cst.codegen import code
from tfmigrate.cst.names import dotted_name

_LEAVES = (
    cst.BaseParenthesizableWhitespace,
    cst.TrailingWhitespace,
    cst.EmptyLine,
    cst.Newline,
    cst.Comment,
    cst.Comma,
    cst.Dot,
    cst.LeftParen,
    cst.RightParen,
    cst.AssignEqual,
    cst.Colon,
    cst.Semicolon,
)
_FIELDS: dict[type, tuple[str, ...]] = {}
# Fields that only ever hold whitespace, comments or punctuation, whatever the node type.
_TRIVIA_FIELDS = frozenset({
    "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace", "comma", "colon", "semicolon", "dot",
    "equal", "newline", "leading_lines", "lines_after_decorators", "trailing_whitespace", "header", "footer",
})


def blank_lines_unindented(statement: cst.BaseStatement) -> cst.BaseStatement:
    """``statement`` with its blank leading lines unindented: a statement moved one level
    deeper must not gain trailing whitespace on them."""
    lines = [line.with_changes(indent=False) if line.comment is None else line for line in statement.leading_lines]
    return statement.with_changes(leading_lines=lines)


# id(node) -> (node, its children): the analyses walk the same statements many times over. An
# entry holds its node, so the id cannot be reused while it lives; bounded, and emptied for
# each file (index_module), not to hold on to the trees of files done with.
_CHILDREN: dict[int, tuple[cst.CSTNode, tuple[cst.CSTNode, ...]]] = {}
_CHILDREN_KEPT = 200_000


def children(node: cst.CSTNode) -> tuple[cst.CSTNode, ...]:
    """The child nodes of ``node`` that can hold code, in source order."""
    known = _CHILDREN.get(id(node))
    if known is not None and known[0] is node:
        return known[1]
    found = _children(node)
    if len(_CHILDREN) >= _CHILDREN_KEPT:
        _CHILDREN.clear()
    _CHILDREN[id(node)] = (node, found)
    return found


def _children(node: cst.CSTNode) -> tuple[cst.CSTNode, ...]:
    cls = type(node)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(
            f.name for f in dataclasses.fields(cls)
            if f.name not in _TRIVIA_FIELDS and not f.name.startswith("whitespace_")
        )
    holds_code = _HOLDS_CODE
    found: list[cst.CSTNode] = []
    for name in names:
        value = getattr(node, name)
        kind = type(value)
        if kind is tuple or kind is list:
            for item in value:
                answer = holds_code.get(type(item))
                if answer or (answer is None and _holds_code(type(item))):
                    found.append(item)
        else:
            answer = holds_code.get(kind)
            if answer or (answer is None and _holds_code(kind)):
                found.append(value)
    return tuple(found)


_HOLDS_CODE: dict[type, bool] = {}


def _holds_code(kind: type) -> bool:
    """Whether nodes of this type can contain code (isinstance against LibCST's abstract
    classes is slow, and this is asked millions of times: remember the answer per type)."""
    answer = _HOLDS_CODE.get(kind)
    if answer is None:
        answer = _HOLDS_CODE[kind] = issubclass(kind, cst.CSTNode) and not issubclass(kind, _LEAVES)
    return answer


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """``node`` and every node under it, in pre-order."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(children(current)))


def events(node: cst.CSTNode) -> Iterator[tuple[cst.CSTNode, bool]]:
    """(node, True) on entering and (node, False) on leaving each node under ``node``."""
    stack: list[tuple[cst.CSTNode, bool]] = [(node, True)]
    while stack:
        current, entering = stack.pop()
        yield current, entering
        if entering:
            stack.append((current, False))
            stack.extend((child, True) for child in reversed(children(current)))


def name_nodes(root: cst.CSTNode) -> dict[str, list[cst.Name]]:
    """name -> the Name nodes under ``root`` with that value, in source order."""
    index = _INDEX[0]
    if index is not None and root is index.module:  # asked of the module over and over
        if index.names is None:
            index.names = _name_nodes(root)
        return index.names
    return _name_nodes(root)


@functools.lru_cache(maxsize=16)  # rewrites ask the same few blocks about many names
def _name_nodes(root: cst.CSTNode) -> dict[str, list[cst.Name]]:
    index: dict[str, list[cst.Name]] = {}
    for node in find(root, cst.Name):
        index.setdefault(node.value, []).append(node)
    return index


def fresh_name(module: cst.Module | None, name: str, taken: set[str] | None = None) -> str:
    """``name``, or ``name_2``, ``name_3``...: the first that the module does not use and that is
    not in ``taken`` (to which it is then added); with no module, the first not in ``taken``."""
    taken = taken if taken is not None else set()
    used = name_nodes(module) if module is not None else {}
    candidate = first_free(lambda candidate: candidate in taken or candidate in used, name)
    taken.add(candidate)
    return candidate


def first_free(taken: cst.Module | Callable[[str], bool], *candidates: str) -> str:
    """The first of ``candidates`` that is not taken (by a module: a name it uses; or as
    ``taken(name)`` says), else the last one numbered: ``name_2``, ``name_3``..."""
    if isinstance(taken, cst.Module):
        taken = name_nodes(taken).__contains__
    free = next((candidate for candidate in candidates if not taken(candidate)), None)
    if free is not None:
        return free
    k = 2
    while taken(f"{candidates[-1]}_{k}"):
        k += 1
    return f"{candidates[-1]}_{k}"


def parents_of(root: cst.CSTNode) -> dict[int, cst.CSTNode]:
    """id(node) -> its parent, for every node under ``root`` that can hold code."""
    parents: dict[int, cst.CSTNode] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in children(node):
            parents[id(child)] = node
            stack.append(child)
    return parents


def find(node: cst.CSTNode, *types: type) -> list:
    """Every node of the given types under ``node`` (``node`` included), in pre-order."""
    wanted = concrete_types(types)
    index = _INDEX[0]
    if index is not None:
        found = index.find(node, wanted)
        if found is not None:
            return found
    return [n for n in walk(node) if type(n) in wanted]


def find_own(node: cst.CSTNode, *types: type) -> list:
    """The nodes of the given types among :func:`own_nodes` of ``node`` (outside nested
    functions, classes, lambdas and comprehensions), in pre-order."""
    wanted = concrete_types(types)
    index = _INDEX[0]
    if index is not None:
        found = index.find(node, wanted, own=True)
        if found is not None:
            return found
    return [n for n in own_nodes(node) if type(n) in wanted]


class _TypeIndex:
    """The nodes of one tree by type, each with its place in pre-order and where its subtree
    ends: the nodes of some types under a node of the module are then slices of the lists of
    those types, not a walk (the analyses ask thousands of times per tower file, mostly of the
    same few statements). A node of another tree (one a rewrite built) is not in it."""

    def __init__(self, root: cst.CSTNode) -> None:
        self.span: dict[int, tuple[cst.CSTNode, int, int]] = {}  # id -> (node, first, past its last)
        self.places: dict[type, list[int]] = {}
        self.nodes: dict[type, list[cst.CSTNode]] = {}
        order = 0
        stack: list[tuple[cst.CSTNode, bool]] = [(root, True)]
        while stack:
            node, entering = stack.pop()
            if not entering:
                self.span[id(node)] = (node, self.span[id(node)][1], order)
                continue
            self.span[id(node)] = (node, order, order)
            kind = type(node)
            self.places.setdefault(kind, []).append(order)
            self.nodes.setdefault(kind, []).append(node)
            order += 1
            stack.append((node, False))
            stack.extend((child, True) for child in reversed(children(node)))

    def find(self, node: cst.CSTNode, wanted: frozenset[type], own: bool = False) -> list | None:
        """As :func:`find` (``own``: as :func:`find_own`); None if ``node`` is not in this tree."""
        known = self.span.get(id(node))
        if known is None or known[0] is not node:
            return None
        _, first, end = known
        found = self._between(first, end, wanted)
        if own:
            found = self._outside_scopes(found, first, end)
        return [n for _, n in found]

    def _between(self, first: int, end: int, wanted: frozenset[type]) -> list[tuple[int, cst.CSTNode]]:
        """(place, node) of the nodes of the ``wanted`` types placed from ``first`` to before ``end``."""
        found: list[tuple[int, cst.CSTNode]] = []
        kinds = 0
        for kind in wanted:
            places = self.places.get(kind)
            if places is None:
                continue
            low, high = bisect.bisect_left(places, first), bisect.bisect_left(places, end)
            if low < high:
                kinds += 1
                found.extend(zip(places[low:high], self.nodes[kind][low:high]))
        if kinds > 1:
            found.sort(key=lambda item: item[0])
        return found

    def _outside_scopes(self, found: list, first: int, end: int) -> list:
        """``found`` less the nodes inside the scopes nested in the node placed at ``first``
        (the scopes themselves stay, as in :func:`own_nodes`)."""
        starts: list[int] = []
        ends: list[int] = []
        for place, scope in self._between(first + 1, end, _SCOPE_TYPES):
            if not ends or place >= ends[-1]:  # not inside the scope before
                starts.append(place)
                ends.append(self.span[id(scope)][2])
        if not starts:
            return found
        kept = []
        for place, node in found:
            k = bisect.bisect_right(starts, place) - 1
            if k < 0 or place == starts[k] or place >= ends[k]:
                kept.append((place, node))
        return kept


class _ModuleIndex:
    """A :class:`_TypeIndex` of each top-level statement of a module that a find looks into,
    made at the first such find (most of a module is never searched)."""

    def __init__(self, module: cst.Module, statement_of: dict[int, int]) -> None:
        self.module = module
        self.statement_of = statement_of  # id(node) -> its top-level statement's index, as far as known
        self.parts: dict[int, _TypeIndex] = {}
        self.names: dict[str, list[cst.Name]] | None = None  # name_nodes of the module

    def find(self, node: cst.CSTNode, wanted: frozenset[type], own: bool = False) -> list | None:
        if node is self.module:  # its children are its statements
            if own:
                return None  # (its functions and classes are scopes nested in it: walked)
            found = [node] if type(node) in wanted else []
            for statement, top in enumerate(node.body):
                found.extend(self._part(statement).find(top, wanted) or ())
            return found
        statement = self.statement_of.get(id(node))
        if statement is None or statement < 0:
            return None
        return self._part(statement).find(node, wanted, own)

    def _part(self, statement: int) -> _TypeIndex:
        part = self.parts.get(statement)
        if part is None:
            part = self.parts[statement] = _TypeIndex(self.module.body[statement])
        return part


# The index of the module being analysed (see index_module).
_INDEX: list[_ModuleIndex | None] = [None]


def index_module(module: cst.Module | None, statement_of: dict[int, int] | None = None) -> None:
    """Make ``find`` answer from an index of ``module`` (the file being analysed; None: no
    index), whose nodes' top-level statements ``statement_of`` gives (filled by the runner's
    walk as it goes), and forget what was remembered of the file before."""
    _CHILDREN.clear()
    _INDEX[0] = None if module is None else _ModuleIndex(module, {} if statement_of is None else statement_of)


@functools.lru_cache(maxsize=None)
def concrete_types(types: tuple[type, ...]) -> frozenset[type]:
    """The classes that are ``types`` or derive from them: ``type(node) in`` this set is
    ``isinstance(node, types)`` without the ABCMeta check every LibCST class goes through
    (several times slower; the rewrites ask it millions of times on a large file)."""
    found: set[type] = set()
    pending = list(types)
    while pending:
        kind = pending.pop()
        if kind not in found:
            found.add(kind)
            pending.extend(kind.__subclasses__())
    return frozenset(found)


def names_used(node: cst.CSTNode, *, keywords: bool = True) -> set[str]:
    """Every plain name read in an expression (attribute names like ``x.gpu`` excluded, and
    with ``keywords=False`` the names of keyword arguments too)."""
    return {name.value for name in name_reads(node, keywords=keywords)}


def name_reads(node: cst.CSTNode, *, keywords: bool = True, targets: bool = True,
               skipped_attributes: frozenset[str] | tuple[str, ...] = ()) -> list[cst.Name]:
    """The Name nodes behind :func:`names_used` (to replace a name where it is read). With
    ``targets=False`` not the names an assignment, a loop or a comprehension binds; not the
    names under an attribute in ``skipped_attributes`` (`x.shape`: what ``x`` is made of)."""
    found: list[cst.Name] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.Name):
            found.append(current)
        elif isinstance(current, cst.Attribute):
            if current.attr.value not in skipped_attributes:
                stack.append(current.value)
        elif not keywords and isinstance(current, cst.Arg):
            stack.append(current.value)
        elif not targets and isinstance(current, (cst.AssignTarget, cst.For, cst.CompFor)):
            stack.extend(child for child in children(current) if child is not current.target)
        else:
            stack.extend(children(current))
    return found


def free_names(node: cst.CSTNode, *, keywords: bool = True) -> set[str]:
    """Names ``node`` reads, less those its own comprehensions bind (`[g for g, v in pairs]`
    reads `pairs`, not `g`); with ``keywords=False`` not the names of keyword arguments."""
    return names_used(node, keywords=keywords) - set().union(*(names_used(comp.target) for comp in find(node, cst.CompFor)))


def identifiers(node: cst.CSTNode) -> set[str]:
    """Every name and attribute name in an expression (``FLAGS.num_gpus`` gives both)."""
    return {n.value for n in find(node, cst.Name)}


def contains(ancestor: cst.CSTNode, node: cst.CSTNode) -> bool:
    """Whether ``node`` (by identity) is ``ancestor`` or lies inside it (one walk: prefer
    ``enclosing_tower`` when asking about many nodes)."""
    return any(candidate is node for candidate in walk(ancestor))


def string_parts(node: cst.CSTNode) -> list[str]:
    """The literal text in an expression: strings, f-string pieces, concatenations."""
    return [s.value for s in find(node, cst.SimpleString, cst.FormattedStringText)]


def enclosing(node: cst.CSTNode, parents: dict[int, cst.CSTNode], kind: type) -> cst.CSTNode | None:
    """The nearest ancestor of ``node`` of type ``kind`` (a function, a class), else None."""
    while id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, kind):
            return node
    return None


def block_indentation(node: cst.CSTNode, parents: dict[int, cst.CSTNode], module: cst.Module) -> str:
    """The indentation of the block ``node`` is in: what LibCST puts before a continuation line
    inside it whose ``ParenthesizedWhitespace.indent`` is set."""
    blocks = []
    while id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, cst.IndentedBlock):
            blocks.append(module.default_indent if node.indent is None else node.indent)
    return "".join(reversed(blocks))


def module_parents(context) -> dict[int, cst.CSTNode]:
    """id(node) -> parent for the whole module: the rules' walk's own once it has visited every
    node (rules plan their rewrites in leave_Module), else computed. (The walk leaves out
    operators and punctuation, which have no children: going up from any node never meets one.)"""
    if context.walk_complete:
        return context.parents
    return context.memo("parents", lambda: parents_of(context.module))


def assignments(context) -> dict[str, list[cst.Assign]]:
    """The module's `target = value` statements (anywhere in it) by the target's code (`x`,
    `self.x`), walked once per file: several rewrites look up what a name is bound to."""

    def compute() -> dict[str, list[cst.Assign]]:
        found: dict[str, list[cst.Assign]] = {}
        for node in find(context.module, cst.Assign):
            for target in node.targets:
                found.setdefault(code(target.target), []).append(node)
        return found

    return context.memo("assignments", compute)


def init_of(cls: cst.ClassDef) -> cst.FunctionDef | None:
    """The class's own `__init__` (not a nested class's), else None."""
    return next((f for f in cls.body.body if isinstance(f, cst.FunctionDef) and f.name.value == "__init__"), None)


def single_small(statement: cst.CSTNode) -> cst.BaseSmallStatement | None:
    """The one small statement of a simple statement line (`x = f()`, `f()`), else None."""
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        return statement.body[0]
    return None


def assigned_pairs(statement: cst.CSTNode) -> list[tuple[cst.BaseExpression, cst.BaseExpression]] | None:
    """(target, value) of `x = v`, or of each element of `a.h, a.w = 16, 16` (a tuple of targets
    given a tuple of values, none starred); None for any other statement."""
    small = single_small(statement)
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
        return None
    target, value = small.targets[0].target, small.value
    if isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple) and len(target.elements) == len(value.elements) \
            and not any(isinstance(e, cst.StarredElement) for e in [*target.elements, *value.elements]):
        return [(t.value, v.value) for t, v in zip(target.elements, value.elements)]
    return [(target, value)]


# Nodes that open their own scope: names bound inside them are not the loop body's.
_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)
_SCOPE_TYPES = concrete_types(_SCOPES)


def own_nodes(node: cst.CSTNode, skipped: frozenset = frozenset(), into_scopes: bool = False):
    """The nodes of ``node`` outside nested functions, classes, lambdas and comprehensions
    (unless ``into_scopes``), and outside the nodes whose ids are in ``skipped``."""
    stack = [node]
    while stack:
        current = stack.pop()
        if id(current) in skipped:
            continue
        yield current
        if current is not node and type(current) in _SCOPE_TYPES and not into_scopes:
            continue
        stack.extend(reversed(children(current)))


def target_names(target: cst.CSTNode) -> list[str]:
    """The plain names an assignment target binds, in order (`a`, `a, (b, *c)`; not `a.x` or `a[k]`)."""
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in target_names(e.value)]
    if isinstance(target, cst.StarredElement):
        return target_names(target.value)
    return []


def scope_bindings(node: cst.CSTNode, skipped: frozenset = frozenset()) -> set[str]:
    """Names a statement binds in its own scope (not inside nested functions or comprehensions)."""
    found: set[str] = set()
    for current in own_nodes(node, skipped) if skipped else find_own(node, *_BINDERS):
        kind = type(current)
        if kind not in _BINDERS:  # most nodes (tested by type: isinstance on LibCST classes is slow)
            continue
        if kind is cst.AssignTarget or kind is cst.AugAssign or kind is cst.AnnAssign:
            found.update(target_names(current.target))
        elif kind is cst.For:
            found.update(target_names(current.target))
        elif kind is cst.AsName:
            found.update(target_names(current.name))
        elif kind is cst.NamedExpr:
            found.update(target_names(current.target))
        elif kind is cst.FunctionDef or kind is cst.ClassDef:
            if current is not node:
                found.add(current.name.value)
        elif not isinstance(current.names, cst.ImportStar):  # Import, ImportFrom
            for alias in current.names:
                name = alias.asname.name if alias.asname else alias.name
                found.add(dotted_name(name).split(".")[0])
    if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
        found.add(node.name.value)
    return found


_BINDERS = frozenset({
    cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.For, cst.AsName, cst.NamedExpr, cst.FunctionDef,
    cst.ClassDef, cst.Import, cst.ImportFrom,
})


class ReplaceById(cst.CSTTransformer):
    """Replaces nodes by identity: ``changes`` maps `id(original node)` to its replacement."""

    def __init__(self, changes: dict[int, object]):
        super().__init__()
        self.changes = changes

    def on_leave(self, original, updated):
        return self.changes.get(id(original), updated)


def placed_after_imports(module: cst.Module, changes: dict, statements: list[cst.BaseStatement]) -> dict:
    """Changes that write ``statements`` (classes a fix needs) after the module's last top-level
    import, two blank lines around each (PEP 8). ``changes`` are the fix's other changes, whose
    replacement of that import is kept; {} where the module imports nothing."""
    body = module.body
    imports_at = [i for i, s in enumerate(body) if isinstance(single_small(s), (cst.Import, cst.ImportFrom))]
    if not statements or not imports_at:
        return {}
    spaced = [s.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()]) for s in statements]
    anchor, after = body[imports_at[-1]], (body[imports_at[-1] + 1] if imports_at[-1] + 1 < len(body) else None)
    # The import and the statement after it as the other changes leave them, with the changes
    # inside them too (`from keras.utils.np_utils import ...` renamed; a class whose method a fix
    # rewrites): these replace them whole.
    inside = ReplaceById({id(node): new for node, new in changes.items()})
    kept = changes.get(anchor, anchor.visit(inside))  # one or more statements
    kept = list(kept.nodes) if isinstance(kept, cst.FlattenSentinel) else [kept]
    placed = {anchor: cst.FlattenSentinel([*kept, *spaced])}
    blank = len(list(itertools.takewhile(lambda line: line.comment is None, after.leading_lines))) if after else 2
    if after is not None and after not in changes and blank < 2:
        placed[after] = after.visit(inside).with_changes(
            leading_lines=[cst.EmptyLine()] * (2 - blank) + list(after.leading_lines))
    return placed
