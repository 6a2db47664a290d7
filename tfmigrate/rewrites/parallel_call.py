"""The TFM105 rewrite: split/concat data parallelism becomes ``tf.distribute.MirroredStrategy``
(the ``compat`` target: the Session program stays). Two shapes get it.

The ``make_parallel`` helper and its one call (:func:`plan_helper`)::

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

The same thing written inline, in one function or at module level (:func:`plan_inline`)::

    x_parts = tf.split(x, N)                             # [, axis=0]: one statement per input
    outputs = []
    for i in range(N):                                   # or: for i, d in enumerate(DEVICES)
        with tf.device(<any spelling>):
            [with tf.variable_scope(tf.get_variable_scope(), reuse=i > 0):]
                ... the tower, reading x_parts[i] ...
                outputs.append(tower_loss)               # the last statement of the body
    loss = tf.concat(outputs, axis=0)                    # or tf.stack(outputs)
    [mean_loss = tf.reduce_mean(loss)]
    train_op = opt.minimize(tf.reduce_mean(loss), ...)

Both become a replica function that MirroredStrategy runs once per device (the helper form
shown; the inline form keeps its split statements where they were, cut into
``strategy.num_replicas_in_sync`` pieces, and its tower code reads ``x_parts[i]`` as before)::

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
slices (an integer count divides the batch evenly), the mean over the global batch is the sum
over replicas of (replica mean / N), so a ``reduce_mean`` loss is divided by the replica count
and a ``reduce_sum`` loss is left alone. An optimizer built inline
(``tf.train.AdamOptimizer(0.1).minimize(...)``) is built once, before the replica function, so
that every replica uses the same one. The joined result keeps its name and value (the
replicas' outputs joined in device order), so the code that fetches it is unchanged;
``colocate_gradients_with_ops`` goes (TFM104).

The inline form's batch is still cut once, in the cross-replica context, and each replica
reads its own piece (``x_parts[i]``, ``i`` the replica id): one split per input rather than one
per replica, each device receives only its slice, and the tower code stays as written. The
device scopes go, and so does a ``tf.variable_scope(tf.get_variable_scope(), reuse=<from i>)``
wrapper: MirroredStrategy builds replica 0's variables and reuses them in the others itself.

As for TFM101 (``mirrored.place_scope``), the graph is built under ``strategy.scope()`` and
the strategy is created before it, so that variables made before the call are mirrored too. A
global step given to ``minimize`` and made by a statement that can run first is made just before
the scope instead (TF1's variable: fetched with the update it reads the count after it, where a
mirrored one read the count before) and counted once after the replicas' update, which goes
without it (:mod:`tfmigrate.rewrites.global_steps`). At module level, with no
``tf.Graph().as_default()`` to put under the scope, the strategy is created just before it is
first needed (``strategy.run`` enters the scope for the replicas) unless ``minimize`` is given a
global step. The helper is deleted; the inline form's
output list and tower loop go. Anything else is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import libcst as cst

from tfmigrate.analysis.devices import device_scope_arg, device_scopes, mentions_gpu, tower_group
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import ReplaceById, children, find, first_free, module_parents, names_used, single_small, walk
from tfmigrate.rewrites.mirrored import (
    REPLICA_INDEX, assigned_name, comment_lines, device_helpers, devices_argument, loop_index,
    method_call, TfNames, only_call, place_scope, references, strategy_scope_owner, tf_root,
)
from tfmigrate.rewrites.global_steps import count_once, global_step_args, steps_made_before_scope
from tfmigrate.rewrites.refusal import Refused
from tfmigrate.rule import Edit, FixSafety

__all__ = ["Refused", "plan_helper", "plan_inline"]

MEANS = {"tensorflow.reduce_mean", "tensorflow.math.reduce_mean"}
SUMS = {"tensorflow.reduce_sum", "tensorflow.math.reduce_sum"}
SPLIT = "tensorflow.split"
CONCAT = "tensorflow.concat"
STACK = "tensorflow.stack"
# What the helper may call besides the split, `fn` and the concat: scopes and bookkeeping.
ALLOWED_TF = {
    "tensorflow.device", "tensorflow.DeviceSpec", "tensorflow.variable_scope", "tensorflow.get_variable_scope",
    "tensorflow.name_scope",
}
ALLOWED_BUILTINS = {"range", "xrange", "dict", "zip", "enumerate", "len", "list", "str", "int", "sorted"}
ALLOWED_METHODS = {"items", "append", "keys", "values", "format", "get"}
DROPPED_KEYWORDS = {"colocate_gradients_with_ops"}


# --- the make_parallel helper ----------------------------------------------------------------
def plan_helper(rule, helper: cst.FunctionDef) -> Edit:
    """The MirroredStrategy rewrite of a ``make_parallel`` helper and its call as an Edit, or Refused."""
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
    parents = module_parents(context)
    statement = parents[id(call)]
    while not isinstance(statement, cst.BaseStatement):
        statement = parents[id(statement)]
    result = assigned_name(statement)
    if only_call(statement) is not call or result is None:
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
    block = parents[id(statement)]
    step = _training_step(block, statement, result, imports, f"the `{name}` call")

    # --- the rewrite ------------------------------------------------------------------
    rewrite = _Rewrite(rule, step, result, output=result, step_names=("replica_step", f"{name}_step"))
    # The index is local to the replica function: it only must not hide a name the inputs read.
    index = first_free(lambda candidate: candidate in names_used(call), "i", "replica", "replica_index")
    split = rewrite.tf(SPLIT)
    inputs = [f"{code(a.keyword)}={split}({code(a.value)}, {rewrite.replicas})[{index}]" for a in keywords]
    forward = f"{result} = {code(fn)}({', '.join(inputs)})"
    depth = _depth(statement, parents) + 1
    if len(forward) + 4 * depth > 100 and len(inputs) > 1:
        forward = f"{result} = {code(fn)}(\n" + "".join(f"    {item},\n" for item in inputs) + ")"
    function = rewrite.function(
        [cst.parse_statement(forward + "\n"), *rewrite.training_tail(depth)], index,
        "# MirroredStrategy runs this once per replica, each on its slice of the batch.",
    )
    region = {step.statement: cst.RemovalSentinel.REMOVE}
    changes = rewrite.place(
        statement, region, list(statement.leading_lines), function, f"['/gpu:%d' % k for k in range({code(count)})]",
        first=statement,
    )
    changes[helper] = cst.RemovalSentinel.REMOVE
    return Edit(
        changes, f"rewrite `{name}` and its call with tf.distribute.MirroredStrategy",
        add_imports=rewrite.tf.imports, safety=FixSafety.UNSAFE,
    )


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
            raise Refused(f"`{name}` also calls `{code(call.func)}`: only a helper that splits, calls "
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
            or not _joins_axis0(returns[0].value, imports, {CONCAT})):
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


def _joins_axis0(value, imports, joins: set[str]) -> bool:
    """`tf.concat(outputs, axis=0)` (or `0`); `tf.stack(outputs)` may leave the axis out."""
    if not isinstance(value, cst.Call) or imports.resolve(value.func) not in joins:
        return False
    args = list(value.args)
    if any(a.star for a in args) or not args or args[0].keyword is not None:
        return False
    if len(args) == 1:
        return imports.resolve(value.func) == STACK
    axis = args[1]
    return len(args) == 2 and (axis.keyword is None or axis.keyword.value == "axis") and _is_zero(axis.value)


def _is_zero(node) -> bool:
    return isinstance(node, cst.Integer) and node.value == "0"


# --- the inline form --------------------------------------------------------------------------
@dataclass
class _Inline:
    """The inline form's pieces, found once and shared by the steps of :func:`plan_inline`."""

    rule: object
    tower: object
    parents: dict
    loop: cst.For
    block: cst.CSTNode  # the block holding the tower loop and the join
    body: list  # its statements
    statement: cst.SimpleStatementLine  # `loss = tf.concat(outputs, axis=0)`
    result: str  # `loss`
    at: int  # where the tower loop is in ``body``
    joined_at: int  # where the join is
    collect: cst.SimpleStatementLine  # `outputs.append(tower_output)`
    init: cst.SimpleStatementLine  # `outputs = []`


