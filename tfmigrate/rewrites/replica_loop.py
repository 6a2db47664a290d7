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

import re
import textwrap
from dataclasses import dataclass, replace

import libcst as cst

from tfmigrate.analysis.devices import (
    DEVICE_SPECS, device_scope_arg, enclosing_class, is_device_function, iteration_key,
    method_tower_group, module_tower_loops, ops_device, tower_group,
)
from tfmigrate.analysis.tower_forms import TowerForm, module_tower_forms
from tfmigrate.analysis.training import (
    KNOWN_LIBRARIES, gradient_computation, module_functions, optimizer_step, tensors_read, training_call,
    trains, variable_update,
)
from tfmigrate.cst.callargs import argument, callee_name, is_false, is_true, method_call, split_arguments
from tfmigrate.cst.codegen import code
from tfmigrate.cst.flow import reads_first
from tfmigrate.cst.traversal import (
    assigned_pairs, assignments, blank_lines_unindented, contains, enclosing, find, find_own, free_names, fresh_name, module_parents, name_reads,
    names_used, own_nodes, scope_bindings, single_small, target_names, walk,
)
from tfmigrate.rewrites.hand_written import kept_caller_update, kept_update, own_optimizer_steps
from tfmigrate.rewrites.mirrored import (
    REPLICA_INDEX, ReplaceById, TfNames, averages, averaging_helper, check_tower, comment_lines, device_helpers,
    devices_argument, helper_import, is_docstring, is_reuse_statement,
    own_optimizer_update, place_scope, references, strategy_scope_owner, tf_root,
)
from tfmigrate.rewrites.refusal import Refused, StateRefused
from tfmigrate.rewrites.tower_averages import applied_per_replica, averages_applied, unhandled_averages
from tfmigrate.rewrites.tower_regularization import (
    counted_per_replica, counting_helper, every_towers_regularization, helpers_regularization, regularization_blocker,
    regularization_scale,
)
from tfmigrate.rewrites.tower_variables import check_variable_copies
from tfmigrate.rewrites.tower_callers import (
    PassedArguments, check_devices_visible, constructor_caller, function_caller, method_caller, passed_arguments,
    user_called_update,
)
from tfmigrate.rewrites.tower_code import (
    Collected, Region, Update, class_methods, collected_appends, functions_called, index_of, left_by_towers, line_of,
    loop_region, mentions, method_of, module_calls, outside_loop, outside_statements,
    simple_statements, single_binding, statement_lines, statements_reaching,
)
from tfmigrate.rule import Edit, FixSafety

__all__ = ["plan"]

# Reductions of a list of tower losses, and the share of the total each replica minimises.
_LOSS_MEANS = {"tensorflow.reduce_mean", "tensorflow.math.reduce_mean"}
_LOSS_SUMS = {"tensorflow.add_n", "tensorflow.math.add_n", "tensorflow.reduce_sum", "tensorflow.math.reduce_sum"}
_REDUCE_SUMS = {"tensorflow.reduce_sum", "tensorflow.math.reduce_sum"}
_STACKS = {"tensorflow.stack", "tensorflow.concat", "tensorflow.convert_to_tensor"}


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
        return _devices(rule, tower) == _devices(rule, other)
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
    strategy = _fresh(module, "strategy", "mirrored_strategy")
    caller = (function_caller(rule, region) or method_caller(rule, region) or constructor_caller(rule, region)
              or user_called_update(rule, region))
    if others and caller is not None:
        raise Refused(f"the towers are built across {len(group)} loops and updated by {_owner_name(caller.owner)}, "
                      "their caller: build the update after the last loop")
    if across_methods or (caller is not None and caller.external):  # the class's user runs them later: the strategy stays on `self`
        strategy = "self." + _fresh(module, "strategy", "mirrored_strategy")
    if caller is None:
        update = _update(rule, region, strategy, tf)
    else:
        update = _caller_update(rule, region, caller, strategy, tf)
    scope_region = caller or region
    if update.statements or update.wrapped:
        if caller is None:
            _increment_global_step_once(rule, scope_region, update, tf)
        _check_training_state(rule, scope_region, update)
    _check_others_compute(rule, region, others, regions)
    run_by = f"{tf('tensorflow.distribute.get_strategy')}()" if caller is not None else strategy
    steps = dict(zip([id(member.loop) for member in group], _step_names(module, len(group))))
    region_changes, originals = _module_changes(rule, group, scope_region, strategy, tf)
    region_changes.update(_loop_changes(rule, tower, region, update, tf, run_by, steps[id(loop)]))
    for member in others:
        region_changes.update(_loop_changes(rule, member, regions[id(member.loop)], Update([]), tf, run_by,
                                            steps[id(member.loop)]))
    home = regions[id(group[0].loop)] if across_methods else scope_region  # where the strategy is made
    devices = _settings_inlined(rule, home, _devices(rule, group[0] if across_methods else tower))
    _check_device_names(rule, devices)
    if caller is not None and caller.owner is not region.owner:
        passed = passed_arguments(region, caller)
        devices = _callee_settings_inlined(region, devices)
        check_devices_visible(rule, region, devices, passed)
        devices = code(cst.parse_expression(devices).visit(PassedArguments(passed)))
    create = cst.parse_statement(f"{strategy} = {tf('tensorflow.distribute.MirroredStrategy')}(devices={devices})\n")
    scope_item = cst.WithItem(cst.parse_expression(f"{strategy}.scope()"))
    _check_one_strategy(rule, home, group)
    moving, prelude = _device_prelude(rule, home, create)
    region_changes.update((id(statement), cst.RemovalSentinel.REMOVE) for statement in moving)
    if _module_run(rule, home):
        _check_in_run(rule, home, [regions[id(member.loop)] for member in others])
        changes = _module_scope(rule, home, region_changes, [*prelude, create], scope_item)
    else:
        anchor, new_anchor = place_scope(home.loop, home.parents, imports, region_changes, create, scope_item, prelude)
        changes = {anchor: new_anchor}
    for method in scope_region.external:
        built_in = scope_region.owner.name.value
        why = _BUILT_IN.format(where="the constructor" if built_in == "__init__" else f"`{built_in}`")
        changes[method] = _under_scope(method.visit(ReplaceById(region_changes)), scope_item, why)
    if across_methods:
        why = _BUILT_ACROSS_METHODS.format(method=group[0].owner.name.value)
        for member in group[1:]:
            changes[member.owner] = _under_scope(member.owner.visit(ReplaceById(region_changes)), scope_item, why)
    _add_outside_changes(rule, changes, region_changes, originals, group, scope_region, tf)
    _remove_unused_helpers(changes, tower, module, update)
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


def _check_loops(rule, towers: list, regions: list[Region]) -> None:
    """The checks every loop of a group must pass, as a loop alone would."""
    for tower, region in zip(towers, regions):
        check_tower(rule, tower, tower_functions=True, grouped=len(towers) > 1)
        _check_body(tower.loop)
        _check_tower_variables(rule, tower)
        check_variable_copies(rule, tower.loop)
        _check_variable_updates(rule, tower)
        if _may_be_iterator(region, tower.loop.iter) and not isinstance(tower.loop.iter, cst.Call):
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
        _check_only_computes(rule, replace(member_region, following=unjudged), trainers)


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
    variables = _variable_calls(rule)
    counters = {key: call for member in members for key, call in _counted(rule, member)[0].items()}
    renamed, op_names = _optimizers_named_apart(rule), _variable_op_names(rule, members)
    averages = applied_per_replica(averages_applied(rule, _replica_code(rule, members)), tf)
    summed = f"{tf('tensorflow.VariableAggregation')}.SUM"
    changes = {
        **new_values,
        **{key: _trainable(call.visit(ReplaceById(new_values))) for key, call in variables.items()},
        **{key: _with_keyword(_trainable(call) if key in variables else call, "aggregation", summed)
           for key, call in counters.items()},
        **{key: new for key, (_, new) in renamed.items()},
        **_loads_per_copy(rule, scope_region, strategy),
        **{key: new for key, (_, new) in op_names.items()},
        **{key: new for key, (_, new) in averages.items()},
    }
    originals = {**variables, **counters, **{key: node for pairs in (initial_values, renamed, op_names, averages)
                                             for key, (node, _) in pairs.items()}}
    return changes, originals


_VARIABLE_LISTS = {f"tensorflow.{name}" for name in (
    "trainable_variables", "global_variables", "all_variables", "model_variables", "local_variables", "get_collection")}


def _variable_op_names(rule, towers: list) -> dict[int, tuple[cst.Attribute, cst.BaseExpression]]:
    """`v.op.name` of a variable the towers walk (`[v for v in tf.trainable_variables() if
    v.op.name in ('fc3/kernel', ...)]`, a weight-decay filter in the tower's loss) read as
    `v.name.split(':')[0]`: the same name in the legacy program, but in a replica after the
    first a mirrored variable's op is its own copy's, `fc3/kernel/replica_1`, where its name
    stays `fc3/kernel:0` (the filter selected nothing there and `tf.add_n([])` failed, a ResNet
    trainer class probe). Outside the replicas the op is replica 0's: left as written."""
    key = ("replica_loop.op_names", tuple(id(tower.loop) for tower in towers))
    return rule.context.memo(key, lambda: _find_variable_op_names(rule, towers))


def _replica_code(rule, towers: list) -> list[cst.CSTNode]:
    """What the replicas run: each loop's body and the functions (and own methods) it reaches
    (found once per group of loops: several checks and edits ask)."""

    def compute() -> list[cst.CSTNode]:
        replicas = []
        for tower in towers:
            replicas += [tower.loop.body, *functions_called(rule, [tower.loop.body], class_methods(rule, tower.loop))]
        return replicas

    return rule.context.memo(("replica_loop.replica_code", tuple(id(tower.loop) for tower in towers)), compute)


def _find_variable_op_names(rule, towers: list) -> dict[int, tuple[cst.Attribute, cst.BaseExpression]]:
    found = {}
    for node in [n for body in _replica_code(rule, towers) for n in find(body, cst.CompFor, cst.For)]:
        if not isinstance(node.target, cst.Name):
            continue
        if not (isinstance(node.iter, cst.Call) and rule.imports.resolve(node.iter.func) in _VARIABLE_LISTS):
            continue
        variable = node.target.value
        scope = module_parents(rule.context).get(id(node)) if isinstance(node, cst.CompFor) else node.body
        for read in find(scope, cst.Attribute):
            if (read.attr.value == "name" and isinstance(read.value, cst.Attribute) and read.value.attr.value == "op"
                    and isinstance(read.value.value, cst.Name) and read.value.value.value == variable):
                found[id(read)] = (read, cst.parse_expression(f"{variable}.name.split(':')[0]"))
    return found


def _loop_changes(rule, tower, region: Region, update: Update, tf: TfNames, run_by: str, step: str) -> dict:
    """id(node) -> replacement for one tower loop: the loop, the update it moved, its tower functions."""
    return {id(tower.loop): _replica_loop(rule, tower, region, update, tf, run_by, step), **update.changes,
            **_tower_functions(rule, tower)}


def _step_names(module: cst.Module, count: int) -> list[str]:
    """The replica functions' names: `tower_fn` for one loop; `tower_fn`, `tower_fn_2`, ... for a group."""
    if count == 1:
        return [_fresh(module, "tower_fn", "replica_fn")]
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
    run = _module_run(rule, home)
    for member in members:
        if not any(contains(statement, member.loop) for statement in run):
            raise Refused(f"the tower loop at line {line_of(rule, member.loop)} is not in the run of statements the strategy "
                          f"scope covers with the loop at line {line_of(rule, home.loop)}: move both into one function")


def _variable_calls(rule) -> dict[int, cst.Call]:
    """The module's `tf.Variable(...)` calls that leave `trainable` to its default, by id.

    TF1's default (None) means trainable. Under MirroredStrategy in graph mode, a compat.v1
    `tf.Variable` left at None puts its per-replica copies (`w:0`, `w/replica_1:0`) in the
    TRAINABLE_VARIABLES collection instead of the one mirrored variable (checked on TF 2.21):
    a replica minimising a loss made of every tower's then differentiates by every copy and
    the update counts each gradient N times. Said explicitly, the collection holds the
    mirrored variable, and the legacy program means the same."""
    return rule.context.memo("replica_loop.variable_calls", lambda: {
        id(call): call for call in module_calls(rule)
        if rule.imports.resolve(call.func) in ("tensorflow.Variable", "tensorflow.compat.v1.Variable")
        and not any(arg.keyword is not None and arg.keyword.value in ("trainable", "synchronization") for arg in call.args)
        and call.args and not any(arg.star for arg in call.args)
        and sum(1 for arg in call.args if arg.keyword is None) < 2  # Variable(initial_value, trainable, ...)
    })


def _optimizers_named_apart(rule) -> dict[int, tuple[cst.Call, cst.Call]]:
    """Optimizers of one class and name that update the same variables (SRGAN's `g_init_opt`
    and `g_opt`, two `AdamOptimizer`s over the generator): legacy TF names the second one's
    slots apart (`kernel/Adam_2`), but under MirroredStrategy both ask for `kernel/Adam` and
    the second fails ("already exists"). Each one after the first gets its own `name=`
    (`'Adam_2'`): only its slot variables' names change. By id of the constructor call:
    (the call, the call with the name)."""

    def compute() -> dict[int, tuple[cst.Call, cst.Call]]:
        # (slot name, the function that makes it) -> (its var_lists, constructor), in source order:
        # optimizers made in different functions build different graphs, as a rule.
        made: dict[tuple[str, int], list[tuple[set, cst.Call]]] = {}
        parents = module_parents(rule.context)
        for call in module_calls(rule):
            name = _slot_name(rule, call)
            parent = parents.get(id(call))
            if name is None:
                continue
            key = (name, id(enclosing(call, parents, cst.FunctionDef)))
            if isinstance(parent, cst.Assign) and len(parent.targets) == 1:  # `opt = tf.train.AdamOptimizer(...)`
                made.setdefault(key, []).append((_var_lists(rule, code(parent.targets[0].target)), call))
            elif isinstance(parent, cst.Attribute) and parent.attr.value in ("minimize", "compute_gradients"):
                # `tf.train.AdamOptimizer(lr).minimize(loss, var_list=...)`: made and used at once
                step = parents.get(id(parent))
                if isinstance(step, cst.Call):
                    made.setdefault(key, []).append(({_var_list(step)}, call))
        renamed, taken = {}, {name for name, _ in made}
        for (name, _), optimizers in made.items():
            for index, (lists, call) in enumerate(optimizers[1:], start=1):
                if not any(_may_overlap(rule, lists, others) and not _exclusive_branches(call, other, parents)
                           for others, other in optimizers[:index]):
                    continue
                apart = next(f"{name}_{k}" for k in range(2, 100) if f"{name}_{k}" not in taken)
                taken.add(apart)
                renamed[id(call)] = (call, _with_keyword(call, "name", f"'{apart}'"))
        return renamed

    return rule.context.memo("replica_loop.optimizer_names", compute)


