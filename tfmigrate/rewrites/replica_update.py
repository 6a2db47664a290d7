"""The update after a tower loop, and each replica's share of it (part of :mod:`.replica_loop`).

MirroredStrategy sums what the replicas apply, so the update the program makes once from
every tower's results becomes one each replica makes from its own:

- the `apply_gradients` of the averaged (or summed) tower gradients, found through the
  program's own averaging (an `average_gradients` helper, a `zip(*tower_grads)` loop);
- the `minimize` of the towers' mean (or summed) loss;
- an update wrapped in a function of the module, or made by the caller the towers' results
  are returned to.

What the update is made from (an optimizer made inline, a gradient list written as a
comprehension) is made once, before the replicas, and the global step counts once.
:func:`find_update` returns the :class:`Update`, or raises :class:`Refused`.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

import libcst as cst

from tfmigrate.analysis.devices import enclosing_class
from tfmigrate.analysis.training import VARIABLE_MAKERS, gradient_computation, optimizer_step, training_call
from tfmigrate.cst.callargs import argument, callee_name, is_false, is_true, method_call, with_keyword
from tfmigrate.cst.codegen import code
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import (
    ReplaceById, assigned_pairs, blank_lines_unindented, contains, enclosing, find, first_free, fresh_name, module_parents,
    names_used, scope_bindings, single_small, target_names, walk,
)
from tfmigrate.rewrites.hand_written import kept_caller_update, kept_update, own_optimizer_steps
from tfmigrate.rewrites.mirrored import TfNames, averages, averaging_helper, comment_lines, is_docstring
from tfmigrate.rewrites.refusal import Refused, StateRefused
from tfmigrate.rewrites.global_steps import count_once, global_steps_outside
from tfmigrate.rewrites.tower_checks import check_only_computes
from tfmigrate.rewrites.tower_code import (
    Collected, Region, Update, collected_appends, index_of, line_of, mentions, method_of, module_calls, outside_loop,
    simple_statements, statement_lines,
)


# Reductions of a list of tower losses, and the share of the total each replica minimises.
_LOSS_MEANS = {"tensorflow.reduce_mean", "tensorflow.math.reduce_mean"}


_LOSS_SUMS = {"tensorflow.add_n", "tensorflow.math.add_n", "tensorflow.reduce_sum", "tensorflow.math.reduce_sum"}


_REDUCE_SUMS = {"tensorflow.reduce_sum", "tensorflow.math.reduce_sum"}


_STACKS = {"tensorflow.stack", "tensorflow.concat", "tensorflow.convert_to_tensor"}


def optimizers_named_apart(rule) -> dict[int, tuple[cst.Call, cst.Call]]:
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
                renamed[id(call)] = (call, with_keyword(call, "name", f"'{apart}'"))
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
        name = first_free(rule.context.module, "replica_grads", "tower_grads_")
        grads = cst.Name(name)
        changes[id(item.statement)] = cst.FlattenSentinel([
            cst.parse_statement(f"{name} = {code(item.value)}\n"),
            item.statement.with_changes(body=[item.statement.body[0].with_changes(
                value=item.statement.body[0].value.with_changes(args=[cst.Arg(grads)]))]),
        ])
    share = grads.value
    pairs = method_call(item.compute, "compute_gradients")  # else `tf.gradients`: a list of gradients
    if average.averages:
        share = first_free(rule.context.module, "grads_share", "replica_share")
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
    name = first_free(rule.context.module, default_name, default_name + "_")
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


def find_update(rule, region: Region, strategy: str, tf: TfNames) -> Update:
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
    collected = {item.target for item in collected_appends(towers.loop)}
    paired = _gradients_applied_once(lines, steps, collected)
    taken: set[str] = set()
    of_copies = {}
    for at, line in enumerate(lines):
        if training_call(rule, line, gradient_computation) is not None and line not in paired.values():
            run_by = strategy if not method_of(region, line) else f"{tf('tensorflow.distribute.get_strategy')}()"
            of_copies[id(line)] = _gradients_of_copies(rule, run_by, tf, line, taken, lines[:at], collected)
    for statement in simple_statements(towers.loop.body):
        if any(optimizer_step(call) for call in find(statement, cst.Call)):
            raise Refused(f"line {line_of(rule, statement)}: each tower updates the model itself as well as the "
                          "update after the loop")
    if any(method_call(call, "minimize") for _, call in steps):
        _check_no_weights_after(rule, lines)
    update = Update([], note=" (the update after the loop stays; each replica runs its optimizer call)")
    update.changes.update((id(compute), cst.RemovalSentinel.REMOVE) for compute in paired.values())
    update.changes.update(of_copies)
    for line in {id(line): line for line, _ in steps}.values():
        calls = [call for at, call in steps if at is line]
        # A step made outside the scope is counted once, after the update.
        update.counted |= _countable_global_steps(rule, region, line)
        # In a method the caller calls after the towers, the caller's strategy is the current one.
        run_by = strategy if not method_of(region, line) else f"{tf('tensorflow.distribute.get_strategy')}()"
        update.changes[id(line)] = _replica_steps(rule, run_by, tf, region, line, calls, taken, update.counted, paired)
        update.wrapped.append(line)
    return update


def _gradients_of_copies(rule, strategy: str, tf: TfNames, line, taken: set[str], before: list,
                         collected: set[str]) -> cst.FlattenSentinel:
    """`grads_and_vars = opt.compute_gradients(total, ...)` after the towers, of a total made
    from a list every tower filled, its gradients read before they are applied (clipped by their
    global norm): each replica takes the gradients of the total by its own copy of the weights,
    and their sum is the gradient of the legacy program's one weight (checked on a held-out
    program, the clip active: equal to the bit). Refused for other gradient computations after
    the loop (`tf.gradients(...)`, one tower's loss: the other replicas would have none)."""
    small = single_small(line)
    call = small.value if isinstance(small, cst.Assign) and len(small.targets) == 1 else None
    loss = argument(call, ("loss",), "loss") if isinstance(call, cst.Call) else None
    if not (isinstance(call, cst.Call) and method_call(call, "compute_gradients") and loss is not None
            and _made_from_all_towers(before, loss, collected)):
        raise Refused(f"line {line_of(rule, line)}: gradients are computed after the tower loop, outside the "
                      "replicas: under MirroredStrategy they would see one replica's copy of the weights")
    name = fresh_name(rule.context.module, "copy_gradients", taken)
    summed = f"{strategy}.reduce({tf('tensorflow.distribute.ReduceOp')}.SUM, g, axis=None)"
    spaced = line.leading_lines or [cst.EmptyLine(indent=False)]
    function = cst.parse_statement(f"def {name}():\n    return {_one_line(call)}\n").with_changes(leading_lines=[
        *spaced,
        cst.EmptyLine(comment=cst.Comment("# Each replica differentiates the total by its own copy of the weights;")),
        cst.EmptyLine(comment=cst.Comment("# the copies' gradients summed are the weight's."))])
    target = code(small.targets[0].target)
    combined = cst.parse_statement(f"{target} = [({summed} if g is not None else None, v)\n"
                                   f"    for g, v in {strategy}.extended.call_for_each_replica({name})]\n")
    return cst.FlattenSentinel([function, combined.with_changes(leading_lines=[cst.EmptyLine(indent=False)])])


def _gradients_applied_once(lines: list, steps: list, collected: set[str]) -> dict[int, cst.BaseStatement]:
    """`grads = opt.compute_gradients(total, ...)`, then `opt.apply_gradients(grads, ...)` and
    nothing else reading `grads` (no clipping between), where `total` is made from a list every
    tower filled (``collected``): the pair is `opt.minimize(total)`, which each replica runs
    differentiating the towers' total by its own copy of the weights (checked on TF 2.21: the
    pair and `minimize` make the same step). A loss of one tower only would leave the other
    replicas no gradient. By id of the apply call: the line computing its gradients."""
    paired = {}
    for at, line in enumerate(lines):
        small = single_small(line)
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
                and method_call(small.value, "compute_gradients") and dotted_name(small.value.func.value)
                and small.value.args and _made_from_all_towers(lines[:at], small.value.args[0].value, collected)):
            continue
        grads, optimizer = small.targets[0].target.value, dotted_name(small.value.func.value)
        readers = [later for later in lines[at + 1:] if mentions(later, grads)]
        applies = [call for later, call in steps if readers == [later] and method_call(call, "apply_gradients")
                   and code(call.func.value) == optimizer and call.args and code(call.args[0].value) == grads]
        if len(applies) == 1:
            paired[id(applies[0])] = line
    return paired