@dataclass
class _TowerLoop:
    """What the tower loop gives the replica function: its index, its device variables, its count."""

    index: str  # `i`
    others: set  # the other loop variables (`d` in `for i, d in enumerate(DEVICES)`)
    count: str  # how many towers, as the split count must spell it
    local: set  # the names the loop binds


def plan_inline(rule, tower, splits: list[cst.Call], join: cst.Call) -> Edit:
    """The MirroredStrategy rewrite of an inline split / tower loop / concat and the training
    step after it, as an Edit, or Refused with the reason.

    ``splits`` are the split calls that feed the tower loop, ``join`` the call that joins its
    outputs (both as the rule found them).
    """
    context, imports = rule.context, rule.imports
    parents = module_parents(context)
    _check_one_tower_loop(context, tower)
    inline = _inline_join(rule, tower, parents, join)
    towers = _inline_loop(inline)
    new_splits = _inline_splits(inline, splits, towers.count)
    first_split = min(new_splits, key=inline.body.index)
    devices = devices_argument(inline.loop)
    step = _training_step(inline.block, inline.statement, inline.result, imports, "the `tf.concat`")
    output, assign = _replica_output(inline, towers.local)

    # --- the rewrite ------------------------------------------------------------------
    rewrite = _Rewrite(rule, step, inline.result, output=output, step_names=("replica_step", "tower_step"))
    _split_by_replicas(new_splits, rewrite.replicas)
    function = _replica_function(inline, towers, rewrite, assign)
    # Comments above the list, the loop and the join stay with the replica function.
    lines = [*inline.init.leading_lines, *comment_lines(inline.loop), *comment_lines(inline.statement)]
    region = {inline.init: cst.RemovalSentinel.REMOVE, inline.loop: cst.RemovalSentinel.REMOVE,
              step.statement: cst.RemovalSentinel.REMOVE, **new_splits}
    changes = rewrite.place(inline.statement, region, lines, function, devices, first=first_split,
                            join=rule.call_name(join))
    _drop_device_helpers(tower, context.module, changes)
    return Edit(
        changes, "rewrite the split, the tower loop and the concat with tf.distribute.MirroredStrategy",
        add_imports=rewrite.tf.imports, safety=FixSafety.UNSAFE,
    )


