"""The TFM101 rewrite: a hand-built tower loop becomes ``tf.distribute.MirroredStrategy``
(DESIGN's ``compat`` target: the Session program stays, its scaffolding is replaced).

The shape it rewrites, in one block of a function::

    tower_grads = []
    [with tf.variable_scope(tf.get_variable_scope()):]
        for i in range(N):                       # or: for i, d in enumerate(DEVICES)
            with tf.device(<any spelling>):
                ... build the tower, `loss = ...` ...
                [tf.get_variable_scope().reuse_variables()]
                tower_grads.append(opt.compute_gradients(loss))
    grads = average_gradients(tower_grads)       # a helper of this module that averages (or sums)
    train_op = opt.apply_gradients(grads, global_step=global_step)
    # or, in one statement: train_op = opt.apply_gradients(average_gradients(tower_grads), ...)

becomes a replica function that MirroredStrategy runs once per device::

    def tower_step():
        i = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
        ... the same tower code ...
        grads = opt.compute_gradients(loss / strategy.num_replicas_in_sync)
        train_op = opt.apply_gradients(grads, global_step=global_step)
        with tf.control_dependencies([train_op]):
            return tf.identity(loss)

    loss = strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(tower_step), axis=None)
    train_op = loss.op

MirroredStrategy *sums* gradients across replicas, so a loss whose gradients the helper
averaged is divided by the replica count; a helper that summed keeps the loss as it was. The
replica index takes the place of the loop variable, so `x_parts[i]`, `'tower_%d' % i` and
per-tower feeds keep working; variables are created by replica 0 and reused by the others,
exactly what `reuse_variables()` did. The graph is built under ``strategy.scope()``, which
takes the place of the hand placement on ``/cpu:0``. Towers that each read their own
``dataset.shard(N, i)`` get one distributed dataset instead (:mod:`tfmigrate.rewrites.tower_input`), and
towers fed through per-tower placeholders, or through the `tf.split` pieces of placeholders made
before the loop, a generator-backed one (:mod:`tfmigrate.rewrites.tower_feeds`).
Anything else is refused with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from tfmigrate.analysis.devices import (
    device_scope_arg, enclosing_class, looks_per_device, mentions_only_cpu, module_tower_loops,
    self_results, tower_group,
)
from tfmigrate.analysis.optimizers import hand_written_update
from tfmigrate.analysis.project_imports import project_function
from tfmigrate.analysis.training import optimizer_step, uses_estimators
from tfmigrate.cst.callargs import argument, is_none, method_call
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import ReplaceById, contains, find, module_parents, name_nodes, names_used, walk
from tfmigrate.rewrites import tower_feeds, tower_input
from tfmigrate.rewrites.refusal import Refused, StateRefused
from tfmigrate.rule import Edit, FixSafety, ImportItem

# A Python int (not a numpy one): `reuse=i > 0` must stay a real bool for variable_scope.
REPLICA_INDEX = "int({tf}.get_static_value({tf}.distribute.get_replica_context().replica_id_in_sync_group))"


@dataclass
class TfNames:
    """TensorFlow spelled with the module's own alias, and the imports that needs."""

    rule: object
    imports: list = field(default_factory=list)

    def __call__(self, target: str) -> str:
        expression, needed = self.rule.tf_ref(target)
        self.imports += [item for item in needed if item not in self.imports]
        return cst.Module([]).code_for_node(expression)


def _statement_of(node: cst.CSTNode, parents) -> cst.BaseStatement:
    while not isinstance(node, cst.BaseStatement):
        node = parents[id(node)]
    return node


def _block_of(statement: cst.CSTNode, parents) -> cst.CSTNode:
    return parents[id(statement)]  # an IndentedBlock or the Module


def only_call(statement: cst.CSTNode) -> cst.Call | None:
    """The call of `name = call(...)` or of a bare `call(...)` statement."""
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        small = statement.body[0]
        if isinstance(small, (cst.Assign, cst.Expr)) and isinstance(small.value, cst.Call):
            return small.value
    return None


def assigned_name(statement: cst.CSTNode) -> str | None:
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        small = statement.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            target = small.targets[0].target
            if isinstance(target, cst.Name):
                return target.value
    return None


@dataclass
class _Gradients:
    """Where the loop collects its gradients."""

    tower_list: str  # `tower_grads`
    append: cst.SimpleStatementLine  # `tower_grads.append(...)`
    compute: cst.Call  # `opt.compute_gradients(loss, ...)`
    compute_statement: cst.SimpleStatementLine | None  # `grads = opt.compute_gradients(...)` when separate
    optimizer: str  # `opt`
    loss: str  # `loss`


def _find_gradients(loop: cst.For) -> _Gradients:
    computes: dict[str, tuple[cst.Call, cst.SimpleStatementLine]] = {}
    for statement in find(loop.body, cst.SimpleStatementLine):
        call, name = only_call(statement), assigned_name(statement)
        if call is not None and name and method_call(call, "compute_gradients"):
            computes[name] = (call, statement)
    for statement in find(loop.body, cst.SimpleStatementLine):
        call = only_call(statement)
        if call is None or assigned_name(statement) or not method_call(call, "append"):
            continue
        if not (isinstance(call.func.value, cst.Name) and len(call.args) == 1):
            continue
        argument = call.args[0].value
        if method_call(argument, "compute_gradients"):
            compute, separate = argument, None
        elif isinstance(argument, cst.Name) and argument.value in computes:
            compute, separate = computes[argument.value]
        else:
            continue
        loss = compute.args[0].value if compute.args else None
        if not isinstance(loss, cst.Name):
            raise Refused("the tower loss passed to compute_gradients is not a plain name")
        return _Gradients(
            tower_list=call.func.value.value, append=statement, compute=compute,
            compute_statement=separate, optimizer=code(compute.func.value), loss=loss.value,
        )
    raise Refused("the loop does not collect `opt.compute_gradients(loss)` with `<list>.append(...)`")


