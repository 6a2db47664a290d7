"""Reading a call's arguments the way Python binds them: by keyword, else by position.

Shared by the rules that look at TF1 and Keras signatures (TFM201, TFM302, TFM303) and by the
pipeline rewrite in ``tfmigrate.pipelines``.
"""

from __future__ import annotations

from typing import Sequence

import libcst as cst


def argument(call: cst.Call, params: Sequence[str], keyword: str) -> cst.BaseExpression | None:
    """The expression passed for ``keyword`` (by keyword, or by its position in ``params``)."""
    arg = argument_node(call, params, keyword)
    return None if arg is None else arg.value


def argument_node(call: cst.Call, params: Sequence[str], keyword: str) -> cst.Arg | None:
    """The ``cst.Arg`` that binds ``keyword``, else None."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg
    if keyword not in params:
        return None
    positional = [a for a in call.args if a.keyword is None and not a.star]
    index = list(params).index(keyword)
    return positional[index] if len(positional) > index else None


def has_star_args(call: cst.Call) -> bool:
    """``f(*args)`` / ``f(**kwargs)``: which parameter gets what cannot be known statically."""
    return any(a.star for a in call.args)


def unknown_keywords(call: cst.Call, params: Sequence[str]) -> list[str]:
    """Keywords passed that are not in ``params``."""
    return [a.keyword.value for a in call.args if a.keyword is not None and a.keyword.value not in params]


def is_true(node: cst.BaseExpression | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


def is_false(node: cst.BaseExpression | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "False"


def is_none(node: cst.BaseExpression | None) -> bool:
    return node is None or (isinstance(node, cst.Name) and node.value == "None")