def _check_one_tower_loop(context, tower) -> None:
    """The towers must be built by one loop, with their device scopes in it."""
    if tower.via:
        names = ", ".join(f"`{fn.name.value}`" for fn in tower.via)
        raise Refused(f"the towers are built by {names}, called in the loop: move its device scope into the loop first")
    if len(tower_group(context, tower.loop)) > 1:
        raise Refused("the towers are built across several loops; merge them into one loop first")


def _inline_join(rule, tower, parents, join: cst.Call) -> _Inline:
    """The join: `loss = tf.concat(outputs, axis=0)` after the loop, in its block, of `outputs = []`."""
    imports, loop = rule.imports, tower.loop
    block = parents[id(loop)]
    statement = parents[id(join)]
    while not isinstance(statement, cst.BaseStatement):
        statement = parents[id(statement)]
    result = assigned_name(statement)
    if (only_call(statement) is not join or result is None or not _joins_axis0(join, imports, {CONCAT, STACK})
            or not isinstance(join.args[0].value, cst.Name)):
        raise Refused("the towers' outputs are not joined as `result = tf.concat(outputs, axis=0)`")
    if parents[id(statement)] is not block:
        raise Refused("the `tf.concat` of the towers' outputs is not in the same block as the tower loop")
    outputs = join.args[0].value.value
    body = list(block.body)
    at, joined_at = body.index(loop), body.index(statement)
    collect = _collection(loop, outputs)
    init = next((s for s in reversed(body[:at]) if assigned_name(s) == outputs), None)
    if not (init is not None and isinstance(init.body[0].value, cst.List) and not init.body[0].value.elements):
        raise Refused(f"`{outputs}` is not created as an empty list (`{outputs} = []`) before the tower loop")
    uses = sum(references(s, outputs) for s in body if not isinstance(s, (cst.FunctionDef, cst.ClassDef)))
    if uses != 3:
        raise Refused(f"`{outputs}` is used other than to collect the towers' outputs and join them once")
    return _Inline(rule, tower, parents, loop, block, body, statement, result, at, joined_at, collect, init)


def _inline_loop(inline: _Inline) -> _TowerLoop:
    """Check that the tower loop's body can become the replica function; its index and count."""
    loop, body, at = inline.loop, inline.body, inline.at
    index, others = loop_index(loop)
    if not index:
        raise Refused(f"the tower loop `for {code(loop.target)} in ...` has no index to pick each replica's slice")
    count = _loop_count(loop)
    _check_loop_body(loop, inline.tower.owner, inline.parents, index)
    _check_leaks(loop, body[at + 1:], inline.statement)
    # What the towers read from outside the loop must still hold when strategy.run runs them.
    between = set().union(set(), *(_bound(s) for s in body[at + 1:inline.joined_at]))
    local = set().union(names_used(loop.target), *(_bound(s) for s in loop.body.body))
    clash = between & (names_used(loop.body) - local)
    if clash:
        raise Refused(f"{_names(clash)} is set between the tower loop and the `tf.concat`")
    return _TowerLoop(index, others, count, local)


