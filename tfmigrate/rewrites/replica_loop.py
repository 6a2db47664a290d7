"""The general tower rewrite: the loop body becomes the replica function.

A tower loop says "build this once per device". MirroredStrategy says the same with
``strategy.extended.call_for_each_replica(fn)``: in graph mode it calls ``fn`` once per
replica, replica 0 first, each running until it finishes or reaches a cross-replica step
(``apply_gradients``). So the body is kept as written, statement for statement::

    tower_grads = []
    for i in range(N):
        with tf.device('/gpu:%d' % i), tf.name_scope('tower_%d' % i) as scope:
            loss = tower_loss(scope, parts[i])
            summaries = tf.get_collection(tf.GraphKeys.SUMMARIES, scope)
            grads = opt.compute_gradients(loss)
            tower_grads.append(grads)
    grads = average_gradients(tower_grads)
    ... histograms of grads ...
    apply_op = opt.apply_gradients(grads, global_step=global_step)
    train_op = tf.group(apply_op, ema_op)

becomes::

    tower_grads = []
    loss = summaries = apply_op = None

    def tower_fn():
        nonlocal loss, summaries, apply_op
        i = <this replica's index>
        with tf.name_scope('tower_%d' % i) as scope:
            ... the same statements ...
        # MirroredStrategy sums the replicas' gradients: each replica applies its share.
        apply_op = opt.apply_gradients([(tf.math.scalar_mul(1.0 / strategy.num_replicas_in_sync, g), v)
                                        for g, v in grads if g is not None], global_step=global_step)

    strategy.extended.call_for_each_replica(tower_fn)
    grads = average_gradients(tower_grads)
    ... histograms of grads ...
    train_op = tf.group(apply_op, ema_op)

What the code means decides what changes, not how it is spelled:

- Lists the body fills are filled once per replica, in replica order, so the code after the
  loop that stacks losses, averages gradients for summaries or concatenates predictions reads
  the same per-replica values it read per tower.
- Names the body binds that the function reads or binds outside the loop are declared
  ``nonlocal`` (``global`` at module level): the last replica leaves its value where the last
  tower did, and ``if i == 0: accuracy = ...`` still keeps tower 0's.
- Only the update moves: the ``apply_gradients`` of the averaged (or summed) tower gradients,
  or the ``minimize`` of the towers' mean (or summed) loss, becomes each replica's update of
  its own share (MirroredStrategy sums what the replicas apply). The code after the loop keeps
  reading the update's name.

:func:`plan` returns the Edit, or raises :class:`Refused` naming the line and the reason when
the meaning cannot be kept.
"""

from __future__ import annotations

from dataclasses import replace

import libcst as cst

from tfmigrate.analysis.devices import iteration_key, method_tower_group, module_tower_loops, tower_group
from tfmigrate.analysis.tower_forms import TowerForm, module_tower_forms
from tfmigrate.analysis.training import module_functions, training_call
from tfmigrate.cst.callargs import method_call, with_keyword
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import (
    ReplaceById, contains, find, first_free, fresh_name, module_parents, name_reads, names_used, walk,
)
from tfmigrate.rewrites.mirrored import (
    TfNames, check_tower, helper_import, is_reuse_statement, place_scope, strategy_scope_owner,
)
from tfmigrate.rewrites.global_steps import steps_made_before_scope
from tfmigrate.rewrites.refusal import Refused, StateRefused
from tfmigrate.rewrites.replica_update import (
    ITERATOR_BUILTINS, caller_update, find_update, increment_global_step_once, may_be_iterator, optimizers_named_apart,
    owner_name, under_scope,
)
from tfmigrate.rewrites.tower_averages import applied_per_replica, averages_applied
from tfmigrate.rewrites.tower_body import made_trainable, replica_body, replica_function, shared_names
from tfmigrate.rewrites.tower_callers import (
    PassedArguments, check_devices_visible, arguments_passed, constructor_caller, function_caller, method_caller,
    user_called_update,
)
from tfmigrate.rewrites.tower_checks import (
    check_body, check_keras_parallel, check_only_computes, check_prebuilt_towers, check_tower_variables,
    check_training_state, check_variable_updates, check_waits, loads_per_copy, tower_counters,
)
from tfmigrate.rewrites.tower_code import (
    Region, Update, class_methods, functions_called, index_of, left_by_towers, line_of, loop_region, module_calls,
    replica_code, simple_statements, single_binding, statements_reaching,
)
from tfmigrate.rewrites.tower_regularization import counting_helper, helpers_regularization
from tfmigrate.rewrites.tower_scope import (
    callee_settings_inlined, check_device_names, device_prelude, module_run, module_scope, remove_unused_helpers,
    graph_strategy_call, graph_strategy_definitions, graph_strategy_why, scope_end, settings_inlined, strategy_devices,
    tower_functions,
)
from tfmigrate.rewrites.tower_variables import (
    check_variable_copies, tensors_made_outside, variable_calls, variable_op_names,
)
from tfmigrate.rule import Edit, FixSafety