def _slot_name(rule, value: cst.BaseExpression) -> str | None:
    """The name a TF1 optimizer made by ``value`` gives its slots (its `name=`, else its class's
    without `Optimizer`), if it keeps slots and names them by default."""
    if not isinstance(value, cst.Call) or not value.args:
        return None
    resolved = rule.imports.resolve(value.func) or ""
    if not (resolved.startswith("tensorflow.train.") and resolved.endswith("Optimizer")) or "GradientDescent" in resolved:
        return None
    if any(arg.keyword is not None and arg.keyword.value == "name" for arg in value.args):
        return None  # named by the program: its own business
    return resolved.rsplit(".", 1)[-1][:-len("Optimizer")]


def _may_overlap(rule, lists: set, others: set) -> bool:
    """Whether optimizers over these `var_list=` codes may hold a slot for the same variable:
    one over every trainable variable (None, `tf.trainable_variables()`), the same list, or one
    list built from the other (`[v for v in t_vars if ...]`, a loop appending from it)."""
    every = {None, "tf.trainable_variables()", "tf.compat.v1.trainable_variables()"}
    if lists & every or others & every or lists & others:
        return True
    derived = _derived_lists(rule)
    return any(a in derived.get(b, ()) or b in derived.get(a, ()) for a in lists for b in others)


def _derived_lists(rule) -> dict[str, set[str]]:
    """list code -> the codes of the lists it is built from (`d_vars = [v for v in t_vars if
    ...]`; `for var in self.all: ... self.first.append(var)`), followed transitively."""

    def compute() -> dict[str, set[str]]:
        direct: dict[str, set[str]] = {}
        for node in find(rule.context.module, cst.Assign, cst.For):
            if isinstance(node, cst.Assign) and len(node.targets) == 1 and isinstance(node.value, cst.ListComp):
                direct.setdefault(code(node.targets[0].target), set()).add(code(node.value.for_in.iter))
            elif isinstance(node, cst.For):
                for call in find(node.body, cst.Call):
                    if method_call(call, "append") and call.args and code(call.args[0].value) in names_used(node.target):
                        direct.setdefault(code(call.func.value), set()).add(code(node.iter))
        closed = {}
        for name in direct:
            seen, pending = set(), list(direct[name])
            while pending:
                source = pending.pop()
                if source not in seen:
                    seen.add(source)
                    pending += direct.get(source, ())
            closed[name] = seen
        return closed

    return rule.context.memo("replica_loop.derived_lists", compute)


def _exclusive_branches(one: cst.CSTNode, other: cst.CSTNode, parents: dict) -> bool:
    """Whether ``one`` and ``other`` lie in different branches of one `if`/`elif`/`else`."""
    ancestors, node = {}, one
    while id(node) in parents:
        parent = parents[id(node)]
        ancestors[id(parent)] = node  # the child of that ancestor on the way to ``one``
        node = parent
    node = other
    while id(node) in parents:
        parent = parents[id(node)]
        if id(parent) in ancestors:  # the nearest common ancestor: its body holds one, its `else`/`elif` the other
            return isinstance(parent, cst.If) and parent.test not in (ancestors[id(parent)], node)
        node = parent
    return False


def _var_lists(rule, receiver: str) -> set:
    """The `var_list=` codes the optimizer bound to ``receiver`` computes gradients or minimizes
    over (None for all the trainable variables; what `apply_gradients` gets, these computed)."""
    return {_var_list(call) for call in module_calls(rule) if isinstance(call.func, cst.Attribute)
            and code(call.func.value) == receiver and call.func.attr.value in ("compute_gradients", "minimize")}


def _var_list(call: cst.Call) -> str | None:
    """The code of the `var_list=` of a `compute_gradients`/`minimize` call, None when absent."""
    params = ("loss", "var_list") if call.func.attr.value == "compute_gradients" else ("loss", "global_step", "var_list")
    var_list = argument(call, params, "var_list")
    return None if var_list is None else code(var_list)


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


def _trainable(call: cst.Call) -> cst.Call:
    """``call`` with `trainable=True` added as its last argument."""
    return _with_keyword(call, "trainable", "True")


def _with_keyword(call: cst.Call, keyword: str, value: str) -> cst.Call:
    """``call`` with `<keyword>=<value>` added as its last argument."""
    args = list(call.args)
    if args:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    added = cst.Arg(keyword=cst.Name(keyword), value=cst.parse_expression(value),
                    equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                          whitespace_after=cst.SimpleWhitespace("")))
    return call.with_changes(args=[*args, added])


def _replica_loop(rule, tower, region: Region, update: Update, tf: TfNames, run_by: str,
                  step: str) -> cst.FlattenSentinel:
    """What takes the loop's place: the replica function ``step`` and the strategy's call of it."""
    loop = region.loop
    hoisted = _hoisted_iterable(rule, region)
    body, rereads = _replica_body(rule, tower, region, update, tf, run_by, hoisted[0] if hoisted else None)
    shared, unbound = _shared_names(region, body, update)
    _check_waits(rule, region, set(shared) - update.binds, _counted(rule, tower)[1] | _merging(rule, tower))
    function = _replica_function(region, step, body, shared, tf)
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
    return isinstance(value, cst.GeneratorExp) or (isinstance(value, cst.Call) and code(value.func) in _ITERATORS)


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
    applies = averages_applied(rule, _replica_code(rule, [tower]))
    if not applies:
        return set()
    methods = class_methods(rule, tower.loop)
    return {id(call) for call in find(tower.loop.body, cst.Call) if id(call) in applies or any(
        id(node) in applies for function in functions_called(rule, [call], methods) for node in walk(function))}


def _check_waits(rule, region: Region, shared: set[str], waiting: set[int]) -> None:
    """A name shared with the code around the loop, bound in the body before a step where the
    replicas wait for each other (`tf.metrics.*` aggregates across them, and so do the calls in
    ``waiting``: the `assign_add` of a counter, see :func:`_counted`, and a moving average's
    merge call, see :func:`_merging`) and read after it: while one replica waits there, the
    next runs its body and binds the name to its own value, so the first would read the
    other's (the loop's iterations never interleaved). What the waiting statement binds is
    bound after the wait (`loss = _tower_loss(...)`): the replica resumes, binds and reads its
    own value before the next one resumes."""
    statements = simple_statements(region.loop.body)  # the simple statements, in the order they run
    for at, statement in enumerate(statements):
        wait = next((c for c in find(statement, cst.Call) if id(c) in waiting or _waits(rule, c)), None)
        if wait is None:
            continue
        before = set().union(set(), *(scope_bindings(s) for s in statements[:at])) & shared
        after = set().union(set(), *(free_names(s) for s in statements[at + 1:])) & before
        if after:
            raise Refused(f"line {line_of(rule, wait)}: `{code(wait.func)}` makes the replicas wait for each other, "
                          f"and `{sorted(after)[0]}`, shared with the code after the loop, is read after it: "
                          "another replica would have changed it by then (read it before, or collect it in a list)")


def _waits(rule, call: cst.Call) -> bool:
    """A cross-replica step inside the replica function: TF1's metrics aggregate across replicas."""
    name = rule.imports.resolve(call.func) or ""
    return name.startswith(("tensorflow.metrics.", "tensorflow.compat.v1.metrics."))


# --- the shape ------------------------------------------------------------------------------


def _check_body(loop: cst.For) -> None:
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


def _check_tower_variables(rule, tower) -> None:
    """A moving average made in the towers (inception's `_tower_loss`: `ExponentialMovingAverage(0.9,
    name='avg').apply(losses)`) makes each tower's own variables, named after the tower's ops.
    Under MirroredStrategy a replica after the first may only reuse replica 0's variables; one
    made and applied to tensors in one function is applied per replica from a merge call
    (:mod:`tfmigrate.rewrites.tower_averages`). Another (one object made outside the towers,
    an average of the model's variables in them, an `apply` in another form) is refused. (Applied
    by replica 0 only, its merge call would meet the other replicas' optimizer merge call: "Values
    to regroup had different lengths".)"""
    replicas = _replica_code(rule, [tower])
    applied = averages_applied(rule, replicas)
    unhandled = unhandled_averages(rule, replicas, applied)
    if unhandled:
        call = unhandled[0]
        raise StateRefused(f"line {line_of(rule, call)}: the towers make a moving average (`ExponentialMovingAverage`), "
                           "each tower its own variables, applied in a form the rewrite does not know (`average = "
                           "...ExponentialMovingAverage(...)` and `average.apply(tensors)` in one function); under "
                           "MirroredStrategy replicas after the first can only reuse replica 0's: average after the "
                           "loop instead (over the mean loss)")


def _check_variable_updates(rule, tower) -> None:
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
                       and arg.keyword.value == "custom_getter"), None)
        if getter is not None:
            # In a replica a getter receives that replica's copy of each variable (its op named
            # `.../replica_1`): mean-teacher's getter, keyed by `var.op.name`, failed on replica 1.
            raise StateRefused(f"line {line_of(rule, getter)}: a custom getter in the towers sees each replica's own copy of "
                               "a variable (named `.../replica_1` after the first), where the towers saw one variable")
        call = training_call(rule, node, _updates_variable)
        if call is not None and id(call) not in _counted(rule, tower)[1]:
            raise StateRefused(f"line {line_of(rule, call)}: the towers update a variable themselves (`{code(call.func)}`): "
                               "under MirroredStrategy each replica would update its own copy of it; update it once "
                               "after the loop (from the towers' results)")


def _counted(rule, tower) -> tuple[dict[int, cst.Call], set[int]]:
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
    if rule.imports.resolve(maker.func) not in _VARIABLE_MAKERS or any(
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


# --- the update -----------------------------------------------------------------------------


def _gradient_update(rule, region: Region, strategy: str, tf: TfNames) -> Update | None:
    """`tower_grads.append(opt.compute_gradients(loss))`, then after the loop the gradients
    averaged (or summed) and `opt.apply_gradients(<them>, ...)`."""
    collected = [c for c in collected_appends(region.loop, rule.imports) if c.compute is not None]
    if not collected:
        return None
    if len(collected) > 1:
        raise Refused(f"line {line_of(rule, collected[1].statement)}: the towers collect gradients into more than one list")
    item = collected[0]
    average = _find_average(rule, region, item.target)
    start = index_of(region.following, average.statement) + (0 if average.inline else 1)
    apply_statement, apply_call = _find_call(
        rule, region, region.following[start:], "apply_gradients", average.argument, item.target)
    _check_available(rule, region, apply_call, upto=apply_statement, skip=average.argument)
    grads = item.value if isinstance(item.value, cst.Name) else None
    statements: list[cst.BaseStatement] = []
    changes: dict = {}
    if grads is None:  # `tower_grads.append(opt.compute_gradients(loss))`: name the replica's gradients
        name = _fresh(rule.context.module, "replica_grads", "tower_grads_")
        grads = cst.Name(name)
        changes[id(item.statement)] = cst.FlattenSentinel([
            cst.parse_statement(f"{name} = {code(item.value)}\n"),
            item.statement.with_changes(body=[item.statement.body[0].with_changes(
                value=item.statement.body[0].value.with_changes(args=[cst.Arg(grads)]))]),
        ])
    share = grads.value
    pairs = method_call(item.compute, "compute_gradients")  # else `tf.gradients`: a list of gradients
    if average.averages:
        share = _fresh(rule.context.module, "grads_share", "replica_share")
        scaled = f"{tf('tensorflow.math.scalar_mul')}(1.0 / {strategy}.num_replicas_in_sync, g)"
        indent = " " * (len(share) + 4)
        statements.append(cst.parse_statement(
            f"{share} = [({scaled}, v)\n{indent}for g, v in {grads.value} if g is not None]\n" if pairs else
            f"{share} = [None if g is None else {scaled}\n{indent}for g in {grads.value}]\n"))
    first = cst.parse_expression(share)
    if not pairs:  # `zip(averaged, params)`: the replica's share takes the averaged list's place
        first = apply_call.args[0].value.visit(_ReplaceCode(average.argument, share))
    moved, binds, after_changes = _move_call(rule, region, apply_statement, apply_call, first, "apply_op")
    statements += moved
    changes.update(after_changes)
    why = ("Replicas' gradients are summed: each replica applies its share of the mean."
           if average.averages else "Replicas' gradients are summed, as the towers' were.")
    statements[0] = statements[0].with_changes(
        leading_lines=[cst.EmptyLine(comment=cst.Comment(f"# {why}")), *statements[0].leading_lines])
    update = Update(statements, changes, binds)
    _drop_average(region, update, average, item)
    _keep_comments(region, update)
    return update


def _keep_comments(region: Region, update: Update) -> None:
    """The comments above the statements the update removes (the averaging, the list it fills)
    go with the update into the replica function rather than away."""
    removed = {key for key, change in update.changes.items() if change is cst.RemovalSentinel.REMOVE}
    if not update.statements:
        return
    first = update.statements[0]
    # A moved statement keeps its own comments (the apply's "# Apply the gradients ...").
    there = {line.comment.value for statement in update.statements for line in getattr(statement, "leading_lines", ())
             if line.comment is not None}
    kept = [line for statement in [*region.preceding, *simple_statements(region.loop.body), *region.following]
            if id(statement) in removed for line in comment_lines(statement) if line.comment.value not in there]
    if kept:  # after the blank lines above the update, before the comment that explains it
        lines = list(first.leading_lines)
        blanks = next((k for k, line in enumerate(lines) if line.comment is not None), len(lines))
        update.statements[0] = first.with_changes(leading_lines=[*lines[:blanks], *kept, *lines[blanks:]])


@dataclass
class _Average:
    """How the code after the loop combines the tower gradients."""

    statement: cst.BaseStatement  # the first statement after the loop that reads the tower list
    argument: str  # what `apply_gradients` must receive: the averaged name, or the inline call
    averages: bool  # else sums
    inline: bool = False  # `opt.apply_gradients(helper(tower_grads), ...)`: nothing to remove
    helper: str | None = None  # the module function that averages
    init: cst.BaseStatement | None = None  # `averaged = []` before an averaging loop


def _find_average(rule, region: Region, tower_list: str) -> _Average:
    """`grads = helper(tower_grads)`, `grads = [<mean of each variable's gradients>]`, a loop
    over `zip(*tower_grads)` appending to a list, or `opt.apply_gradients(helper(tower_grads))`."""
    for at, statement in enumerate(region.following):
        if not mentions(statement, tower_list):
            continue
        for call in find(statement, cst.Call):
            if method_call(call, "apply_gradients") and call.args and _is_helper_call(call.args[0].value, tower_list):
                helper = code(call.args[0].value.func)
                return _Average(statement, code(call.args[0].value), _helper_averages(rule, region, call.args[0].value),
                                inline=True, helper=helper)
        small = single_small(statement)
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, (cst.Name, cst.Attribute)):
            target = code(small.targets[0].target)
            if _is_helper_call(small.value, tower_list):
                helper = code(small.value.func)
                return _Average(statement, target, _helper_averages(rule, region, small.value), helper=helper)
            return _Average(statement, target, _verdict(rule, statement, tower_list))
        if any(mentions(r, tower_list) for r in find(statement, cst.Return)):
            raise Refused(f"line {line_of(rule, statement)}: `{tower_list}` is returned to the caller, which applies "
                          "them: apply the towers' gradients in the function that builds the towers")
        if isinstance(statement, cst.For) and mentions(statement.iter, tower_list):
            appended = {c.target for c in collected_appends(statement)}
            init = next((s for s in reversed(region.following[:at]) if any(_empty_list_init_of(s, n) for n in appended)), None)
            if len(appended) == 1 and init is not None:
                return _Average(statement, appended.pop(), _verdict(rule, statement, tower_list), init=init)
        raise Refused(f"line {line_of(rule, statement)}: `{tower_list}` is read after the loop other than to "
                      "average or sum the towers' gradients")
    appends = {id(c.statement) for c in collected_appends(region.loop) if c.target == tower_list}
    combining = [s for s in simple_statements(region.loop.body) if mentions(s, tower_list) and id(s) not in appends]
    if combining:
        raise Refused(f"line {line_of(rule, combining[0])}: the towers' gradients `{tower_list}` are combined inside the "
                      "tower loop (by one tower): average and apply them after the loop")
    raise Refused(f"the tower gradients `{tower_list}` are not averaged after the loop in the same function "
                  "(returned to a caller?): apply them in the function that builds the towers")


