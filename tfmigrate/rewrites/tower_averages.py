"""Moving averages the towers make themselves, applied once per replica from cross-replica context.

Inception's `_tower_loss` (and the C3D and video trainers copied from it) keeps a moving average
of each tower's losses for its summaries::

    loss_averages = tf.train.ExponentialMovingAverage(0.9, name='avg')
    loss_averages_op = loss_averages.apply(losses + [total_loss])

Each tower made its own average variables, named after that tower's ops (`tower_1/total_loss/avg`).
In a replica under MirroredStrategy that cannot be written as it is: a replica after the first may
only make a variable replica 0 made under the same name (TF 2.21: "Variable replica_1/.../avg/
does not exist"; with `AUTO_REUSE`, "Tried to create variable ... with mismatching name"). A merge
call can: every replica hands its average and its tensors to one function that runs in
cross-replica context, where each replica's average is applied to that replica's tensors and makes
its own variables, as each tower did::

    loss_averages_op = tf.distribute.get_replica_context().merge_call(
        lambda strategy, averages, tensors: tf.group(*[
            average.apply([strategy.experimental_local_results(t)[k] for t in tensors])
            for k, average in enumerate(strategy.experimental_local_results(averages))]),
        args=(loss_averages, losses + [total_loss]))

`loss_averages.average(l)` then finds each replica's own average, as the tower's summaries read
it. Outside a strategy the default replica context runs the same call on the one average. Only an
average the same function makes and applies to tensors is rewritten this way: one made outside
the towers (one object every tower applies) or applied to the model's variables stays refused.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import method_call
from tfmigrate.cst.traversal import find, module_parents
from tfmigrate.rewrites.tower_code import module_calls

__all__ = ["applied_per_replica", "averages_applied", "unhandled_averages"]

_MOVING_AVERAGE = "tensorflow.train.ExponentialMovingAverage"
# The model's variables: an average of these is the variables' shadow copy, not a tower's result.
_VARIABLE_LISTS = {f"tensorflow.{name}" for name in (
    "trainable_variables", "global_variables", "all_variables", "model_variables", "moving_average_variables",
    "local_variables")}

_APPLIED_PER_REPLICA = (
    "{replica_context}().merge_call(\n"
    "    lambda strategy, averages, tensors: {group}(*[\n"
    "        average.apply([strategy.experimental_local_results(t)[k] for t in tensors])\n"
    "        for k, average in enumerate(strategy.experimental_local_results(averages))]),\n"
    "    args=({average}, {tensors}))"
)


def unhandled_averages(rule, bodies: list, applied: dict) -> list[cst.Call]:
    """In the code the replicas run, the moving averages the rewrite cannot apply per replica:
    an `ExponentialMovingAverage(...)` made there and not rewritten, and an `apply` there of an
    average the module makes elsewhere (one object for every tower: each tower's apply made
    variables named after its own tensors, which a replica after the first cannot), except the
    ``applied`` calls (:func:`averages_applied`)."""
    names = {name for name, _ in _module_averages(rule)}
    found = []
    for body in _holding(rule, bodies, _average_calls(rule)):
        made = {id(call) for call in _averages_made(rule, body).values()}
        found += [call for call in find(body, cst.Call) if id(call) not in applied and (
            (_makes_moving_average(rule, call) and id(call) not in made)
            or (method_call(call, "apply") and isinstance(call.func.value, cst.Name) and call.func.value.value in names))]
    return found


def _makes_moving_average(rule, call: cst.Call) -> bool:
    """`tf.train.ExponentialMovingAverage(...)`, or a name imported for it (an attribute's last
    name is read first: resolving every call of a module is the slow part)."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value != "ExponentialMovingAverage":
        return False
    return rule.imports.resolve(func) == _MOVING_AVERAGE