# What code that only averages or sums the towers' gradients calls: the rewrites drop that code
# (MirroredStrategy's all-reduce does it), so anything else in it (a clip, a scale, noise, a
# summary) would be lost; such code is kept as written instead (the wrapped update).
_COMBINING_OPS = {
    "tensorflow.reduce_mean", "tensorflow.math.reduce_mean", "tensorflow.reduce_sum", "tensorflow.math.reduce_sum",
    "tensorflow.add_n", "tensorflow.math.add_n", "tensorflow.stack", "tensorflow.pack", "tensorflow.concat",
    "tensorflow.expand_dims", "tensorflow.divide", "tensorflow.div", "tensorflow.truediv", "tensorflow.identity",
    "tensorflow.convert_to_tensor", "tensorflow.squeeze",
}
_COMBINING_BUILTINS = {"zip", "len", "float", "int", "range", "list", "tuple", "enumerate", "isinstance"}
_COMBINING_METHODS = {"append", "extend"}


def _only_combines(node: cst.CSTNode, imports) -> bool:
    """Whether ``node`` does nothing to the gradients but average or sum them: it calls only
    :data:`_COMBINING_OPS` (and Python's plumbing) and does no arithmetic but `+` and `/`."""
    for call in find(node, cst.Call):
        name = imports.resolve(call.func)
        if name in _COMBINING_OPS:
            continue
        if name is None and isinstance(call.func, cst.Name) and call.func.value in _COMBINING_BUILTINS:
            continue
        if name is None and isinstance(call.func, cst.Attribute) and call.func.attr.value in _COMBINING_METHODS:
            continue
        return False
    return all(isinstance(b.operator, cst.Add) or (isinstance(b.operator, cst.Divide) and _is_tower_count(b.right))
               for b in find(node, cst.BinaryOperation))


def _is_tower_count(divisor: cst.BaseExpression) -> bool:
    """A divisor that reads as the number of towers: `len(grads)`, `num_gpus`, `float(FLAGS.num_gpus)`,
    a literal. Anything else (`/ batch_size`) scales the gradients as well as averaging them."""
    if isinstance(divisor, (cst.Integer, cst.Float)):
        return True
    if isinstance(divisor, cst.Call) and isinstance(divisor.func, cst.Name) and len(divisor.args) == 1:
        if divisor.func.value == "len":
            return True
        if divisor.func.value in ("float", "int"):
            return _is_tower_count(divisor.args[0].value)
    return isinstance(divisor, (cst.Name, cst.Attribute)) and looks_per_device(divisor)


def averages(node: cst.CSTNode, imports) -> bool | None:
    """Whether code combining tower gradients averages them (True), sums them (False), or
    neither can be told (None): a mean or a division averages, `add_n`/`reduce_sum` alone sums;
    code that also does something else to them (:func:`_only_combines`) is neither."""
    if not _only_combines(node, imports):
        return None
    called = {imports.resolve(c.func) for c in find(node, cst.Call)}
    divides = any(isinstance(b.operator, cst.Divide) for b in find(node, cst.BinaryOperation))
    if called & {"tensorflow.reduce_mean", "tensorflow.math.reduce_mean", "tensorflow.divide",
                 "tensorflow.div", "tensorflow.truediv"} or divides:
        return True
    if called & {"tensorflow.add_n", "tensorflow.reduce_sum", "tensorflow.math.reduce_sum", "tensorflow.math.add_n"}:
        return False
    return None


def averaging_helper(helper: str, context, within: cst.ClassDef | None = None) -> tuple[cst.FunctionDef, bool]:
    """The def of the averaging helper, and whether it averages (else sums): a module function,
    a method of the class ``within`` (`self.average_gradients(tower_grads)`), or a function the
    module imports from another module of its project (`from utils import average_gradients`)."""
    found = next((s for s in (context.module.body if within is None else within.body.body)
                  if isinstance(s, cst.FunctionDef) and s.name.value == helper), None)
    imports = context.imports
    if found is None and within is None:
        imported = project_function(context, helper)
        if imported is not None:
            found, imports = imported.definition, imported.imports
    if found is None:
        where = "this module or the project modules beside it" if within is None else f"class `{within.name.value}`"
        raise Refused(f"`{helper}` is not defined in {where}, so whether it averages or sums is unknown")
    verdict = averages(found, imports)
    if verdict is None:
        raise Refused(f"cannot tell whether `{helper}` averages or sums the tower gradients")
    return found, verdict


def helper_import(context, helper: str | None) -> list[ImportItem]:
    """The import of an averaging helper from another module of the project (`from utils import
    average_gradients`), to go with the helper's one call: the fixer removes it only if nothing
    else in the module uses it. A relative import stays."""
    imported = project_function(context, helper) if helper and "." not in helper else None
    if imported is None or imported.level:
        return []
    name = imported.definition.name.value
    return [ImportItem(imported.module, name, None if name == helper else helper)]


def own_optimizer_update(rule, statements) -> str:
    """Why the optimizer of an update in ``statements`` cannot run in the replicas, or "": a
    class of the project that overrides `apply_gradients` (BERT's `AdamWeightDecayOptimizer`)
    updates each replica's copy of a weight from that replica's gradients alone (a BERT-style
    probe trained differently from step 3). See :mod:`tfmigrate.analysis.optimizers`."""
    for statement in statements:
        for call in find(statement, cst.Call):
            if not optimizer_step(call):
                continue
            found = hand_written_update(rule.context, call.func.value)
            if found is None:
                continue
            where = f"in {Path(found.where).name}" if found.where else f"line {rule.position(found.node).start.line}"
            return (f"the update runs `{found.name}.{found.method}` ({where}), the project's own optimizer update: "
                    "MirroredStrategy sums the replicas' gradients only inside TensorFlow's `apply_gradients`, so "
                    "each replica would update its copy of the weights from its own gradients (override a "
                    "tf.train optimizer's `_apply_dense`/`_resource_apply_dense` instead)")
    return ""