__all__ = ["plan"]


def plan(rule, tower) -> Edit:
    """The replica rewrite of ``tower`` (a :class:`tfmigrate.analysis.devices.TowerLoop`).

    Towers built across several loops (the model in one, the loss in the next, the gradients in
    a third, each reading what the one before filled: `logits[i]`, `self.tower_loss[i]`), and
    tower loops that build into one graph side by side (training towers and forward-only
    validation towers), are rewritten together: each loop becomes its own replica function, all
    run by one strategy, and replica k of a later loop reads what replica k of an earlier one
    made, as tower k did. One loop of them may update the model; the others only compute. One
    edit does it; every loop's finding carries that edit."""
    group = towers_together(rule, tower)
    if len(group) < 2:
        return _plan(rule, tower, [tower])
    return rule.context.memo(("replica_loop.group", id(group[0].loop)),
                             lambda: _plan(rule, _updating_member(rule, group), group))


def towers_together(rule, tower) -> list:
    """The tower loops rewritten with ``tower`` under one strategy, in the order they run: those
    building the same towers (:func:`tower_group`, :func:`method_tower_group`) and the others
    under the same strategy scope over the same devices (a validation loop beside the training
    loop), and so on from each of them: the same loops whichever of them is asked about (``[tower]``
    alone when none)."""
    return rule.context.memo(("replica_loop.together", id(tower.loop)), lambda: _find_towers_together(rule, tower))


def _find_towers_together(rule, tower) -> list:
    across = method_tower_group(rule.context, tower.loop)
    if len(across) > 1 and len(tower_group(rule.context, tower.loop)) < 2:
        return across
    loops = module_tower_loops(rule.context)
    members, pending = {id(tower.loop): tower}, [tower]
    while pending:
        member = pending.pop()
        owner = member.owner if member.owner is not None else rule.context.module
        region = loop_region(rule.context, member.loop, owner, rule.imports)
        # Over the same devices only: a loop over others (one evaluation GPU) is not these replicas.
        beside = [other for other in _other_towers(rule, region)
                  if not isinstance(other, TowerForm) and _same_replicas(rule, member, other)]
        for other in [*tower_group(rule.context, member.loop), *beside]:
            if id(other.loop) not in members:
                members[id(other.loop)] = other
                pending.append(other)
    return [t for t in loops if id(t.loop) in members]


def _same_replicas(rule, tower, other) -> bool:
    """Whether two tower loops run over the same devices: they iterate over the same thing
    (`range(n)`, `enumerate(gpus)`), or their towers' device lists read the same (`DEVICES` for
    `enumerate(DEVICES)` and `zip(DEVICES, splits)`)."""
    module = rule.context.module
    if iteration_key(tower.loop.iter, module) == iteration_key(other.loop.iter, module):
        return True
    try:
        return strategy_devices(rule, tower) == strategy_devices(rule, other)
    except Refused:
        return False


def _updating_member(rule, group: list):
    """The loop of ``group`` whose towers feed the update: the one that computes gradients or
    updates in its body, or whose results a training step after it reads (a GAN's
    discriminator loop, read by both `minimize` calls); the last when none does (all only
    compute). Refused when two loops do."""
    found = []
    for member in group:
        region = _member_region(rule, member, group)
        filled = left_by_towers(member.loop)
        after = [s for s in region.following if names_used(s) & filled]
        if any(training_call(rule, s) is not None for s in [*simple_statements(member.loop.body), *after]):
            found.append(member)
    if len(found) > 1:
        lines = " and ".join(str(line_of(rule, member.loop)) for member in found)
        raise Refused(f"the tower loops at lines {lines} each feed an update, under one graph: one strategy must "
                      "run both, and the rewrite moves one update only")
    return found[0] if found else group[-1]


