"""Updates written by hand after the tower loop: they stay where they are, outside the replicas.

The towers compute gradients; the code after the loop (or the caller the gradients are
returned to) combines them as the program combines them and applies them with assignments of
its own: OpenAI's `adam_updates` (`p.assign(p - lr * g_t)`, moments and a step counter in
`tf.Variable`s), or a project optimizer whose `apply_gradients` assigns the weights itself
(BERT's `AdamWeightDecayOptimizer`). Outside the replicas, assigning a mirrored variable sets
every replica's copy, and reading one reads replica 0's, equal to the others: one update of
one set of weights, as the legacy program made (checked on TF 2.21; the BERT-style and
pixel-cnn-style programs match step by step). So the rewrite leaves all of it as written,
and only checks what it must not do outside the replicas.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from tfmigrate.analysis.optimizers import HandWritten, hand_written_update
from tfmigrate.analysis.training import (
    KNOWN_LIBRARIES, METADATA, gradient_computation, module_functions, optimizer_step, tensors_read, training_call,
    variable_update,
)
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import contains, find, name_reads, names_used, scope_bindings, target_names, walk
from tfmigrate.rewrites.refusal import Refused
from tfmigrate.rewrites.tower_code import (
    Region, Update, functions_called, left_by_towers, line_of, statements_reaching,
)

__all__ = ["kept_caller_update", "kept_update", "own_optimizer_steps"]


def kept_update(rule, region: Region) -> Update | None:
    """Gradients the towers compute, combined after the loop as the program combines them (an
    in-place sum, a helper) and applied by assignments written by hand (OpenAI's
    `adam_updates`: `p.assign(p - lr * g_t)`, its moments and step counter `tf.Variable`s; a
    project optimizer whose `apply_gradients` assigns the weights itself, BERT's
    `AdamWeightDecayOptimizer`): all of it stays after the loop, as written. Outside the
    replicas, assigning a mirrored variable sets every replica's copy, and reading one reads
    replica 0's, equal to the others: one update of one set of weights, as the legacy program
    made. None when the code after the loop assigns no variable from the towers' results."""
    loop = region.loop
    if training_call(rule, loop.body, gradient_computation) is None:
        return None
    filled = left_by_towers(loop)
    reaching = statements_reaching(region.following, filled)
    reached = filled.union(*(scope_bindings(statement) for statement in reaching))
    own_steps = own_optimizer_steps(rule, reaching)
    if not own_steps and not any(training_call(rule, statement, _assigns_variable) is not None for statement in reaching):
        if not any(_unknown_callee(rule, statement, reached) for statement in reaching):
            return None  # no update here at all: not this shape
    _check_hand_written(rule, reaching, reached, own_steps)
    return Update([], note=" (the hand-written update after the loop stays: outside the replicas an assignment "
                           "sets every replica's copy of a variable)")


def kept_caller_update(rule, region: Region, caller: Region) -> Update | None:
    """The towers' gradients, combined after the loop and returned to the caller (``caller``:
    the region around its call), which applies them with a project optimizer whose update
    assigns the weights itself (an ALBERT-style `main`: clip, `optimizer.apply_gradients`,
    count the step): all of it stays where it is, outside the replicas, as
    :func:`kept_update` keeps it after the loop. None for another shape."""
    if training_call(rule, region.loop.body, gradient_computation) is None:
        return None
    filled = left_by_towers(region.loop)
    inside = statements_reaching(region.following, filled)
    returned = scope_bindings(caller.loop)  # what the caller binds from the call
    reaching = statements_reaching(caller.following, returned)
    own_steps = own_optimizer_steps(rule, reaching)
    if not own_steps:
        return None
    reached = filled.union(returned, *(scope_bindings(statement) for statement in [*inside, *reaching]))
    _check_hand_written(rule, [*inside, *reaching], reached, own_steps)
    return Update([], note=" (the hand-written update in the caller stays: outside the replicas an assignment "
                           "sets every replica's copy of a variable)")


def _check_hand_written(rule, reaching: list, reached: set[str], own_steps: list[HandWritten]) -> None:
    """What the statements that carry the towers' gradients to a hand-written update must not do
    outside the replicas: compute gradients, step a TensorFlow optimizer, hand them to code that
    cannot be read, or read a variable the update changes with nothing ordering the two."""
    for statement in reaching:
        if training_call(rule, statement, gradient_computation) is not None:
            raise Refused(f"line {line_of(rule, statement)}: gradients are computed after the tower loop, outside the "
                          "replicas: under MirroredStrategy they would see one replica's copy of the weights")
        step = training_call(rule, statement, _steps_optimizer)
        if step is not None:
            raise Refused(f"line {line_of(rule, statement)}: `{code(step.func)}` updates through an optimizer inside, "
                          "outside the replicas, where a TF1 optimizer cannot run under MirroredStrategy")
        unknown = _unknown_callee(rule, statement, reached)
        if unknown is not None:
            raise Refused(f"line {line_of(rule, statement)}: the towers' gradients reach `{unknown}`, not defined in this "
                          "module (nor an optimizer call after the loop): what it does with them cannot be seen")
    for body in [*reaching, *functions_called(rule, reaching)]:
        _check_reads_ordered(rule, body)
    for optimizer in own_steps:
        _check_reads_ordered(rule, optimizer.node, optimizer.where and Path(optimizer.where).name)


