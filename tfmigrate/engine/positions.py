"""Node positions (LibCST's ``PositionProvider`` ranges), computed only where a rule asks.

LibCST finds positions by generating the code of the whole module while counting lines and
columns: as long as the rules' own walk. A finding needs the positions of one top-level
statement only, so :class:`LazyPositions` generates the code of that statement alone and
shifts its lines by where the statement starts, which Python's own parser says (``ast``: the
line of its first token). The shifted result is used only when the statement's generated
code is, character for character, the text at that line; otherwise, and for a node whose
top-level statement is not known, the whole module's positions are computed as LibCST does.

Most findings are at a call or a ``for``/``with`` statement, and Python's parser knows those
ranges already: such a node is paired with its ``ast`` twin (the k-th call of the statement in
LibCST's order is the k-th call in source order), and the twin's range is used without
generating any code, when the two parsers agree on how many there are and the text at the
range starts as the node does.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import libcst as cst

_LINE_END = re.compile(r"\r\n|\r|\n")

# ast node type -> the LibCST node type with the same range. A parenthesized call is not one:
# LibCST's range includes its parentheses.
_TWIN_OF = {ast.Call: "Call", ast.For: "For", ast.AsyncFor: "For", ast.With: "With", ast.AsyncWith: "With"}
# The LibCST node types the rules' walk lists per top-level statement: the twins' kinds, and
# f-strings (what is inside one is not paired).
TWIN_KINDS = frozenset(_TWIN_OF.values()) | {"FormattedString"}
# ast node types (and field values) that hold no call: not walked into.
_CALL_FREE = frozenset({
    ast.Name, ast.Constant, ast.Load, ast.Store, ast.Del, ast.Pass, ast.Break, ast.Continue,
    ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom, ast.alias, str, int, type(None),
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Mod, ast.Pow, ast.FloorDiv, ast.MatMult, ast.And, ast.Or,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In, ast.NotIn,
    ast.Not, ast.USub, ast.UAdd, ast.Invert, ast.BitAnd, ast.BitOr, ast.BitXor, ast.LShift, ast.RShift,
})


class LazyPositions(Mapping):
    """node -> ``CodeRange``. ``statement_of`` maps id(node) to the index in ``module.body`` of
    the top-level statement the node lies in; ``in_order``, when given, maps (that index, a
    kind of :data:`TWIN_KINDS`) to the nodes of that kind in LibCST's order, complete for the
    statements in ``walked`` (all three filled by the rules' walk)."""

    def __init__(
        self, module: cst.Module, text: str, statement_of: dict[int, int],
        in_order: dict[tuple[int, str], list] | None = None, walked: set[int] | None = None,
        python_tree: ast.Module | None = None,
    ) -> None:
        self.module = module
        self.text = text
        self.python_tree = python_tree  # Python's parse of ``text`` when the caller has one
        self.statement_of = statement_of
        self.in_order = in_order
        self.walked = walked  # the top-level statements the rules' walk has left (in_order complete)
        self.whole: Mapping | None = None
        self.parts: dict[int, tuple[Mapping, int] | None] = {}
        self._starts: list[int] | None = None  # top-level statement index -> first line (ast)
        self._groups: list[list[ast.stmt]] = []  # top-level statement index -> its ast statements
        self._twins: dict[tuple[int, str], dict[int, ast.AST]] = {}
        self._offsets: list[int] | None = None

    # -- the whole module, as LibCST computes it --
    def _whole(self) -> Mapping:
        if self.whole is None:
            from libcst.metadata import PositionProvider

            # The provider's own pass, without MetadataWrapper.resolve: that also walks the
            # whole tree once more for the (here empty) batch of batchable providers.
            provider = PositionProvider()
            provider._gen_impl(self.module)
            self.whole = provider._computed
        return self.whole

    # -- one top-level statement --
    def _statement_lines(self) -> list[int]:
        """The first line of each of ``module.body``, from Python's parser; [] if the two
        parsers' statements do not pair up."""
        if self._starts is None:
            import libcst as cst

            self._starts = []
            try:
                statements = (self.python_tree or ast.parse(self.text)).body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                return self._starts
            starts, taken = [], 0
            for node in self.module.body:
                # `a = 1; b = 2` is one LibCST statement line and two Python statements.
                count = len(node.body) if isinstance(node, cst.SimpleStatementLine) else 1
                if taken + count > len(statements):
                    return self._starts
                first = statements[taken]
                decorators = getattr(first, "decorator_list", None) or []
                starts.append(min([first.lineno] + [d.lineno for d in decorators]))
                self._groups.append(statements[taken:taken + count])
                taken += count
            if taken == len(statements):
                self._starts = starts
            else:
                self._groups = []
        return self._starts

    def _line_offsets(self) -> list[int]:
        """Where each line starts in the text (computed once per file)."""
        if self._offsets is None:
            self._offsets = [0]
            self._offsets.extend(match.end() for match in _LINE_END.finditer(self.text))
        return self._offsets

    def _part(self, index: int) -> tuple[Mapping, int] | None:
        """(positions within statement ``index`` generated alone, lines to add), or None."""
        if index in self.parts:
            return self.parts[index]
        self.parts[index] = None
        starts = self._statement_lines()
        if not 0 <= index < len(starts):
            return None
        from libcst.metadata import PositionProvider
        from libcst.metadata.position_provider import PositionProvidingCodegenState

        statement = self.module.body[index]
        provider = PositionProvider()
        state = PositionProvidingCodegenState(
            default_indent=self.module.default_indent, default_newline=self.module.default_newline,
            provider=provider,
        )
        statement._codegen(state)
        code = "".join(state.tokens)
        # The generated code opens with the statement's leading blank and comment lines (and,
        # for a decorated definition, those before its first decorator); Python's line is
        # that of the first token after them.
        lead = len(statement.leading_lines)
        decorators = getattr(statement, "decorators", ())
        if decorators:
            lead += len(decorators[0].leading_lines)
        shift = starts[index] - 1 - lead
        if index == len(self.module.body) - 1 and not self.module.has_trailing_newline:
            # The file's last line has no line break: the module's code drops the one the
            # statement's own code ends with.
            code = code[: -len(self.module.default_newline)] if code.endswith(self.module.default_newline) else code
        offsets = self._line_offsets()
        if not 0 <= shift < len(offsets) or self.text[offsets[shift]:offsets[shift] + len(code)] != code:
            return None
        self.parts[index] = (provider._computed, shift)
        return self.parts[index]

    # -- a call, a for or a with statement, from Python's parser --
    def _pairs(self, index: int, kind: str) -> dict[int, ast.AST]:
        """id(LibCST node) -> its ast twin, for the nodes of type ``kind`` in statement
        ``index``; {} when the two parsers do not see the same number of them."""
        key = (index, kind)
        if self.in_order is not None and index not in self.walked:
            return {}  # a rule reporting while the walk is still inside the statement
        if key not in self._twins:
            for name in _TWIN_OF.values():
                self._twins[(index, name)] = {}
            if not 0 <= index < len(self._groups):
                return self._twins[key]
            # What is inside an f-string is left out on both sides: before Python 3.12 its
            # nodes' ranges are not reliable.
            twins: dict[str, list[ast.AST]] = {name: [] for name in _TWIN_OF.values()}
            pending: list[ast.AST] = list(self._groups[index])
            while pending:  # ast.iter_child_nodes, without the nodes that cannot hold a call
                node = pending.pop()
                node_type = type(node)
                name = _TWIN_OF.get(node_type)
                if name is not None:
                    twins[name].append(node)
                elif node_type is ast.JoinedStr:
                    continue
                for field in node._fields:
                    value = getattr(node, field, None)
                    if type(value) is list:
                        pending.extend(item for item in value if type(item) not in _CALL_FREE)
                    elif value is not None and type(value) not in _CALL_FREE and isinstance(value, ast.AST):
                        pending.append(value)
            nodes = self.in_order if self.in_order is not None else self._walk_in_order(index)
            in_fstrings = _inside(nodes.get((index, "FormattedString"), []))
            for name, found in twins.items():
                found.sort(key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
                ours = [node for node in nodes.get((index, name), []) if id(node) not in in_fstrings]
                if len(found) == len(ours):
                    self._twins[(index, name)] = {id(node): twin for node, twin in zip(ours, found)}
        return self._twins[key]

    def _walk_in_order(self, index: int) -> dict[tuple[int, str], list]:
        """The twin-kind nodes of statement ``index`` in LibCST's order (when the rules' walk
        did not record them)."""
        from tfmigrate.cst.walker import skipped_types, walk

        found: dict[tuple[int, str], list] = {}

        def on_visit(node) -> None:
            name = type(node).__name__
            if name in TWIN_KINDS:
                found.setdefault((index, name), []).append(node)

        walk(self.module.body[index], on_visit, lambda node: None, skipped_types(()))
        return found

    def _column(self, line: int, byte_offset: int) -> int | None:
        """The (0-based) character column of ``ast``'s byte offset on a line (1-based), None off
        the text."""
        offsets = self._line_offsets()
        if not 0 < line <= len(offsets):
            return None
        start = offsets[line - 1]
        text = self.text[start:start + byte_offset]
        if text.isascii():
            return byte_offset if len(text) == byte_offset else None
        # Non-ASCII: a line's first n bytes are at most n characters.
        return len(text.encode("utf-8")[:byte_offset].decode("utf-8", "ignore"))

    def _twin_range(self, node, index: int):
        kind = type(node).__name__
        if kind not in _TWIN_OF.values() or (kind == "Call" and node.lpar):
            return None
        self._statement_lines()
        twin = self._pairs(index, kind).get(id(node))
        if twin is None:
            return None
        start = self._column(twin.lineno, twin.col_offset)
        end = self._column(twin.end_lineno, twin.end_col_offset)
        if start is None or end is None:
            return None
        # The same node, seen from the text: a call starts with its callee's first name, a
        # statement with its keyword (`async` first for async ones).
        head = self.text[self._line_offsets()[twin.lineno - 1] + start:][:40]
        expected = _head(node)
        if expected is None or not head.startswith(expected):
            return None
        from libcst.metadata import CodePosition, CodeRange

        return CodeRange(CodePosition(twin.lineno, start), CodePosition(twin.end_lineno, end))

    def __getitem__(self, node):
        if self.whole is None:
            index = self.statement_of.get(id(node))
            twin = self._twin_range(node, index) if index is not None else None
            if twin is not None:
                return twin
            part = self._part(index) if index is not None else None
            if part is not None and node in part[0]:
                from libcst.metadata import CodePosition, CodeRange

                found, shift = part[0][node], part[1]
                return CodeRange(
                    CodePosition(found.start.line + shift, found.start.column),
                    CodePosition(found.end.line + shift, found.end.column),
                )
        return self._whole()[node]

    def __iter__(self):
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())


def _inside(fstrings: list) -> set[int]:
    """The ids of the nodes inside these f-strings."""
    from tfmigrate.cst.walker import skipped_types, walk

    found: set[int] = set()
    for fstring in fstrings:
        walk(fstring, lambda node: found.add(id(node)), lambda node: None, skipped_types(()))
    return found


def _head(node) -> str | None:
    """What the text of a call or a for/with statement starts with; None when not simple."""
    import libcst as cst

    if isinstance(node, cst.Call):
        callee = node.func
        while isinstance(callee, (cst.Attribute, cst.Call, cst.Subscript)) and not callee.lpar:
            callee = callee.value if not isinstance(callee, cst.Call) else callee.func
        return callee.value if isinstance(callee, cst.Name) and not callee.lpar else None
    return "async" if node.asynchronous is not None else type(node).__name__.lower()