def _scoped(rule, home: Region, region_changes: dict, creates: list, scope_item: cst.WithItem, others: list) -> dict:
    """The changes that make the strategy (``creates``) and open its scope over ``home``: over
    the module's run, or the `with`/function that builds the graph, a global step made first."""
    end, _ = scope_end(rule, home)
    if module_run(rule, home):
        _check_in_run(rule, home, others)
        made_first = steps_made_before_scope(rule, rule.context.module, home)
        return module_scope(rule, home, region_changes, creates, scope_item, made_first, end)
    made_first = steps_made_before_scope(rule, strategy_scope_owner(home.loop, home.parents, rule.imports))
    anchor, new_anchor = place_scope(home.loop, home.parents, rule.imports, region_changes, creates[-1], scope_item,
                                     creates[:-1], made_first, end)
    return {anchor: new_anchor}


def _plan(rule, tower, group: list) -> Edit:
    """The rewrite of the loops of ``group`` (``tower`` alone, or with the loops rewritten with
    it), where ``tower`` feeds the update and the others only compute."""
    context, imports, module = rule.context, rule.imports, rule.context.module
    loop = tower.loop
    region = loop_region(context, loop, tower.owner if tower.owner is not None else module, imports)
    others = [member for member in group if member is not tower]
    regions = {id(member.loop): _member_region(rule, member, group) for member in others}
    regions[id(loop)] = region
    _check_loops(rule, group, [regions[id(member.loop)] for member in group])
    tf = TfNames(rule)
    across_methods = any(member.owner is not tower.owner for member in others)
    strategy = first_free(module, "strategy", "mirrored_strategy")
    caller = (function_caller(rule, region) or method_caller(rule, region) or constructor_caller(rule, region)
              or user_called_update(rule, region))
    if others and caller is not None:
        raise Refused(f"the towers are built across {len(group)} loops and updated by {owner_name(caller.owner)}, "
                      "their caller: build the update after the last loop")
    if across_methods or (caller is not None and caller.external):  # the class's user runs them later: the strategy stays on `self`
        strategy = "self." + first_free(module, "strategy", "mirrored_strategy")
    if caller is None:
        update = find_update(rule, region, strategy, tf)
    else:
        update = caller_update(rule, region, caller, strategy, tf)
    first = _moved_first(rule, tower, region, others, regions)
    update.first = [statement.deep_clone() for statement in first]
    scope_region = caller or region
    if update.statements or update.wrapped:
        if caller is None:
            increment_global_step_once(rule, scope_region, update, tf)
        check_training_state(rule, scope_region, update)
    _check_others_compute(rule, region, others, regions)
    run_by = f"{tf('tensorflow.distribute.get_strategy')}()" if caller is not None else strategy
    steps = dict(zip([id(member.loop) for member in group], _step_names(module, len(group))))
    region_changes, originals = _module_changes(rule, group, scope_region, strategy, tf)
    placed = _colocations_placed(rule, group, list(regions.values()), tf)
    region_changes.update((key, new) for key, (_, new) in placed.items())
    originals.update((key, node) for key, (node, _) in placed.items())
    region_changes.update(_loop_changes(rule, tower, region, update, tf, run_by, steps[id(loop)]))
    region_changes.update((id(statement), cst.RemovalSentinel.REMOVE) for statement in first)
    for member in others:
        region_changes.update(_loop_changes(rule, member, regions[id(member.loop)], Update([]), tf, run_by,
                                            steps[id(member.loop)]))
    home = regions[id(group[0].loop)] if across_methods else scope_region  # where the strategy is made
    devices = settings_inlined(rule, home, strategy_devices(rule, group[0] if across_methods else tower))
    check_device_names(rule, devices)
    if caller is not None and caller.owner is not region.owner:
        passed = arguments_passed(region.owner, caller.call)
        devices = callee_settings_inlined(region, devices)
        check_devices_visible(rule, region, devices, passed)
        devices = code(cst.parse_expression(devices).visit(PassedArguments(passed)))
    _check_other_towers(rule, home, group)
    builds = _builds_into_one_graph(rule, home)
    create = _strategy_made(rule, home, tf, strategy, devices, builds)
    scope_item = cst.WithItem(cst.parse_expression(f"{strategy}.scope()"))
    moving, prelude = device_prelude(rule, home, create)
    region_changes.update((id(statement), cst.RemovalSentinel.REMOVE) for statement in moving)
    changes = _scoped(rule, home, region_changes, [*prelude, create], scope_item,
                      [regions[id(member.loop)] for member in others])
    changes.update(graph_strategy_definitions(rule, tf, changes) if builds else {})  # the graph's strategy
    for method in scope_region.external:
        built_in = scope_region.owner.name.value
        why = _BUILT_IN.format(where="the constructor" if built_in == "__init__" else f"`{built_in}`")
        changes[method] = under_scope(method.visit(ReplaceById(region_changes)), scope_item, why)
    if across_methods:
        why = _BUILT_ACROSS_METHODS.format(method=group[0].owner.name.value)
        for member in group[1:]:
            changes[member.owner] = under_scope(member.owner.visit(ReplaceById(region_changes)), scope_item, why)
    _add_outside_changes(rule, changes, region_changes, originals, group, scope_region, tf)
    remove_unused_helpers(changes, tower, module, update, devices)
    title = "rewrite the tower loop as a replica function run by tf.distribute.MirroredStrategy" + update.note
    if others:
        lines = [str(line_of(rule, member.loop)) for member in group]
        title = (f"rewrite the {len(group)} tower loops (lines {', '.join(lines[:-1])} and {lines[-1]}) as replica "
                 "functions run by one tf.distribute.MirroredStrategy" + update.note)
    if context.target == "tf2":  # the TF2 step is written only for the textbook shape (mirrored.py)
        title += (" (compat target: the Session program stays; a tf.function step with tf.GradientTape is "
                  "written only for a loop that averages and applies its gradients right after it)")
    return Edit(changes, title, add_imports=list(tf.imports), remove_imports=helper_import(context, update.helper),
                safety=FixSafety.UNSAFE)