def _verdict(rule, statement: cst.CSTNode, tower_list: str) -> bool:
    verdict = averages(statement, rule.imports)
    if verdict is None:
        raise Refused(f"line {line_of(rule, statement)}: cannot tell whether this averages or sums `{tower_list}`")
    return verdict


def _is_helper_call(node: cst.CSTNode, tower_list: str) -> bool:
    """`helper(tower_grads)` or `self.helper(tower_grads)` (a trainer's own averaging method)."""
    return (isinstance(node, cst.Call) and callee_name(node) is not None and len(node.args) == 1
            and code(node.args[0].value) == tower_list)


def _helper_averages(rule, region: Region, call: cst.Call) -> bool:
    """Whether the helper ``call`` runs averages (else sums): a module function, or a method of
    the class around the tower loop."""
    within = enclosing_class(region.loop, region.parents) if isinstance(call.func, cst.Attribute) else None
    if isinstance(call.func, cst.Attribute) and within is None:
        raise Refused(f"`{code(call.func)}` is a method of no class around the tower loop, so whether it "
                      "averages or sums is unknown")
    return averaging_helper(callee_name(call), rule.context, within)[1]


def _find_call(rule, region: Region, statements, method: str, argument: str, what: str):
    """The first `<x>.<method>(<argument>, ...)` in ``statements``: (statement, call). The value
    must not change on the way (a clip or a rebinding would then be lost)."""
    for statement in statements:
        for call in find(statement, cst.Call):
            if method_call(call, method) and call.args and _receives(call.args[0].value, argument):
                if not any(s is statement for s in region.following) or not (
                        isinstance(statement, cst.SimpleStatementLine) or _dependency_block(rule, statement, call)):
                    raise Refused(f"line {line_of(rule, statement)}: `{method}` is inside a block after the loop")
                return statement, call
        if "." not in argument and argument in scope_bindings(statement):
            raise Refused(f"line {line_of(rule, statement)}: `{argument}` is changed after the loop before "
                          f"`{method}` (a replica can only apply its own share of the unchanged value)")
    reader = next((s for s in statements if mentions(s, argument)), None)
    if reader is not None and isinstance(single_small(reader), cst.Return):
        owner = region.owner.name.value if isinstance(region.owner, cst.FunctionDef) else "the function"
        raise Refused(f"line {line_of(rule, reader)}: `{argument}` is returned to `{owner}`'s caller, where the rewrite "
                      "does not follow it (a caller of a method on an object made elsewhere, or in another module): "
                      f"{method.split('_')[0]} them in the function with the tower loop, or call it from one function")
    if reader is not None:
        raise Refused(f"line {line_of(rule, reader)}: `{argument}` goes through other code before `{method}` "
                      f"(a clip?): a replica can only {method.split('_')[0]} its own share of the unchanged value")
    raise Refused(f"no `<optimizer>.{method}({argument}, ...)` after the loop for `{what}`")


def _dependency_block(rule, statement: cst.CSTNode, call: cst.Call) -> bool:
    """`with tf.control_dependencies(update_ops): train_op = opt.apply_gradients(...)` and no
    more in the block (batch-norm updates before the step): the block moves with the call."""
    if not (isinstance(statement, cst.With) and isinstance(statement.body, cst.IndentedBlock)
            and len(statement.body.body) == 1):
        return False
    if not all(isinstance(item.item, cst.Call) and item.asname is None
               and rule.imports.resolve(item.item.func) in _CONTROL_DEPENDENCIES for item in statement.items):
        return False
    small = single_small(statement.body.body[0])
    return isinstance(small, (cst.Assign, cst.Expr)) and small.value is call


_CONTROL_DEPENDENCIES = {"tensorflow.control_dependencies", "tensorflow.compat.v1.control_dependencies"}


def _receives(node: cst.CSTNode, argument: str) -> bool:
    """`argument` itself, or zipped with the variables: `zip(argument, params)`, `list(zip(...))`."""
    if code(node) == argument:
        return True
    if isinstance(node, cst.Call) and code(node.func) == "list" and len(node.args) == 1:
        node = node.args[0].value
    return (isinstance(node, cst.Call) and code(node.func) == "zip" and len(node.args) == 2
            and code(node.args[0].value) == argument)


def _check_available(rule, region: Region, call: cst.Call, upto, skip) -> None:
    """The moved update runs inside the replica function: what it reads must exist by then."""
    read = names_used(call.func) | set().union(*(names_used(a.value) for a in call.args[1:]))
    if isinstance(upto, cst.With):  # the control dependencies move with it
        read |= set().union(*(names_used(item.item) for item in upto.items))
    before = region.following[:index_of(region.following, upto)]
    late = sorted(read & set().union(*(scope_bindings(s) for s in before)) - {skip})
    # An attribute set there (`self.global_step = tf.train.get_or_create_global_step()`).
    read_attributes = {code(n) for part in [call.func, *(a.value for a in call.args[1:])] for n in find(part, cst.Attribute)}
    late += sorted(read_attributes & {code(t.target) for s in before for t in find(s, cst.AssignTarget)} - {skip})
    if late:
        raise Refused(f"line {line_of(rule, upto)}: the update reads {', '.join(f'`{n}`' for n in late)}, "
                      "made after the loop; move it above the tower loop")


class _ReplaceCode(cst.CSTTransformer):
    """Every name or attribute chain spelled ``old`` becomes the name ``new``."""

    def __init__(self, old: str, new: str):
        super().__init__()
        self.old, self.new = old, new

    def leave_Name(self, original, updated):
        return cst.Name(self.new) if original.value == self.old else updated

    def leave_Attribute(self, original, updated):
        return cst.Name(self.new) if code(original) == self.old else updated


def _move_call(rule, region: Region, statement, call: cst.Call, first_argument, default_name: str):
    """The update call with its first argument replaced (code or an expression), as a statement
    for the replica function; and what becomes of its statement after the loop."""
    if isinstance(statement, cst.With):  # the control dependencies around the call move with it
        moved, binds, _ = _move_call(rule, region, statement.body.body[0], call, first_argument, default_name)
        block = statement.with_changes(body=statement.body.with_changes(body=moved), leading_lines=comment_lines(statement))
        return [block], binds, {id(statement): cst.RemovalSentinel.REMOVE}
    if isinstance(first_argument, str):
        first_argument = cst.parse_expression(first_argument)
    new_call = call.with_changes(args=[call.args[0].with_changes(value=first_argument), *call.args[1:]])
    small = single_small(statement)
    if isinstance(small, cst.Assign) and small.value is call:
        moved = statement.with_changes(body=[small.with_changes(value=new_call)], leading_lines=comment_lines(statement))
        binds = set().union(*(target_names(t.target) for t in small.targets))
        return [moved], binds, {id(statement): cst.RemovalSentinel.REMOVE}
    if isinstance(small, cst.Expr) and small.value is call:
        return [statement.with_changes(leading_lines=comment_lines(statement))], set(), {id(statement): cst.RemovalSentinel.REMOVE}
    # Inside a larger expression (`train_op = tf.group(opt.apply_gradients(...), ema_op)`).
    name = _fresh(rule.context.module, default_name, default_name + "_")
    moved = cst.parse_statement(f"{name} = {code(new_call)}\n")
    return [moved], {name}, {id(call): cst.Name(name)}


def _drop_average(region: Region, update: Update, average: _Average, item: Collected) -> None:
    """The averaging after the loop stays while something else reads its result (gradient
    summaries); otherwise it goes, and so do the tower list and its appends if nothing reads them."""
    if average.inline:
        update.helper = average.helper  # its one call moved into the replica, without it
        return
    went_ids = {id(s) for s in (average.statement, average.init) if s is not None}
    after = region.following[index_of(region.following, average.statement) + 1:]  # what can read the average
    readers = [s for s in after if id(s) not in went_ids and id(s) not in update.changes
               and mentions(s, average.argument, skipped=frozenset(update.changes))]
    if readers:
        update.note = " (the averaged gradients stay for the code after the loop that reads them)"
        return
    update.changes[id(average.statement)] = cst.RemovalSentinel.REMOVE
    if average.init is not None:
        update.changes[id(average.init)] = _without_list(average.init, average.argument)
    update.helper = average.helper
    if "." in item.target or _reads_elsewhere(region, item.target, (average.statement, item.statement)):
        return
    init = _empty_list_init(region, item.target)
    if init is not None:
        update.changes[id(init)] = _without_list(init, item.target)
        update.changes[id(item.statement)] = (
            cst.FlattenSentinel(update.changes[id(item.statement)].nodes[:1])
            if id(item.statement) in update.changes else cst.RemovalSentinel.REMOVE
        )


def _reads_elsewhere(region: Region, name: str, skipped: tuple) -> bool:
    skipped_ids = {id(s) for s in (*skipped, _empty_list_init(region, name))}
    statements = [*outside_loop(region), *simple_statements(region.loop.body)]
    return any(mentions(s, name) for s in statements if id(s) not in skipped_ids)


def _empty_list_init(region: Region, name: str):
    return next((s for s in reversed(region.preceding) if _empty_list_init_of(s, name)), None)


def _empty_list_init_of(statement: cst.CSTNode, name: str) -> bool:
    """Whether ``statement`` is `<name> = []`, or makes it among others (`grads, losses = [], []`)."""
    return _without_list(statement, name) is not None


def _without_list(statement: cst.CSTNode, name: str):
    """``statement`` without the empty list it binds to ``name``: REMOVE for `<name> = []`, the
    others' bindings for `tower_grads, tower_losses = [], []`; None where it binds no such list."""
    pairs = [(code(target), value) for target, value in assigned_pairs(statement) or ()]
    if not any(target == name and isinstance(value, cst.List) and not value.elements for target, value in pairs):
        return None
    kept = [(target, code(value)) for target, value in pairs if target != name]
    if not kept:
        return cst.RemovalSentinel.REMOVE
    line = f"{', '.join(t for t, _ in kept)} = {', '.join(v for _, v in kept)}\n"
    return cst.parse_statement(line).with_changes(leading_lines=statement.leading_lines,
                                                  trailing_whitespace=statement.trailing_whitespace)


def _loss_update(rule, region: Region, strategy: str, tf: TfNames) -> Update | None:
    """`tower_losses.append(loss)`, then after the loop `total = tf.add_n(tower_losses) / N`
    (or a mean, or a sum) and `opt.minimize(total, ...)`: each replica minimises its share."""
    for item in collected_appends(region.loop):
        if not isinstance(item.value, cst.Name):
            continue
        reduction = _find_reduction(rule, region, item.target)
        if reduction is None:
            continue
        statement, total, share, inline = reduction
        tail = region.following[index_of(region.following, statement) + (0 if inline else 1):]
        if not any(method_call(c, "minimize") and c.args and code(c.args[0].value) == total
                   for s in tail for c in find(s, cst.Call)):
            continue
        minimize_statement, minimize_call = _find_call(rule, region, tail, "minimize", total, item.target)
        _check_available(rule, region, minimize_call, upto=minimize_statement, skip=total)
        share_code = share.format(loss=item.value.value, n=f"{strategy}.num_replicas_in_sync",
                                  mean=tf("tensorflow.reduce_mean"), sum=tf("tensorflow.reduce_sum"))
        moved, binds, changes = _move_call(rule, region, minimize_statement, minimize_call, share_code, "train_op")
        why = ("MirroredStrategy sums the replicas' gradients: each replica minimises its share of the mean loss."
               if share_code != item.value.value else "MirroredStrategy sums the replicas' gradients, as the summed loss did.")
        moved[0] = moved[0].with_changes(
            leading_lines=[cst.EmptyLine(comment=cst.Comment(f"# {why}")), *moved[0].leading_lines])
        return Update(moved, changes, binds)
    return None