def _inline_splits(inline: _Inline, splits: list[cst.Call], count: str) -> dict[cst.CSTNode, cst.CSTNode]:
    """The splits: `x_parts = tf.split(x, N)` before the loop; each statement with its checked call."""
    rule, parents, loop = inline.rule, inline.parents, inline.loop
    new_splits: dict[cst.CSTNode, cst.CSTNode] = {}
    for call in splits:
        if any(node is call for node in walk(loop)):
            raise Refused("the batch is cut in the tower loop itself: cut it before the loop "
                          "(`x_parts = tf.split(x, n)`) and read `x_parts[i]` in the loop")
        split_statement = parents[id(call)]
        while not isinstance(split_statement, cst.BaseStatement):
            split_statement = parents[id(split_statement)]
        pieces = assigned_name(split_statement)
        if pieces is not None and pieces in names_used(loop.iter):
            raise Refused(f"the tower loop runs over the pieces of `{pieces}` itself: loop over `range(n)` "
                          f"and read `{pieces}[i]` in the body")
        new_splits[split_statement] = _recount(call, split_statement, count, rule.imports, rule)
        if parents[id(split_statement)] is not inline.block or inline.body.index(split_statement) > inline.at:
            raise Refused("the batch is not cut in the same block as the tower loop, before it")
    return new_splits


def _replica_output(inline: _Inline, local: set) -> tuple[str, list[cst.BaseStatement]]:
    """The name the replica function returns, and the assignment that binds it if one is needed."""
    loop, result = inline.loop, inline.result
    appended = inline.collect.body[0].value.args[0].value
    if isinstance(appended, cst.Name) and appended.value in local:
        output, assign = appended.value, []
    else:
        output = result if result not in names_used(loop) else first_free(
            lambda n: n in names_used(loop), f"replica_{result}", "replica_output")
        assign = [cst.parse_statement(f"{output} = {code(appended)}\n")]
    return output, assign


def _split_by_replicas(new_splits: dict, replicas: str) -> None:
    """Each split statement now cuts the batch into ``replicas`` pieces (in place)."""
    for split_statement, new_call in list(new_splits.items()):
        new_call = new_call.with_changes(args=[
            new_call.args[0], new_call.args[1].with_changes(value=cst.parse_expression(replicas)),
            *new_call.args[2:],
        ])
        new_splits[split_statement] = split_statement.visit(ReplaceById({id(only_call(split_statement)): new_call}))


def _replica_function(inline: _Inline, towers: _TowerLoop, rewrite, assign: list) -> cst.FunctionDef:
    """The loop body as the replica function, `outputs.append(x)` replaced by the training step."""
    collect, index = inline.collect, towers.index
    depth = _depth(inline.statement, inline.parents) + 1
    tail = [*assign, *rewrite.training_tail(depth)]
    tail[0] = tail[0].with_changes(leading_lines=[*comment_lines(collect), *tail[0].leading_lines])
    statements = list(inline.loop.body.visit(_TowerBody(inline.rule.imports, index, collect, tail)).body)
    used = set().union(*(names_used(s) for s in statements))
    if towers.others & used:
        raise Refused(f"the tower code uses the loop's device variable {_names(towers.others & used)}")
    return rewrite.function(
        statements, index if index in used else None,
        "# MirroredStrategy runs this once per replica; the replica index replaces the loop variable.",
    )


def _drop_device_helpers(tower, module: cst.Module, changes: dict) -> None:
    """Device helpers only the tower loop called (`assign_to_device(...)`) go with it."""
    removed = [scope.device for scope in tower.scopes]
    for name, definition in device_helpers(tower, module):
        inside = sum(references(node, name) for node in removed)
        if definition is not None and references(module, name) - 1 - inside == 0:
            changes[definition] = cst.RemovalSentinel.REMOVE


def _collection(loop: cst.For, outputs: str) -> cst.SimpleStatementLine:
    """`outputs.append(tower_output)`, the last statement the loop body runs."""
    for statement in find(loop.body, cst.SimpleStatementLine):
        call = only_call(statement)
        if (call is not None and assigned_name(statement) is None and method_call(call, "append")
                and isinstance(call.func.value, cst.Name) and call.func.value.value == outputs):
            if len(call.args) != 1 or call.args[0].star or call.args[0].keyword is not None:
                break
            if not _last_in(statement, loop):
                raise Refused(f"statements follow `{outputs}.append(...)` in the tower loop's body")
            return statement
    raise Refused(f"the tower loop does not collect one output per tower with `{outputs}.append(output)`")


def _last_in(statement: cst.CSTNode, loop: cst.For) -> bool:
    """Whether ``statement`` is what the loop body runs last (through nested `with` blocks only)."""
    block = loop.body
    while True:
        last = block.body[-1]
        if last is statement:
            return True
        if not isinstance(last, cst.With) or not isinstance(last.body, cst.IndentedBlock):
            return False
        block = last.body


