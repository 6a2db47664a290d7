"""What the towers do that replicas could not do the same way, checked before the tower
rewrite (:mod:`.replica_loop`) changes anything.

- The loop's shape: a body the replica function can hold, variables the towers update or
  count themselves (a counter's `assign_add` is kept, summed across the replicas).
- Where the towers' results go: code the rewrite cannot follow (a container passed in, a
  trainer class elsewhere) would read per-replica values where it read per-tower ones.
- Training state that would differ per replica: a TF1 metric made under the scope outside
  the replicas, a variable the session feeds or loads, a global step counted outside.

Each check raises :class:`Refused` naming the line and the reason, or returns what the
rewrite must handle.
"""

from __future__ import annotations

import re

import libcst as cst

from tfmigrate.analysis.batch_splits import keras_parallel_class, keras_parallel_helper
from tfmigrate.analysis.devices import enclosing_class, tower_loop_at
from tfmigrate.analysis.training import (
    KNOWN_LIBRARIES, VARIABLE_MAKERS, module_functions, tensors_read, training_call, trains, variable_update,
)
from tfmigrate.cst.callargs import argument, callee_name, method_call, short_name
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import (
    contains, enclosing, find, find_own, first_free, free_names, module_parents, names_used, own_nodes, scope_bindings,
    single_small, walk,
)
from tfmigrate.rewrites.mirrored import own_optimizer_update, references, strategy_scope_owner
from tfmigrate.rewrites.global_steps import global_steps_outside
from tfmigrate.rewrites.refusal import Refused, StateRefused
from tfmigrate.rewrites.tower_averages import averages_applied, unhandled_averages
from tfmigrate.rewrites.tower_code import (
    Region, Update, index_of, left_by_towers, line_of, module_calls, replica_code, simple_statements, statement_lines,
)
from tfmigrate.rewrites.tower_regularization import regularization_blocker
from tfmigrate.rewrites.tower_scope import is_metric, scope_end


def check_waits(rule, region: Region, shared: set[str], waiting: set[int]) -> None:
    """A name shared with the code around the loop, bound in the body before a step where the
    replicas wait for each other (`tf.metrics.*` aggregates across them, and so do the calls in
    ``waiting``: the `assign_add` of a counter, see :func:`tower_counters`, and a moving average's
    merge call, see :func:`_merging`) and read after it: while one replica waits there, the
    next runs its body and binds the name to its own value, so the first would read the
    other's (the loop's iterations never interleaved). What the waiting statement binds is
    bound after the wait (`loss = _tower_loss(...)`): the replica resumes, binds and reads its
    own value before the next one resumes."""
    statements = simple_statements(region.loop.body)  # the simple statements, in the order they run
    for at, statement in enumerate(statements):
        wait = next((c for c in find(statement, cst.Call) if id(c) in waiting or is_metric(rule, c)), None)
        if wait is None:
            continue
        before = set().union(set(), *(scope_bindings(s) for s in statements[:at])) & shared
        after = set().union(set(), *(free_names(s) for s in statements[at + 1:])) & before
        if after:
            raise Refused(f"line {line_of(rule, wait)}: `{code(wait.func)}` makes the replicas wait for each other, "
                          f"and `{sorted(after)[0]}`, shared with the code after the loop, is read after it: "
                          "another replica would have changed it by then (read it before, or collect it in a list)")


def check_body(loop: cst.For) -> None:
    if loop.orelse is not None:
        raise Refused("the tower loop has an `else:` clause")
    for node in own_nodes(loop.body):
        if isinstance(node, (cst.Return, cst.Yield, cst.Await)):
            raise Refused("the tower loop body returns or yields: a replica function cannot do that for the caller")
        if isinstance(node, (cst.Break, cst.Continue)) and not _inside_inner_loop(node, loop):
            raise Refused("the tower loop body uses `break`/`continue` on the tower loop")
        if type(node) is cst.Call and _runs_the_graph(node):
            # A device scope around Session.run places nothing: the loop runs steps one after
            # another (a YOLOv3 "multi-GPU" trainer), and the replicas would call the session.
            raise Refused(f"the loop body runs the graph (`{code(node.func)}(...)`): its device scope places nothing, "
                          "and this loop runs training steps one by one, not towers")


