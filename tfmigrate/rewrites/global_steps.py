"""The global step under the tower rewrite: where it is made and who counts it.

TF1 programs fetch their step with the update and steer by it (`_, step = sess.run([train_op,
global_step])`, then a rate chosen from `step`, an evaluation every N steps). A TF1
`tf.Variable` is a reference variable: fetched with the update, it reads the count after it
(1 after the first run). Made under the strategy's scope it would be a mirrored resource
variable, read before the update (0): the program's Python side would run one step behind
(a held-out TextCNN trainer evaluated after its first step and trained apart from there).

So a step made in the code the scope covers, by a statement that can run first, is made just
before the scope opens (:func:`steps_made_before_scope`); like a step made outside it (in
`__init__`, at module level) it stays TF1's variable, and the replicas update without it while
the step is counted once after their update (:func:`count_once`). Checked on TF
2.21: such a step fetched with the update reads 1, 2, 3 as TF1's did; a mirrored one 0, 1, 2.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.training import GLOBAL_STEP_MAKERS, VARIABLE_MAKERS, variable_update
from tfmigrate.cst.callargs import method_call
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import find, names_used, scope_bindings, single_small
from tfmigrate.rewrites.mirrored import TfNames, strategy_scope_owner
from tfmigrate.rewrites.tower_code import Region, simple_statements
from tfmigrate.rewrites.tower_scope import module_run


def global_steps_outside(rule, region: Region, statements) -> list[tuple[cst.BaseStatement, cst.Arg]]:
    """The `global_step=` arguments of ``statements`` that name a step made outside what the
    strategy scope covers (in `__init__`, at module level, or made just before the scope): a
    plain variable, not a mirrored one."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    in_loop = {id(s) for s in simple_statements(region.loop)}
    made_before = {id(s) for s in steps_made_before_scope(rule, owner, region)}
    made_inside: set[str] = set()
    for line in simple_statements(owner):
        small = single_small(line)
        if id(line) in in_loop | made_before or (isinstance(small, cst.Assign)
                                                  and isinstance(small.value, (cst.Name, cst.Attribute))
                                                  and code(small.value) not in made_inside):
            continue  # another name for what is made elsewhere (`self.global_step = global_step`)
        made_inside |= _bindings(line)
    return [(statement, arg) for statement in statements for arg in global_step_args(statement)
            if code(arg.value) not in made_inside | {"None"}]


def global_step_args(statement: cst.CSTNode) -> list[cst.Arg]:
    """`global_step=step`, or the step passed by position to `apply_gradients(grads, step)` or
    `minimize(loss, step)` (ChineseNER's `self.opt.apply_gradients(grads_vars, self.global_step)`)."""
    found = []
    for call in find(statement, cst.Call):
        positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
        found += [arg for arg in call.args if arg.keyword is not None and arg.keyword.value == "global_step"]
        if method_call(call, "apply_gradients") or method_call(call, "minimize"):
            found += positional[1:2]
    return found


def steps_made_before_scope(rule, owner: cst.CSTNode | None, region: Region | None = None) -> list[cst.SimpleStatementLine]:
    """The statements of ``owner``'s block (the `with` or function the strategy scope would
    cover; at module level, the run of statements around ``region``'s loop that it covers) that
    make a global step the rewrite makes just before the scope: `step = tf.Variable(0,
    trainable=False)`, `self.global_step = tf.train.get_or_create_global_step()`, reading nothing
    bound above them in the block (they run first), naming a step that only updates bound to a
    name count (the single count goes after them)."""
    if isinstance(owner, cst.Module) and region is not None:
        return rule.context.memo(("global_steps.before_scope", id(region.loop)),
                                 lambda: _made_before_scope(rule, owner, module_run(rule, region)))
    if not isinstance(owner, (cst.With, cst.FunctionDef)):
        return []
    return rule.context.memo(("global_steps.before_scope", id(owner)),
                             lambda: _made_before_scope(rule, owner, owner.body.body))