def is_variable_scope_wrapper(statement: cst.CSTNode, imports) -> bool:
    """`with tf.variable_scope(tf.get_variable_scope()):` — only there to share the towers' variables."""
    if not isinstance(statement, cst.With) or len(statement.body.body) != 1:
        return False
    for item in statement.items:
        call = item.item
        if not (isinstance(call, cst.Call) and imports.resolve(call.func) == "tensorflow.variable_scope"):
            return False
        if not (call.args and isinstance(call.args[0].value, cst.Call)
                and imports.resolve(call.args[0].value.func) == "tensorflow.get_variable_scope"):
            return False
    return True


def is_reuse_statement(statement: cst.CSTNode) -> bool:
    call = only_call(statement)
    return call is not None and method_call(call, "reuse_variables")


class _RewriteBody(cst.CSTTransformer):
    """The loop body as a replica function body: no device scopes, no reuse call, and the
    gradient bookkeeping replaced by compute + apply + return."""

    def __init__(self, imports, grads: _Gradients, new_compute: cst.Call, tail: list[cst.BaseStatement]):
        super().__init__()
        self.imports, self.grads, self.new_compute, self.tail = imports, grads, new_compute, tail

    def leave_With(self, original: cst.With, updated: cst.With):
        items = [item for item in updated.items if device_scope_arg(item.item, self.imports) is None]
        if len(items) == len(updated.items):
            return updated
        if not items:
            return cst.FlattenSentinel(updated.body.body)
        items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(items=items)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        return self.new_compute if original is self.grads.compute else updated

    def leave_SimpleStatementLine(self, original, updated):
        if is_reuse_statement(original):
            return cst.RemovalSentinel.REMOVE
        if original is self.grads.append:
            return cst.FlattenSentinel(self.tail)
        return updated


def _last_in_body(statement: cst.CSTNode, loop: cst.For, parents) -> bool:
    """Whether nothing runs after ``statement`` in the loop body (so a return can go there)."""
    node = statement
    while node is not loop:
        block = parents[id(node)]
        body = block.body if isinstance(block, (cst.IndentedBlock, cst.Module)) else None
        if body is not None and body[-1] is not node:
            return False
        node = block
    return True


def devices_argument(loop: cst.For) -> str:
    iterable = loop.iter
    if isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Name):
        name = iterable.func.value
        if name in ("range", "xrange") and len(iterable.args) == 1:
            return f"['/gpu:%d' % k for k in range({code(iterable.args[0].value)})]"
        if name == "enumerate" and len(iterable.args) == 1:
            return code(iterable.args[0].value)
    if isinstance(iterable, (cst.Name, cst.Attribute, cst.List, cst.Tuple)):
        return code(iterable)
    raise Refused(f"cannot tell the devices from `{code(iterable)}`")


def loop_index(loop: cst.For) -> tuple[str, set[str]]:
    """The loop's index variable, and the other names its target binds."""
    target = loop.target
    if isinstance(target, cst.Name):
        if isinstance(loop.iter, cst.Call) and code(loop.iter.func) in ("range", "xrange"):
            return target.value, set()
        return "", {target.value}  # `for d in DEVICES`: the element is a device, not an index
    if isinstance(target, cst.Tuple) and len(target.elements) == 2:
        first, second = (e.value for e in target.elements)
        if isinstance(first, cst.Name):
            return first.value, names_used(second)
    raise Refused(f"cannot use the loop target `{code(target)}` as a replica index")


def references(module: cst.Module, name: str) -> int:
    return len(name_nodes(module).get(name, ()))


@dataclass
class Planned:
    """What :func:`plan` made of a tower loop (computed once per loop and run, shared by the
    rules that offer the rewrite: TFM101, and TFM106 for the per-tower placeholders)."""

    edit: Edit | None
    refused: str | None = None        # why there is no edit
    fed: tower_input.DistributedInput | None = None  # the per-tower placeholders' dataset, if made
    feeds_kept: str | None = None     # why per-tower placeholders stay per replica
    split_kept: str | None = None     # why placeholders cut with tf.split stay fed each step


GENERAL_FEEDS = "each replica reads its own placeholders, fed by the session loop as before"


def planned(rule, tower) -> Planned:
    def compute() -> Planned:
        from tfmigrate.rewrites import replica_loop

        if len(replica_loop.towers_together(rule, tower)) > 1:
            # Only the general rewrite takes several loops at once (under one strategy).
            try:
                return Planned(replica_loop.plan(rule, tower), feeds_kept=GENERAL_FEEDS)
            except Refused as reason:
                return Planned(None, refused=str(reason))
        try:
            replica_loop.check_other_towers(rule, tower)
        except StateRefused as reason:
            return Planned(None, refused=str(reason))
        textbook_first = rule.context.target == "tf2" or rule.context.tower_input == "dataset"
        if not textbook_first:
            # The general rewrite first: it keeps the program's own input (feeds, splits, queues)
            # and ran at 0.7-1.2x the legacy throughput where the textbook one, through a
            # generator-backed distributed dataset, ran at 0.3-0.6x (bench_verify.py).
            try:
                return Planned(replica_loop.plan(rule, tower), feeds_kept=GENERAL_FEEDS)
            except StateRefused as reason:
                return Planned(None, refused=str(reason))
            except Refused as reason:
                general = str(reason)
        try:
            return _plan(rule, tower)
        except Refused:
            pass
        if textbook_first:
            try:
                return Planned(replica_loop.plan(rule, tower), feeds_kept=GENERAL_FEEDS)
            except Refused as reason:
                general = str(reason)
        # the general rewrite's reason is the one to give: it is tried on every shape
        return Planned(None, refused=general)

    return rule.context.memo(("mirrored.plan", id(tower.loop)), compute)


def plan(rule, tower) -> Edit:
    """The MirroredStrategy rewrite of ``tower`` as an Edit, or Refused with the reason."""
    result = planned(rule, tower)
    if result.edit is None:
        raise Refused(result.refused)
    return result.edit


# Collection reads that filter by a name scope: (the parameters before and with `scope`).
_SCOPED_READS = {
    "tensorflow.get_collection": ("key", "scope"),
    "tensorflow.losses.get_losses": ("scope",),
    "tensorflow.losses.get_regularization_losses": ("scope",),
    "tensorflow.losses.get_regularization_loss": ("scope",),
    "tensorflow.losses.get_total_loss": ("add_regularization_losses", "name", "scope"),
}