def averages_applied(rule, bodies: list) -> dict[int, tuple[cst.Call, str, cst.BaseExpression]]:
    """In the code the replicas run (``bodies``: the tower loop's body and the functions it
    reaches), the `average.apply(tensors)` calls of the averages made there that can be applied
    per replica: id(apply call) -> (the call, the average's name, the tensors)."""
    found = {}
    for body in _holding(rule, bodies, [call for _, call in _module_averages(rule)]):
        for name in _averages_made(rule, body):
            applies = [call for call in find(body, cst.Call) if method_call(call, "apply")
                       and isinstance(call.func.value, cst.Name) and call.func.value.value == name]
            tensors = [_applied_to(call) for call in applies]
            if not applies or any(t is None or _reads_variable_list(rule, t) for t in tensors):
                continue
            found.update((id(call), (call, name, applied)) for call, applied in zip(applies, tensors))
    return found


def applied_per_replica(applied: dict, tf) -> dict[int, tuple[cst.Call, cst.BaseExpression]]:
    """The ``applied`` calls (:func:`averages_applied`) rewritten as the merge call above:
    id(apply call) -> (the call, its replacement). ``tf`` spells TensorFlow names."""
    return {key: (call, cst.parse_expression(_APPLIED_PER_REPLICA.format(
        replica_context=tf("tensorflow.distribute.get_replica_context"), group=tf("tensorflow.group"),
        average=name, tensors=cst.Module([]).code_for_node(tensors))))
        for key, (call, name, tensors) in applied.items()}


def _averages_made(rule, body: cst.CSTNode) -> dict[str, cst.Call]:
    """`name = tf.train.ExponentialMovingAverage(...)` in ``body``, by name: a name bound once."""
    made: dict[str, list[cst.Call]] = {}
    for name, call in _bindings(rule, body):
        made.setdefault(name, []).append(call)
    return {name: calls[0] for name, calls in made.items() if len(calls) == 1}


def _mentions_averages(rule) -> bool:
    """Whether the module's text names a moving average at all (most modules do not: their
    calls are not walked for one)."""
    text = rule.context.text
    return text is None or "MovingAverage" in text


def _average_calls(rule) -> list[cst.Call]:
    """The module's calls that make a moving average or apply one it names, found once."""
    if not _mentions_averages(rule):
        return []
    names = {name for name, _ in _module_averages(rule)}
    return rule.context.memo("tower_averages.calls", lambda: [
        call for call in module_calls(rule) if _makes_moving_average(rule, call)
        or (method_call(call, "apply") and isinstance(call.func.value, cst.Name) and call.func.value.value in names)])


def _holding(rule, bodies: list, calls: list[cst.Call]) -> list[cst.CSTNode]:
    """The ``bodies`` some of the ``calls`` lie in (most replica code holds none: walked no further)."""
    if not calls:
        return []
    parents, wanted, found = module_parents(rule.context), {id(body) for body in bodies}, set()
    for call in calls:
        node = call
        while id(node) in parents:
            node = parents[id(node)]
            if id(node) in wanted:
                found.add(id(node))
    return [body for body in bodies if id(body) in found]


def _module_averages(rule) -> list[tuple[str, cst.Call]]:
    """(name, call) of each `name = tf.train.ExponentialMovingAverage(...)` of the module, found once."""
    return rule.context.memo("tower_averages.bindings", lambda: _bindings(rule, rule.context.module)
                             if _mentions_averages(rule) else [])


def _bindings(rule, node: cst.CSTNode) -> list[tuple[str, cst.Call]]:
    """(name, call) of each `name = tf.train.ExponentialMovingAverage(...)` under ``node``."""
    return [(assign.targets[0].target.value, assign.value) for assign in find(node, cst.Assign)
            if len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)
            and isinstance(assign.value, cst.Call) and _makes_moving_average(rule, assign.value)]


def _applied_to(call: cst.Call) -> cst.BaseExpression | None:
    """The tensors of `average.apply(tensors)` / `apply(var_list=tensors)`; None for another form."""
    if len(call.args) != 1 or call.args[0].star:
        return None
    arg = call.args[0]
    return arg.value if arg.keyword is None or arg.keyword.value == "var_list" else None


def _reads_variable_list(rule, tensors: cst.BaseExpression) -> bool:
    return any(rule.imports.resolve(call.func) in _VARIABLE_LISTS for call in find(tensors, cst.Call))