def _made_before_scope(rule, owner: cst.CSTNode, statements) -> list[cst.SimpleStatementLine]:
    found = []
    bound: set[str] = set()
    for statement in statements:
        small = single_small(statement)
        if (isinstance(small, cst.Assign) and len(small.targets) == 1
                and isinstance(small.targets[0].target, (cst.Name, cst.Attribute)) and isinstance(small.value, cst.Call)
                and rule.imports.resolve(small.value.func) in VARIABLE_MAKERS | GLOBAL_STEP_MAKERS
                and not names_used(small.value) & bound
                and _counted_by_named_updates(rule, owner, code(small.targets[0].target))):
            found.append(statement)
        bound |= _bindings(statement)
    return found


def _bindings(statement: cst.CSTNode) -> set[str]:
    """What ``statement`` binds: names, and attributes by their code (`self.global_step`)."""
    return scope_bindings(statement) | {code(target.target) for target in find(statement, cst.AssignTarget)}


def _counted_by_named_updates(rule, owner: cst.CSTNode, step: str) -> bool:
    """Whether ``step`` is bound once in ``owner``, passed as the global step only to updates
    bound to a name outside any loop (`train_op = opt.apply_gradients(grads, global_step=step)`
    after the towers, maybe under a `with tf.control_dependencies(...)`), at least one, and
    assigned by nothing else. A tower's own `minimize(loss, global_step=step)` keeps it mirrored."""
    updates = [arg for line in simple_statements(owner) for arg in global_step_args(line) if code(arg.value) == step]
    if not updates or sum(step in _bindings(line) for line in simple_statements(owner)) != 1:
        return False
    in_loops = {id(line) for loop in find(owner, cst.For, cst.While) for line in simple_statements(loop)}
    named = {id(small.value) for line in simple_statements(owner)
             if id(line) not in in_loops and isinstance(small := single_small(line), cst.Assign)
             and len(small.targets) == 1}
    calls = [call for call in find(owner, cst.Call) if any(arg is update for arg in call.args for update in updates)]
    if len(calls) != len(updates) or not all(id(call) in named for call in calls):
        return False
    return not any((update := variable_update(rule, call)) is not None and update[1] is not None
                   and code(update[1]) == step for call in find(owner, cst.Call))


def count_once(rule, update: str, step: str, tf: TfNames) -> list[cst.BaseStatement]:
    """`step += 1` once the replicas' ``update`` ran, where the update's op was; and, where the
    program reads TF1's `train_op` collection back, the counted update in place of the replicas'
    (TF1's optimizer put its update, which counted the step, there first)."""
    increment = cst.parse_statement(
        f"with {tf('tensorflow.control_dependencies')}([{update}]):\n    {update} = {step}.assign_add(1).op\n")
    counted = [increment.with_changes(leading_lines=[
        cst.EmptyLine(indent=False),
        cst.EmptyLine(comment=cst.Comment(f"# The replicas apply without `{step}`, which counts the step once, after")),
        cst.EmptyLine(comment=cst.Comment("# their update: fetched with the update, it reads the count after it, as it did.")),
    ])]
    if rule.context.memo("global_steps.train_op_collection", lambda: _reads_train_op_collection(rule)):
        collection = cst.parse_statement(
            f"{tf('tensorflow.get_collection_ref')}({tf('tensorflow.GraphKeys.TRAIN_OP')})[:] = [{update}]\n")
        counted.append(collection.with_changes(leading_lines=[
            cst.EmptyLine(comment=cst.Comment("# The program reads the `train_op` collection, where TF1's optimizer put its")),
            cst.EmptyLine(comment=cst.Comment("# counting update first: the counted update takes the replicas' place there.")),
        ]))
    return counted


def _reads_train_op_collection(rule) -> bool:
    """`tf.get_collection('train_op')`, `tf.get_collection(tf.GraphKeys.TRAIN_OP)`."""
    for call in find(rule.context.module, cst.Call):
        name = (rule.imports.resolve(call.func) or "").rsplit(".", 1)[-1]
        if name in ("get_collection", "get_collection_ref") and call.args and code(
                call.args[0].value).strip("'\"").endswith(("train_op", "TRAIN_OP")):
            return True
    return False