def _strategy_made(rule, home: Region, tf: TfNames, strategy: str, devices: str, builds: list) -> cst.BaseStatement:
    """`strategy = tf.distribute.MirroredStrategy(devices=...)`; the graph's one strategy, said
    why, where the towers are built into one graph more than once (``builds``)."""
    if not builds:
        return cst.parse_statement(f"{strategy} = {tf('tensorflow.distribute.MirroredStrategy')}(devices={devices})\n")
    create = cst.parse_statement(f"{strategy} = {graph_strategy_call(rule, home, tf, devices, builds)}\n")
    why = graph_strategy_why(rule, home, builds)
    return create.with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(f"# {line}")) for line in why])


def _check_loops(rule, towers: list, regions: list[Region]) -> None:
    """The checks every loop of a group must pass, as a loop alone would."""
    for tower, region in zip(towers, regions):
        check_tower(rule, tower, tower_functions=True, grouped=len(towers) > 1)
        check_body(tower.loop)
        check_keras_parallel(rule, tower)
        check_prebuilt_towers(rule, tower.loop)
        check_tower_variables(rule, tower)
        check_variable_copies(rule, tower.loop)
        check_variable_updates(rule, tower)
        if may_be_iterator(region, tower.loop.iter) and not isinstance(tower.loop.iter, cst.Call):
            raise Refused(f"the tower loop walks `{code(tower.loop.iter)}`, an iterator made before it: the "
                          "replicas need a list they can index (`list(...)`)")


def _add_outside_changes(rule, changes: dict, region_changes: dict, originals: dict, towers: list,
                         scope_region: Region, tf: TfNames) -> None:
    """Add to ``changes`` the edits outside what the strategy scope replaced: they apply on their
    own (a variable made in another function, a helper counting regularization per replica).
    ``originals``: the nodes of the module-wide edits (:func:`_module_changes`) by id; the
    others lie in the functions of the loops, their caller and what it reaches."""
    inside = {id(node) for replaced in changes for node in walk(replaced)}
    owners = [scope_region.owner, *scope_region.reaches, *(node for tower in towers for node in [tower.owner, *tower.via])]
    owners = [owner if owner is not None else rule.context.module for owner in owners]
    nodes = {id(node): node for owner in {id(owner): owner for owner in owners}.values() for node in walk(owner)}
    nodes.update(originals)
    changes.update((nodes[key], value) for key, value in region_changes.items() if key not in inside)
    for tower in towers:
        for helper, reads in helpers_regularization(rule, tower.loop).items():
            if helper not in changes and id(helper) not in inside:
                # The helper is replaced whole: the module-wide edits inside it go in with it.
                within = {id(node) for node in walk(helper)}
                edits = {key: value for key, value in region_changes.items() if key in within}
                changes[helper] = counting_helper(helper, reads, tf, edits)