def _made_from_all_towers(before: list, loss: cst.BaseExpression, collected: set[str]) -> bool:
    """Whether ``loss`` reads a list the towers filled, itself or through the one assignment
    before it that binds it (`total = tf.add_n(tower_losses)`)."""
    if any(mentions(loss, name) for name in collected):
        return True
    name = dotted_name(loss)
    if name is None:
        return False
    assigns = [small for small in map(single_small, before) if isinstance(small, cst.Assign)]
    bound = [small.value for small in assigns if any(dotted_name(t.target) == name for t in small.targets)]
    return len(bound) == 1 and any(mentions(bound[0], each) for each in collected)


def _check_no_weights_after(rule, lines) -> None:
    """A trainable weight made after the tower loop, outside the replicas (GE2E's similarity
    scale `w = tf.get_variable("w", ...)` over the towers' joined embeddings): the loss reads
    replica 0's copy only, so the other replicas' `minimize` find no gradient for theirs, and
    MirroredStrategy wants one from each (an assertion failed in a held-out GE2E trainer)."""
    for line in lines:
        for call in find(line, cst.Call):
            name = rule.imports.resolve(call.func) or ""
            trainable = argument(call, (), "trainable")
            makes = name in VARIABLE_MAKERS or name.startswith(("tensorflow.layers.", "tensorflow.keras.layers."))
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
    return {id(arg) for _, arg in global_steps_outside(rule, region, [line])}