def _check_reads_ordered(rule, body: cst.CSTNode, where: str | None = None) -> None:
    """Refused when ``body`` updates a variable (`t.assign_add(1)`) and reads it elsewhere
    (`tf.pow(mom1, t)` for Adam's bias correction) with nothing ordering the two: OpenAI's
    `adam_updates`. Which runs first is the runtime's choice; the legacy program's ran the read
    first, the migrated one's (resource variables, other ops) did not, and a pixel-cnn-style
    program trained differently from step 1. A read whose value feeds the update itself
    (`v.assign(mom1 * v + ...)`, `tt = t + 1; t.assign(tt)`) is ordered by it."""
    values: dict[str, list[cst.BaseExpression]] = {}
    for assign in find(body, cst.Assign):
        for target in assign.targets:
            for name in target_names(target.target):
                values.setdefault(name, []).append(assign.value)
    for augmented in find(body, cst.AugAssign):  # `update += weight_decay_rate * param`
        for name in target_names(augmented.target):
            values.setdefault(name, []).append(augmented.value)
    ordered = [w for w in find(body, cst.With) if any(
        isinstance(i.item, cst.Call) and code(i.item.func).endswith("control_dependencies") for i in w.items)]
    for call in find(body, cst.Call):
        update = variable_update(rule, call)
        if update is None or not isinstance(update[1], cst.Name) or any(contains(w, call) for w in ordered):
            continue
        variable, feeding = update[1].value, [arg.value for arg in call.args]
        names, pending = set(), [n for value in feeding for n in names_used(value)]
        while pending:  # what the update's value is computed from, through the body's assignments
            name = pending.pop()
            if name not in names:
                names.add(name)
                feeding += values.get(name, [])
                pending += [n for value in values.get(name, []) for n in names_used(value)]
        fed = {id(node) for value in feeding for node in walk(value)} | {id(update[1])} | _reads_of_no_value(rule, body)
        reads = name_reads(body, targets=False, skipped_attributes=METADATA)
        read = next((n for n in reads if n.value == variable and id(n) not in fed), None)
        if read is not None:
            at, updated = (f"in {where}", "there") if where else (f"line {line_of(rule, read)}", f"line {line_of(rule, call)}")
            raise Refused(f"{at}: the hand-written update reads `{variable}` while it updates it "
                          f"({updated}) with nothing ordering the two: which runs first is the runtime's "
                          "choice, and the migrated program's may choose otherwise than the legacy one's; put the update "
                          "under `tf.control_dependencies` of what reads it, then fix again")


def _reads_of_no_value(rule, body: cst.CSTNode) -> set[int]:
    """Ids of the nodes in ``body`` that read a variable for no value a step computes with: a
    Python test (`p is None`, `isinstance(g, ...)`), a shape (`tf.zeros_like(p)`), a new
    variable's initial value (run once, at initialization)."""
    harmless = []
    for node in find(body, cst.Comparison, cst.Call):
        if isinstance(node, cst.Comparison):
            if all(isinstance(c.operator, (cst.Is, cst.IsNot)) for c in node.comparisons):
                harmless.append(node)
        elif code(node.func) in ("isinstance", "len", "type") or (rule.imports.resolve(node.func) or "") in _SHAPE_ONLY:
            harmless.append(node)
        elif _own_update(rule, node) is not None:
            harmless += node.args  # handed to the optimizer's own update, whose reads are checked in it
    return {id(n) for node in harmless for n in walk(node)}


_SHAPE_ONLY = {"tensorflow.zeros_like", "tensorflow.ones_like", "tensorflow.Variable", "tensorflow.get_variable"}


def _assigns_variable(rule, call: cst.Call) -> bool:
    return variable_update(rule, call) is not None


def _steps_optimizer(rule, call: cst.Call) -> bool:
    """A TF optimizer's step (not one whose class assigns the weights itself)."""
    return optimizer_step(call) and _own_update(rule, call) is None


def _own_update(rule, call: cst.Call) -> HandWritten | None:
    """The project optimizer class whose own `apply_gradients`/`minimize` the step ``call`` runs."""
    if not (optimizer_step(call) and isinstance(call.func, cst.Attribute)):
        return None
    return rule.context.memo(("replica_loop.own_update", id(call)), lambda: hand_written_update(rule.context, call.func.value))


def own_optimizer_steps(rule, statements: list) -> list[HandWritten]:
    """The project optimizer classes with their own update that ``statements`` step."""
    return [found for statement in statements for call in find(statement, cst.Call)
            if (found := _own_update(rule, call)) is not None]


def _unknown_callee(rule, statement: cst.CSTNode, names: set[str]) -> str | None:
    """The first function ``statement`` hands ``names`` (or what it made of them) to that is
    neither the module's own nor a known library's, else None."""
    for call in find(statement, cst.Call):
        if not any(tensors_read(arg.value) & names for arg in call.args):
            continue
        if isinstance(call.func, cst.Name) and call.func.value in module_functions(rule):
            continue
        resolved = rule.imports.resolve(call.func)
        if resolved is not None and resolved.split(".")[0] not in KNOWN_LIBRARIES:
            return code(call.func)
    return None