def _loop_count(loop: cst.For) -> str:
    """How many towers the loop builds, as the split count must spell it."""
    iterable = loop.iter
    if isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Name) and len(iterable.args) == 1:
        if iterable.func.value in ("range", "xrange"):
            return code(iterable.args[0].value)
        if iterable.func.value == "enumerate":
            return f"len({code(iterable.args[0].value)})"
    raise Refused(f"the tower loop runs over `{code(iterable)}`, not `range(n)` or `enumerate(devices)`")


def _check_loop_body(loop: cst.For, owner, parents, index: str) -> None:
    """The loop body must become a function body that does what one iteration did."""
    for kind, word in ((cst.Break, "break"), (cst.Continue, "continue"), (cst.Return, "return"),
                       (cst.Yield, "yield"), (cst.Global, "global"), (cst.Nonlocal, "nonlocal")):
        if find(loop.body, kind):
            raise Refused(f"the tower loop's body has a `{word}`")
    augmented = find(loop.body, cst.AugAssign)
    if augmented:
        raise Refused(f"`{code(augmented[0].target)} {code(augmented[0].operator).strip()} ...` in the tower "
                      "loop carries a value from one tower to the next")
    # `reuse = False` before the loop, read and then `reuse = True` in it: a flag carried from
    # one tower to the next, which a function's local variable cannot be.
    bound = set().union(set(), *(_bound(s) for s in loop.body.body)) - {index}
    earlier: set[str] = set()  # bound before the loop: in the blocks around it, and the parameters
    node = loop
    while node is not owner and id(node) in parents:
        block = parents[id(node)]
        if isinstance(block, (cst.IndentedBlock, cst.Module)):
            for statement in block.body:
                if statement is node:
                    break
                earlier |= _bound(statement)
        node = block
    if isinstance(owner, cst.FunctionDef):
        earlier |= {p.name.value for p in find(owner.params, cst.Param)}
    carried = bound & earlier & _reads(loop.body)
    if carried:
        raise Refused(f"the tower loop sets {_names(carried)}, also set before it: a value carried from one "
                      "tower to the next")


def _check_leaks(loop: cst.For, after: list, join_statement) -> None:
    """Names the loop body binds must not be read after it: they stay inside the function.
    (A later def reading the same name reads its own variable, as a rule.)"""
    leaking = set().union(set(), *(_bound(s) for s in loop.body.body)) | names_used(loop.target)
    for statement in after:
        if isinstance(statement, cst.For):  # a later loop over `i` reads its own `i`
            leaking -= {n.value for n in _binding_names(statement.target)}
        if statement is not join_statement and not isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            read = leaking & _reads(statement)
            if read:
                raise Refused(f"the tower loop defines {_names(read)}, used after the loop")
        leaking -= _rebound(statement)


def _recount(call: cst.Call, statement, count: str, imports, rule) -> cst.Call:
    """Check `x_parts = tf.split(x, <the tower count>[, axis=0])`; the call to rewrite."""
    name = rule.call_name(call)
    if name != SPLIT:
        raise Refused(f"the batch is cut with `{code(call.func)}`: only `x_parts = tf.split(x, n)` along axis 0 "
                      "is rewritten")
    if only_call(statement) is not call or assigned_name(statement) is None:
        raise Refused(f"`{code(call)}` is not assigned to one name the towers index (`x_parts = tf.split(x, n)`)")
    args = list(call.args)
    if len(args) < 2 or any(a.star for a in args) or args[0].keyword is not None or (
            args[1].keyword is not None and args[1].keyword.value != "num_or_size_splits"):
        raise Refused(f"`{code(call)}` is not `tf.split(value, n)`")
    pieces = args[1].value
    if isinstance(pieces, (cst.List, cst.Tuple)):
        raise Refused(f"`{code(call)}` cuts the batch into unequal sizes: the replicas' mean losses would not "
                      "average to the batch's")
    if code(pieces) != count:
        raise Refused(f"`{code(call)}` cuts the batch into `{code(pieces)}` pieces, the tower loop builds `{count}` towers")
    for k, arg in enumerate(args[2:], start=2):
        keyword = arg.keyword.value if arg.keyword is not None else ("axis" if k == 2 else "num")
        if keyword == "axis" and not _is_zero(arg.value):
            raise Refused(f"`{code(call)}` cuts along axis {code(arg.value)}, not the batch axis")
        if keyword not in ("axis", "name"):
            raise Refused(f"`{code(call)}` passes `{keyword}`")
    return call