def _update(rule, region: Region, strategy: str, tf: TfNames) -> Update:
    """The update moved into the replicas where its shape is known (the cheapest program);
    else the update left as written with its optimizer call run by each replica; else none."""
    if own_optimizer_steps(rule, region.following):
        # A project optimizer whose `apply_gradients` assigns the weights itself (BERT's
        # `AdamWeightDecayOptimizer`) is a hand-written update: it stays after the loop.
        update = kept_update(rule, region)
        if update is not None:
            return update
    try:
        update = _gradient_update(rule, region, strategy, tf) or _loss_update(rule, region, strategy, tf)
    except Refused as refusal:
        update, moved_refusal = None, refusal
    else:
        moved_refusal = None
    if update is not None and _steps_left_behind(region, update):
        # One update moved, another optimizer step left after the loop, where it would run in
        # the cross-replica context and fail (a GAN's generator moved, its critic left): the
        # updates stay as written instead, each optimizer call run by the replicas.
        update = None
    if update is None:
        update = _wrapped_update(rule, region, strategy, tf)
    if update is None:
        update = kept_update(rule, region)
    if update is None and moved_refusal is not None:
        raise moved_refusal
    return update or _forward_only(rule, region)


def _steps_left_behind(region: Region, update: Update) -> bool:
    """Whether an optimizer step after the loop lies in nothing ``update`` moves or changes."""
    kept = [statement for statement in region.following if id(statement) not in update.changes]
    for line in statement_lines(kept):
        changed = [node for node in walk(line) if id(node) in update.changes]
        for call in find(line, cst.Call):
            if optimizer_step(call) and not any(contains(node, call) for node in changed):
                return True
    return False


def _wrapped_update(rule, region: Region, strategy: str, tf: TfNames, towers: Region | None = None) -> Update | None:
    """The code after the loop keeps combining the towers' results as it did (a clip, a
    dict of gradients, a custom total loss); only its optimizer call runs once per replica.

    The replicas' copies of a weight are one weight to the legacy program, so its gradient is
    the sum over the copies' gradients, which is what MirroredStrategy all-reduces:
    ``opt.minimize(total)`` run by each replica differentiates ``total`` by that replica's copy
    (each tower reads its own), and ``opt.apply_gradients(g)`` of gradients already combined
    applies ``g / N`` from each replica.

    ``region`` holds the update (after the loop, or after the call of the function that builds
    the towers: ``towers``, whose code after its loop must not compute gradients either).
    """
    towers = towers or region
    lines = statement_lines(region.following)
    steps = [(line, call) for line in lines for call in find(line, cst.Call) if optimizer_step(call)]
    if not steps:
        return None
    if towers is not region:
        lines += statement_lines(towers.following)
    for line in lines:
        if training_call(rule, line, gradient_computation) is not None:
            raise Refused(f"line {line_of(rule, line)}: gradients are computed after the tower loop, outside the "
                          "replicas: under MirroredStrategy they would see one replica's copy of the weights")
    for statement in simple_statements(towers.loop.body):
        if any(optimizer_step(call) for call in find(statement, cst.Call)):
            raise Refused(f"line {line_of(rule, statement)}: each tower updates the model itself as well as the "
                          "update after the loop")
    if any(method_call(call, "minimize") for _, call in steps):
        _check_no_weights_after(rule, lines)
    update = Update([], note=" (the update after the loop stays; each replica runs its optimizer call)")
    taken: set[str] = set()
    for line in {id(line): line for line, _ in steps}.values():
        calls = [call for at, call in steps if at is line]
        # A step made outside the scope is counted once, after the update.
        update.counted |= _countable_global_steps(rule, region, line)
        # In a method the caller calls after the towers, the caller's strategy is the current one.
        run_by = strategy if not method_of(region, line) else f"{tf('tensorflow.distribute.get_strategy')}()"
        update.changes[id(line)] = _replica_steps(rule, run_by, tf, region, line, calls, taken, update.counted)
        update.wrapped.append(line)
    return update


def _check_no_weights_after(rule, lines) -> None:
    """A trainable weight made after the tower loop, outside the replicas (GE2E's similarity
    scale `w = tf.get_variable("w", ...)` over the towers' joined embeddings): the loss reads
    replica 0's copy only, so the other replicas' `minimize` find no gradient for theirs, and
    MirroredStrategy wants one from each (an assertion failed in a held-out GE2E trainer)."""
    for line in lines:
        for call in find(line, cst.Call):
            name = rule.imports.resolve(call.func) or ""
            trainable = argument(call, (), "trainable")
            makes = name in _VARIABLE_MAKERS or name.startswith(("tensorflow.layers.", "tensorflow.keras.layers."))
            if makes and not is_false(trainable) and not _reuses(rule, call):
                raise Refused(f"line {line_of(rule, call)}: `{code(call.func)}` makes a trainable weight after the tower "
                              "loop, outside the replicas: the loss after the loop reads one replica's copy of it, and "
                              "the other replicas would have no gradient for theirs; make it in the towers")


def _reuses(rule, call: cst.Call) -> bool:
    """`tf.get_variable("w")` under `tf.variable_scope(..., reuse=True)` (or AUTO_REUSE), or with
    neither shape nor initializer: a weight the towers made, got back (an L2 term on it)."""
    if rule.imports.resolve(call.func) == "tensorflow.get_variable" and not any(
            arg.keyword is None or arg.keyword.value in ("shape", "initializer") for arg in call.args[1:]):
        return True
    parents = module_parents(rule.context)
    node = enclosing(call, parents, cst.With)
    while node is not None:
        for item in node.items:
            reuse = argument(item.item, (), "reuse") if isinstance(item.item, cst.Call) else None
            if reuse is not None and (is_true(reuse) or code(reuse).endswith("AUTO_REUSE")):
                return True
        node = enclosing(node, parents, cst.With)
    return False


def _countable_global_steps(rule, region: Region, line) -> set[int]:
    """The `global_step=` arguments in ``line`` naming a step made outside the scope, when the
    line names what it makes (`train_op = ...`) or returns it (`return opt.apply_gradients(...)`,
    named first): the increment is ordered after that."""
    small = single_small(line)
    if not ((isinstance(small, cst.Assign) and len(small.targets) == 1)
            or (isinstance(small, cst.Return) and small.value is not None)):
        return set()
    return {id(arg) for _, arg in _global_steps_outside(rule, region, [line])}


# --- towers built by a function whose caller updates ---------------------------------------


def _under_scope(method: cst.FunctionDef, scope_item: cst.WithItem, why: str) -> cst.FunctionDef:
    """``method``'s body (after its docstring) under the strategy kept on `self`, ``why`` said
    in a comment: its optimizer calls run through `tf.distribute.get_strategy()`, and the
    variables they make are mirrored."""
    body = list(method.body.body)
    at = 1 if body and is_docstring(body[0]) else 0
    why = cst.EmptyLine(comment=cst.Comment(f"# {why}"))
    scoped = cst.With(items=[scope_item], body=cst.IndentedBlock(body=[blank_lines_unindented(s) for s in body[at:]]),
                      leading_lines=[why])
    return method.with_changes(body=method.body.with_changes(body=[*body[:at], scoped]))


def _caller_update(rule, region: Region, caller: Region, strategy: str, tf: TfNames) -> Update:
    update = kept_caller_update(rule, region, caller)
    if update is not None:
        return update
    update = _wrapped_update(rule, caller, strategy, tf, towers=region)
    if update is None:
        raise Refused(f"the towers' results go back to {_owner_name(caller.owner)}, which does not update the model "
                      "through an optimizer: build the update in the function with the tower loop")
    where = {method_of(caller, line) or caller.owner for line in update.wrapped}
    names = ", ".join(sorted(_owner_name(owner) for owner in where))
    update.note = f" (the update stays in {names}; each replica runs its optimizer call)"
    return update


def _owner_name(owner: cst.CSTNode) -> str:
    return f"`{owner.name.value}`" if isinstance(owner, cst.FunctionDef) else "the module's code"


def _replica_steps(rule, strategy: str, tf: TfNames, region: Region, line, calls: list[cst.Call], taken: set[str],
                   counted: set[int]):
    """``line`` with each optimizer call run by the replicas: a function before it per call;
    the global steps in ``counted`` are incremented once after it."""
    before: list[cst.BaseStatement] = []
    after: list[cst.BaseStatement] = []
    runs = {}
    for call in calls:
        steps = [arg for arg in call.args if id(arg) in counted]
        run = _without_argument(call, steps[0]) if steps else call
        # An optimizer made in the call itself may need a name of its own (see _optimizers_named_apart).
        run = run.visit(ReplaceById({key: new for key, (_, new) in _optimizers_named_apart(rule).items()}))
        statements, name = _replica_step(rule, strategy, tf, region, run, taken, _control_dependencies(rule, region, line))
        before += statements
        # Each replica's step returns its own handle on the one update: group them into one op.
        runs[id(call)] = cst.parse_expression(f"{tf('tensorflow.group')}({strategy}.experimental_local_results(\n"
                                              f"    {strategy}.extended.call_for_each_replica({name})))")
        if not steps:
            continue
        small = single_small(line)
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and small.value is call:
            after.append(_count_once(code(small.targets[0].target), code(steps[0].value), tf))
            continue
        # The update is part of a bigger value (`train_op = [opt.apply_gradients(...)]`): its op
        # gets a name of its own, counted after, and the value takes that name.
        applied = fresh_name(rule.context.module, "update_op", taken)
        named = cst.parse_statement(f"{applied} = {code(runs[id(call)])}\n")
        before += [named.with_changes(leading_lines=[cst.EmptyLine(indent=False)]),
                   _count_once(applied, code(steps[0].value), tf)]
        runs[id(call)] = cst.Name(applied)
    blank = [cst.EmptyLine(indent=False)]
    block = region.parents[id(line)]
    first = isinstance(block, (cst.IndentedBlock, cst.Module)) and block.body[0] is line
    spaced = bool(line.leading_lines) and line.leading_lines[-1].comment is None
    before[0] = before[0].with_changes(leading_lines=[*line.leading_lines, *([] if first or spaced else blank),
                                                      *before[0].leading_lines])
    replaced = line.visit(ReplaceById(runs)).with_changes(leading_lines=blank)
    return cst.FlattenSentinel([*before, replaced, *after])


def _control_dependencies(rule, region: Region, line: cst.CSTNode) -> list[str]:
    """The `tf.control_dependencies(...)` items of the `with` blocks around ``line``, outermost
    first. A replica function run by `call_for_each_replica` does not inherit them once the
    towers' replica function has run (checked on TF 2.21): gradient-accumulation code whose
    apply reads the accumulators `with tf.control_dependencies(accum_ops):` raced with the
    accumulation (a probe program: MISMATCH 0.33, and not deterministic)."""
    found: list[str] = []
    node = line
    while node is not region.owner and id(node) in region.parents:
        node = region.parents[id(node)]
        if not isinstance(node, cst.With):
            continue
        for item in reversed(node.items):
            call = item.item
            if isinstance(call, cst.Call) and rule.imports.resolve(call.func) == "tensorflow.control_dependencies":
                if not all(_reads_only(rule, arg.value) for arg in call.args):
                    raise Refused(f"line {line_of(rule, node)}: the update runs under `{code(call)}`, which makes ops: "
                                  "entered again in each replica's step, they would run once per replica")
                found.insert(0, code(call))
    return found


def _reads_only(rule, value: cst.BaseExpression) -> bool:
    """Names, attributes, lists of them (joined with `+`), collection reads, and groupings of
    such (`tf.group(*ops)`, a no-op that waits for them): entered again, nothing that does work
    is made twice."""
    if isinstance(value, (cst.Name, cst.Attribute, cst.Subscript)):
        return True
    if isinstance(value, (cst.List, cst.Tuple)):
        return all(_reads_only(rule, element.value) for element in value.elements)
    if isinstance(value, cst.StarredElement):
        return _reads_only(rule, value.value)
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
        # `update_ops + [loss]`: lists joined (control inputs are a list, not a sum of tensors)
        return _reads_only(rule, value.left) and _reads_only(rule, value.right)
    name = rule.imports.resolve(value.func) if isinstance(value, cst.Call) else None
    if name in ("tensorflow.group", "tensorflow.tuple"):
        return all(_reads_only(rule, arg.value) for arg in value.args if arg.keyword is None)
    return name in ("tensorflow.get_collection", "tensorflow.get_collection_ref")


def _replica_step(rule, strategy: str, tf: TfNames, region: Region, call: cst.Call, taken: set[str],
                  dependencies: list[str] = ()):
    """The function each replica runs in place of ``call`` (with what it needs first), and its
    name; under the ``dependencies`` (see _control_dependencies) when there are some."""
    module = rule.context.module
    first = call.args[0].value if call.args else None
    before: list[cst.BaseStatement] = []
    if isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Call):
        # `tf.train.RMSPropOptimizer(...).minimize(loss)`: one optimizer, made before the
        # replicas, as the program made one; an optimizer per replica has slots nobody made.
        optimizer = fresh_name(module, "optimizer", taken)
        before.append(cst.parse_statement(f"{optimizer} = {code(call.func.value)}\n"))
        call = call.with_changes(func=call.func.with_changes(value=cst.Name(optimizer)))
    if method_call(call, "apply_gradients") and first is not None:
        if _may_be_iterator(region, first) or not isinstance(first, (cst.Name, cst.Attribute)):
            # Made once, before the replicas, as the program made it: each replica walking a zip
            # would run it dry, and in a replica `v.op.name` names that replica's copy of `v`.
            pairs = fresh_name(module, "grads_and_vars_list", taken)
            made = code(first) if isinstance(first, (cst.List, cst.ListComp)) else f"list({code(first)})"
            before.append(cst.parse_statement(f"{pairs} = {made}\n"))
            first = cst.Name(pairs)
        scaled = f"{tf('tensorflow.math.scalar_mul')}(1.0 / {strategy}.num_replicas_in_sync, g)"
        share = f"share = [({scaled}, v)\n         for g, v in {code(first)} if g is not None]\n"
        call = call.with_changes(args=[cst.Arg(cst.Name("share")), *call.args[1:]])
        why = "MirroredStrategy sums what the replicas apply: each applies 1/N of these gradients."
        name = fresh_name(module, "apply_share", taken)
    else:
        share = ""
        why = ("Each replica differentiates the loss by its own copy of the weights;\n"
               "MirroredStrategy sums the copies' gradients into the weight's.")
        name = fresh_name(module, "minimize_share", taken)
    body = f"{share}return {_one_line(call)}\n"  # unindented; a call over several lines keeps its own
    if dependencies:
        body = f"with {', '.join(dependencies)}:\n" + textwrap.indent(body, "    ")
        why += "\nThe control dependencies around it do not reach a replica function: they are entered again."
    function = cst.parse_statement(f"def {name}():\n" + textwrap.indent(body, "    "))
    comments = [cst.EmptyLine(comment=cst.Comment(f"# {line}")) for line in why.split("\n")]
    if before:
        before[0] = before[0].with_changes(leading_lines=comments)
        function = function.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    else:
        function = function.with_changes(leading_lines=comments)
    return [*before, function], name


