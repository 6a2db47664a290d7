"""Source text for a node, outside of its module."""

from __future__ import annotations

import libcst as cst


def code(node: cst.CSTNode) -> str:
    """``node`` as source, with the default module's formatting (4-space indent, ``\\n``)."""
    return cst.Module([]).code_for_node(node)