_VARIABLE_COLLECTIONS = ("VARIABLES", "'variables'", "'trainable_variables'", "'model_variables'",
                         "'local_variables'", '"variables"', '"trainable_variables"', '"model_variables"',
                         '"local_variables"')


def _check_collection_scopes(rule, loop: cst.For) -> None:
    """A collection read in the body filtered by a scope spelled out (`tf.get_collection('losses',
    'tower_%d' % i)`): under MirroredStrategy replica k's ops are named `replica_k/tower_k/...`,
    so the filter finds none of replica k's (the rewrite ran into `add_n([])`). The name scope's
    own value (`with tf.name_scope(...) as scope:`) is what each replica's ops are named under.
    Variables are not ops: a mirrored variable keeps replica 0's name, so a variable collection
    read by its variable scope (`tf.get_collection(TRAINABLE_VARIABLES, scope='model/dnn')`)
    finds the same variables in every replica."""
    for call in find(loop.body, cst.Call):
        params = _SCOPED_READS.get(rule.imports.resolve(call.func) or "")
        scope = argument(call, params, "scope") if params else None
        key = argument(call, params, "key") if params else None
        if key is not None and code(key).endswith(_VARIABLE_COLLECTIONS):
            continue
        if scope is not None and not isinstance(scope, (cst.Name, cst.Attribute)) and not is_none(scope):
            raise Refused(f"line {rule.position(call).start.line}: `{code(call)}` filters by the scope `{code(scope)}`, which "
                          "does not name replica k's ops (`replica_k/...`) under MirroredStrategy; read the "
                          "`with tf.name_scope(...) as scope:` value instead")


def check_tower(rule, tower, tower_functions: bool = False, grouped: bool = False) -> None:
    """Refused for towers no rewrite takes: built by a function called in the loop (unless the
    rewrite takes ``tower_functions``), spread over several loops (unless the rewrite takes the
    loops together: ``grouped``), inside an Estimator model_fn, or reading a collection by a
    spelled-out scope (:func:`_check_collection_scopes`)."""
    context = rule.context
    if tower.via and not tower_functions:
        names = ", ".join(f"`{fn.name.value}`" for fn in tower.via)
        raise Refused(f"the towers are built by {names}, called in the loop: move its device scope into the loop first")
    group = tower_group(context, tower.loop)
    if len(group) > 1 and not grouped:
        raise Refused(f"the towers are built across {len(group)} loops; merge them into one loop first")
    owner = tower.owner
    if (isinstance(owner, cst.FunctionDef) and {"features", "mode"} <= {p.name.value for p in owner.params.params}
            and uses_estimators(rule)):
        raise Refused("the loop is inside an Estimator model_fn (TFM107): Estimators are gone from TF 2.16")
    _check_collection_scopes(rule, tower.loop)
    if not grouped:
        _check_sibling_methods(rule, tower)


def _check_sibling_methods(rule, tower) -> None:
    """Towers built over several methods of one class (Tacotron-2's `initialize`, `add_loss`,
    `add_optimizer`), each loop reading what another fills on `self` (`self.tower_loss[i]`):
    one loop rewritten alone reads tensors built outside its strategy (the rewrite crashed on
    "destinations must be one of a DistributedValues object")."""
    parents = module_parents(rule.context)
    home = enclosing_class(tower.loop, parents)
    if home is None:
        return
    reads = {code(node) for node in find(tower.loop.body, cst.Attribute)}
    for other in module_tower_loops(rule.context):
        if other is tower or enclosing_class(other.loop, parents) is not home:
            continue
        shared = sorted(reads & self_results(other.loop))
        if shared:
            raise Refused(f"the towers read `{shared[0]}`, which the tower loop at line "
                          f"{rule.position(other.loop).start.line} fills: the towers are built across methods, "
                          "and one loop rewritten alone would read tensors made outside its strategy; "
                          "build them in one loop first")


@dataclass
class _Loop:
    """The textbook tower loop and the statements around it, as :func:`_plan` reads them."""

    grads: _Gradients
    outer: cst.CSTNode                  # the loop, or the variable-scope `with` that wraps it
    body: list[cst.BaseStatement]       # the block that holds ``outer``
    at: int                             # ``outer``'s place in ``body``
    init: cst.BaseStatement | None      # `tower_grads = []`
    average: cst.BaseStatement | None = None  # `grads = average_gradients(tower_grads)`
    apply: cst.BaseStatement | None = None    # `train_op = opt.apply_gradients(grads, ...)`
    average_call: cst.Call | None = None
    averaged: str | None = None         # `grads`, when the average has its own statement