class _TowerBody(cst.CSTTransformer):
    """The loop body as the replica's work: no device scopes, no reuse wrapper, and
    `outputs.append(x)` replaced by the training step and the return."""

    def __init__(self, imports, index: str, collect, tail: list[cst.BaseStatement]):
        super().__init__()
        self.imports, self.index, self.collect, self.tail = imports, index, collect, tail

    def _goes(self, item: cst.WithItem) -> bool:
        return device_scope_arg(item.item, self.imports) is not None or self._reuse_wrapper(item)

    def _reuse_wrapper(self, item: cst.WithItem) -> bool:
        """`tf.variable_scope(tf.get_variable_scope(), reuse=<from i>)`: only shares variables."""
        call = item.item
        if item.asname is not None or not isinstance(call, cst.Call):
            return False
        if self.imports.resolve(call.func) != "tensorflow.variable_scope" or len(call.args) != 2:
            return False
        scope, reuse = call.args
        return (scope.keyword is None and isinstance(scope.value, cst.Call)
                and self.imports.resolve(scope.value.func) == "tensorflow.get_variable_scope"
                and reuse.keyword is not None and reuse.keyword.value == "reuse"
                and names_used(reuse.value) - {"bool"} == {self.index})

    def leave_With(self, original: cst.With, updated: cst.With):
        items = [item for item in updated.items if not self._goes(item)]
        if len(items) == len(updated.items):
            return updated
        if not items:
            inner = updated.body
            if isinstance(inner, cst.SimpleStatementSuite):
                return cst.SimpleStatementLine(body=inner.body, leading_lines=updated.leading_lines)
            statements = list(inner.body)
            statements[0] = statements[0].with_changes(
                leading_lines=[*comment_lines(updated), *statements[0].leading_lines])
            return cst.FlattenSentinel(statements)
        items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(items=items)

    def leave_SimpleStatementLine(self, original, updated):
        return cst.FlattenSentinel(self.tail) if original is self.collect else updated


# --- shared: the training step, the replica function, the strategy ----------------------------
@dataclass
class _Step:
    """`train_op = opt.minimize(tf.reduce_mean(loss), ...)`, in the block after the joined result."""

    statement: cst.SimpleStatementLine
    call: cst.Call
    train: str  # `train_op`
    loss: cst.Call  # `tf.reduce_mean(loss)`: what each replica minimizes, on its own output
    averages: bool  # reduce_mean (divide by the replica count), else reduce_sum
    optimizer: cst.BaseExpression
    kept: list[cst.Arg]  # the other arguments, less `colocate_gradients_with_ops`


def _training_step(block, statement, result: str, imports, what: str) -> _Step:
    """The `minimize` of `tf.reduce_mean(result)` (or `reduce_sum`, or of a name holding either)
    after ``statement`` in ``block``, or Refused."""
    body = list(block.body)
    at = next(k for k, s in enumerate(body) if s is statement)
    reduced: dict[str, tuple[bool, cst.Call]] = {}  # `mean_loss = tf.reduce_mean(loss)`: averages?, the call
    minimize = None
    bound_between: set[str] = set()
    for later in body[at + 1:]:
        value = only_call(later)
        target = assigned_name(later)
        if target and value is not None and _reduction(value, result, imports) is not None:
            reduced[target] = (_reduction(value, result, imports), value)
            continue
        if value is not None and method_call(value, "minimize") and value.args:
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
    call = only_call(minimize)
    train = assigned_name(minimize)
    if train is None:
        raise Refused("the result of `minimize(...)` is not assigned to a plain name")
    loss = call.args[0].value
    if isinstance(loss, cst.Name):  # `minimize(mean_loss)`: the replica minimizes the reduction itself
        averages, loss = reduced[loss.value]
    else:
        averages = _reduction(loss, result, imports)
    optimizer = call.func.value
    others = call.args[1:]
    if any(a.star for a in others) or any(result in names_used(a.value) for a in others):
        raise Refused(f"the other arguments of `minimize` read `{result}`")
    clash = (names_used(minimize) - set(reduced)) & bound_between
    if clash:
        raise Refused(f"{_names(clash)} is set between {what} and `minimize`")
    if not isinstance(optimizer, (cst.Name, cst.Attribute, cst.Call)):
        raise Refused("the optimizer of `minimize` is not a name or a constructor call")
    kept = [a for a in others if not (a.keyword is not None and a.keyword.value in DROPPED_KEYWORDS)]
    return _Step(minimize, call, train, loss, averages, optimizer, kept)