def under_scope(method: cst.FunctionDef, scope_item: cst.WithItem, why: str) -> cst.FunctionDef:
    """``method``'s body (after its docstring) under the strategy kept on `self`, ``why`` said
    in a comment: its optimizer calls run through `tf.distribute.get_strategy()`, and the
    variables they make are mirrored."""
    body = list(method.body.body)
    at = 1 if body and is_docstring(body[0]) else 0
    why = cst.EmptyLine(comment=cst.Comment(f"# {why}"))
    scoped = cst.With(items=[scope_item], body=cst.IndentedBlock(body=[blank_lines_unindented(s) for s in body[at:]]),
                      leading_lines=[why])
    return method.with_changes(body=method.body.with_changes(body=[*body[:at], scoped]))


def caller_update(rule, region: Region, caller: Region, strategy: str, tf: TfNames) -> Update:
    update = kept_caller_update(rule, region, caller)
    if update is not None:
        return update
    update = _wrapped_update(rule, caller, strategy, tf, towers=region)
    if update is None:
        raise Refused(f"the towers' results go back to {owner_name(caller.owner)}, which does not update the model "
                      "through an optimizer: build the update in the function with the tower loop")
    where = {method_of(caller, line) or caller.owner for line in update.wrapped}
    names = ", ".join(sorted(owner_name(owner) for owner in where))
    update.note = f" (the update stays in {names}; each replica runs its optimizer call)"
    return update


def owner_name(owner: cst.CSTNode) -> str:
    return f"`{owner.name.value}`" if isinstance(owner, cst.FunctionDef) else "the module's code"


def _replica_steps(rule, strategy: str, tf: TfNames, region: Region, line, calls: list[cst.Call], taken: set[str],
                   counted: set[int], paired: dict[int, cst.BaseStatement]):
    """``line`` with each optimizer call run by the replicas: a function before it per call;
    the global steps in ``counted`` are incremented once after it."""
    before: list[cst.BaseStatement] = []
    after: list[cst.BaseStatement] = []
    runs = {}
    for call in calls:
        steps = [arg for arg in call.args if id(arg) in counted]
        run = _without_argument(call, steps[0]) if steps else call
        # An optimizer made in the call itself may need a name of its own (see optimizers_named_apart).
        run = run.visit(ReplaceById({key: new for key, (_, new) in optimizers_named_apart(rule).items()}))
        statements, name = _replica_step(rule, strategy, tf, region, run, taken, _control_dependencies(rule, region, line),
                                         paired.get(id(call)))
        before += statements
        # Each replica's step returns its own handle on the one update: group them into one op.
        runs[id(call)] = cst.parse_expression(f"{tf('tensorflow.group')}({strategy}.experimental_local_results(\n"
                                              f"    {strategy}.extended.call_for_each_replica({name})))")
        if not steps:
            continue
        small = single_small(line)
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and small.value is call:
            after += count_once(rule, code(small.targets[0].target), code(steps[0].value), tf)
            continue
        # The update is part of a bigger value (`train_op = [opt.apply_gradients(...)]`): its op
        # gets a name of its own, counted after, and the value takes that name.
        applied = fresh_name(rule.context.module, "update_op", taken)
        named = cst.parse_statement(f"{applied} = {code(runs[id(call)])}\n")
        before += [named.with_changes(leading_lines=[cst.EmptyLine(indent=False)]),
                   *count_once(rule, applied, code(steps[0].value), tf)]
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
    """Names, attributes, lists of them (joined with `+`, or picked by a comprehension),
    collection reads, and groupings of such (`tf.group(*ops)`, a no-op that waits for them):
    entered again, nothing that does work is made twice."""
    if isinstance(value, (cst.Name, cst.Attribute, cst.Subscript)):
        return True
    if isinstance(value, (cst.List, cst.Tuple)):
        return all(_reads_only(rule, element.value) for element in value.elements)
    if isinstance(value, cst.StarredElement):
        return _reads_only(rule, value.value)
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
        # `update_ops + [loss]`: lists joined (control inputs are a list, not a sum of tensors)
        return _reads_only(rule, value.left) and _reads_only(rule, value.right)
    if isinstance(value, cst.ListComp) and value.for_in.inner_for_in is None:
        # `[g for g, _ in averaged]`: the tensors a list holds, picked (a held-out CycleGAN waited
        # for every generator gradient before updating either generator so)
        return _reads_only(rule, value.elt) and _reads_only(rule, value.for_in.iter)
    name = rule.imports.resolve(value.func) if isinstance(value, cst.Call) else None
    if name in ("tensorflow.group", "tensorflow.tuple"):
        return all(_reads_only(rule, arg.value) for arg in value.args if arg.keyword is None)
    return name in ("tensorflow.get_collection", "tensorflow.get_collection_ref")