def _plan(rule, tower) -> Planned:
    context, module = rule.context, rule.context.module
    tf = TfNames(rule)
    check_tower(rule, tower)
    parents = module_parents(context)
    found = _region(tower.loop, parents, rule.imports)
    _find_average_and_apply(found)
    helper_name = code(found.average_call.func)
    helper, averages = averaging_helper(helper_name, rule.context)
    optimizer = own_optimizer_update(rule, [found.apply])
    if optimizer:
        raise Refused(optimizer)
    _refuse_leaks(tower.loop, found)
    index, other_targets = loop_index(tower.loop)
    devices = devices_argument(tower.loop)

    strategy = "strategy" if references(module, "strategy") == 0 else "mirrored_strategy"
    step = "tower_step" if references(module, "tower_step") == 0 else "replica_step"
    train_name = assigned_name(found.apply)
    if train_name is None:  # `self.train_op = ...`, or no name: the rewrite binds the step's op to a name
        raise Refused(f"the update `{code(found.apply).strip()}` is not bound to a plain name")
    statements = _step_statements(rule, tower.loop, found, strategy, train_name, averages, tf)
    fresh = lambda *names: next((n for n in names if references(module, n) == 0), names[-1] + "_")  # noqa: E731
    feed, statements, kept = _step_input(rule, tower, found, statements, index, strategy, fresh, tf)
    statements = _with_replica_index(statements, index, other_targets, tf)

    region = _region_changes(found, feed, step, strategy, train_name, statements, tf)
    create = cst.parse_statement(
        f"{strategy} = {tf('tensorflow.distribute.MirroredStrategy')}(devices={devices})\n"
    )
    scope_item = cst.WithItem(cst.parse_expression(f"{strategy}.scope()"))
    anchor, new_anchor = place_scope(found.outer, parents, rule.imports, region, create, scope_item)
    changes: dict = {anchor: new_anchor}
    changes.update(_unused_helpers(tower, module, found.average, anchor, [(helper_name, helper)]))

    title = "rewrite the tower loop with tf.distribute.MirroredStrategy" + (feed.note if feed else "")
    add_imports = [*(feed.imports if feed else ())]
    if context.target == "tf2":
        from tfmigrate.rewrites import tf2_step  # only for this target: `check` start-up stays small

        apply_call = only_call(found.apply)
        loop_names = tf2_step.Loop(
            strategy=strategy, step=step, loss=found.grads.loss, train=train_name,
            optimizer=found.grads.optimizer, iterator=feed.get_next.split(".")[0] if feed else "",
            averages=averages, compute_rest=tuple(found.grads.compute.args[1:]), apply_rest=tuple(apply_call.args[1:]),
        )
        names_before = list(tf.imports)
        try:
            changes[anchor] = _tf2(rule, module, changes, anchor, loop_names, feed, fresh, tf)
            title = ("rewrite the tower loop as a tf.function train step with tf.GradientTape under "
                     "tf.distribute.MirroredStrategy" + (feed.note if feed else ""))
            # The compat loop's `itertools.count()` became `enumerate(...)`.
            add_imports = [item for item in add_imports if item.module != "itertools"]
        except tf2_step.NotTf2 as reason:
            tf.imports[:] = names_before
            title += f" (compat target: {reason})"
    edit = Edit(
        changes, title, add_imports=[*tf.imports, *add_imports],
        remove_imports=[*(feed.remove_imports if feed else ()), *helper_import(context, helper_name)], safety=FixSafety.UNSAFE,
    )
    return Planned(edit, fed=feed if feed is not None and feed.anchors else None, **kept)


def _region(loop: cst.For, parents, imports) -> _Loop:
    """The loop's gradients, the block it sits in and the `tower_grads = []` before it:
    [init] [wrapper] loop ... averaging ... apply, all in one block."""
    grads = _find_gradients(loop)
    if not _last_in_body(grads.append, loop, parents):
        raise Refused("statements follow the gradient collection in the loop body")
    outer: cst.CSTNode = loop
    while isinstance(parents[id(outer)], cst.IndentedBlock) and is_variable_scope_wrapper(
        parents[id(parents[id(outer)])], imports
    ):
        outer = parents[id(parents[id(outer)])]
    body = list(_block_of(outer, parents).body)
    at = next(k for k, s in enumerate(body) if s is outer)
    init = next(
        (s for s in reversed(body[:at]) if assigned_name(s) == grads.tower_list
         and isinstance(s.body[0].value, cst.List) and not s.body[0].value.elements),
        None,
    )
    return _Loop(grads, outer, body, at, init)


def _find_average_and_apply(found: _Loop) -> None:
    """`grads = helper(tower_grads)` then `opt.apply_gradients(grads, ...)`, or the two in one
    statement: `opt.apply_gradients(helper(tower_grads), ...)`; nothing else may read them."""
    grads = found.grads

    def is_averaging(call: cst.Call | None) -> bool:
        return (call is not None and isinstance(call.func, cst.Name) and len(call.args) == 1
                and code(call.args[0].value) == grads.tower_list)

    def is_apply(call: cst.Call | None, first_argument: str) -> bool:
        return (call is not None and method_call(call, "apply_gradients") and bool(call.args)
                and code(call.func.value) == grads.optimizer and code(call.args[0].value) == first_argument)

    for statement in found.body[found.at + 1:]:
        used = names_used(statement)
        if found.average is None:
            if grads.tower_list not in used:
                continue
            call = only_call(statement)
            inner = call.args[0].value if call is not None and call.args else None
            if isinstance(inner, cst.Call) and is_averaging(inner) and is_apply(call, code(inner)):
                found.average = found.apply = statement
                found.average_call = inner
                continue
            if not (is_averaging(call) and assigned_name(statement)):
                raise Refused(f"`{grads.tower_list}` is used after the loop other than by one averaging call")
            found.average, found.average_call, found.averaged = statement, call, assigned_name(statement)
        elif found.apply is None:
            if found.averaged not in used:
                continue
            if not is_apply(only_call(statement), found.averaged):
                raise Refused(f"the averaged gradients are used other than by `{grads.optimizer}.apply_gradients(...)`")
            found.apply = statement
        elif ({grads.tower_list, found.averaged} & used):
            raise Refused("the gradients are used again after apply_gradients")
    if found.average is None or found.apply is None:
        raise Refused(
            "no `grads = <helper>(tower_grads)` and `opt.apply_gradients(grads, ...)` (or "
            "`opt.apply_gradients(<helper>(tower_grads), ...)`) after the loop"
        )


def _refuse_leaks(loop: cst.For, found: _Loop) -> None:
    """Names the loop body binds that the code after it reads would vanish into the function."""
    bound_in_loop = {n for s in find(loop.body, cst.AssignTarget) for n in names_used(s.target)}
    after = set()
    for statement in found.body[found.body.index(found.apply) + 1:]:
        after |= names_used(statement)
    leaking = sorted((bound_in_loop & after) - {found.grads.loss})
    if leaking:
        raise Refused(f"the loop body defines {', '.join(f'`{n}`' for n in leaking)}, used after the loop")