def check_prebuilt_towers(rule, loop: cst.For) -> None:
    """The loop walks objects another tower loop made, one per device (bi-att-flow: models built
    under `/gpu:i` by `get_multi_gpu_models()`, then a trainer's loop over `enumerate(models)`
    computing each one's gradients): their variables were made there, outside the strategy's
    scope, and a replica cannot update them (checked: "destinations must be one of a
    `DistributedValues` object")."""
    iterable = loop.iter
    if isinstance(iterable, cst.Call) and code(iterable.func) == "enumerate" and iterable.args:
        iterable = iterable.args[0].value
    if not isinstance(iterable, (cst.Name, cst.Attribute)):
        return
    walked = short_name(iterable)  # `models`, `self.models`
    for other in find(rule.context.module, cst.For):
        if other is loop or tower_loop_at(rule.context, other) is None:
            continue
        filled = next((call for call in find(other.body, cst.Call) if method_call(call, "append")
                       and short_name(call.func.value) == walked), None)  # type: ignore[attr-defined]
        if filled is not None:
            raise Refused(f"the towers walk `{code(iterable)}`, which the tower loop on line {line_of(rule, other)} fills "
                          "with one object per device: their variables are made there, outside the strategy's scope, "
                          "where replicas cannot update them; build each tower's model in this loop")


def check_keras_parallel(rule, tower) -> None:
    """A tower loop of a hand-written Keras `multi_gpu_model` (a `make_parallel` function, a
    `ParallelModel` class: Lambda slices per GPU around a template) is no graph of replicas to
    rewrite in place: TFM201 replaces its one call with the template under the strategy."""
    owner = tower.owner
    cls = enclosing(tower.loop, module_parents(rule.context), cst.ClassDef)
    if isinstance(owner, cst.FunctionDef) and keras_parallel_helper(rule.context, owner):
        helper = owner.name.value
    elif cls is not None and keras_parallel_class(rule.context, cls):
        helper = cls.name.value
    else:
        return
    raise Refused(f"`{helper}` is a hand-written Keras `multi_gpu_model` (Lambda slices of the batch per GPU): "
                  "TFM201 builds the template under the strategy where it is called, and deletes the helper")


def check_tower_variables(rule, tower) -> None:
    """A moving average made in the towers (inception's `_tower_loss`: `ExponentialMovingAverage(0.9,
    name='avg').apply(losses)`) makes each tower's own variables, named after the tower's ops.
    Under MirroredStrategy a replica after the first may only reuse replica 0's variables; one
    made and applied to tensors in one function is applied per replica from a merge call
    (:mod:`tfmigrate.rewrites.tower_averages`). Another (one object made outside the towers,
    an average of the model's variables in them, an `apply` in another form) is refused. (Applied
    by replica 0 only, its merge call would meet the other replicas' optimizer merge call: "Values
    to regroup had different lengths".)"""
    replicas = replica_code(rule, [tower])
    applied = averages_applied(rule, replicas)
    unhandled = unhandled_averages(rule, replicas, applied)
    if unhandled:
        call = unhandled[0]
        raise StateRefused(f"line {line_of(rule, call)}: the towers make a moving average (`ExponentialMovingAverage`), "
                           "each tower its own variables, applied in a form the rewrite does not know (`average = "
                           "...ExponentialMovingAverage(...)` and `average.apply(tensors)` in one function); under "
                           "MirroredStrategy replicas after the first can only reuse replica 0's: average after the "
                           "loop instead (over the mean loss)")