def _one_line(call: cst.Call) -> str:
    """The call's code on one line where its arguments are (a call laid out over several lines
    keeps its own indentation, which is wrong inside the new function)."""
    args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace("")) for a in call.args]
    flat = code(call.with_changes(args=args, whitespace_before_args=cst.SimpleWhitespace("")))
    joined = _CONTINUATION.sub("", flat)  # `opt \` + `.minimize(...)` (carpedm20 DCGAN): one line
    if "\n" not in joined and _parses(joined):
        return joined
    return code(call)


_CONTINUATION = re.compile(r"[ \t]*\\\n[ \t]*")


def _parses(expression: str) -> bool:
    try:
        cst.parse_expression(expression)
    except cst.ParserSyntaxError:
        return False
    return True


_ITERATORS = ("zip", "map", "filter", "iter", "enumerate", "reversed")


def _may_be_iterator(region: Region, value: cst.BaseExpression) -> bool:
    """Whether the pairs handed to `apply_gradients` may be an iterator (`zip(...)` bound to a name)."""
    if isinstance(value, (cst.List, cst.ListComp, cst.Tuple)):
        return False
    if isinstance(value, cst.Call):
        return code(value.func) not in ("zip", "list", "map", "tuple")  # a fresh one at each call, or a list
    name = code(value)
    for node in find(region.owner, cst.Assign):
        if any(code(t.target) == name for t in node.targets):
            if isinstance(node.value, cst.GeneratorExp) or (
                    isinstance(node.value, cst.Call) and code(node.value.func) in _ITERATORS):
                return True
    return False


def _forward_only(rule, region: Region) -> Update:
    """Towers that only compute (predictions, an evaluation) need no update moved, as long as
    nothing trains on what they make: a training step left outside the replicas would fail."""
    _check_only_computes(rule, region)
    return Update([], note=" (the towers only compute: nothing to update)")


def _check_only_computes(rule, region: Region, own_update: frozenset | set = frozenset()) -> None:
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


def _check_training_state(rule, region: Region, update: Update) -> None:
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
    for _, arg in _global_steps_outside(rule, region, [*update.statements, *update.wrapped]):
        if id(arg) in update.counted:
            continue
        raise StateRefused(f"the global step `{code(arg.value)}` is made outside the code the strategy scope "
                           "would cover, so it would not be a mirrored variable the replicas can update")


def _check_metrics_outside(rule, region: Region) -> None:
    """A TF1 metric (`tf.metrics.accuracy` over the towers' concatenated predictions) made after
    the towers, under the strategy scope: its counters become sync-on-read variables, which
    cannot be added to outside the replicas (ValueError at graph construction: a held-out
    cifar10_estimator-style trainer)."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    for node in [owner, *region.reaches]:
        for call in find_own(node.body if isinstance(node, cst.FunctionDef) else node, cst.Call):
            if _waits(rule, call) and not contains(region.loop, call):
                raise StateRefused(f"line {line_of(rule, call)}: `{code(call.func)}` makes its counters under the strategy "
                                   "scope, outside the replicas, where they become sync-on-read variables that cannot be "
                                   "updated there; compute the metric in numpy from fetched values, or outside the scope")


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
        if isinstance(node.value, cst.Call) and rule.imports.resolve(node.value.func) in _VARIABLE_MAKERS
        for target in node.targets})


def _loads_per_copy(rule, region: Region, strategy: str) -> dict:
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
        copy, loaded = _fresh(module, "replica_copy", "variable_copy"), call.args[0].value
        # A value made by a call is made once (a random draw must be the same for every copy).
        value = _fresh(module, "loaded_value", "load_value") if find(loaded, cst.Call) else code(loaded)
        load = call.with_changes(func=call.func.with_changes(value=cst.Name(copy)),
                                 args=[call.args[0].with_changes(value=cst.parse_expression(value)), *call.args[1:]])
        lines = [f"{value} = {code(loaded)}\n"] if value != code(loaded) else []
        lines.append(f"for {copy} in {strategy}.experimental_local_results({code(call.func.value)}):\n    {code(load)}\n")
        why = [f"# `{code(call.func.value)}` is mirrored now, and a mirrored variable has no `load`: each replica's copy is loaded."]
        new = [cst.parse_statement(line) for line in lines]
        new[0] = new[0].with_changes(leading_lines=[*statement.leading_lines, *(cst.EmptyLine(comment=cst.Comment(w)) for w in why)])
        changes[id(statement)] = cst.FlattenSentinel(new)
    return changes


_VARIABLE_MAKERS = {"tensorflow.Variable", "tensorflow.get_variable"}
_SESSION_NAME = re.compile(r"(^|\.)_?(sess|session)$", re.IGNORECASE)


def _loads_in_session(call: cst.Call) -> bool:
    """`kernel.load(w, sess)`: a load into a session is `Variable.load`, whatever the variable
    was found by (a distillation teacher's kernel picked from `tf.global_variables('teacher')`);
    `np.load(path)` and `json.load(f)` take no session."""
    session = argument(call, ("value", "session"), "session")
    return session is not None and bool(_SESSION_NAME.search(code(session)))


def _global_steps_outside(rule, region: Region, statements) -> list[tuple[cst.BaseStatement, cst.Arg]]:
    """The `global_step=` arguments of ``statements`` that name a step made outside what the
    strategy scope covers (in `__init__`, at module level): a plain variable, not a mirrored one."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    in_loop = {id(s) for s in simple_statements(region.loop)}
    made_inside: set[str] = set()
    for line in simple_statements(owner):
        small = single_small(line)
        if id(line) in in_loop or (isinstance(small, cst.Assign) and isinstance(small.value, (cst.Name, cst.Attribute))
                                   and code(small.value) not in made_inside):
            continue  # another name for what is made elsewhere (`self.global_step = global_step`)
        made_inside |= scope_bindings(line) | {code(t.target) for t in find(line, cst.AssignTarget)}
    return [(statement, arg) for statement in statements for arg in _global_step_args(statement)
            if code(arg.value) not in made_inside | {"None"}]


def _global_step_args(statement: cst.CSTNode) -> list[cst.Arg]:
    """`global_step=step`, or the step passed by position to `apply_gradients(grads, step)` or
    `minimize(loss, step)` (ChineseNER's `self.opt.apply_gradients(grads_vars, self.global_step)`)."""
    found = []
    for call in find(statement, cst.Call):
        positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
        found += [arg for arg in call.args if arg.keyword is not None and arg.keyword.value == "global_step"]
        if method_call(call, "apply_gradients") or method_call(call, "minimize"):
            found += positional[1:2]
    return found


def _increment_global_step_once(rule, region: Region, update: Update, tf: TfNames) -> None:
    """A moved `train_op = opt.apply_gradients(..., global_step=step)` whose step is made outside
    the scope: the replicas update without it, and once they have, the step is incremented once
    in its place (the replicas cannot update a variable that is not mirrored; checked on TF 2.21)."""
    for statement, arg in _global_steps_outside(rule, region, update.statements):
        # The update's assignment, or that in the `with tf.control_dependencies(...)` it moved in.
        small = single_small(statement.body.body[0] if isinstance(statement, cst.With) else statement)
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
            continue  # no handle on the update to order the increment after: refused
        call = next(c for c in find(statement, cst.Call) if any(a is arg for a in c.args))
        update.statements[update.statements.index(statement)] = statement.visit(
            ReplaceById({id(call): _without_argument(call, arg)}))
        update.after_run.append(_count_once(code(small.targets[0].target), code(arg.value), tf))
        update.counted.add(id(arg))


def _without_argument(call: cst.Call, argument: cst.Arg) -> cst.Call:
    args = [a for a in call.args if a is not argument]
    if argument.keyword is None and any(a.keyword is None for a in args[call.args.index(argument):]):
        raise StateRefused("the global step is passed by position before other arguments by position: pass it "
                           "as `global_step=`")
    args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return call.with_changes(args=args)


def _count_once(update: str, step: str, tf: TfNames) -> cst.BaseStatement:
    """`step += 1` once the replicas' ``update`` ran, where the update's op was."""
    increment = cst.parse_statement(
        f"with {tf('tensorflow.control_dependencies')}([{update}]):\n    {update} = {step}.assign_add(1).op\n")
    return increment.with_changes(leading_lines=[
        cst.EmptyLine(indent=False),
        cst.EmptyLine(comment=cst.Comment(f"# The replicas apply without `{step}`, which counts the step once, after")),
        cst.EmptyLine(comment=cst.Comment("# their update (made outside the strategy's scope, a step is not mirrored).")),
    ])


def _find_reduction(rule, region: Region, tower_list: str):
    """`total = tf.add_n(L) / K`, `tf.reduce_mean(L)`, `tf.reduce_mean(tf.stack(L))`, `tf.add_n(L)`:
    (statement, the total's code, the replica's share as a format of {loss} and {n}, whether the
    reduction is written inside the `minimize` call)."""
    resolve = rule.imports.resolve
    for statement in region.following:
        if not mentions(statement, tower_list):
            continue
        small = single_small(statement)
        minimized = [c.args[0].value for c in find(statement, cst.Call) if method_call(c, "minimize") and c.args]
        if minimized and mentions(minimized[0], tower_list):  # `opt.minimize(tf.add_n(tower_losses))`
            value, target, inline = minimized[0], code(minimized[0]), True
        elif isinstance(small, cst.Assign) and len(small.targets) == 1:
            value, target, inline = small.value, code(small.targets[0].target), False
        else:
            return None
        divisor = None
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Divide):
            value, divisor = value.left, value.right
        if not (isinstance(value, cst.Call) and value.args and _is_list_of(value.args[0].value, tower_list, resolve)):
            return None
        if any(a.keyword is not None and a.keyword.value != "axis" for a in value.args[1:]):
            return None
        reducer = resolve(value.func)
        # Concatenated, the towers' values are per-example losses (a scalar cannot be
        # concatenated): the mean of the pieces is the mean of their means (the pieces of a
        # split are equal), the sum the sum of their sums. `minimize` of one piece as it is
        # would differentiate the sum of its elements (golbin's many-GPUs-MNIST: B times the step).
        inner = value.args[0].value
        pieces = isinstance(inner, cst.Call) and resolve(inner.func) == "tensorflow.concat"
        if reducer in _LOSS_MEANS and divisor is None:
            share = "{mean}({loss}) / {n}" if pieces else "{loss} / {n}"
        elif reducer in _LOSS_SUMS and not (pieces and reducer not in _REDUCE_SUMS):
            loss = "{sum}({loss})" if pieces else "{loss}"
            share = loss if divisor is None else loss + " / " + code(divisor).replace("{", "{{").replace("}", "}}")
        else:
            return None
        return statement, target, share, inline
    return None


def _is_list_of(node: cst.CSTNode, tower_list: str, resolve) -> bool:
    if code(node) == tower_list:
        return True
    return (isinstance(node, cst.Call) and resolve(node.func) in _STACKS and bool(node.args)
            and code(node.args[0].value) == tower_list)


# --- the replica function -------------------------------------------------------------------