def _step_statements(rule, loop: cst.For, found: _Loop, strategy: str, train_name: str, averages: bool,
                     tf: TfNames):
    """The replica function's body: the loop body, its gradients of the (scaled) loss applied
    there, the loss returned once the update ran."""
    grads, module = found.grads, rule.context.module
    scaled = (
        cst.parse_expression(f"{grads.loss} / {strategy}.num_replicas_in_sync") if averages
        else cst.Name(grads.loss)
    )
    new_compute = grads.compute.with_changes(
        args=[grads.compute.args[0].with_changes(value=scaled), *grads.compute.args[1:]]
    )
    if grads.compute_statement is not None:
        grads_name = assigned_name(grads.compute_statement)
    elif found.averaged is not None:
        grads_name = found.averaged
    else:  # averaged inside apply_gradients(...): the replica's gradients need a name
        grads_name = next(n for n in ("grads", "grads_and_vars", "replica_grads") if references(module, n) == 0)
    apply_call = only_call(found.apply)
    apply_statement = cst.parse_statement(
        f"{train_name} = " + code(apply_call.with_changes(
            args=[apply_call.args[0].with_changes(value=cst.Name(grads_name)), *apply_call.args[1:]]
        )) + "\n"
    )
    tail: list[cst.BaseStatement] = []
    if grads.compute_statement is None:
        tail.append(cst.parse_statement(f"{grads_name} = {code(new_compute)}\n"))
    tail.append(apply_statement)
    tail.append(cst.parse_statement(
        f"with {tf('tensorflow.control_dependencies')}([{train_name}]):\n"
        f"    return {tf('tensorflow.identity')}({grads.loss})\n"
    ))
    step_body = loop.body.visit(_RewriteBody(rule.imports, grads, new_compute, tail))
    return list(step_body.body)


def _step_input(rule, tower, found: _Loop, statements, index: str | None, strategy: str, fresh, tf: TfNames):
    """Towers reading their own shard of one dataset get one dataset distributed by the strategy;
    towers fed through their own placeholders a generator-backed one. Returns the input plan
    (None: the input stays as it is), the step's statements and why feeds stay per replica."""
    module, imports = rule.context.module, rule.imports
    parents = module_parents(rule.context)
    loop, outer, before = tower.loop, found.outer, found.body[:found.at]
    scope_owner = strategy_scope_owner(outer, parents, imports)
    owner = tower.owner if tower.owner is not None else module
    order: dict[int, int] = {}

    def after_loop(node: cst.CSTNode) -> bool:
        # Document order, computed only when a shard was found (plan runs on every tower
        # loop `check` sees, to know whether it is fixable).
        if not order:
            order.update((id(n), k) for k, n in enumerate(walk(owner)))
            order[-1] = max(order.get(id(n), -1) for n in walk(outer))
        return order.get(id(node), -1) > order[-1]

    feed = tower_input.plan(
        statements, index, before, owner, after_loop,
        strategy=strategy, tf=tf, tf_api=rule.call_name, fresh=fresh,
    )
    kept = {"feeds_kept": None, "split_kept": None}
    if feed is None:
        try:
            feed = tower_feeds.plan(
                statements, loop, before, owner, after_loop, strategy=strategy, tf=tf,
                tf_api=rule.call_name, fresh=fresh, imports=imports, module=module,
            )
        except tower_feeds.SplitUnmatched as reason:
            kept["split_kept"] = str(reason)
        except tower_feeds.Unmatched as reason:
            kept["feeds_kept"] = str(reason)
    if feed is not None and scope_owner is not None and all(
        contains(scope_owner, node) for node in (feed.initializer, *feed.anchors)
    ):
        return feed, feed.step_body(statements), kept
    if feed is not None and feed.anchors:
        reason = "the session loop is not inside the graph's `with` block that the strategy scope replaces"
        kept["split_kept" if isinstance(feed, tower_feeds.SplitFedInput) else "feeds_kept"] = reason
    return None, statements, kept


def _with_replica_index(statements, index: str | None, other_targets: set[str], tf: TfNames):
    """``statements`` with the loop variable bound to the replica index where they read it."""
    used_in_step = set().union(*(names_used(s) for s in statements)) if statements else set()
    if other_targets & used_in_step:
        raise Refused(f"the tower code uses the loop's device variable {sorted(other_targets & used_in_step)}")
    if not (index and index in used_in_step):
        return statements
    index_line = cst.parse_statement(
        f"{index} = " + REPLICA_INDEX.format(tf=tf_root(tf)) + "\n"
    ).with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(
        "# MirroredStrategy runs this once per replica; the replica index replaces the loop variable."
    ))])
    return [index_line, *statements]


def _region_changes(found: _Loop, feed, step: str, strategy: str, train_name: str, statements, tf: TfNames):
    """What replaces the statements of the region: the replica function and the one line that
    runs it in place of the loop; the averaging, the apply and `tower_grads = []` go."""
    loss, average, apply = found.grads.loss, found.average, found.apply
    # Comments above the statements that go stay with what replaces them.
    comments = [*(found.init.leading_lines if found.init is not None else ()), *found.outer.leading_lines]
    function = cst.FunctionDef(
        name=cst.Name(step), body=cst.IndentedBlock(body=statements),
        params=cst.Parameters(params=[cst.Param(cst.Name(feed.parameter))] if feed else []),
        leading_lines=[cst.EmptyLine(indent=False)] if feed else comments,
    )
    reduce_op = tf("tensorflow.distribute.ReduceOp.MEAN")
    replacement = [
        *(_lead([*feed.prelude, feed.iterator_statement], comments) + [function] if feed else [function]),
        cst.parse_statement(
            f"{loss} = {strategy}.reduce({reduce_op}, {strategy}.run({step}), axis=None)\n" if not feed else
            f"{loss} = {strategy}.reduce(\n"
            f"    {reduce_op}, {strategy}.run({step}, args=({feed.get_next},)), axis=None)\n"
        ).with_changes(leading_lines=[
            cst.EmptyLine(indent=False), *comment_lines(average), *(comment_lines(apply) if apply is not average else ()),
        ]),
        cst.parse_statement(f"{train_name} = {loss}.op\n"),
    ]
    region = {id(found.outer): cst.FlattenSentinel(replacement), id(average): cst.RemovalSentinel.REMOVE,
              id(apply): cst.RemovalSentinel.REMOVE}
    if found.init is not None:
        region[id(found.init)] = cst.RemovalSentinel.REMOVE
    if feed is not None:
        region[id(feed.initializer)] = cst.FlattenSentinel([feed.initializer, feed.initialize])
        region.update(feed.region)
    return region