def check_variable_updates(rule, tower) -> None:
    """A tower that counts or stores into a variable itself (`tf.assign_add(episodes, n)` for
    what each worker consumed, a word counter setting the learning rate, `tf.assign(last, x)`):
    the towers updated one variable in turn, but in a replica `tf.assign` on a mirrored
    variable updates that replica's own copy (checked on TF 2.21: the copies part, and a read
    gives replica 0's). An A2C-style and a word2vec-style probe trained differently from steps
    1 and 2: refused. A moving average (`tf.assign(m, m * decay + x * (1 - decay))`, PointNet's
    hand-written batch norm) stays: each copy averages its replica's batches, an estimate of
    the same statistic, as the batch-norm statistics of the rewrite do."""
    for node in [tower.loop.body, *(function.body for function in tower.via)]:
        getter = next((arg for arg in find(node, cst.Arg) if arg.keyword is not None
                       and arg.keyword.value == "custom_getter" and not _places_only(rule, arg.value)), None)
        if getter is not None:
            # In a replica a getter receives that replica's copy of each variable (its op named
            # `.../replica_1`): mean-teacher's getter, keyed by `var.op.name`, failed on replica 1.
            raise StateRefused(f"line {line_of(rule, getter)}: a custom getter in the towers sees each replica's own copy of "
                               "a variable (named `.../replica_1` after the first), where the towers saw one variable")
        call = training_call(rule, node, _updates_variable)
        if call is not None and id(call) not in tower_counters(rule, tower)[1]:
            raise StateRefused(f"line {line_of(rule, call)}: the towers update a variable themselves (`{code(call.func)}`): "
                               "under MirroredStrategy each replica would update its own copy of it; update it once "
                               "after the loop (from the towers' results)")


def _places_only(rule, getter: cst.BaseExpression) -> bool:
    """Whether a custom getter only places the variables (`with tf.device(d): return getter(*args,
    **kwargs)`, model_deploy's and inception's "variables on the CPU"), named or made by a module
    function (`_variables_on(device)`): the strategy places each replica's copy itself, and a
    held-out inception trainer with one matched."""
    function = module_functions(rule).get(callee_name(getter) if isinstance(getter, cst.Call) else
                                          getter.value if isinstance(getter, cst.Name) else "")
    if function is None:
        return False
    if isinstance(getter, cst.Call):  # a factory: `def _variables_on(device): def _getter(...): ...; return _getter`
        inner = [s for s in function.body.body if isinstance(s, cst.FunctionDef)]
        returned = [r.value for r in find_own(function, cst.Return)]
        if len(inner) != 1 or len(returned) != 1 or code(returned[0]) != inner[0].name.value:
            return False
        function = inner[0]
    return _device_then_getter(rule, function)


def _device_then_getter(rule, function: cst.FunctionDef) -> bool:
    """`def g(getter, *args, **kwargs): with tf.device(d): return getter(*args, **kwargs)`."""
    body = function.body.body
    params = function.params
    if len(body) != 1 or not isinstance(body[0], cst.With) or not params.params or params.star_arg is None:
        return False
    if not all(isinstance(item.item, cst.Call) and rule.imports.resolve(item.item.func) == "tensorflow.device"
               for item in body[0].items):
        return False
    inner = body[0].body.body
    call = inner[0].body[0].value if len(inner) == 1 and isinstance(single_small(inner[0]), cst.Return) else None
    first = params.params[0].name.value
    return (isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == first
            and all(arg.star for arg in call.args))


def tower_counters(rule, tower) -> tuple[dict[int, cst.Call], set[int]]:
    """The counters the towers add to (`tf.assign_add(episodes, n)`: what each A2C worker
    consumed; a word2vec word counter): (their constructors, by id, made under the strategy
    scope; the ids of the counting calls). Made with `aggregation=tf.VariableAggregation.SUM`,
    a counter's `assign_add` in a replica adds every replica's amount to every copy, as the
    towers' adds did (an A2C-style and a word2vec-style probe then match; without it each copy
    counted its own replica's). A counter made elsewhere, or updated otherwise, is refused."""

    def compute() -> tuple[dict[int, cst.Call], set[int]]:
        makers, counting = {}, set()
        scope = strategy_scope_owner(tower.loop, module_parents(rule.context), rule.imports)
        for node in [tower.loop.body, *(function.body for function in tower.via)]:
            for call in find(node, cst.Call):
                target = _counter_target(rule, call)
                maker = _variable_maker(rule, target) if target is not None else None
                if maker is not None and scope is not None and contains(scope, maker):
                    makers[id(maker)] = maker
                    counting.add(id(call))
        return makers, counting

    return rule.context.memo(("replica_loop.counted", id(tower.loop)), compute)