class _ReplicaBody(cst.CSTTransformer):
    """The loop body without the tower's device scopes and `reuse_variables()` calls (the
    strategy places each replica and reuses replica 0's variables), with the update's edits.

    Collections read by the tower's scope (`tf.get_collection(UPDATE_OPS, scope)`):
    - SUMMARIES are widened to every replica's: MirroredStrategy records TF1 summaries on
      replica 0 only, so another replica's own scope holds none of them.
    - UPDATE_OPS stay each replica's own: a batch norm's moving statistics are one copy per
      replica (SyncOnRead, read back as their mean), each updated by its own replica's ops,
      which are named under `replica_k/<tower scope>`. Taken on the first tower only
      (`if i == 0:`), they leave the other copies untouched (the mean would drift toward
      the initial value): the statement leaves that `if` and runs in every replica. Code after
      the loop reads them again, every replica's (``rereads``).
    """

    def __init__(self, scopes: set[int], changes: dict, imports, tower_scopes: set[str], indices: set[str] = frozenset(),
                 variables: frozenset[int] = frozenset(), regularization: frozenset[int] = frozenset(),
                 replaced: dict | None = None, index: str | None = None):
        super().__init__()
        self.index = index  # the name the replica's index is bound to in the replica function, if one is
        self.first_only = False
        self.scopes, self.changes, self.imports = scopes, changes, imports
        self.replaced = replaced or {}  # id(call or attribute) -> its replacement
        self.regularization = regularization  # ids of the reads of every term (every_towers_regularization)
        self.variables = variables  # ids of the `tf.Variable(...)` calls to say `trainable=True` (see _trainable)
        self.tower_scopes = tower_scopes  # the names of the towers' `name_scope(...) as scope`
        self.indices = indices  # the loop's index names
        self.widened = False
        self.rereads: dict[str, cst.SimpleStatementLine] = {}  # name -> its statement, every replica's

    def _tower_collection(self, call: cst.Call, kinds: tuple[str, ...]) -> bool:
        return (self.imports.resolve(call.func) == "tensorflow.get_collection" and len(call.args) == 2
                and code(call.args[0].value).endswith(kinds) and code(call.args[1].value) in self.tower_scopes)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        return self.replaced.get(id(original), updated)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if id(original) in self.replaced:
            return self.replaced[id(original)]
        if id(original) in self.variables:
            return _trainable(updated)
        if id(original) in self.regularization:
            return counted_per_replica(updated)
        if not self._tower_collection(original, ("SUMMARIES",)):
            return updated
        if self.index is not None:
            self.first_only = True  # see leave_SimpleStatementLine
            return updated
        self.widened = True
        return _every_replica(updated)

    def leave_With(self, original: cst.With, updated: cst.With):
        if id(original) not in self.scopes:
            return updated
        items = [item for item in updated.items if device_scope_arg(item.item, self.imports) is None]
        if not items:
            return cst.FlattenSentinel(updated.body.body)
        items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(items=items)

    def leave_SimpleStatementLine(self, original, updated):
        if is_reuse_statement(original):
            return cst.RemovalSentinel.REMOVE
        if self.widened:
            self.widened = False
            note = cst.EmptyLine(comment=cst.Comment(
                "# Every replica's: under MirroredStrategy these live in replica 0's scope."))
            updated = updated.with_changes(leading_lines=[*updated.leading_lines, note])
        if self.first_only:
            self.first_only = False
            updated = self._replica_0_summaries(updated)
        small = single_small(original)
        if (isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
                and any(self._tower_collection(call, _UPDATE_OPS) for call in find(small.value, cst.Call))):
            self.rereads[small.targets[0].target.value] = updated.visit(_EveryReplica(self))
        return self.changes.get(id(original), updated)

    def _replica_0_summaries(self, statement: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
        """`summaries = tf.get_collection(SUMMARIES, scope)`: MirroredStrategy makes summary ops in
        replica 0 only, so the later replicas' scopes hold none and would leave an empty list; the
        first replica's are kept (the towers' own, not every summary of the graph: inception's
        input summaries, added to them again after the loop, were merged twice and failed).
        Another use of the read (`summaries.extend(...)`) is right as it is."""
        small = single_small(statement)
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)):
            return statement
        target = small.targets[0].target.value
        chosen = cst.parse_expression(f"{code(small.value)} if {self.index} == 0 else {target}")
        note = cst.EmptyLine(comment=cst.Comment(
            "# MirroredStrategy makes summaries in replica 0 only: keep replica 0's."))
        return statement.with_changes(body=[small.with_changes(value=chosen)],
                                      leading_lines=[*statement.leading_lines, note])

    def leave_If(self, original: cst.If, updated: cst.If):
        """`if i == 0:` around the tower's UPDATE_OPS: they leave it (see the class)."""
        if original.orelse is not None or not (names_used(original.test) & self.indices):
            return updated
        moved = [s for s in updated.body.body if any(
            self._tower_collection(call, _UPDATE_OPS) for call in find(s, cst.Call))]
        if not moved:
            return updated
        kept = [s for s in updated.body.body if not any(s is m for m in moved)]
        note = cst.EmptyLine(indent=True, comment=cst.Comment(
            "# Each replica updates its own copy of the batch-norm statistics (read back as their mean)."))
        moved[0] = moved[0].with_changes(leading_lines=[*updated.leading_lines, *moved[0].leading_lines, note])
        if not kept:
            return cst.FlattenSentinel(moved)
        return cst.FlattenSentinel([*moved, updated.with_changes(body=updated.body.with_changes(body=kept))])

    def leave_IndentedBlock(self, original, updated):
        if not updated.body:  # `if i > 0: reuse_variables()` lost its only statement
            return updated.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
        return updated


_UPDATE_OPS = ("UPDATE_OPS", "UPDATE_OPS_COLLECTION")


def _every_replica(call: cst.Call) -> cst.Call:
    """`tf.get_collection(KEY, scope)` -> `tf.get_collection(KEY)`."""
    return call.with_changes(args=[call.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)])


class _EveryReplica(cst.CSTTransformer):
    """A statement's tower-scoped UPDATE_OPS reads widened to every replica's, with a comment."""

    def __init__(self, body: _ReplicaBody):
        super().__init__()
        self.body = body

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        return _every_replica(updated) if self.body._tower_collection(original, _UPDATE_OPS) else updated

    def leave_SimpleStatementLine(self, original, updated):
        note = cst.EmptyLine(indent=True, comment=cst.Comment(
            "# Every replica's batch-norm updates (each replica updates its own copy of the statistics)."))
        return updated.with_changes(leading_lines=[note])


def _replica_body(rule, tower, region: Region, update: Update, tf: TfNames, run_by: str,
                  source: str | None = None) -> tuple[list, dict]:
    """The replica function's statements, and the statements that read again after the
    strategy's call what every replica collected (see _ReplicaBody), by the name they bind.
    ``source``: the list the loop's elements were walked into before the function, if any."""
    loop = region.loop
    in_body = {k: v for k, v in update.changes.items() if any(id(s) == k for s in simple_statements(loop.body))}
    for key in in_body:
        del update.changes[key]
    scopes = {id(scope.with_node) for scope in tower.scopes}
    tower_scopes = {code(item.asname.name) for with_node in find(loop.body, cst.With) for item in with_node.items
                    if item.asname is not None and isinstance(item.item, cst.Call)
                    and (rule.imports.resolve(item.item.func) or "").endswith("name_scope")}
    in_body.update({id(s): cst.RemovalSentinel.REMOVE for s in _device_bindings(tower, loop)})
    reads = frozenset(id(call) for call in every_towers_regularization(rule, loop))
    # The module-wide edits of replica code that fall in the body (see _module_changes).
    replaced = {key: new for key, (_, new) in [*_variable_op_names(rule, [tower]).items(),
                                               *applied_per_replica(averages_applied(rule, [loop.body]), tf).items()]}
    replica = _ReplicaBody(scopes, in_body, rule.imports, tower_scopes, names_used(loop.target),
                           frozenset(_variable_calls(rule)), reads, replaced, _replica_index(loop))
    body = loop.body.visit(replica)
    statements = [*body.body, *update.statements]
    prelude = _loop_variables(rule, loop, statements, tf, _targets_read_after(region), source)
    if reads:
        prelude.append(regularization_scale(tf, run_by))
    return [*prelude, *statements], replica.rereads


def _replica_index(loop: cst.For) -> str | None:
    """The loop's index, which the replica function binds to the replica's (see
    :func:`_loop_variables`): `i` of `for i in range(n)` or `for i, d in enumerate(devices)`."""
    if _is_range_index(loop, loop.target):
        return loop.target.value  # type: ignore[attr-defined]
    index = loop.target.elements[0].value if _enumerates(loop) else None  # type: ignore[attr-defined]
    return index.value if isinstance(index, cst.Name) else None


def _enumerates(loop: cst.For) -> bool:
    """`for i, x in enumerate(xs)`: one iterable, counted from 0."""
    iterable, target = loop.iter, loop.target
    return (isinstance(iterable, cst.Call) and code(iterable.func) == "enumerate" and len(iterable.args) == 1
            and isinstance(target, cst.Tuple) and len(target.elements) == 2)


def _targets_read_after(region: Region) -> set[str]:
    """Loop variables the code after the loop reads (the last tower's piece, its index): the
    replica function binds and shares them, and the last replica leaves them as the last
    iteration did."""
    return reads_first(region.following, names_used(region.loop.target))


def _device_bindings(tower, loop: cst.For) -> list[cst.BaseStatement]:
    """`setter = tf.train.replica_device_setter(...)` in the body, read only by the device scope
    the replica function drops: it goes with the scope."""
    found = []
    for scope in tower.scopes:
        if not isinstance(scope.device, cst.Name):
            continue
        name = scope.device.value
        binding = [s for s in loop.body.body if _assigns(single_small(s), name)]
        reads = sum(1 for node in walk(loop.body) if type(node) is cst.Name and node.value == name)
        if len(binding) == 1 and reads == 2 and binding[0] not in found:
            found.append(binding[0])
    return found


def _assigns(small: cst.CSTNode | None, name: str) -> bool:
    """`<name> = ...`, one target."""
    return isinstance(small, cst.Assign) and len(small.targets) == 1 and code(small.targets[0].target) == name


def _loop_variables(rule, loop: cst.For, statements, tf: TfNames, read_after: set[str],
                    source: str | None = None) -> list[cst.BaseStatement]:
    """The loop target, bound to this replica's index (and element) where the body, or the code
    after the loop (``read_after``), reads it; the element read from ``source`` when given."""
    used = set().union(read_after, *(names_used(s) for s in statements))
    index_expression = REPLICA_INDEX.format(tf=tf_root(tf))
    target, iterable = loop.target, loop.iter
    lines: list[str] = []
    if _is_range_index(loop, target):
        if target.value in used:  # type: ignore[attr-defined]
            lines.append(f"{target.value} = {index_expression}")  # type: ignore[attr-defined]
    elif _enumerates(loop):
        index, element = (e.value for e in target.elements)  # type: ignore[attr-defined]
        if not isinstance(index, cst.Name):
            raise Refused(f"cannot use `{code(index)}` of the loop target as a replica index")
        element_used = bool(names_used(element) & used)
        if index.value in used or element_used:
            lines.append(f"{index.value} = {index_expression}")
        if element_used:
            lines.append(f"{code(element)} = {source or _indexable(iterable.args[0].value)}[{index.value}]")
    else:
        if names_used(target) & used:
            lines.append(f"{code(target)} = {source or _indexable(iterable)}[{index_expression}]")
    statements = [cst.parse_statement(line + "\n") for line in lines]
    if statements:
        statements[0] = statements[0].with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(
            "# MirroredStrategy runs this once per replica; the replica index replaces the loop variable."))])
    return statements


def _indexable(iterable: cst.BaseExpression) -> str:
    if isinstance(iterable, (cst.Name, cst.Attribute, cst.List, cst.Tuple, cst.Subscript)):
        return code(iterable)
    return f"list({code(iterable)})"


def _shared_names(region: Region, body, update: Update) -> tuple[list[str], set[str]]:
    """Names the replica function must share with the code around the loop, and those of them
    nothing else binds (they get a `= None` before the function so `nonlocal` has a binding)."""
    bound = set(update.binds)
    for statement in body:
        bound |= scope_bindings(statement)
    loop_targets = names_used(region.loop.target)
    bound_outside = set()
    # What moved into the replica function, or went, binds nothing outside any more.
    removed = frozenset(key for key, change in update.changes.items() if change is cst.RemovalSentinel.REMOVE)
    for statement in outside_statements(region):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):  # its body is another scope
            bound_outside.add(statement.name.value)
        elif id(statement) not in removed:
            bound_outside |= scope_bindings(statement, removed)
    if isinstance(region.owner, cst.FunctionDef):
        parameters = {p.name.value for p in find(region.owner.params, cst.Param)}
        bound_outside |= parameters
    # Shared: what the code after the loop reads of the towers' names before binding them again
    # (not `grads` that an averaging loop after it starts afresh: a shared name can be changed
    # by another replica while this one waits at a cross-replica step), what functions of the
    # owner may read when they run, and what the moved update binds (`tf.group(apply_op, ...)`).
    # And what the body reads before it binds it: state a tower leaves for the next (`reuse =
    # True` at the end of the first, `reuse = False` before the loop).
    following = [s for s in region.following if id(s) not in removed]
    read_later = reads_first(following, bound) | (bound & _read_by_functions(region, removed))
    carried = reads_first(body, bound) | _carried(body)
    shared = sorted(((read_later | update.binds | carried) - loop_targets) | _targets_read_after(region))
    unbound = set() if isinstance(region.owner, cst.Module) else set(shared) - bound_outside
    return shared, unbound


def _read_by_functions(region: Region, removed: frozenset) -> set[str]:
    """Names the functions and classes defined in the owner outside the loop read: at module
    level, any function of the module may run after the loop and read its globals."""
    found: set[str] = set()
    for statement in outside_statements(region):
        if id(statement) not in removed:
            for definition in find(statement, cst.FunctionDef, cst.Lambda):
                # its free names: not its parameters, nor what it binds itself (its locals)
                local = {p.name.value for p in find(definition.params, cst.Param)} | scope_bindings(definition)
                found |= free_names(definition) - local
            for definition in find(statement, cst.ClassDef):
                found |= free_names(definition)
    return found


def _carried(body: list[cst.BaseStatement]) -> set[str]:
    """Names the body binds only under a condition and reads: state one tower leaves for the
    next (`if gpu == 0: d_vars = [...]`, read by every tower). Iterations of the loop shared
    them; local to each replica, replica 1 would read an unbound name."""
    bound = set().union(*(scope_bindings(statement) for statement in body))
    read = set().union(*(names_used(statement) for statement in body))
    return (bound - _always_bound(body)) & read


def _always_bound(statements) -> set[str]:
    """Names bound whenever ``statements`` run: `with` blocks opened, both branches of an
    `if`/`else`; loops and `try` count as binding what they bind (not shared: only the
    `if` on a tower index is the pattern, and sharing more would let replicas overwrite
    each other's names across a merge point)."""
    found: set[str] = set()
    for statement in statements:
        if isinstance(statement, cst.With):
            for item in statement.items:
                found.update(target_names(item.asname.name) if item.asname is not None else ())
            found |= _always_bound(statement.body.body)
        elif isinstance(statement, cst.If):
            if statement.orelse is not None:
                orelse = statement.orelse
                other = [orelse] if isinstance(orelse, cst.If) else orelse.body.body  # `elif` or `else`
                found |= _always_bound(statement.body.body) & _always_bound(other)
        else:
            found |= scope_bindings(statement)
    return found


def _replica_function(region: Region, step: str, body, shared: list[str], tf: TfNames) -> cst.FunctionDef:
    statements = list(body)
    decorators = []
    if shared:
        keyword = cst.Global if isinstance(region.owner, cst.Module) else cst.Nonlocal
        declaration = cst.SimpleStatementLine([keyword([cst.NameItem(cst.Name(n)) for n in shared])])
        statements.insert(0, declaration)
        if keyword is cst.Global:
            # The strategy runs the function through AutoGraph, whose converted `if` blocks bind
            # a `global` name in a namespace of their own: `accuracy` set under `if i == 0:` was
            # never defined for the module (a sentiment-BiLSTM script probe). Graph code written
            # for TF1 has nothing for AutoGraph to convert.
            decorators.append(cst.Decorator(cst.parse_expression(tf("tensorflow.autograph.experimental.do_not_convert"))))
    # A comment on the loop's line (`for i in range(n):  # one tower per GPU`) stays on the def's.
    block = cst.IndentedBlock(body=statements, header=region.loop.body.header)
    return cst.FunctionDef(name=cst.Name(step), params=cst.Parameters(), body=block, decorators=decorators)