def _reduction(node, result: str, imports) -> bool | None:
    """True for `tf.reduce_mean(result)`, False for `tf.reduce_sum(result)`, else None."""
    if not (isinstance(node, cst.Call) and len(node.args) == 1 and node.args[0].keyword is None
            and not node.args[0].star and isinstance(node.args[0].value, cst.Name)
            and node.args[0].value.value == result):
        return None
    qualified = imports.resolve(node.func)
    return True if qualified in MEANS else False if qualified in SUMS else None


class _Rewrite:
    """What both shapes produce: the strategy, the replica function, the joined result."""

    def __init__(self, rule, step: _Step, result: str, *, output: str, step_names: tuple[str, ...]):
        self.rule, self.step, self.result, self.output = rule, step, result, output
        self.module = rule.context.module
        self.parents = module_parents(rule.context)
        self.tf = TfNames(rule)
        self.strategy = first_free(self.module, "strategy", "mirrored_strategy")
        self.name = first_free(self.module, *step_names)
        self.replicas = f"{self.strategy}.num_replicas_in_sync"
        self.head: list[cst.BaseStatement] = []  # an optimizer built inline, built once
        self.optimizer = step.optimizer
        if isinstance(step.optimizer, cst.Call):
            name = first_free(self.module, "opt", "optimizer", "mirrored_optimizer")
            self.head.append(cst.parse_statement(f"{name} = {code(step.optimizer)}\n"))
            self.optimizer = cst.Name(name)
        self.made_first, self.counted = self._step_counted_once()

    def _step_counted_once(self) -> tuple[list[cst.BaseStatement], str | None]:
        """A global step made first in the block the scope covers and passed to `minimize`: made
        before the scope (TF1's variable, not a mirrored one, which read the count before the
        update when fetched with it: a step one behind), and counted once after the replicas'
        update, which goes without it (:mod:`tfmigrate.rewrites.global_steps`). Returns (the
        statements made first, the step), or ([], None)."""
        owner = strategy_scope_owner(self.step.statement, self.parents, self.rule.imports)
        made = {code(single_small(s).targets[0].target): s for s in steps_made_before_scope(self.rule, owner)}
        passed = [arg for arg in global_step_args(self.step.statement) if code(arg.value) in made]
        if not passed:
            return [], None
        self.step = replace(self.step, kept=[arg for arg in self.step.kept if arg is not passed[0]])
        return [made[code(passed[0].value)]], code(passed[0].value)

    def training_tail(self, depth: int) -> list[cst.BaseStatement]:
        """`train_op = opt.minimize(<the replica's loss> [/ N], ...)` and the return of the output."""
        step, call = self.step, self.step.call
        loss = step.loss.with_changes(args=[step.loss.args[0].with_changes(value=cst.Name(self.output))])
        scaled = cst.parse_expression(code(loss) + (f" / {self.replicas}" if step.averages else ""))
        args = [call.args[0].with_changes(value=scaled), *step.kept]
        args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in args]
        minimize = call.with_changes(
            func=call.func.with_changes(value=self.optimizer), args=args,
            whitespace_before_args=cst.SimpleWhitespace(""),
        )
        return [
            _wrapped(f"{step.train} = {code(minimize)}", "    " * depth).with_changes(
                leading_lines=comment_lines(step.statement)),
            cst.parse_statement(
                f"with {self.tf('tensorflow.control_dependencies')}([{step.train}]):\n"
                f"    return {self.tf('tensorflow.identity')}({self.output})\n"
            ),
        ]

    def function(self, statements: list, index: str | None, comment: str) -> cst.FunctionDef:
        """`def replica_step():` over ``statements``, first binding ``index`` to the replica id."""
        if index is not None:
            line = cst.parse_statement(f"{index} = " + REPLICA_INDEX.format(tf=tf_root(self.tf)) + "\n")
            statements = [line.with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(comment))]), *statements]
        return cst.FunctionDef(name=cst.Name(self.name), params=cst.Parameters(),
                               body=cst.IndentedBlock(body=statements))

    def place(self, statement, region: dict, lines: list, function, devices: str, *, first,
              join: str = CONCAT) -> dict:
        """The changes: ``statement`` (the call or the join) becomes [optimizer,] the replica
        function and the joined result, with ``region``'s other changes, the graph under
        ``strategy.scope()``; at module level without a graph, the strategy is created before
        ``first`` (the first statement that needs it)."""
        block = self.parents[id(statement)]
        blank = [cst.EmptyLine(indent=False)] * (1 if isinstance(block, cst.IndentedBlock) else 2)
        create = cst.parse_statement(
            f"{self.strategy} = {self.tf('tensorflow.distribute.MirroredStrategy')}(devices={devices})\n"
        )
        tail = [
            cst.parse_statement(
                f"{self.result} = {self.tf(join)}({self.strategy}.experimental_local_results("
                f"{self.strategy}.run({self.name})), axis=0)\n"
            ).with_changes(leading_lines=blank),
            cst.parse_statement(f"{self.step.train} = {self.result}.op\n"),
            *(count_once(self.rule, self.step.train, self.counted, self.tf) if self.counted else []),
        ]
        # The graph goes under strategy.scope(), as for TFM101, so that the variables built before
        # the call (a global step) are mirrored too; at module level without a graph to put under
        # it, the strategy is created where it is first needed (strategy.run enters the scope for
        # the replicas).
        changes = dict(region)
        changes[statement] = _region(lines, self.head, function, tail, blank)
        try:
            anchor, new_anchor = place_scope(
                statement, self.parents, self.rule.imports, {id(k): v for k, v in changes.items()}, create,
                cst.WithItem(cst.parse_expression(f"{self.strategy}.scope()")), made_first=self.made_first)
            return {anchor: new_anchor}
        except Refused:
            if not isinstance(block, cst.Module):
                raise
        if any(a.keyword is not None and a.keyword.value == "global_step" for a in self.step.kept):
            raise Refused("the global step is created outside a strategy scope at module level: move the graph "
                          "into a function or a `with tf.Graph().as_default():` block first") from None
        if first is statement:
            changes[statement] = _region(lines, [create, *self.head], function, tail, blank)
        else:
            before = changes.get(first, first)
            changes[first] = cst.FlattenSentinel([
                create.with_changes(leading_lines=first.leading_lines), before.with_changes(leading_lines=()),
            ])
        return changes