def _counter_target(rule, call: cst.Call) -> cst.BaseExpression | None:
    """The variable of `tf.assign_add(v, n)`, `v.assign_add(n)` (or `assign_sub`)."""
    update = variable_update(rule, call)
    return update[1] if update is not None and update[0] in ("assign_add", "assign_sub") else None


def _variable_maker(rule, target: cst.BaseExpression) -> cst.Call | None:
    """The one `tf.Variable(...)`/`tf.get_variable(...)` the module binds to ``target``, that does
    not choose its aggregation already."""
    makers = [node.value for node in find(rule.context.module, cst.Assign)
              if any(code(t.target) == code(target) for t in node.targets)]
    if len(makers) != 1 or not isinstance(makers[0], cst.Call):
        return None
    maker = makers[0]
    if rule.imports.resolve(maker.func) not in VARIABLE_MAKERS or any(
            arg.keyword is not None and arg.keyword.value in ("aggregation", "synchronization") for arg in maker.args):
        return None
    return maker


def _updates_variable(rule, call: cst.Call) -> bool:
    """A call that counts or stores into a variable (not a moving average of it)."""
    update = variable_update(rule, call)
    if update is None:
        return False
    name, target, value = update
    # `tf.assign(m, m * decay + x * (1 - decay))`, `tf.assign_sub(m, (1 - decay) * (m - x))`
    # (charlesq34's tf_util batch norm): the new value reads the old one, scaled.
    moving_average = (name in ("assign", "assign_sub", "assign_add") and target is not None and value is not None
                      and code(target) in {code(n) for n in find(value, cst.Name, cst.Attribute)}
                      and bool(find(value, cst.BinaryOperation)))
    return not moving_average


def _runs_the_graph(call: cst.Call) -> bool:
    """`sess.run(...)`, `self._sess.run(...)`, `session.run(...)`."""
    return method_call(call, "run") and "sess" in code(call.func.value).lower()


def _inside_inner_loop(node: cst.CSTNode, loop: cst.For) -> bool:
    """Whether a break/continue belongs to a loop nested in the tower loop."""
    return any(n is node for inner in find(loop.body, cst.For, cst.While) for n in walk(inner.body))