# --- names ----------------------------------------------------------------------------------


def _fresh(module: cst.Module, *names: str) -> str:
    return next((n for n in names if references(module, n) == 0), names[-1] + "_")


# --- devices and cleanup --------------------------------------------------------------------


def _devices(rule, tower) -> str:
    """The strategy's device list: the towers' own device expression for each loop value."""
    loop, imports = tower.loop, rule.imports
    if not tower.scopes:
        raise Refused("cannot tell the towers' devices")
    device = _body_value(loop, _in_loop_terms(tower, tower.scopes[0].device))  # `setter = ...; with tf.device(setter):`
    if isinstance(device, cst.Call) and imports.resolve(device.func) in DEVICE_SPECS:
        device = cst.parse_expression(f"{code(device)}.to_string()")
    elif is_device_function(device, imports):
        # A device function: `assign_to_device('/gpu:%d' % i, ...)`, `replica_device_setter(worker_device=...)`.
        device = ops_device(device, imports)
        if device is None:
            raise Refused(f"cannot tell the towers' devices from `{code(tower.scopes[0].device)}`")
        if _is_range_index(loop, device):  # `assign_to_gpu(i, ps_device)`: the GPU's number, not its name
            return devices_argument(loop)
        if _is_enumerate_index(loop, device):  # the same over `enumerate(zip(*splits))` (finetune-transformer-lm)
            count = _pieces_count(rule, tower, loop.iter, device)
            if count is None:
                raise Refused(f"cannot tell how many GPUs `{code(tower.scopes[0].device)}` numbers from `{code(loop.iter)}`")
            return f"['/gpu:%d' % k for k in range({code(count)})]"
    targets = names_used(loop.target)
    device = _body_value(loop, device)
    body_bound = set().union(*(scope_bindings(s) for s in loop.body.body))
    if names_used(device) & (body_bound - targets):
        return devices_argument(loop)  # computed in the body (a device setter): the loop's own count
    if (isinstance(device, cst.Subscript) and len(device.slice) == 1 and code(device.slice[0].slice) == code(loop.target)
            and code(loop.iter) == f"range(len({code(device.value)}))"):
        return code(device.value)  # `for i in range(len(devices)): device = devices[i]`
    if code(device) == code(loop.target):
        return _indexable(loop.iter) if not isinstance(loop.iter, cst.Call) else f"list({code(loop.iter)})"
    if (isinstance(loop.iter, cst.Call) and code(loop.iter.func) == "enumerate" and isinstance(loop.target, cst.Tuple)
            and code(loop.target.elements[1].value) == code(device)):
        return code(loop.iter.args[0].value)
    zipped = _zipped_devices(loop, device)
    if zipped is not None:  # `for i, (device, x) in enumerate(zip(DEVICES, x_parts))`
        return zipped
    count = _pieces_count(rule, tower, loop.iter, device)
    if count is not None:  # `for i, (x, y) in enumerate(zip(x_splits, y_splits))`: one device per piece
        index = code(loop.target.elements[0].value)
        return f"[{code(device)} for {index} in range({code(count)})]"
    return f"[{code(device)} for {code(loop.target)} in {code(loop.iter)}]"


def _check_device_names(rule, devices: str) -> None:
    """The strategy takes device names. A device list the module fills with objects of its own
    classes (tf_cnn_benchmarks' `get_devices()`: a `ParamServerDeviceSetter` per GPU, a device
    function) is refused: passed on, MirroredStrategy failed on the first ("Unknown attribute
    ... while parsing the device spec")."""
    module = rule.context.module
    classes = {s.name.value for s in module.body if isinstance(s, cst.ClassDef)}
    makers = [node for node in assignments(rule.context).get(devices, []) if isinstance(node.value, cst.Call)]
    functions: dict[str, list[cst.FunctionDef]] = {}
    for function in find(module, cst.FunctionDef) if makers else []:
        functions.setdefault(function.name.value, []).append(function)
    for node in makers:
        func = node.value.func
        name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else ""
        for function in functions.get(name, []):
            for returned in find(function, cst.Return):
                value = returned.value
                items = [value.elt] if isinstance(value, cst.ListComp) else (
                    [e.value for e in value.elements] if isinstance(value, cst.List) else [])
                made = next((callee_name(i) for i in items if isinstance(i, cst.Call) and callee_name(i) in classes), None)
                if made is not None:
                    raise Refused(f"line {line_of(rule, node)}: the towers' devices `{devices}` come from "
                                  f"`{code(func)}()`, which makes `{made}` objects (device functions), not device "
                                  "names: MirroredStrategy needs the devices' names (those they place the towers on)")


def _zipped_devices(loop: cst.For, device: cst.BaseExpression) -> str | None:
    """The device list a loop over `zip(DEVICES, pieces)` (or `enumerate` of it) takes its
    device from: that argument of the zip, when the device is its element's name."""
    target, iterable = loop.target, loop.iter
    if (isinstance(iterable, cst.Call) and code(iterable.func) == "enumerate" and len(iterable.args) == 1
            and isinstance(target, cst.Tuple) and len(target.elements) == 2):
        target, iterable = target.elements[1].value, iterable.args[0].value
    if not (isinstance(iterable, cst.Call) and code(iterable.func) == "zip" and isinstance(target, cst.Tuple)
            and len(target.elements) == len(iterable.args) and not any(a.star or a.keyword for a in iterable.args)):
        return None
    for element, zipped in zip(target.elements, iterable.args):
        if isinstance(element.value, cst.Name) and isinstance(device, cst.Name) and element.value.value == device.value:
            return _indexable(zipped.value)
    return None


def _pieces_count(rule, tower, iterable: cst.BaseExpression, device: cst.BaseExpression) -> cst.BaseExpression | None:
    """How many pieces `enumerate(<pieces>)` walks, when the device reads only the index and
    the pieces are a batch cut with `tf.split(x, n)` (or a zip of such cuts, a comprehension
    over them, or a literal list): ``n``. The strategy is made before the graph, so it must
    not read the pieces."""
    if not (isinstance(iterable, cst.Call) and code(iterable.func) == "enumerate" and len(iterable.args) == 1
            and isinstance(tower.loop.target, cst.Tuple) and len(tower.loop.target.elements) == 2):
        return None
    if names_used(device) & names_used(tower.loop.target.elements[1].value):
        return None
    owner = tower.owner if tower.owner is not None else rule.context.module
    pieces = [iterable.args[0].value]
    while pieces:
        node = pieces.pop(0)
        if isinstance(node, cst.Call) and code(node.func) == "zip" and rule.imports.resolve(node.func) is None:
            pieces += [a.value for a in node.args if not a.star]
            # `zip(*[tf.split(x, n) for x in xs])`: as many as each zipped list has (also through a
            # name bound to the comprehension: `xs = (tf.split(x, n) for x in xs)`, `zip(*xs)`)
            starred = [single_binding(owner, a.value) if isinstance(a.value, cst.Name) else a.value
                       for a in node.args if a.star == "*"]
            pieces += [value.elt for value in starred if isinstance(value, (cst.ListComp, cst.GeneratorExp))]
        elif (isinstance(node, (cst.ListComp, cst.GeneratorExp)) and node.for_in.inner_for_in is None
              and not node.for_in.ifs):
            pieces.append(node.for_in.iter)  # one piece per element it walks (Show-and-Tell's dict per shard)
        elif isinstance(node, (cst.List, cst.Tuple)) and not any(isinstance(e, cst.StarredElement) for e in node.elements):
            return cst.Integer(str(len(node.elements)))
        elif isinstance(node, cst.Call) and rule.imports.resolve(node.func) == "tensorflow.split":
            count = split_arguments(node)[1]
            if count is not None and not isinstance(count, (cst.List, cst.Tuple)):
                return count
        elif isinstance(node, cst.Name) and single_binding(owner, node) is not None:
            pieces.append(single_binding(owner, node))
    return None


def _tower_functions(rule, tower) -> dict[int, cst.CSTNode]:
    """The tower functions the loop calls (`build_tower(i, ...)` opening `tf.device('/gpu:%d' %
    gpu_id)` on its parameter) without their device scopes: the strategy places each replica.
    Only functions that the tower loop alone calls: any other caller would lose its placement."""
    changes = {}
    for function in tower.via:
        name = function.name.value
        outside = next((call for call in module_calls(rule) if _calls(call, name) and not contains(tower.loop, call)), None)
        if outside is not None:
            raise Refused(f"the towers are built by `{name}`, which line {line_of(rule, outside)} also calls outside the "
                          "tower loop: its device scope cannot go (that call would lose its placement)")
        scopes = {id(scope.with_node) for scope in tower.scopes if contains(function, scope.with_node)}
        replica = _ReplicaBody(scopes, {}, rule.imports, set(), variables=frozenset(_variable_calls(rule)))
        changes[id(function)] = function.visit(replica)
    return changes


def _calls(call: cst.Call, name: str) -> bool:
    """`name(...)` or `<object>.name(...)`."""
    func = call.func
    return (isinstance(func, cst.Name) and func.value == name) or (isinstance(func, cst.Attribute) and func.attr.value == name)


def _in_loop_terms(tower, device: cst.BaseExpression) -> cst.BaseExpression:
    """A tower function's device expression with its parameters replaced by what the loop's call
    passes (`'/gpu:%d' % gpu_id` of `build_tower(i, ...)` is `'/gpu:%d' % i`)."""
    function = next((f for f in tower.via if contains(f, device)), None)
    if function is None:
        return device
    call = next(c for c in find(tower.loop.body, cst.Call) if _calls(c, function.name.value))
    params = [p.name.value for p in function.params.params]
    if isinstance(call.func, cst.Attribute) and params[:1] == ["self"]:
        params = params[1:]
    passed: dict[str, cst.BaseExpression] = {}
    for position, arg in enumerate(call.args):
        if arg.star:
            break
        if arg.keyword is not None:
            passed[arg.keyword.value] = arg.value
        elif position < len(params):
            passed[params[position]] = arg.value
    receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
    if isinstance(receiver, cst.Name) and params != [p.name.value for p in function.params.params]:
        passed["self"] = receiver  # `self.build_tower(i)`: the method's `self` is the caller's receiver
    unbound = names_used(device) & ({p.name.value for p in find(function.params, cst.Param)} - set(passed))
    if unbound:
        raise Refused(f"cannot tell the towers' devices from `{code(device)}`: `{sorted(unbound)[0]}` is not passed by the loop")
    return device.visit(PassedArguments(passed))


def _is_enumerate_index(loop: cst.For, node: cst.CSTNode) -> bool:
    """Whether ``node`` is the index of `for i, x in enumerate(...)`."""
    target = loop.target
    return (isinstance(node, cst.Name) and isinstance(target, cst.Tuple) and len(target.elements) == 2
            and isinstance(target.elements[0].value, cst.Name) and target.elements[0].value.value == node.value
            and isinstance(loop.iter, cst.Call) and code(loop.iter.func) == "enumerate")


def _is_range_index(loop: cst.For, node: cst.CSTNode) -> bool:
    """Whether ``node`` is the index of `for i in range(...)`."""
    return (isinstance(node, cst.Name) and isinstance(loop.target, cst.Name) and node.value == loop.target.value
            and isinstance(loop.iter, cst.Call) and code(loop.iter.func) in ("range", "xrange"))


def _body_value(loop: cst.For, device: cst.BaseExpression) -> cst.BaseExpression:
    """A device named in the body (`device = DEVICES[i]`, first statements) is its value."""
    if not isinstance(device, cst.Name):
        return device
    for statement in loop.body.body:
        small = single_small(statement)
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and code(small.targets[0].target) == device.value:
            return small.value
        if device.value in scope_bindings(statement):
            break
    return device