def _replica_step(rule, strategy: str, tf: TfNames, region: Region, call: cst.Call, taken: set[str],
                  dependencies: list[str] = (), computed: cst.BaseStatement | None = None):
    """The function each replica runs in place of ``call`` (with what it needs first), and its
    name; under the ``dependencies`` (see _control_dependencies) when there are some. With
    ``computed`` (the line computing the gradients ``call`` applies), the replica runs both."""
    module = rule.context.module
    first = call.args[0].value if call.args else None
    before: list[cst.BaseStatement] = []
    if isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Call):
        # `tf.train.RMSPropOptimizer(...).minimize(loss)`: one optimizer, made before the
        # replicas, as the program made one; an optimizer per replica has slots nobody made.
        optimizer = fresh_name(module, "optimizer", taken)
        before.append(cst.parse_statement(f"{optimizer} = {code(call.func.value)}\n"))
        call = call.with_changes(func=call.func.with_changes(value=cst.Name(optimizer)))
    if computed is not None:
        share = code(computed.with_changes(leading_lines=()))
        why = ("Each replica differentiates the loss by its own copy of the weights;\n"
               "MirroredStrategy sums the copies' gradients into the weight's.")
        name = fresh_name(module, "minimize_share", taken)
    elif method_call(call, "apply_gradients") and first is not None:
        if may_be_iterator(region, first) or not isinstance(first, (cst.Name, cst.Attribute)):
            # Made once, before the replicas, as the program made it: each replica walking a zip
            # would run it dry, and in a replica `v.op.name` names that replica's copy of `v`.
            pairs = fresh_name(module, "grads_and_vars_list", taken)
            listed = isinstance(first, (cst.List, cst.ListComp)) or (
                isinstance(first, cst.Call) and code(first.func) == "list")  # `list(zip(grads, tvars))`
            made = code(first) if listed else f"list({code(first)})"
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


ITERATOR_BUILTINS = ("zip", "map", "filter", "iter", "enumerate", "reversed")


def may_be_iterator(region: Region, value: cst.BaseExpression) -> bool:
    """Whether the pairs handed to `apply_gradients` may be an iterator (`zip(...)` bound to a name)."""
    if isinstance(value, (cst.List, cst.ListComp, cst.Tuple)):
        return False
    if isinstance(value, cst.Call):
        return code(value.func) not in ("zip", "list", "map", "tuple")  # a fresh one at each call, or a list
    name = code(value)
    for node in find(region.owner, cst.Assign):
        if any(code(t.target) == name for t in node.targets):
            if isinstance(node.value, cst.GeneratorExp) or (
                    isinstance(node.value, cst.Call) and code(node.value.func) in ITERATOR_BUILTINS):
                return True
    return False


def _forward_only(rule, region: Region) -> Update:
    """Towers that only compute (predictions, an evaluation) need no update moved, as long as
    nothing trains on what they make: a training step left outside the replicas would fail."""
    check_only_computes(rule, region)
    return Update([], note=" (the towers only compute: nothing to update)")


def increment_global_step_once(rule, region: Region, update: Update, tf: TfNames) -> None:
    """A moved `train_op = opt.apply_gradients(..., global_step=step)` whose step is made outside
    the scope: the replicas update without it, and once they have, the step is incremented once
    in its place (the replicas cannot update a variable that is not mirrored; checked on TF 2.21)."""
    for statement, arg in global_steps_outside(rule, region, update.statements):
        # The update's assignment, or that in the `with tf.control_dependencies(...)` it moved in.
        small = single_small(statement.body.body[0] if isinstance(statement, cst.With) else statement)
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
            continue  # no handle on the update to order the increment after: refused
        call = next(c for c in find(statement, cst.Call) if any(a is arg for a in c.args))
        update.statements[update.statements.index(statement)] = statement.visit(
            ReplaceById({id(call): _without_argument(call, arg)}))
        update.after_run += count_once(rule, code(small.targets[0].target), code(arg.value), tf)
        update.counted.add(id(arg))


def _without_argument(call: cst.Call, argument: cst.Arg) -> cst.Call:
    args = [a for a in call.args if a is not argument]
    if argument.keyword is None and any(a.keyword is None for a in args[call.args.index(argument):]):
        raise StateRefused("the global step is passed by position before other arguments by position: pass it "
                           "as `global_step=`")
    args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return call.with_changes(args=args)


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