def check_only_computes(rule, region: Region, own_update: frozenset | set = frozenset()) -> None:
    """Refused when something may train on what the towers make outside the replicas: in the
    loop or ``region.following``, in the caller they are returned to, in another module, or, when
    the results leave for storage other functions read, anywhere in the module but the group's
    own update (the nodes whose ids are in ``own_update``: the loops of a group, and what
    follows the last)."""
    in_loop = simple_statements(region.loop.body)
    for statement in [*in_loop, *region.following]:
        call = training_call(rule, statement)
        if call is not None and trains(rule, call):
            if any(statement is s for s in in_loop):
                raise Refused(f"line {line_of(rule, statement)}: the towers train through `{code(call.func)}`, and "
                              "the rewrite cannot follow their update (returned to the caller, or made in another "
                              "function): build it in the function with the tower loop")
            raise Refused(f"line {line_of(rule, statement)}: `{code(call.func)}` trains on what the towers build, in "
                          "a shape the rewrite does not know: build the gradients and the update in the function "
                          "with the tower loop")
        if call is not None:  # a function of the module that computes gradients or updates
            raise Refused(f"line {line_of(rule, statement)}: `{code(call.func)}` computes gradients or updates the "
                          "model inside, in a shape the rewrite cannot move into the replicas (even where an "
                          "argument turns that off, which the rewrite cannot tell)")
    filled = left_by_towers(region.loop)
    returned = set().union(*(names_used(r) for r in find(region.owner, cst.Return) if r.value is not None))
    if filled & returned:  # the caller may train on them, or open its own strategy: neither can be seen here
        raise Refused(f"the towers' {', '.join(f'`{n}`' for n in sorted(filled & returned))} are returned to the "
                      "caller: build the update (or use the results) in the function with the tower loop")
    _check_no_foreign_consumer(rule, region, filled)
    # What is returned as values, a session run's results, is no tensor the caller can train on.
    returned_tensors = set().union(*(names_used(r.value) - _run_reads(r.value) for r in find(region.owner, cst.Return)
                                     if r.value is not None))
    made = _made_from(region.following, filled) & returned_tensors
    if made and not _callers_only_compute(rule, region):  # `merged['loss'] = ...`, `return merged`
        raise Refused(f"the towers' results reach {', '.join(f'`{n}`' for n in sorted(made))}, returned to the "
                      "caller: build the update (or use the results) in the function with the tower loop")
    # Results can also leave through an argument, a dict, an attribute or a collection: where
    # anything in the module trains, it may train on them outside the replicas.
    if own_update:
        trainer = next((c for c in module_calls(rule) if id(c) not in own_update and trains(rule, c)), None)
    else:
        trainer = rule.context.memo("replica_loop.trainer", lambda: next((c for c in module_calls(rule) if trains(rule, c)), None))
    if trainer is not None and _results_leave(region) and not _kept_from_trainers(rule, region, own_update):
        raise Refused(f"line {line_of(rule, trainer)}: `{code(trainer.func)}` trains in this module, and the towers' "
                      "results go where the rewrite cannot follow them (an update it does not know, or storage other "
                      "functions read): build the update after the tower loop with an optimizer")


def _callers_only_compute(rule, region: Region) -> bool:
    """Whether the function with the loop is a module function whose every call binds its
    results to names nothing after trains on (finetune-transformer-lm's `mgpu_predict`, whose
    outputs the evaluation only runs): the results stay computed values."""
    owner, module, parents = region.owner, rule.context.module, region.parents
    if not isinstance(owner, cst.FunctionDef) or not any(s is owner for s in module.body):
        return False
    name = owner.name.value
    calls = [c for c in module_calls(rule) if isinstance(c.func, cst.Name) and c.func.value == name]
    if not calls or references(module, name) != len(calls) + 1:  # its def and these calls: used no other way
        return False
    for call in calls:
        statement = enclosing(call, parents, cst.SimpleStatementLine)
        if statement is None:
            return False
        if any(_runs_the_graph(run) and contains(run, call) for run in find(statement, cst.Call)):
            continue  # `sess.run(predict(...))`: only computed
        block = parents.get(id(statement))
        if not isinstance(block, (cst.IndentedBlock, cst.Module)):
            return False
        siblings = list(block.body)
        after = siblings[index_of(siblings, statement) + 1:]
        results = scope_bindings(statement)
        reached = results | _made_from(after, results)
        for line in statement_lines(after):
            if not names_used(line) & reached:
                continue
            if training_call(rule, line) is not None or any(
                    (rule.imports.resolve(c.func) or "").split(".")[0] not in ("", *KNOWN_LIBRARIES)
                    for c in find(line, cst.Call)):
                return False  # trains on them, or hands them to code of another module
        if not results:
            return False
    return True


def _run_reads(value: cst.BaseExpression) -> set[str]:
    """The names read only inside session runs in ``value`` (`sess.run(loss)`)."""
    inside = set().union(set(), *(names_used(c) for c in find(value, cst.Call) if _runs_the_graph(c)))
    outside = {n.value for n in find(value, cst.Name)
               if not any(contains(c, n) for c in find(value, cst.Call) if _runs_the_graph(c))}
    return inside - outside


def _made_from(statements: list, names: set[str]) -> set[str]:
    """The names ``statements`` bind from ``names`` (or from what they bound before), or fill
    with them: `total = tf.add_n(losses)`, `merged['loss'] = ...`, `outputs.append(...)`."""
    reached = set(names)
    for line in statement_lines(statements):
        if not names_used(line) & reached:
            continue
        reached |= scope_bindings(line)
        for node in find(line, cst.AssignTarget, cst.Call):
            target = node.target if isinstance(node, cst.AssignTarget) else (
                node.func.value if isinstance(node.func, cst.Attribute) and node.func.attr.value in _FILLING_METHODS
                else None)
            while isinstance(target, (cst.Subscript, cst.Attribute)):
                target = target.value
            if isinstance(target, cst.Name):
                reached.add(target.value)
    return reached - set(names)


