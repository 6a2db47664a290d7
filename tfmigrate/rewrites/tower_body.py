"""The tower loop's body as the replica function (part of :mod:`.replica_loop`).

The device scopes and `reuse_variables()` calls go (the strategy places each replica and
reuses replica 0's variables); the tower's index becomes the replica's; the names the code
around the loop shares with the body are declared `nonlocal` (`global` at module level), so
the last replica leaves its values where the last tower did; `tf.Variable`s say
`trainable=True`; and the collections read by the tower's scope are read as each replica
needs them (:class:`ReplicaBody`).
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import device_scope_arg
from tfmigrate.cst.callargs import with_keyword
from tfmigrate.cst.codegen import code
from tfmigrate.cst.flow import reads_first
from tfmigrate.cst.traversal import find, free_names, names_used, scope_bindings, single_small, target_names, walk
from tfmigrate.rewrites.mirrored import REPLICA_INDEX, TfNames, is_reuse_statement, tf_root
from tfmigrate.rewrites.refusal import Refused
from tfmigrate.rewrites.tower_averages import applied_per_replica, averages_applied
from tfmigrate.rewrites.tower_code import Region, Update, outside_statements, simple_statements
from tfmigrate.rewrites.tower_regularization import (
    counted_per_replica, every_towers_regularization, regularization_scale,
)
from tfmigrate.rewrites.tower_variables import variable_calls, variable_op_names


def made_trainable(call: cst.Call) -> cst.Call:
    """``call`` with `trainable=True` added as its last argument."""
    return with_keyword(call, "trainable", "True")


class ReplicaBody(cst.CSTTransformer):
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
        self.variables = variables  # ids of the `tf.Variable(...)` calls to say `trainable=True` (see made_trainable)
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
            return made_trainable(updated)
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

    def __init__(self, body: ReplicaBody):
        super().__init__()
        self.body = body

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        return _every_replica(updated) if self.body._tower_collection(original, _UPDATE_OPS) else updated

    def leave_SimpleStatementLine(self, original, updated):
        note = cst.EmptyLine(indent=True, comment=cst.Comment(
            "# Every replica's batch-norm updates (each replica updates its own copy of the statistics)."))
        return updated.with_changes(leading_lines=[note])


def replica_body(rule, tower, region: Region, update: Update, tf: TfNames, run_by: str,
                  source: str | None = None) -> tuple[list, dict]:
    """The replica function's statements, and the statements that read again after the
    strategy's call what every replica collected (see ReplicaBody), by the name they bind.
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
    replaced = {key: new for key, (_, new) in [*variable_op_names(rule, [tower]).items(),
                                               *applied_per_replica(averages_applied(rule, [loop.body]), tf).items()]}
    replica = ReplicaBody(scopes, in_body, rule.imports, tower_scopes, names_used(loop.target),
                           frozenset(variable_calls(rule)), reads, replaced, _replica_index(loop))
    body = loop.body.visit(replica)
    statements = [*update.first, *body.body, *update.statements]
    prelude = _loop_variables(rule, loop, statements, tf, _targets_read_after(region), source)
    if reads:
        prelude.append(regularization_scale(tf, run_by))
    return [*prelude, *statements], replica.rereads


def _replica_index(loop: cst.For) -> str | None:
    """The loop's index, which the replica function binds to the replica's (see
    :func:`_loop_variables`): `i` of `for i in range(n)` or `for i, d in enumerate(devices)`."""
    if is_range_index(loop, loop.target):
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
        binding = [s for s in loop.body.body if _assigns_to(single_small(s), name)]
        reads = sum(1 for node in walk(loop.body) if type(node) is cst.Name and node.value == name)
        if len(binding) == 1 and reads == 2 and binding[0] not in found:
            found.append(binding[0])
    return found


def _assigns_to(small: cst.CSTNode | None, name: str) -> bool:
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
    if is_range_index(loop, target):
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
            lines.append(f"{code(element)} = {source or indexable(iterable.args[0].value)}[{index.value}]")
    else:
        if names_used(target) & used:
            lines.append(f"{code(target)} = {source or indexable(iterable)}[{index_expression}]")
    statements = [cst.parse_statement(line + "\n") for line in lines]
    if statements:
        statements[0] = statements[0].with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(
            "# MirroredStrategy runs this once per replica; the replica index replaces the loop variable."))])
    return statements


def indexable(iterable: cst.BaseExpression) -> str:
    if isinstance(iterable, (cst.Name, cst.Attribute, cst.List, cst.Tuple, cst.Subscript)):
        return code(iterable)
    return f"list({code(iterable)})"


def shared_names(region: Region, body, update: Update) -> tuple[list[str], set[str]]:
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


def replica_function(region: Region, step: str, body, shared: list[str], tf: TfNames) -> cst.FunctionDef:
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


def is_enumerate_index(loop: cst.For, node: cst.CSTNode) -> bool:
    """Whether ``node`` is the index of `for i, x in enumerate(...)`."""
    target = loop.target
    return (isinstance(node, cst.Name) and isinstance(target, cst.Tuple) and len(target.elements) == 2
            and isinstance(target.elements[0].value, cst.Name) and target.elements[0].value.value == node.value
            and isinstance(loop.iter, cst.Call) and code(loop.iter.func) == "enumerate")


def is_range_index(loop: cst.For, node: cst.CSTNode) -> bool:
    """Whether ``node`` is the index of `for i in range(...)`."""
    return (isinstance(node, cst.Name) and isinstance(loop.target, cst.Name) and node.value == loop.target.value
            and isinstance(loop.iter, cst.Call) and code(loop.iter.func) in ("range", "xrange"))