def _region(lines: list, head: list, function, tail: list, blank: list) -> cst.FlattenSentinel:
    """What replaces the call or the join: [strategy, optimizer,] the replica function, the joined
    result. ``lines`` are the leading lines of what goes."""
    if head:  # the blank lines go before what comes first, the comments stay with the function
        head = [head[0].with_changes(leading_lines=[line for line in lines if line.comment is None]), *head[1:]]
        lines = [line for line in lines if line.comment is not None]
    if not lines or lines[0].comment is not None:
        lines = [*blank, *lines]
    function = function.with_changes(leading_lines=lines)
    return cst.FlattenSentinel([*head, function, *tail])


def _wrapped(line: str, indent: str) -> cst.SimpleStatementLine:
    """`name = opt.minimize(args)`, its arguments on a continuation line when it is too long."""
    if len(indent) + len(line) > 100 and line.endswith(")"):
        name, _, call = line.partition(" = ")
        func, _, args = call.partition("(")
        line = f"{name} = {func}(\n    {args}"
    return cst.parse_statement(line + "\n")


def _binding_names(target: cst.CSTNode) -> list[cst.Name]:
    """The Name nodes an assignment target binds: `x`, `a, (b, *c)`; not `x[i]` or `x.a`."""
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in _binding_names(e.value)]
    if isinstance(target, cst.StarredElement):
        return _binding_names(target.value)
    return []


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


def _rebound(statement: cst.CSTNode) -> set[str]:
    """The plain names a `name = ...` line binds anew."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
            and isinstance(statement.body[0], cst.Assign)):
        return set()
    return {n.value for t in statement.body[0].targets for n in _binding_names(t.target)}


def _reads(node: cst.CSTNode) -> set[str]:
    """The plain names ``node`` reads (the names it only binds left out)."""
    binding = set()
    for n in walk(node):
        if isinstance(n, (cst.AssignTarget, cst.For, cst.CompFor)):
            binding |= {id(name) for name in _binding_names(n.target)}
        elif isinstance(n, cst.AnnAssign) and n.value is not None:
            binding |= {id(name) for name in _binding_names(n.target)}
        elif isinstance(n, cst.AsName):
            binding |= {id(name) for name in _binding_names(n.name)}
        elif isinstance(n, (cst.Param, cst.FunctionDef, cst.ClassDef)):
            binding.add(id(n.name))
    found: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.Name):
            if id(current) not in binding:
                found.add(current.value)
        elif isinstance(current, cst.Attribute):
            stack.append(current.value)
        elif isinstance(current, cst.Arg):
            stack.append(current.value)
        else:
            stack.extend(children(current))
    return found


def _names(names: set[str]) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names))


def _depth(statement, parents) -> int:
    depth, node = 0, parents.get(id(statement))
    while node is not None:
        if isinstance(node, cst.IndentedBlock):
            depth += 1
        node = parents.get(id(node))
    return depth