def _check_no_foreign_consumer(rule, region: Region, filled: set[str]) -> None:
    """Towers that only compute, whose results (or what is computed from them after the loop)
    are passed to a function imported from another module of the project: it may train on
    them (`build_train_op(total_loss)`), outside the replicas, which cannot be seen here."""
    reached = set(filled)
    for statement in region.following:
        for call in find(statement, cst.Call):
            name = rule.imports.resolve(call.func)
            if (name is not None and name.split(".")[0] not in KNOWN_LIBRARIES
                    and any(tensors_read(arg.value) & reached for arg in call.args)):
                raise Refused(f"line {line_of(rule, statement)}: the towers' results reach `{code(call.func)}`, "
                              "imported from another module: whether it trains on them outside the replicas "
                              "cannot be seen here")
        if names_used(statement) & reached:
            reached |= scope_bindings(statement)


def _results_leave(region: Region) -> bool:
    """Whether the loop or the code after it stores anything where other functions can read it:
    an attribute or an item of something (`self.x = ...`, `settings['x'] = ...`), a list that is
    not the function's own (`self.tower_outputs.append(...)`, a parameter's), a collection."""
    local = _local_names(region.owner)
    in_function = isinstance(region.owner, cst.FunctionDef)

    def not_local(target: cst.CSTNode) -> bool:
        base = target
        while isinstance(base, (cst.Attribute, cst.Subscript)):
            base = base.value
        return not (isinstance(base, cst.Name) and base.value in local)  # a local dict's item stays here

    return any(kind == "collection" or ((kind == "assign" or in_function) and not_local(target))
               for kind, target in _stores(region))


def _stores(region: Region):
    """(kind, target) for each place the loop and the code after it store into: `assign` (an
    attribute or an item: `self.x = ...`, `d['k'] = ...`), `fill` (`x.append(...)` and the other
    :data:`_FILLING_METHODS`: the container), `collection` (`tf.add_to_collection`: None)."""
    for statement in [region.loop.body, *region.following]:
        for node in own_nodes(statement):
            if isinstance(node, (cst.AssignTarget, cst.AugAssign)) and isinstance(node.target, (cst.Attribute, cst.Subscript)):
                yield "assign", node.target
            elif isinstance(node, cst.Call) and code(node.func).endswith("add_to_collection"):
                yield "collection", None
            elif (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)
                  and node.func.attr.value in _FILLING_METHODS):
                yield "fill", node.func.value


def _local_names(owner: cst.CSTNode) -> set[str]:
    """The names a function's own statements bind (none for the module)."""
    return set().union(*(scope_bindings(s) for s in owner.body.body)) if isinstance(owner, cst.FunctionDef) else set()


# Methods that fill a container in place: a container the function does not own leaves with it.
_FILLING_METHODS = ("append", "extend", "insert", "update", "add", "setdefault")


def _kept_from_trainers(rule, region: Region, own_update) -> bool:
    """Whether what the towers store (only on `self`) cannot reach any training code of the
    module: every trainer is a method of a class unrelated to the loop's (SimpleHumanPose's
    `Tester` beside its `Trainer`, both from `Base`), and nothing outside the loop's class reads
    those attributes but a class's own `self`. A trainer's `self.x` is its own object's."""
    parents = region.parents
    home = enclosing_class(region.loop, parents)
    stored = _stored_on_self(region)
    if home is None or not stored:
        return False
    module = rule.context.module
    for call in module_calls(rule):
        if id(call) in own_update or not trains(rule, call):
            continue
        other = enclosing_class(call, parents)
        if other is None or other is home or _related_classes(module, home, other):
            return False
    return not any(node.attr.value in stored and not contains(home, node)
                   and not (isinstance(node.value, cst.Name) and node.value.value == "self")
                   for node in find(module, cst.Attribute))