def _unused_helpers(tower, module: cst.Module, average, anchor, helpers) -> dict:
    """The helpers only the loop used go with it: the averaging helper and the device functions."""
    changes = {}
    removed = [average] + [scope.device for scope in tower.scopes]
    for name, definition in [*helpers, *device_helpers(tower, module)]:
        if definition is None or definition is anchor:
            continue
        inside = sum(references(node, name) for node in removed)
        if references(module, name) - 1 - inside == 0:
            changes[definition] = cst.RemovalSentinel.REMOVE
    return changes


def _tf2(rule, module: cst.Module, changes: dict, anchor: cst.CSTNode, loop, feed, fresh, tf: TfNames):
    """The compat rewrite of ``anchor`` (``changes[anchor]``) made TF2, or NotTf2 with the reason."""
    from tfmigrate.rewrites import tf2_step

    if feed is None:
        raise tf2_step.NotTf2("the towers' input stays fed through placeholders, which TF2 does not have")
    if any(target.startswith("tensorflow.compat") for target in rule.imports.bindings.values()):
        raise tf2_step.NotTf2("the module imports tensorflow.compat.v1; the tf2 target writes against "
                              "`import tensorflow as tf`")
    compat = changes[anchor]
    resolve = rule.imports.resolve
    # TF1 model code first: it is the reason that matters most when there are several. What the
    # program keeps: the compat code, and the module without what that code replaces (the
    # anchor) or what the rewrite deletes (the helpers only the loop used).
    deleted = [node for node, change in changes.items() if change is cst.RemovalSentinel.REMOVE]
    compat_nodes = list(compat.nodes) if isinstance(compat, cst.FlattenSentinel) else [compat]
    tf2_step.check_api(compat_nodes, resolve, allowed=tf2_step.CONVERTED)
    tf2_step.check_api([module], resolve, skipped=[anchor, *deleted])
    tf2_step.check_loop(loop)
    if isinstance(compat, cst.FlattenSentinel):  # the strategy's creation, then the `with`
        create, scoped = compat.nodes
        converted = tf2_step.convert(scoped, loop, resolve=resolve, tf=tf, fresh=fresh, module=module)
        replacement, scope_body, new_nodes = cst.FlattenSentinel([create, converted]), converted, [create, converted]
    else:  # the function, its body under the scope
        converted = tf2_step.convert(compat, loop, resolve=resolve, tf=tf, fresh=fresh, module=module)
        replacement, scope_body, new_nodes = converted, converted.body, [converted]
    step_def = next(f for f in find(converted, cst.FunctionDef) if f.name.value == loop.step)
    # The module around was checked above; the new code must have lost what the conversion replaces.
    tf2_step.check_model_code(module, new_nodes, step_def, scope_body, loop.strategy, resolve)
    return replacement


def _lead(statements: list[cst.BaseStatement], comments) -> list[cst.BaseStatement]:
    """``statements`` with ``comments`` above the first one."""
    first = statements[0]
    return [first.with_changes(leading_lines=[*comments, *first.leading_lines]), *statements[1:]]


def comment_lines(statement: cst.CSTNode) -> list[cst.EmptyLine]:
    return [line for line in statement.leading_lines if line.comment is not None]


def tf_root(tf: TfNames) -> str:
    """The module's name for TensorFlow itself (`tf`), from a reference to one of its APIs."""
    return tf("tensorflow.identity").rsplit(".", 1)[0]


def device_helpers(tower, module: cst.Module) -> list[tuple[str, cst.FunctionDef | None]]:
    """Module-level functions called in the loop's device scopes (`assign_to_device(...)`)."""
    called = {
        call.func.value for scope in tower.scopes for call in find(scope.device, cst.Call)
        if isinstance(call.func, cst.Name)
    }
    defs = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    return [(name, defs.get(name)) for name in sorted(called) if name in defs]


def place_scope(outer, parents, imports, region, create, scope_item, prelude=(), made_first=(), ends_before=None):
    """Put the graph under ``strategy.scope()`` in place of the hand placement on the CPU.

    Prefers the `with` that opens the graph (`tf.Graph().as_default()`) or pins it to
    `/cpu:0`; otherwise the whole enclosing function body goes under the scope. Returns the
    node to replace and its replacement (with the loop region rewritten inside). The
    ``prelude`` statements (what the strategy's device list reads) go just before ``create``;
    the ``made_first`` statements of the block (a global step kept TF1's variable) go just
    before the scope opens, which then holds the rest of the block, up to the ``ends_before``
    statement of the block where one is given (see :func:`scope_ended`).
    """
    creates = [*prelude, create]
    node = strategy_scope_owner(outer, parents, imports)
    if made_first:
        region = {**region, **{id(statement): cst.RemovalSentinel.REMOVE for statement in made_first}}
    region, end = scope_ended(region, ends_before)
    if isinstance(node, cst.With) and (made_first or ends_before is not None):
        _, cpu = _graph_items(node, imports)
        items = _comma_separated([item for i, item in enumerate(node.items) if i not in cpu])
        rewritten = node.visit(ReplaceById(region))
        block = [*made_before_scope(made_first), *scoped_until(list(rewritten.body.body), end, scope_item,
                                                               rewritten.body)]
        creates[0] = creates[0].with_changes(leading_lines=node.leading_lines)
        if not items:  # the `with` only pinned the graph to the CPU
            return node, cst.FlattenSentinel([*creates, *block])
        opened = rewritten.with_changes(items=items, body=rewritten.body.with_changes(body=block), leading_lines=())
        return node, cst.FlattenSentinel([*creates, opened])
    if isinstance(node, cst.With):
        graph, cpu = _graph_items(node, imports)
        items = [item for i, item in enumerate(node.items) if i not in cpu]
        position = graph[-1] + 1 if graph else cpu[0]
        items.insert(position, scope_item)
        items = _comma_separated(items)
        rewritten = node.visit(ReplaceById(region)).with_changes(items=items)
        creates[0] = creates[0].with_changes(leading_lines=node.leading_lines)
        return node, cst.FlattenSentinel([*creates, rewritten.with_changes(leading_lines=())])
    if isinstance(node, cst.FunctionDef):
        body = list(node.body.visit(ReplaceById(region)).body)
        before = body[:1] if body and is_docstring(body[0]) else []
        rest = body[len(before):]
        reset = _graph_reset_after_plain_python(rest, imports)
        before, rest = [*before, *rest[:reset]], rest[reset:]
        while rest and runs_before_strategy(rest[0]):
            before, rest = [*before, rest[0]], rest[1:]
        return node, node.with_changes(body=node.body.with_changes(
            body=[*before, *creates, *made_before_scope(made_first), *scoped_until(rest, end, scope_item)]))
    raise Refused("the tower loop is at module level outside any `with` opening the graph: "
                  "move it into a function so the graph can be built under strategy.scope()")


