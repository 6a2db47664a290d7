"""The TFM105 rewrite: a ``make_parallel`` helper and its one call become
``tf.distribute.MirroredStrategy`` (the ``compat`` target: the Session program stays).

The shape it rewrites::

    def make_parallel(fn, num_gpus, **kwargs):          # a module-level helper
        in_splits = {k: tf.split(v, num_gpus) for k, v in kwargs.items()}
        out_split = []
        for i in range(num_gpus):
            with tf.device(<any spelling>):
                [with tf.variable_scope(tf.get_variable_scope(), reuse=i > 0):]
                    out_split.append(fn(**{k: v[i] for k, v in in_splits.items()}))
        return tf.concat(out_split, axis=0)

    loss = make_parallel(model, 2, x=x, y=y)             # its only call, in some block
    [mean_loss = tf.reduce_mean(loss)]
    train_op = opt.minimize(tf.reduce_mean(loss), ...)   # or minimize(mean_loss); or reduce_sum

becomes a replica function that MirroredStrategy runs once per device::

    strategy = tf.distribute.MirroredStrategy(devices=['/gpu:%d' % k for k in range(2)])
    [opt = tf.train.AdamOptimizer(0.1)]                  # an optimizer built inline, built once

    def replica_step():
        i = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
        loss = model(x=tf.split(x, strategy.num_replicas_in_sync)[i],
                     y=tf.split(y, strategy.num_replicas_in_sync)[i])
        train_op = opt.minimize(tf.reduce_mean(loss) / strategy.num_replicas_in_sync)
        with tf.control_dependencies([train_op]):
            return tf.identity(loss)

    loss = tf.concat(strategy.experimental_local_results(strategy.run(replica_step)), axis=0)
    train_op = loss.op

A v1 optimizer cannot ``minimize`` in the cross-replica context, so the training step moves
into the replica function. MirroredStrategy *sums* the replicas' gradients: with equal
slices, the mean over the global batch is the sum over replicas of (replica mean / N), so a
``reduce_mean`` loss is divided by the replica count and a ``reduce_sum`` loss is left alone.
An optimizer built inline (``tf.train.AdamOptimizer(0.1).minimize(...)``) is built once,
before the replica function, so that every replica uses the same one. The joined result keeps
its name and value (the replicas' outputs concatenated in device order), so the code that
fetches it is unchanged; `colocate_gradients_with_ops` goes (TFM104). As for TFM101
(``mirrored._place_scope``), the graph is built under ``strategy.scope()`` and the strategy is
created before it, so that variables made before the call (a global step) are mirrored too; at
module level, with no ``tf.Graph().as_default()`` to put under the scope, the strategy is created
at the call (``strategy.run`` enters the scope for the replicas) unless ``minimize`` is given a
global step. The helper is deleted. Anything else is refused with the reason.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.devices import device_scope_arg, device_scopes, find, mentions_gpu, names_used, walk
from tfmigrate.mirrored import (
    REPLICA_INDEX, Refused, _assigned_name, _code, _comments, _method_call, _Names, _only_call, _parents,
    _place_scope, _references, _tf_root,
)
from tfmigrate.rule import Edit, FixSafety

__all__ = ["Refused", "plan"]

MEANS = {"tensorflow.reduce_mean", "tensorflow.math.reduce_mean"}
SUMS = {"tensorflow.reduce_sum", "tensorflow.math.reduce_sum"}
SPLIT = "tensorflow.split"
CONCAT = "tensorflow.concat"
# What the helper may call besides the split, `fn` and the concat: scopes and bookkeeping.
ALLOWED_TF = {
    "tensorflow.device", "tensorflow.DeviceSpec", "tensorflow.variable_scope", "tensorflow.get_variable_scope",
    "tensorflow.name_scope",
}
ALLOWED_BUILTINS = {"range", "xrange", "dict", "zip", "enumerate", "len", "list", "str", "int", "sorted"}
ALLOWED_METHODS = {"items", "append", "keys", "values", "format", "get"}
DROPPED_KEYWORDS = {"colocate_gradients_with_ops"}


def plan(rule, helper: cst.FunctionDef) -> Edit:
    """The MirroredStrategy rewrite of ``helper`` and its call as an Edit, or Refused."""
    context, imports = rule.context, rule.imports
    module = context.module
    name = helper.name.value
    if not any(statement is helper for statement in module.body):
        raise Refused(f"`{name}` is not a module-level function")
    fn_param, count_param = _check_signature(helper)
    _check_body(helper, imports, fn_param, count_param)

    # --- the one call ----------------------------------------------------------------
    uses = sum(1 for node in walk(module) if isinstance(node, cst.Name) and node.value == name) - 1
    calls = [c for c in find(module, cst.Call) if isinstance(c.func, cst.Name) and c.func.value == name]
    if uses == 0:
        raise Refused(f"`{name}` is not called in this module (its callers elsewhere cannot be rewritten here)")
    if uses > 1 or len(calls) != 1:
        raise Refused(f"`{name}` is used {uses} times in this module; only a helper called once is rewritten")
    (call,) = calls
    parents = _parents(context)
    statement = parents[id(call)]
    while not isinstance(statement, cst.BaseStatement):
        statement = parents[id(statement)]
    result = _assigned_name(statement)
    if _only_call(statement) is not call or result is None:
        raise Refused(f"the result of `{name}(...)` is not assigned to a plain name")
    args = list(call.args)
    keywords = args[2:]
    if (len(args) < 3 or any(a.star for a in args) or any(a.keyword is not None for a in args[:2])
            or any(a.keyword is None for a in keywords)):
        raise Refused(f"`{name}` is not called as `{name}(fn, num_gpus, name=tensor, ...)`")
    fn, count = args[0].value, args[1].value
    if not isinstance(fn, (cst.Name, cst.Attribute)):
        raise Refused(f"the function passed to `{name}` is not a plain name")
    if result in names_used(call):
        raise Refused(f"`{result}` is both an input and the result of `{name}(...)`")

    # --- the training step after it, in the same block -------------------------------
    block = parents[id(statement)]
    body = list(block.body)
    at = next(k for k, s in enumerate(body) if s is statement)
    reduced: dict[str, tuple[bool, cst.Call]] = {}  # `mean_loss = tf.reduce_mean(loss)`: averages?, the call
    minimize = None
    bound_between: set[str] = set()
    for later in body[at + 1:]:
        value = _only_call(later)
        target = _assigned_name(later)
        if target and value is not None and _reduction(value, result, imports) is not None:
            reduced[target] = (_reduction(value, result, imports), value)
            continue
        if value is not None and _method_call(value, "minimize") and value.args:
            loss_arg = value.args[0].value
            if _reduction(loss_arg, result, imports) is not None or (
                    isinstance(loss_arg, cst.Name) and loss_arg.value in reduced):
                minimize = later
                break
        bound_between |= _bound(later)
    if minimize is None:
        if any(result in names_used(s) for s in body[at + 1:]):
            raise Refused(
                f"`{result}` is not minimized in the same block as `tf.reduce_mean({result})` or "
                f"`tf.reduce_sum({result})` (`train_op = opt.minimize(tf.reduce_mean({result}))`)"
            )
        raise Refused(f"`{result}` is not minimized in the same block: the training step cannot move into a replica function")
    minimize_call = _only_call(minimize)
    train = _assigned_name(minimize)
    if train is None:
        raise Refused("the result of `minimize(...)` is not assigned to a plain name")
    loss_arg = minimize_call.args[0].value
    if isinstance(loss_arg, cst.Name):  # `minimize(mean_loss)`: the replica minimizes the reduction itself
        averages, loss_arg = reduced[loss_arg.value]
    else:
        averages = _reduction(loss_arg, result, imports)
    optimizer = minimize_call.func.value
    others = minimize_call.args[1:]
    if any(a.star for a in others) or any(result in names_used(a.value) for a in others):
        raise Refused(f"the other arguments of `minimize` read `{result}`")
    clash = (names_used(minimize) - set(reduced)) & bound_between
    if clash:
        raise Refused(
            f"{', '.join(f'`{n}`' for n in sorted(clash))} is set between the `{name}` call and `minimize`"
        )
    if not isinstance(optimizer, (cst.Name, cst.Attribute, cst.Call)):
        raise Refused("the optimizer of `minimize` is not a name or a constructor call")

    # --- the rewrite ------------------------------------------------------------------
    tf = _Names(rule)

    def taken(candidate: str) -> bool:
        return _references(module, candidate) > 0

    strategy = _fresh(taken, "strategy", "mirrored_strategy")
    step = _fresh(taken, "replica_step", f"{name}_step")
    # The index is local to the replica function: it only must not hide a name the inputs read.
    index = _fresh(lambda candidate: candidate in names_used(call), "i", "replica", "replica_index")
    replicas = f"{strategy}.num_replicas_in_sync"
    split = tf("tensorflow.split")

    in_function = isinstance(block, cst.IndentedBlock)
    blank = [cst.EmptyLine(indent=False)] * (1 if in_function else 2)
    create = cst.parse_statement(
        f"{strategy} = {tf('tensorflow.distribute.MirroredStrategy')}"
        f"(devices=['/gpu:%d' % k for k in range({_code(count)})])\n"
    )
    head: list[cst.BaseStatement] = []
    if isinstance(optimizer, cst.Call):
        opt_name = _fresh(taken, "opt", "optimizer", "mirrored_optimizer")
        head.append(cst.parse_statement(f"{opt_name} = {_code(optimizer)}\n"))
        optimizer = cst.Name(opt_name)

    inputs = [f"{_code(a.keyword)}={split}({_code(a.value)}, {replicas})[{index}]" for a in keywords]
    forward = f"{result} = {_code(fn)}({', '.join(inputs)})"
    indent = "    " * (_depth(statement, parents) + 1)
    if len(indent) + len(forward) > 100 and len(inputs) > 1:
        forward = f"{result} = {_code(fn)}(\n" + "".join(f"    {item},\n" for item in inputs) + ")"
    scaled_loss = cst.parse_expression(_code(loss_arg) + (f" / {replicas}" if averages else ""))
    kept = [a for a in others if not (a.keyword is not None and a.keyword.value in DROPPED_KEYWORDS)]
    new_args = [minimize_call.args[0].with_changes(value=scaled_loss), *kept]
    new_args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in new_args]
    new_minimize = minimize_call.with_changes(
        func=minimize_call.func.with_changes(value=optimizer), args=new_args,
        whitespace_before_args=cst.SimpleWhitespace(""),
    )
    index_line = cst.parse_statement(f"{index} = " + REPLICA_INDEX.format(tf=_tf_root(tf)) + "\n").with_changes(
        leading_lines=[cst.EmptyLine(comment=cst.Comment(
            "# MirroredStrategy runs this once per replica, each on its slice of the batch."
        ))]
    )
    function = cst.FunctionDef(
        name=cst.Name(step), params=cst.Parameters(),
        body=cst.IndentedBlock(body=[
            index_line,
            cst.parse_statement(forward + "\n"),
            _wrapped(f"{train} = {_code(new_minimize)}", indent).with_changes(
                leading_lines=_comments(minimize)),
            cst.parse_statement(
                f"with {tf('tensorflow.control_dependencies')}([{train}]):\n"
                f"    return {tf('tensorflow.identity')}({result})\n"
            ),
        ]),
    )
    tail = [
        cst.parse_statement(
            f"{result} = {tf('tensorflow.concat')}({strategy}.experimental_local_results("
            f"{strategy}.run({step})), axis=0)\n"
        ).with_changes(leading_lines=blank),
        cst.parse_statement(f"{train} = {result}.op\n"),
    ]
    # The graph goes under strategy.scope(), as for TFM101, so that the variables built before
    # the call (a global step) are mirrored too; at module level without a graph to put under
    # it, the strategy is created at the call (strategy.run enters the scope for the replicas).
    region = {id(minimize): cst.RemovalSentinel.REMOVE}
    try:
        region[id(statement)] = _region(statement, head, function, tail, blank)
        anchor, new_anchor = _place_scope(statement, parents, imports, region, create,
                                          cst.WithItem(cst.parse_expression(f"{strategy}.scope()")))
        changes: dict = {anchor: new_anchor}
    except Refused:
        if not isinstance(block, cst.Module):
            raise
        global_step = [a for a in kept if a.keyword is not None and a.keyword.value == "global_step"]
        if global_step:
            raise Refused("the global step is created outside a strategy scope at module level: move the graph "
                          "into a function or a `with tf.Graph().as_default():` block first") from None
        changes = {
            statement: _region(statement, [create, *head], function, tail, blank),
            minimize: cst.RemovalSentinel.REMOVE,
        }
    changes[helper] = cst.RemovalSentinel.REMOVE
    return Edit(
        changes, f"rewrite `{name}` and its call with tf.distribute.MirroredStrategy",
        add_imports=tf.imports, safety=FixSafety.UNSAFE,
    )


def _region(statement, head, function, tail, blank) -> cst.FlattenSentinel:
    """What replaces the call: [strategy, optimizer,] the replica function, the joined result."""
    lines = list(statement.leading_lines)
    if head:  # the call's blank lines go before what comes first, its comments stay with the function
        head = [head[0].with_changes(leading_lines=[line for line in lines if line.comment is None]), *head[1:]]
        lines = _comments(statement)
    if not lines or lines[0].comment is not None:
        lines = [*blank, *lines]
    function = function.with_changes(leading_lines=lines)
    return cst.FlattenSentinel([*head, function, *tail])


# --- the helper ------------------------------------------------------------------------------
def _check_signature(helper: cst.FunctionDef) -> tuple[str, str]:
    params = helper.params
    name = helper.name.value
    if (len(params.params) != 2 or params.posonly_params or params.kwonly_params
            or isinstance(params.star_arg, cst.Param) or params.star_kwarg is None
            or any(p.default is not None for p in params.params)):
        raise Refused(f"`{name}` does not take `(fn, num_gpus, **kwargs)`")
    return params.params[0].name.value, params.params[1].name.value


def _check_body(helper: cst.FunctionDef, imports, fn: str, count: str) -> None:
    """The helper must only split its keyword inputs, call `fn` per device, and concatenate."""
    name = helper.name.value
    device_args = [scope.device for scope in device_scopes(helper.body, imports)]
    if not device_args or not all(mentions_gpu(d, imports) for d in device_args):
        raise Refused(f"`{name}` does not place its towers on GPUs")
    in_devices = {id(n) for d in device_args for n in walk(d)}
    splits, fn_calls = [], []
    for call in find(helper.body, cst.Call):
        if id(call) in in_devices:
            continue
        qualified = imports.resolve(call.func)
        if qualified == SPLIT:
            splits.append(call)
        elif isinstance(call.func, cst.Name) and call.func.value == fn:
            fn_calls.append(call)
        elif qualified == CONCAT or qualified in ALLOWED_TF or device_scope_arg(call, imports) is not None:
            continue
        elif isinstance(call.func, cst.Name) and call.func.value in ALLOWED_BUILTINS and qualified is None:
            continue
        elif isinstance(call.func, cst.Attribute) and call.func.attr.value in ALLOWED_METHODS and qualified is None:
            continue
        else:
            raise Refused(f"`{name}` also calls `{_code(call.func)}`: only a helper that splits, calls "
                          f"`{fn}` per device and concatenates is rewritten")
    if not splits or not all(_splits_by(s, count) for s in splits):
        raise Refused(f"`{name}` does not cut its inputs with `tf.split(value, {count})` along axis 0")
    loops = [loop for loop in find(helper.body, cst.For) if _ranges_over(loop, count)]
    if (len(fn_calls) != 1 or len(loops) != 1 or not any(n is fn_calls[0] for n in walk(loops[0]))
            or len(fn_calls[0].args) != 1 or fn_calls[0].args[0].star != "**"):
        raise Refused(f"`{name}` does not call `{fn}(**<slice i of each input>)` once in a loop over `range({count})`")
    returns = find(helper.body, cst.Return)
    last = helper.body.body[-1]
    if (len(returns) != 1 or not isinstance(last, cst.SimpleStatementLine) or last.body[0] is not returns[0]
            or not _concat_axis0(returns[0].value, imports)):
        raise Refused(f"`{name}` does not end with `return tf.concat(outputs, axis=0)`")


def _splits_by(call: cst.Call, count: str) -> bool:
    args = list(call.args)
    if len(args) < 2 or any(a.star for a in args) or args[0].keyword is not None:
        return False
    second = args[1]
    if second.keyword is not None and second.keyword.value != "num_or_size_splits":
        return False
    if not (isinstance(second.value, cst.Name) and second.value.value == count):
        return False
    rest = args[2:]
    return all(a.keyword is not None and a.keyword.value == "axis" and _is_zero(a.value) for a in rest)


def _ranges_over(loop: cst.For, count: str) -> bool:
    iterable = loop.iter
    return (isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Name)
            and iterable.func.value in ("range", "xrange") and len(iterable.args) == 1
            and isinstance(iterable.args[0].value, cst.Name) and iterable.args[0].value.value == count)


def _concat_axis0(value, imports) -> bool:
    if not isinstance(value, cst.Call) or imports.resolve(value.func) != CONCAT:
        return False
    args = list(value.args)
    if len(args) != 2 or any(a.star for a in args):
        return False
    axis = args[1]
    return (axis.keyword is None or axis.keyword.value == "axis") and _is_zero(axis.value)


def _is_zero(node) -> bool:
    return isinstance(node, cst.Integer) and node.value == "0"


# --- the call site ---------------------------------------------------------------------------
def _reduction(node, result: str, imports) -> bool | None:
    """True for `tf.reduce_mean(result)`, False for `tf.reduce_sum(result)`, else None."""
    if not (isinstance(node, cst.Call) and len(node.args) == 1 and node.args[0].keyword is None
            and not node.args[0].star and isinstance(node.args[0].value, cst.Name)
            and node.args[0].value.value == result):
        return None
    qualified = imports.resolve(node.func)
    return True if qualified in MEANS else False if qualified in SUMS else None


def _wrapped(line: str, indent: str) -> cst.SimpleStatementLine:
    """`name = opt.minimize(args)`, its arguments on a continuation line when it is too long."""
    if len(indent) + len(line) > 100 and line.endswith(")"):
        name, _, call = line.partition(" = ")
        func, _, args = call.partition("(")
        line = f"{name} = {func}(\n    {args}"
    return cst.parse_statement(line + "\n")


def _bound(statement: cst.CSTNode) -> set[str]:
    names: set[str] = set()
    for target in find(statement, cst.AssignTarget):
        names |= names_used(target.target)
    for node in find(statement, cst.AugAssign, cst.AnnAssign, cst.For):
        names |= names_used(node.target)
    for node in find(statement, cst.FunctionDef, cst.ClassDef):
        names.add(node.name.value)
    for node in find(statement, cst.AsName):
        names |= names_used(node.name)
    return names


def _depth(statement, parents) -> int:
    depth, node = 0, parents.get(id(statement))
    while node is not None:
        if isinstance(node, cst.IndentedBlock):
            depth += 1
        node = parents.get(id(node))
    return depth


def _fresh(taken, *candidates: str) -> str:
    for candidate in candidates:
        if not taken(candidate):
            return candidate
    base = candidates[-1]
    k = 2
    while taken(f"{base}_{k}"):
        k += 1
    return f"{base}_{k}"