def _stored_on_self(region: Region) -> set[str]:
    """The attributes of `self` the loop and the code after it store into (`self.x = ...`,
    `self.outputs.append(...)`); empty when anything else leaves (a collection, another object)."""
    local = _local_names(region.owner)
    stored: set[str] = set()
    for kind, target in _stores(region):
        if kind == "collection":
            return set()
        while isinstance(target, cst.Subscript):
            target = target.value
        if not (isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) and target.value.value == "self"):
            if not (isinstance(target, cst.Name) and target.value in local):
                return set()  # another object's, a parameter's or a global container
            continue  # a local list or dict
        stored.add(target.attr.value)
    return stored


def _related_classes(module: cst.Module, one: cst.ClassDef, other: cst.ClassDef) -> bool:
    """Whether either class derives from the other, through the module's classes."""
    classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}

    def ancestors(cls: cst.ClassDef) -> set[str]:
        found, pending = set(), [cls]
        while pending:
            for base in pending.pop().bases:
                name = code(base.value)
                if name not in found:
                    found.add(name)
                    if name in classes:
                        pending.append(classes[name])
        return found

    return one.name.value in ancestors(other) or other.name.value in ancestors(one)


def check_training_state(rule, region: Region, update: Update) -> None:
    """What the moved update needs that the strategy cannot give each replica.

    A regularization loss is made once, when the first tower makes the variables. One made by
    `tf.get_variable(regularizer=...)` (slim's `weights_regularizer`, a variable scope's
    `regularizer`) is evaluated again wherever it is read, so each replica's reads its own copy
    of the weights (checked on TF 2.21); one made by a Keras-style layer argument
    (`kernel_regularizer=`) or added to the collection by hand is a fixed tensor on replica 0's
    copy, and the other replicas would not decay theirs. A global step made outside what the
    strategy scope covers is not a mirrored variable, and the update cannot increment it.
    """
    blocker = rule.context.memo("replica_loop.regularization", lambda: regularization_blocker(rule))
    if blocker:
        raise StateRefused(blocker)
    optimizer = own_optimizer_update(rule, [*update.statements, *update.wrapped])
    if optimizer:
        raise StateRefused(optimizer)
    _check_metrics_outside(rule, region)
    fed = rule.context.memo("replica_loop.fed_variable", lambda: _fed_variable(rule))
    if fed is not None:
        raise StateRefused(f"line {line_of(rule, fed)}: the session feeds `{code(fed)}`, a variable: under MirroredStrategy "
                           "each replica reads its own copy of it, which the feed does not reach (the copies would "
                           "train apart); feed a placeholder (`tf.compat.v1.placeholder_with_default`) instead")
    for _, arg in global_steps_outside(rule, region, [*update.statements, *update.wrapped]):
        if id(arg) in update.counted:
            continue
        raise StateRefused(f"the global step `{code(arg.value)}` is made outside the code the strategy scope "
                           "would cover, so it would not be a mirrored variable the replicas can update")


def _check_metrics_outside(rule, region: Region) -> None:
    """A TF1 metric (`tf.metrics.accuracy` over the towers' concatenated predictions) made after
    the towers is made outside the strategy scope, which ends before it (:func:`scope_end`);
    refused where the scope cannot end there."""
    _, why = scope_end(rule, region)
    if why:
        raise StateRefused(why)


def _fed_variable(rule) -> cst.BaseExpression | None:
    """A feed key naming a variable the module makes (sketch-rnn's `feed = {model.lr: lr}` for
    `self.lr = tf.Variable(...)`): a fed variable is read at the fed value by the towers, but a
    mirrored one only by replica 0 (a held-out Sketch-RNN trainer drifted from step 11)."""
    made = _made_variables(rule)
    attributes = {name.rsplit(".", 1)[1] for name in made if name.startswith("self.")}
    keys = [element.key for node in find(rule.context.module, cst.Dict) for element in node.elements
            if isinstance(element, cst.DictElement)]
    keys += [node.slice[0].slice.value for node in find(rule.context.module, cst.Subscript)
             if "feed" in code(node.value).lower() and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index)]
    for key in keys:
        if code(key) in made or (isinstance(key, cst.Attribute) and key.attr.value in attributes):
            return key
    return None