def _check_one_strategy(rule, region: Region, group: list) -> None:
    """The strategy is made where the graph is built, and runs every tower loop built there
    (``group``, rewritten together). A function that builds into its caller's graph and runs
    more than once (a model class made for training and for evaluation, sharing variables)
    would make one strategy per call, and the second would find the first's variables
    mirrored onto other devices."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    _check_other_towers(rule, region, group)
    if not isinstance(owner, cst.FunctionDef):
        return  # a `with` that opens a graph of its own, or the module
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
    if len(uses) > 1:
        lines = ", ".join(str(line_of(rule, c)) for c in uses)
        raise Refused(f"`{wanted}` runs {len(uses)} times (lines {lines}) into one graph: each run would make its "
                      "own MirroredStrategy over the same variables; make one strategy where the graph is built")


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
    covered = _module_run(rule, region) if isinstance(owner, cst.Module) else [owner]
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


def _module_run(rule, region: Region) -> list[cst.BaseStatement]:
    """At module level with no `with` that opens the graph: the run of statements around the
    loop, in its own block, that the strategy scope covers (up to the nearest import, definition,
    docstring or `if __name__ == '__main__':`). The block is the module or the body of a module
    level `if` (`if __name__ == '__main__':`), which runs once. A module level `with` runs once
    too (`with tf.variable_scope(tf.get_variable_scope()):` around the loop): it goes under the
    scope whole, with the code around it. Empty elsewhere."""
    module = rule.context.module
    if strategy_scope_owner(region.loop, region.parents, rule.imports) is not module:
        return []
    unit = node = region.loop  # the statement of the block that holds the loop
    while node is not module:
        node = region.parents[id(node)]
        if isinstance(node, cst.With):
            unit = node
        elif not isinstance(node, (cst.If, cst.Else, cst.IndentedBlock, cst.Module)):
            raise Refused(f"line {line_of(rule, node)}: the tower loop is inside a block at module level that may run "
                          "more than once: move it into a function so the graph can be built under strategy.scope()")
    block = region.parents[id(unit)]
    body = list(block.body)
    at = index_of(body, unit)
    start, end = at, at
    while start > 0 and _plain_module_statement(body[start - 1]):
        start -= 1
    while end + 1 < len(body) and _plain_module_statement(body[end + 1]):
        end += 1
    return body[start:end + 1]


def _plain_module_statement(statement: cst.BaseStatement) -> bool:
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return False
    if isinstance(statement, cst.If) and "__name__" in code(statement.test):
        return False
    small = single_small(statement)
    return not (isinstance(small, (cst.Import, cst.ImportFrom))
                or (isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString))))


def _module_scope(rule, region: Region, region_changes: dict, creates: list, scope_item: cst.WithItem) -> dict:
    """The module run around the loop under `with strategy.scope():`, the strategy made before it."""
    run = _module_run(rule, region)
    statements: list[cst.BaseStatement] = []
    for statement in run:
        change = region_changes.get(id(statement))
        if change is cst.RemovalSentinel.REMOVE:
            continue
        if isinstance(change, cst.FlattenSentinel):
            statements += list(change.nodes)
        else:
            statements.append(change or statement.visit(ReplaceById(region_changes)))
    statements = [blank_lines_unindented(s) for s in statements]
    statements[0] = statements[0].with_changes(leading_lines=[])
    creates[0] = creates[0].with_changes(leading_lines=run[0].leading_lines)
    scoped = cst.With(items=[scope_item], body=cst.IndentedBlock(body=statements))
    changes: dict = {run[0]: cst.FlattenSentinel([*creates, scoped])}
    changes.update((statement, cst.RemovalSentinel.REMOVE) for statement in run[1:])
    return changes


def _device_prelude(rule, region: Region, create: cst.BaseStatement) -> tuple[list, list]:
    """The statements before the loop that the strategy's device list reads (`devices = [...]`):
    they move up with the strategy, above the scope, which is only safe for plain Python.
    Returns (the statements that move, what takes their place above the strategy: the same,
    reading settings where they read names set later, see :func:`_inline_settings`)."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    block = owner.body.body if isinstance(owner, (cst.With, cst.FunctionDef)) else _module_run(rule, region)
    # Not the comprehension's own `i`; `self` is a parameter: its attributes are followed instead.
    needed = free_names(create) - {"tf", "self"}
    needed_attributes = _self_attributes(create)  # `self.devices`, set in `__init__` above the loop
    prelude, moved = [], []
    for statement in reversed([s for s in region.preceding if any(s is t for t in block)]):
        builds_graph = any(_builds_graph(rule, n) for n in find(statement, cst.Name, cst.Attribute))
        if scope_bindings(statement) & needed or _assigned_attributes(statement) & needed_attributes:
            if builds_graph:
                raise Refused(f"line {line_of(rule, statement)}: the towers' devices come from TensorFlow code in the "
                              "graph; name the device list before the graph is built")
        elif not (_changes_by_call(statement, needed) and not builds_graph):
            continue
        # A call made for its effect on a name the devices read (`parser.add_argument(...)`
        # before `args = parser.parse_args()`) moves up with it, in its place.
        prelude.insert(0, statement)
        inlined = _inline_settings(rule, region, statement)
        moved.insert(0, inlined)
        needed |= free_names(inlined) - {"self"}
        needed_attributes |= _self_attributes(inlined)
    _check_bound_before(rule, owner, [create, *moved], prelude, block)
    declarations = _declarations(prelude, block)
    return declarations + prelude, declarations + moved


def _declarations(prelude: list[cst.BaseStatement], block) -> list[cst.BaseStatement]:
    """The `global`/`nonlocal` statements of ``block`` for names ``prelude`` binds (DeepSpeech's
    `global available_devices` above the device list): they move up first, as Python wants a
    declaration before any use of the name."""
    bound = set().union(set(), *(scope_bindings(statement) for statement in prelude))
    moved = {id(statement) for statement in prelude}
    return [statement for statement in block if id(statement) not in moved
            and isinstance(single_small(statement), (cst.Global, cst.Nonlocal))
            and {item.name.value for item in single_small(statement).names} & bound]


def _self_attributes(node: cst.CSTNode) -> set[str]:
    """The `self.x` an expression or statement reads (or writes)."""
    return {code(n) for n in find(node, cst.Attribute) if isinstance(n.value, cst.Name) and n.value.value == "self"}


def _assigned_attributes(statement: cst.CSTNode) -> set[str]:
    return {code(t.target) for t in find(statement, cst.AssignTarget) if isinstance(t.target, cst.Attribute)}


def _changes_by_call(statement: cst.CSTNode, names: set[str]) -> bool:
    """Whether ``statement`` is a call made for its effect that may change one of ``names``:
    a method of it (`parser.add_argument(...)`), or a function given it whole (`add_flags(parser)`).
    Reading one in an argument (`images.set_shape([FLAGS.batch_size, ...])`) changes nothing."""
    small = single_small(statement)
    if not (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)):
        return False
    receiver = small.value.func.value if isinstance(small.value.func, cst.Attribute) else None
    while isinstance(receiver, (cst.Attribute, cst.Call, cst.Subscript)):
        receiver = receiver.func if isinstance(receiver, cst.Call) else receiver.value
    if isinstance(receiver, cst.Name) and receiver.value in names:
        return True
    return any(isinstance(arg.value, cst.Name) and arg.value.value in names for arg in small.value.args)


# TensorFlow calls that ask the runtime what it has, or log, without building the graph: a
# device list made with them can be worked out above the strategy.
_DEVICE_QUERIES = ("tensorflow.python.client.device_lib", "tensorflow.config", "tensorflow.test.is_gpu_available",
                   "tensorflow.test.gpu_device_name", "tensorflow.test.is_built_with_cuda", "tensorflow.logging",
                   "tensorflow.compat.v1.logging", "tensorflow.get_logger",
                   # Command-line settings (`FLAGS = tf.app.flags.FLAGS`; DeepSpeech's device list
                   # from `FLAGS.num_gpus`) build nothing in a graph either.
                   "tensorflow.app.flags", "tensorflow.flags", "tensorflow.compat.v1.app.flags",
                   "tensorflow.compat.v1.flags")


def _builds_graph(rule, node: cst.CSTNode) -> bool:
    name = rule.imports.resolve(node) or ""
    return name.startswith("tensorflow") and not name.startswith(_DEVICE_QUERIES)


def _settings_inlined(rule, region: Region, devices: str) -> str:
    """The device list, reading `FLAGS.n_gpus` itself where it read `n_gpus` set from it by
    `n_gpus = FLAGS.n_gpus` inside the code the scope covers (BERT-GPU's `if FLAGS.do_train:`
    block): the strategy is made above that code (see :func:`_inline_settings`)."""
    return code(_inline_settings(rule, region, cst.parse_expression(devices)))


def _inline_settings(rule, region: Region, node: cst.CSTNode) -> cst.CSTNode:
    """``node`` reading the value of each name the loop's function binds once, inside a block,
    by a plain assignment, to a plain reading of settings (:func:`_plain_setting`) that reads
    nothing the function binds but its parameters it never rebinds (`hp = self._hparams` inside
    Tacotron-2's `with tf.device(split_device):`): it has the same value in both places. A name
    bound by a statement of the block the strategy scope covers stays: that statement moves up
    (:func:`_device_prelude`), as it does at module level."""
    owner = region.owner
    if not isinstance(owner, cst.FunctionDef):
        return node
    scope_owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    movable = {id(s) for s in [*owner.body.body, *(scope_owner.body.body if isinstance(scope_owner, cst.With) else ())]}
    statements = [s for s in simple_statements(owner) if id(s) not in movable]
    bound_in_body = scope_bindings(owner)
    bound_in_owner = {p.name.value for p in find(owner.params, cst.Param)} | bound_in_body
    other_binders = _other_binders(owner)
    values: dict[str, cst.BaseExpression] = {}
    for name in (free_names(node) & bound_in_owner) - other_binders:
        if any(name in scope_bindings(s) for s in simple_statements(owner) if id(s) in movable):
            continue
        value = _plain_binding(statements, name)
        if value is not None and not names_used(value) & bound_in_body:
            values[name] = value
    return _read_as(node, values)


def _callee_settings_inlined(region: Region, devices: str) -> str:
    """The device list, for a strategy its caller makes, reading the value of each name the
    towers' function binds once, by a plain assignment, to a plain setting computed from its
    parameters it never rebinds and the module's names (`devices = ['/gpu:0', '/gpu:1',
    '/gpu:2', '/gpu:3'][:num_gpus]` in a `build_towers(opt, tensors, num_gpus)`), and that
    nothing changes in place: the same value in the caller, where the parameters read what the
    call passes (:class:`tfmigrate.rewrites.tower_callers.PassedArguments`)."""
    owner = region.owner
    node = cst.parse_expression(devices)
    bound_in_body = scope_bindings(owner.body)
    other_binders = _other_binders(owner)
    parameters = {p.name.value for p in find(owner.params, cst.Param)}
    values: dict[str, cst.BaseExpression] = {}
    for name in (free_names(node) & bound_in_body) - other_binders:
        value = _plain_binding(simple_statements(owner), name, comprehensions=True)
        if value is None:
            continue
        reads = free_names(value)
        # (a comprehension's own name that a parameter also has would read the caller's argument)
        if not reads & bound_in_body and not (names_used(value) - reads) & parameters \
                and not _changed_in_place(owner, name):
            values[name] = value
    return code(_read_as(node, values)) if values else devices


def _plain_binding(statements: list, name: str, comprehensions: bool = False) -> cst.BaseExpression | None:
    """The value the one statement of ``statements`` that binds ``name`` gives it, when that is
    a plain assignment (`name = value`) of a plain setting (:func:`_plain_setting`)."""
    bindings = [s for s in statements if name in scope_bindings(s)]
    small = single_small(bindings[0]) if len(bindings) == 1 else None
    return small.value if _assigns(small, name) and _plain_setting(small.value, comprehensions) else None


def _read_as(node: cst.CSTNode, values: dict[str, cst.BaseExpression]) -> cst.CSTNode:
    """``node`` with each read of a name in ``values`` replaced by its value."""
    reads = {id(read): values[read.value] for read in name_reads(node) if read.value in values}
    return node.visit(ReplaceById(reads)) if reads else node


def _other_binders(owner: cst.CSTNode) -> set[str]:
    """Names ``owner`` binds other than by a plain assignment (loop targets, `as` names, `+=`,
    `:=`): not settings."""
    return set().union(set(), *(target_names(n.target) for n in find(owner, cst.For, cst.AugAssign, cst.NamedExpr)),
                       *(target_names(n.name) for n in find(owner, cst.AsName)))


def _changed_in_place(scope: cst.CSTNode, name: str) -> bool:
    """Whether code in ``scope`` may change the object ``name`` holds without rebinding the name:
    an attribute of it used (`devices.append(...)`), an item of it assigned or deleted."""
    if any(type(n.value) is cst.Name and n.value.value == name for n in find(scope, cst.Attribute)):
        return True
    targets = [t.target for t in find(scope, cst.AssignTarget, cst.AugAssign)]
    for statement in find(scope, cst.Del):
        target = statement.target
        targets += [e.value for e in target.elements] if isinstance(target, cst.Tuple) else [target]
    return any(isinstance(t, cst.Subscript) and type(t.value) is cst.Name and t.value.value == name for t in targets)


# Calls that only read a setting: `len(cfgs.GPU_GROUP.strip().split(','))` (FPN_Tensorflow).
_PLAIN_FUNCTIONS = {"len", "int", "str", "list", "tuple", "range", "sorted"}
_PLAIN_METHODS = {"split", "strip", "lstrip", "rstrip", "lower", "upper", "replace"}


def _plain_setting(value: cst.BaseExpression, comprehensions: bool = False) -> bool:
    """Names, attributes, literals and calls of ``_PLAIN_FUNCTIONS`` or string methods on them
    (`'/gpu:{}'.format(k)` on a literal); with ``comprehensions``, also list comprehensions of
    those (`['/gpu:%d' % k for k in range(n_gpus)]`)."""
    for node in walk(value):
        if type(node) is cst.Call:
            func = node.func
            if not ((type(func) is cst.Name and func.value in _PLAIN_FUNCTIONS)
                    or (type(func) is cst.Attribute and func.attr.value in _PLAIN_METHODS)
                    or (type(func) is cst.Attribute and func.attr.value == "format" and type(func.value) is cst.SimpleString)):
                return False
        elif type(node) is cst.ListComp and comprehensions:
            continue
        elif isinstance(node, (cst.Lambda, cst.BaseComp, cst.NamedExpr, cst.Await, cst.Yield)):
            return False
    return True


def _check_bound_before(rule, owner: cst.CSTNode, above: list, prelude: list, block: list) -> None:
    """The strategy is made before what its scope covers: the device list, and the statements
    that move ``above`` it, must not read a name that code there binds (`n_gpus = FLAGS.n_gpus`
    inside an `if` above the loop)."""
    block = owner.body.body if isinstance(owner, (cst.With, cst.FunctionDef)) else block
    moved = {id(s) for s in prelude}
    covered = [s for s in block if id(s) not in moved]
    read = set().union(*(free_names(s) for s in above)) - set().union(set(), *(scope_bindings(s) for s in above[1:]))
    late = read & set().union(*(scope_bindings(s) for s in covered))
    if late:
        # The line that binds it: a simple statement inside what is covered, else the compound
        # statement itself (`for name in ...`, `with ... as name`: az05's tf_cnn_benchmarks).
        binding = next((s for s in simple_statements(owner) if scope_bindings(s) & late and id(s) not in moved),
                       next(s for s in covered if scope_bindings(s) & late))
        raise Refused(f"line {line_of(rule, binding)}: the towers' devices read "
                      f"{', '.join(f'`{n}`' for n in sorted(late))}, set inside the code the strategy scope must "
                      "cover; set it before that code (or at the top of the function)")


def _remove_unused_helpers(changes: dict, tower, module: cst.Module, update: Update) -> None:
    """The averaging helper and device functions only the loop used go with it."""
    removed = [scope.device for scope in tower.scopes]
    names = [name for name, _ in device_helpers(tower, module)]
    if update.helper:
        names.append(update.helper)
    definitions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    for name in names:
        definition = definitions.get(name)
        if definition is None or definition in changes:  # rebuilt with the strategy scope
            continue
        inside = sum(references(node, name) for node in removed)
        if name == update.helper:
            inside += 1  # its one call went with the averaging statement
        if references(module, name) - 1 - inside == 0:
            changes[definition] = cst.RemovalSentinel.REMOVE