def scope_ended(region: dict, ends_before: cst.BaseStatement | None) -> tuple[dict, cst.BaseStatement | None]:
    """``region`` with the ``ends_before`` statement (rewritten by it) marked by why the scope
    ends there, and that new statement (found again in the rewritten block by identity); the
    region as it is and None where the scope does not end early."""
    if ends_before is None:
        return region, None
    why = [cst.EmptyLine(comment=cst.Comment(f"# {line}")) for line in (
        "The strategy's scope ends here: under it, outside the replicas, a TF1 metric cannot be made;",
        "made after it, the metric counts what it counted.")]
    statement = ends_before.visit(ReplaceById(region))
    lines = list(statement.leading_lines)
    blank = next((i for i, line in enumerate(lines) if line.comment is not None), len(lines))
    marked = statement.with_changes(leading_lines=[*lines[:blank], *why, *lines[blank:]])
    return {**region, id(ends_before): marked}, marked


def scoped_until(body: list[cst.BaseStatement], end: cst.BaseStatement | None, scope_item: cst.WithItem,
                 block: cst.IndentedBlock | None = None) -> list[cst.BaseStatement]:
    """``body`` under `with <scope_item>:` up to the ``end`` statement, which follows the `with`
    with the rest (the whole body where ``end`` is None); the `with`'s block indented as
    ``block`` (the one the body came from) where given."""
    at = next((i for i, statement in enumerate(body) if statement is end), len(body))
    scoped = block.with_changes(body=body[:at]) if block is not None else cst.IndentedBlock(body=body[:at])
    return [cst.With(items=[scope_item], body=scoped), *body[at:]]


def _comma_separated(items: list[cst.WithItem]) -> list[cst.WithItem]:
    return [item.with_changes(comma=cst.MaybeSentinel.DEFAULT) for item in items]


def made_before_scope(statements) -> list[cst.BaseStatement]:
    """``statements`` (global steps) moved to just before the strategy's scope, said why."""
    if not statements:
        return []
    why = [cst.EmptyLine(comment=cst.Comment(f"# {line}")) for line in (
        "Made before the strategy's scope, the step stays TF1's variable: fetched with the update,",
        "it reads the count after it, as it did (a mirrored step would read the count before).")]
    first = statements[0]
    return [first.with_changes(leading_lines=[*why, *first.leading_lines]), *statements[1:]]


def _graph_reset_after_plain_python(statements: list, imports) -> int:
    """How many leading statements stay above the strategy because a `tf.reset_default_graph()`
    comes after plain Python only (`rng = np.random.RandomState(7)` first, GE2E style): the
    reset must not run under the strategy's scope ("Do not use tf.reset_default_graph() to clear
    nested graphs"). 0 when there is no such reset."""
    for index, statement in enumerate(statements):
        if resets_graph(statement):
            return index + 1
        if any((imports.resolve(node) or "").startswith("tensorflow") for node in find(statement, cst.Name, cst.Attribute)):
            return 0
    return 0


def resets_graph(statement: cst.CSTNode) -> bool:
    """`tf.reset_default_graph()`: what was built before it is gone, and a strategy's scope must
    not be open when it runs ("Do not use tf.reset_default_graph() to clear nested graphs")."""
    call = only_call(statement)
    return call is not None and method_call(call, "reset_default_graph")


def runs_before_strategy(statement: cst.CSTNode) -> bool:
    """Leading statements that stay above the strategy: `tf.reset_default_graph()` (a strategy
    scope must not be open when it runs), imports, and settings of the environment such as
    `os.environ['CUDA_VISIBLE_DEVICES'] = ...` (making the strategy starts the runtime, which
    reads them once)."""
    if isinstance(statement, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom))
                                                               for s in statement.body):
        return True
    if resets_graph(statement):
        return True
    text = code(statement)
    return isinstance(statement, cst.SimpleStatementLine) and ("os.environ" in text or "putenv" in text)


def _graph_items(node: cst.With, imports) -> tuple[list[int], list[int]]:
    """The items of a `with` that open the graph, and those that pin it to the CPU."""
    graph = [i for i, item in enumerate(node.items) if _is_graph_scope(item.item)]
    cpu = [i for i, item in enumerate(node.items)
           if device_scope_arg(item.item, imports) is not None
           and mentions_only_cpu(device_scope_arg(item.item, imports), imports)]
    return graph, cpu


def strategy_scope_owner(outer, parents, imports) -> cst.CSTNode | None:
    """What goes under ``strategy.scope()``: the nearest `with` around the loop that opens the
    graph or pins it to the CPU, else the enclosing function (or the module)."""
    node = parents[id(outer)]
    while node is not None and not isinstance(node, (cst.FunctionDef, cst.Module)):
        if isinstance(node, cst.With) and any(_graph_items(node, imports)):
            return node
        node = parents.get(id(node))
    return node


def _is_graph_scope(expression: cst.CSTNode) -> bool:
    return method_call(expression, "as_default")


def is_docstring(statement: cst.CSTNode) -> bool:
    return (isinstance(statement, cst.SimpleStatementLine) and isinstance(statement.body[0], cst.Expr)
            and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))