def _check_others_compute(rule, region: Region, others: list, regions: dict) -> None:
    """The loops rewritten beside the updating one (``region``) only compute: nothing trains on
    what they make outside the replicas. What follows the updating loop is its update's to
    judge, and the loops themselves are replica functions; the update's function holds the
    optimizer the module's training calls make (at module level, the code around the loop)."""
    loops = [region.loop, *(member.loop for member in others)]
    judged = {id(node) for statement in [*region.following, *loops] for node in walk(statement)}
    home = [region.owner] if isinstance(region.owner, cst.FunctionDef) else [*region.preceding, *region.following]
    trainers = judged | {id(node) for statement in [*home, *loops] for node in walk(statement)}
    for member in others:
        member_region = regions[id(member.loop)]
        filled = left_by_towers(member.loop)
        # What the code between the loops does with other things (makes the optimizer the
        # update will use, reads the placeholders) is not this loop's results' business.
        unjudged = statements_reaching([s for s in member_region.following if id(s) not in judged], filled)
        check_only_computes(rule, replace(member_region, following=unjudged), trainers)


_BUILT_IN = "The towers were built under this strategy (in {where}); their update runs under it too."


_BUILT_ACROSS_METHODS = "The towers are built across this class's methods, under the one strategy `{method}` made."


def _module_changes(rule, members: list, scope_region: Region, strategy: str, tf: TfNames) -> tuple[dict, dict]:
    """The edits outside the loops, as (id(node) -> replacement, id(node) -> the node): variables
    made trainable under the strategy (counters summed), `initialized_value()` read as
    `initial_value`, optimizers over the same variables named apart, `v.op.name` of a variable
    the replicas walk, `Variable.load` per copy (its statements lie in the strategy's function,
    whose nodes the caller walks)."""
    initial_values = {key: pair for member in members for key, pair in _initial_values(rule, member.loop).items()}
    new_values = {key: new for key, (_, new) in initial_values.items()}
    variables = variable_calls(rule)
    counters = {key: call for member in members for key, call in tower_counters(rule, member)[0].items()}
    renamed, op_names = optimizers_named_apart(rule), variable_op_names(rule, members)
    averages = applied_per_replica(averages_applied(rule, replica_code(rule, members)), tf)
    summed = f"{tf('tensorflow.VariableAggregation')}.SUM"
    changes = {
        **new_values,
        **{key: made_trainable(call.visit(ReplaceById(new_values))) for key, call in variables.items()},
        **{key: with_keyword(made_trainable(call) if key in variables else call, "aggregation", summed)
           for key, call in counters.items()},
        **{key: new for key, (_, new) in renamed.items()},
        **loads_per_copy(rule, scope_region, strategy),
        **{key: new for key, (_, new) in op_names.items()},
        **{key: new for key, (_, new) in averages.items()},
    }
    originals = {**variables, **counters, **{key: node for pairs in (initial_values, renamed, op_names, averages)
                                             for key, (node, _) in pairs.items()}}
    return changes, originals


def _colocations_placed(rule, members: list, regions: list[Region], tf: TfNames) -> dict:
    """`with tf.colocate_with(v):` after the loops and in the functions that code calls (the
    cifar10/inception `average_gradients` sums each variable's gradients next to it) ->
    `with tf.device(v.device):`: run in the cross-replica context on a mirrored variable,
    `colocate_with` failed ("DistributedVariable.handle is not available outside the replica
    context"; a held-out Inception-style trainer), where the variable's device places the ops
    as it did. id(call) -> (call, replacement)."""
    after = [statement for region in regions for statement in region.following]
    replicas = {id(node) for part in replica_code(rule, members) for node in walk(part)}
    placed = {}
    for part in [*after, *functions_called(rule, after)]:
        for item in find(part, cst.WithItem):
            call = item.item
            if (id(call) in replicas or not isinstance(call, cst.Call) or len(call.args) != 1
                    or call.args[0].keyword is not None or call.args[0].star
                    or rule.imports.resolve(call.func) not in ("tensorflow.colocate_with",
                                                               "tensorflow.compat.v1.colocate_with")):
                continue
            device = cst.parse_expression(f"{tf('tensorflow.device')}({code(call.args[0].value)}.device)")
            placed[id(call)] = (call, device)
    return placed


def _moved_first(rule, tower, region: Region, others: list, regions: dict) -> list[cst.BaseStatement]:
    """The statements before the loop that each replica runs first (:func:`tensors_made_outside`);
    for the updating loop of a group only."""
    for member in others:
        if tensors_made_outside(rule, member, regions[id(member.loop)]):
            raise Refused(f"line {line_of(rule, member.loop)}: the towers read a tensor computed from the model's "
                          "variables before them, which the rewrite moves into the replicas for one loop only")
    return tensors_made_outside(rule, tower, region)