def _loaded_variables(rule) -> list[cst.Call]:
    """`kl_weight.load(value, sess)` on a variable the module makes (`tf.Variable`,
    `tf.get_variable`) or into a session: under the strategy scope the variable is a
    MirroredVariable, and `load` fails there (IndexError in TF 2.21, a VAE-style probe)."""
    loads = [call for call in module_calls(rule) if method_call(call, "load") and 1 <= len(call.args) <= 2]
    if not loads:
        return []
    made = _made_variables(rule)
    return [call for call in loads if code(call.func.value) in made or _loads_in_session(call)]


def _made_variables(rule) -> set[str]:
    """What the module binds to a variable it makes (`tf.Variable`, `tf.get_variable`), as code:
    `kl_weight`, `self.lr`."""
    return rule.context.memo("replica_loop.made_variables", lambda: {
        code(target.target) for node in find(rule.context.module, cst.Assign)
        if isinstance(node.value, cst.Call) and rule.imports.resolve(node.value.func) in VARIABLE_MAKERS
        for target in node.targets})


def loads_per_copy(rule, region: Region, strategy: str) -> dict:
    """Each `Variable.load` statement of the function the strategy is made in, loading every
    replica's copy of the (now mirrored) variable: `strategy.experimental_local_results(v)`
    (a VAE's KL weight set each step, a teacher's kernel restored from numpy; two probes
    failed with IndexError). A load elsewhere, or inside a larger expression, is refused."""
    changes = {}
    module = rule.context.module
    for call in rule.context.memo("replica_loop.loaded", lambda: _loaded_variables(rule)):
        statement = region.parents.get(id(region.parents.get(id(call))))
        expression = region.parents.get(id(call))
        if not (contains(region.owner, call) and isinstance(expression, cst.Expr) and expression.value is call
                and isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
            raise StateRefused(f"line {line_of(rule, call)}: `{code(call.func)}(...)` sets a variable by `Variable.load`, "
                               "which a variable the strategy mirrors does not have, outside the function the "
                               "strategy is made in: feed the value through a placeholder and `tf.assign` it instead")
        copy, loaded = first_free(module, "replica_copy", "variable_copy"), call.args[0].value
        # A value made by a call is made once (a random draw must be the same for every copy).
        value = first_free(module, "loaded_value", "load_value") if find(loaded, cst.Call) else code(loaded)
        load = call.with_changes(func=call.func.with_changes(value=cst.Name(copy)),
                                 args=[call.args[0].with_changes(value=cst.parse_expression(value)), *call.args[1:]])
        lines = [f"{value} = {code(loaded)}\n"] if value != code(loaded) else []
        lines.append(f"for {copy} in {strategy}.experimental_local_results({code(call.func.value)}):\n    {code(load)}\n")
        why = [f"# `{code(call.func.value)}` is mirrored now, and a mirrored variable has no `load`: each replica's copy is loaded."]
        new = [cst.parse_statement(line) for line in lines]
        new[0] = new[0].with_changes(leading_lines=[*statement.leading_lines, *(cst.EmptyLine(comment=cst.Comment(w)) for w in why)])
        changes[id(statement)] = cst.FlattenSentinel(new)
    return changes


_SESSION_NAME = re.compile(r"(^|\.)_?(sess|session)$", re.IGNORECASE)


def _loads_in_session(call: cst.Call) -> bool:
    """`kernel.load(w, sess)`: a load into a session is `Variable.load`, whatever the variable
    was found by (a distillation teacher's kernel picked from `tf.global_variables('teacher')`);
    `np.load(path)` and `json.load(f)` take no session."""
    session = argument(call, ("value", "session"), "session")
    return session is not None and bool(_SESSION_NAME.search(code(session)))


