"""Node positions (LibCST's ``PositionProvider`` ranges), computed only where a rule asks.

LibCST finds positions by generating the code of the whole module while counting lines and
columns: as long as the rules' own walk. A finding needs the positions of one top-level
statement only, so :class:`LazyPositions` generates the code of that statement alone and
shifts its lines by where the statement starts, which Python's own parser says (``ast``: the
line of its first token). The shifted result is used only when the statement's generated
code is, character for character, the text at that line; otherwise, and for a node whose
top-level statement is not known, the whole module's positions are computed as LibCST does.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import libcst as cst

_LINE_END = re.compile(r"\r\n|\r|\n")


class LazyPositions(Mapping):
    """node -> ``CodeRange``. ``statement_of`` maps id(node) to the index in ``module.body`` of
    the top-level statement the node lies in (filled by the rules' walk)."""

    def __init__(self, module: cst.Module, text: str, statement_of: dict[int, int]) -> None:
        self.module = module
        self.text = text
        self.statement_of = statement_of
        self.whole: Mapping | None = None
        self.parts: dict[int, tuple[Mapping, int] | None] = {}
        self._starts: list[int] | None = None  # top-level statement index -> first line (ast)
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
                statements = ast.parse(self.text).body
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
                taken += count
            if taken == len(statements):
                self._starts = starts
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

    def __getitem__(self, node):
        if self.whole is None:
            index = self.statement_of.get(id(node))
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
