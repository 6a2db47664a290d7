"""Source text for a node, outside of its module."""

from __future__ import annotations

import libcst as cst


def code(node: cst.CSTNode) -> str:
    """``node`` as source, with the default module's formatting (4-space indent, ``\\n``)."""
    return cst.Module([]).code_for_node(node)


def code_in(module: cst.Module, node: cst.CSTNode) -> str:
    """``node`` as source with ``module``'s formatting, without surrounding whitespace."""
    return module.code_for_node(node).strip()


class _ContinuationLines(cst.CSTVisitor):
    """The continuation lines (``ParenthesizedWhitespace``) that start at ``opening`` or right
    of it; ``block`` is the width a line with ``indent`` set starts with."""

    def __init__(self, opening: int, block: int) -> None:
        super().__init__()
        self.opening, self.block, self.found = opening, block, []

    def visit_ParenthesizedWhitespace(self, node) -> None:
        start = len(node.last_line.value) + (self.block if node.indent else 0)
        if start >= self.opening and "\t" not in node.last_line.value:
            self.found.append(node)


def realigned_continuations(renamed: list[tuple[cst.Call, cst.Call, int, str]]) -> dict:
    """For calls given a callee of another length -- (old, new, the column where old starts, the
    indentation of its block) -- the continuation lines that were aligned under an old call's
    opening parenthesis, or right of it (PEP 8's visual indent), moved as far as the
    parenthesis moved: {old line's whitespace: new}. A hanging indent stays; a line inside
    several such calls moves by each.
    `model.fit_generator(gen,` / `steps_per_epoch=10)` keeps `steps_per_epoch` under `gen`."""
    shifts: dict[int, list] = {}
    for old, new, column, block in renamed:
        before, after = code(old.func), code(new.func)
        hanging = isinstance(old.whitespace_before_args, cst.ParenthesizedWhitespace)  # nothing aligns under `(`
        if len(before) == len(after) or "\n" in before + after or "\t" in block or hanging:
            continue
        lines = _ContinuationLines(column + len(before) + 1, len(block))
        for arg in old.args:
            arg.visit(lines)
        for line in lines.found:
            shifts.setdefault(id(line), [line, 0])[1] += len(after) - len(before)
    return {line: line.with_changes(last_line=cst.SimpleWhitespace(" " * max(len(line.last_line.value) + shift, 0)))
            for line, shift in shifts.values() if shift}
