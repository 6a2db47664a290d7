"""Reading a call's arguments the way Python binds them: by keyword, else by position.

Shared by the rules that look at TF1 and Keras signatures (TFM201, TFM302, TFM303) and by the
pipeline rewrite in ``tfmigrate.rewrites.pipelines``.
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


# `tf.split` as TF 1.x+ binds it, and as TF 0.x did (axis first: `tf.split(0, num_gpus, images)`).
SPLIT_PARAMS = ("value", "num_or_size_splits", "axis", "num", "name")
LEGACY_SPLIT_PARAMS = ("split_dim", "num_split", "value", "name")


def is_legacy_split(call: cst.Call) -> bool:
    """``tf.split(0, n, x)`` / ``tf.split(split_dim=0, num_split=n, value=x)``: TF 0.x's order,
    told apart by its keywords, or by three positional arguments led by an integer axis."""
    keywords = {a.keyword.value for a in call.args if a.keyword is not None}
    if keywords & {"split_dim", "num_split"}:
        return True
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    first = positional[0] if positional else None
    if isinstance(first, cst.UnaryOperation):
        first = first.expression
    return len(positional) >= 3 and isinstance(first, cst.Integer)


def split_arguments(call: cst.Call) -> tuple[cst.BaseExpression | None, ...]:
    """(value, count, axis) of a ``tf.split`` call in either argument order; None where the
    call does not pass it (a missing axis is the default, 0)."""
    params = LEGACY_SPLIT_PARAMS if is_legacy_split(call) else SPLIT_PARAMS
    if params is LEGACY_SPLIT_PARAMS:
        return (argument(call, params, "value"), argument(call, params, "num_split"),
                argument(call, params, "split_dim"))
    return argument(call, params, "value"), argument(call, params, "num_or_size_splits"), argument(call, params, "axis")


def is_zero(node: cst.BaseExpression | None) -> bool:
    return isinstance(node, cst.Integer) and node.evaluated_value == 0


def callee_name(call: cst.Call, receivers: Sequence[str] = ("self", "cls"), plain: bool = True) -> str | None:
    """The name of the module function or own method a call runs: `f` of `f(...)` (unless not
    ``plain``) and of `self.f(...)` or `cls.f(...)` (``receivers`` says which), else None."""
    func = call.func
    if isinstance(func, cst.Name):
        return func.value if plain else None
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value in receivers:
        return func.attr.value
    return None


def method_call(call: cst.CSTNode, method: str) -> bool:
    """Whether ``call`` calls a method named ``method`` (`opt.minimize(...)`)."""
    return isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == method


#: The `=` of a keyword argument as PEP 8 spells it, without spaces.
KEYWORD_EQUAL = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


def keyword_arg(keyword: str, value: cst.BaseExpression) -> cst.Arg:
    """`<keyword>=<value>`."""
    return cst.Arg(value, keyword=cst.Name(keyword), equal=KEYWORD_EQUAL)


def receiver_passed(call: cst.Call, function: str) -> cst.Call:
    """``call`` of a method, `model.train_on_batch(x, y)`, as a call of ``function`` that takes
    the receiver first: `train_split(model, x, y)`."""
    comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")) if call.args else cst.MaybeSentinel.DEFAULT
    return call.with_changes(func=cst.Name(function), args=[cst.Arg(call.func.value, comma=comma), *call.args])


def with_keyword(call: cst.Call, keyword: str, value: str) -> cst.Call:
    """``call`` with `<keyword>=<value>` added as its last argument."""
    args = list(call.args)
    if args:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return call.with_changes(args=[*args, keyword_arg(keyword, cst.parse_expression(value))])


def short_name(func: cst.BaseExpression) -> str:
    """The last name of a callee (`sum` of `K.sum`, `tf.reduce_sum` or `sum`); "" for anything else."""
    return func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""


def keyword_is(arg: cst.Arg, keyword: str, test=lambda value: True) -> bool:
    """Whether ``arg`` is `keyword=...` (and its value passes ``test``)."""
    return arg.keyword is not None and arg.keyword.value == keyword and test(arg.value)


def keyword_renamed(arg: cst.Arg, old: str, new: str) -> cst.Arg:
    """``arg`` as `new=...` if it is `old=...`."""
    return arg.with_changes(keyword=cst.Name(new)) if keyword_is(arg, old) else arg


def commas_mended(args: list[cst.Arg], original: tuple[cst.Arg, ...]) -> list[cst.Arg]:
    """``args`` (some of ``original`` dropped) with the last one's comma as the original last's."""
    if not args:
        return args
    return [*args[:-1], args[-1].with_changes(comma=original[-1].comma)]