def _loop_changes(rule, tower, region: Region, update: Update, tf: TfNames, run_by: str, step: str) -> dict:
    """id(node) -> replacement for one tower loop: the loop, the update it moved, its tower functions."""
    return {id(tower.loop): _replica_loop(rule, tower, region, update, tf, run_by, step), **update.changes,
            **tower_functions(rule, tower)}


def _step_names(module: cst.Module, count: int) -> list[str]:
    """The replica functions' names: `tower_fn` for one loop; `tower_fn`, `tower_fn_2`, ... for a group."""
    if count == 1:
        return [first_free(module, "tower_fn", "replica_fn")]
    taken: set[str] = set()
    return [fresh_name(module, "tower_fn", taken) for _ in range(count)]


def _member_region(rule, member, group: list) -> Region:
    """The region of an earlier loop of a group, its ``following`` cut where the next loop of the
    group starts (what runs after that is the later loops' to check)."""
    region = loop_region(rule.context, member.loop, member.owner if member.owner is not None else rule.context.module,
                     rule.imports)
    others = [m.loop for m in group if m is not member]
    cut = next((k for k, s in enumerate(region.following) if any(contains(s, other) for other in others)),
               len(region.following))
    region.following = region.following[:cut]
    return region


def _check_in_run(rule, home: Region, members: list[Region]) -> None:
    """At module level the strategy scope covers the run of statements around the last loop:
    every loop of the group must be in it."""
    run = module_run(rule, home)
    for member in members:
        if not any(contains(statement, member.loop) for statement in run):
            raise Refused(f"the tower loop at line {line_of(rule, member.loop)} is not in the run of statements the strategy "
                          f"scope covers with the loop at line {line_of(rule, home.loop)}: move both into one function")


def _initial_values(rule, loop: cst.For) -> dict[int, tuple[cst.Call, cst.Attribute]]:
    """`v.initialized_value()` -> `v.initial_value`, by id of the call: a mirrored variable
    raises NotImplementedError for the first (gradient accumulators made with
    `tf.Variable(tf.zeros_like(v.initialized_value()))` crashed). The same where the value only
    gives a shape or initializes another variable (legacy code evaluates it at initialization,
    before any update); anywhere else it reads the trained value, and the rewrite is refused."""
    found = {}
    parents = module_parents(rule.context)
    for call in module_calls(rule):
        if not (method_call(call, "initialized_value") and not call.args):
            continue
        line = rule.position(call).start.line
        if contains(loop, call) or not _initializes(rule, call, parents):
            raise Refused(f"line {line}: `{code(call)}` is not implemented for a mirrored variable, and here it "
                          "reads more than a shape or an initial value")
        found[id(call)] = (call, cst.Attribute(value=call.func.value, attr=cst.Name("initial_value")))
    return found


def _initializes(rule, call: cst.Call, parents: dict) -> bool:
    """Whether ``call`` lies in the arguments of `tf.zeros_like`/`ones_like` (a shape) or of a
    call that makes a variable (its initial value)."""
    node = call
    while id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, cst.Call) and (rule.imports.resolve(node.func) or "").rsplit(".", 1)[-1] in (
                "zeros_like", "ones_like", "Variable", "get_variable", "VariableV1"):
            return True
        if isinstance(node, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            return False
    return False


def _replica_loop(rule, tower, region: Region, update: Update, tf: TfNames, run_by: str,
                  step: str) -> cst.FlattenSentinel:
    """What takes the loop's place: the replica function ``step`` and the strategy's call of it."""
    loop = region.loop
    hoisted = _hoisted_iterable(rule, region)
    body, rereads = replica_body(rule, tower, region, update, tf, run_by, hoisted[0] if hoisted else None)
    shared, unbound = shared_names(region, body, update)
    check_waits(rule, region, set(shared) - update.binds, tower_counters(rule, tower)[1] | _merging(rule, tower))
    function = replica_function(region, step, body, shared, tf)
    call = cst.parse_statement(f"{run_by}.extended.call_for_each_replica({step})\n")
    blank = [cst.EmptyLine(indent=False)]
    replacement = [function.with_changes(leading_lines=blank), call.with_changes(leading_lines=blank),
                   *_reuse_left_on(rule, loop), *(rereads[name] for name in shared if name in rereads),
                   *update.after_run]
    if unbound:
        replacement.insert(0, cst.parse_statement(" = ".join(sorted(unbound)) + " = None\n"))
    if hoisted:
        replacement.insert(0, hoisted[1])
    leading = list(loop.leading_lines)
    block = region.parents.get(id(loop))
    if isinstance(replacement[0], cst.FunctionDef) and not any(line.comment is None for line in leading) and not (
            isinstance(block, (cst.IndentedBlock, cst.Module)) and block.body and block.body[0] is loop):
        leading.insert(0, blank[0])  # a nested function after a statement: a blank line between (PEP 8)
    replacement[0] = replacement[0].with_changes(leading_lines=leading)
    return cst.FlattenSentinel(replacement)


def _hoisted_iterable(rule, region: Region) -> tuple[str, cst.BaseStatement] | None:
    """`for i, xs in enumerate(zip(*xs))` over a generator (finetune-transformer-lm: `xs =
    (tf.split(x, n) for x in xs)` first), `for device, inputs in zip(devices, splits)` over an
    iterator made before (`splits = zip(*[tf.split(...) ...])`: ray's parallel optimizer), or
    whose target rebinds a name the iterable reads: the replicas cannot each walk it again (the
    first would exhaust the iterator, and `xs` would be each replica's own, unbound name; the
    rewrites crashed). Walked once, before the replica function, into a list the replicas
    index: (its name, the statement)."""
    loop, iterable = region.loop, region.loop.iter
    if not isinstance(iterable, cst.Call) or code(iterable.func) in ("range", "xrange"):
        return None
    enumerated = code(iterable.func) == "enumerate" and len(iterable.args) == 1
    source = iterable.args[0].value if enumerated else iterable
    if isinstance(source, (cst.Name, cst.Attribute, cst.List, cst.Tuple, cst.Subscript)):
        return None  # indexed as it is
    shadowed = names_used(loop.target) & names_used(source)
    iterator = any(_made_as_iterator(single_binding(region.owner, name)) for name in name_reads(source))
    if not (shadowed or iterator):
        return None
    name = fresh_name(rule.context.module, "tower_inputs")
    return name, cst.parse_statement(f"{name} = list({code(source)})\n")


def _made_as_iterator(value: cst.BaseExpression | None) -> bool:
    """A generator expression, or `zip(...)`, `map(...)` and the like: walked once only."""
    return isinstance(value, cst.GeneratorExp) or (isinstance(value, cst.Call) and code(value.func) in ITERATOR_BUILTINS)


def _reuse_left_on(rule, loop: cst.For) -> list[cst.BaseStatement]:
    """`tf.get_variable_scope().reuse_variables()` in the body, outside any variable scope the
    body opens, left the scope around the loop reusing its variables once the first tower had
    made them, and the code after the loop in that block may count on it (an A2C model's step
    policy, built after the towers in the same `tf.variable_scope('model')`, failed with "already
    exists"). The replica function drops the call (the strategy shares the variables itself);
    it comes back once, after the strategy's call, where that code may get variables."""
    opened = [w for w in find(loop.body, cst.With) if any(
        isinstance(i.item, cst.Call) and rule.imports.resolve(i.item.func) == "tensorflow.variable_scope" for i in w.items)]
    reuse = next((s for s in simple_statements(loop.body) if is_reuse_statement(s) and not any(contains(w, s) for w in opened)),
                 None)
    block = module_parents(rule.context).get(id(loop))
    siblings = list(block.body) if isinstance(block, (cst.IndentedBlock, cst.Module)) else []
    after = siblings[index_of(siblings, loop) + 1:] if reuse is not None and siblings else []
    if not any(_may_get_variables(rule, call) for statement in after for call in find(statement, cst.Call)):
        return []
    why = cst.EmptyLine(comment=cst.Comment("# The towers left this scope reusing their variables; the code below counts on it."))
    return [reuse.with_changes(leading_lines=[why])]


def _may_get_variables(rule, call: cst.Call) -> bool:
    """A call that may make or get variables by name: the module's own functions and classes, a
    method of `self`, `tf.get_variable`, a `tf.layers` layer."""
    if isinstance(call.func, cst.Name):
        return call.func.value in module_functions(rule) or any(
            isinstance(s, cst.ClassDef) and s.name.value == call.func.value for s in rule.context.module.body)
    name = rule.imports.resolve(call.func) or ""
    return code(call.func).startswith("self.") or name == "tensorflow.get_variable" or name.startswith("tensorflow.layers.")


def _merging(rule, tower) -> set[int]:
    """The calls of the loop body that apply a tower's moving average from a merge call, or
    reach a function that does (:mod:`tfmigrate.rewrites.tower_averages`), by id."""
    applies = averages_applied(rule, replica_code(rule, [tower]))
    if not applies:
        return set()
    methods = class_methods(rule, tower.loop)
    return {id(call) for call in find(tower.loop.body, cst.Call) if id(call) in applies or any(
        id(node) in applies for function in functions_called(rule, [call], methods) for node in walk(function))}


def _builds_into_one_graph(rule, region: Region) -> list[cst.Call]:
    """The calls that build the towers, where more than one builds them into one graph.

    The strategy is made where the graph is built, and runs every tower loop built there
    (rewritten together, :func:`_check_other_towers`). A function that builds into its caller's
    graph and runs more than once (ptb_word_lm's model class made for training and for
    validation, sharing variables) must make one strategy per graph, not per call: a second
    strategy would find the first's variables mirrored by another
    (:func:`~tfmigrate.rewrites.tower_scope.graph_strategy_call`). [] where the towers are built
    once."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    if not isinstance(owner, cst.FunctionDef):
        return []  # a `with` that opens a graph of its own, or the module
    name, parent = owner.name.value, region.parents.get(id(owner))
    holder = region.parents.get(id(parent)) if isinstance(parent, cst.IndentedBlock) else None
    if isinstance(holder, cst.ClassDef):
        wanted = holder.name.value if name == "__init__" else name
        # A subclass's construction runs the class's `__init__` too (neuralgym's
        # `SecondaryMultiGPUTrainer(MultiGPUTrainer)`, made beside a `MultiGPUTrainer`).
        made = {wanted, *_subclasses(rule, wanted)} if name == "__init__" else set()
        uses = [c for c in module_calls(rule)
                if (isinstance(c.func, cst.Name) and c.func.value in made)
                or (isinstance(c.func, cst.Attribute) and c.func.attr.value == wanted and name != "__init__")]
    else:
        wanted = name
        uses = [c for c in module_calls(rule) if isinstance(c.func, cst.Name) and c.func.value == name]
    return uses if len(uses) > 1 else []


def _subclasses(rule, base: str) -> set[str]:
    """The module's classes that derive from ``base``, directly or through one another."""
    classes = list(find(rule.context.module, cst.ClassDef))
    found: set[str] = set()
    while True:
        more = {c.name.value for c in classes if c.name.value not in found
                and any(isinstance(b.value, cst.Name) and b.value.value in found | {base} for b in c.bases)}
        if not more:
            return found
        found |= more


def check_other_towers(rule, tower) -> None:
    """StateRefused when another tower (a `while` or comprehension form) builds under the
    strategy scope this loop's rewrite would open (asked before any rewrite of the loop)."""
    owner = tower.owner if tower.owner is not None else rule.context.module
    _check_other_towers(rule, loop_region(rule.context, tower.loop, owner, rule.imports), towers_together(rule, tower))


def _other_towers(rule, region: Region) -> list:
    """The other tower loops (and tower forms) that build under the strategy scope this loop's
    rewrite opens: one strategy must run them all (two, one inside the other, crashed:
    "Mixing different tf.distribute.Strategy objects")."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    group = {id(t.loop) for t in tower_group(rule.context, region.loop)} | {id(region.loop)}
    # At module level the scope covers the run of statements around the loop only.
    covered = module_run(rule, region) if isinstance(owner, cst.Module) else [owner]
    found = []
    for other in [*module_tower_loops(rule.context), *module_tower_forms(rule.context)]:
        node = other.statement if isinstance(other, TowerForm) else other.loop
        if id(node) in group or not any(contains(scope, node) for scope in covered):
            continue
        if strategy_scope_owner(node, region.parents, rule.imports) is owner:
            found.append(other)
    return found


def _check_other_towers(rule, region: Region, group: list) -> None:
    """Every tower loop under the strategy scope is rewritten with this one: any other (a
    `make_parallel` form, a loop the group does not take) would open its own strategy."""
    taken = {id(member.loop) for member in group}
    for other in _other_towers(rule, region):
        node = other.statement if isinstance(other, TowerForm) else other.loop
        if id(node) in taken:
            continue
        if isinstance(other, TowerForm):
            raise StateRefused(f"the tower loop at line {line_of(rule, node)} builds towers under the same graph: "
                               "each would get its own MirroredStrategy, one inside the other; one strategy must run both")
        raise StateRefused(f"the tower loop at line {line_of(rule, node)} builds towers under the same graph over other "
                           f"devices (`{code(other.loop.iter)}`): one strategy cannot run both, and two would nest")
