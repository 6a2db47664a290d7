"""Regularization losses in the towers, under MirroredStrategy.

A regularization loss is made once, when the first tower makes the variables. Made by
`tf.get_variable(regularizer=...)` (slim's `weights_regularizer`, a variable scope's
`regularizer`) it is evaluated again wherever it is read, so each replica's read reaches its
own copy of the weights (checked on TF 2.21). Made by a Keras-style layer argument
(`kernel_regularizer=`) it is a fixed tensor on replica 0's copy: a replica that reads every
term counts them in replica 0 once per replica, with the same value (`t * n -
stop_gradient(t) * (n - 1)`), so the summed update holds their gradient as the towers' average
did. Terms added to the collection by hand, or a module mixing both kinds, cannot be kept:
:func:`regularization_blocker` says why.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import module_tower_loops
from tfmigrate.analysis.training import module_functions
from tfmigrate.cst.callargs import argument, callee_name, method_call
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import ReplaceById, contains, find
from tfmigrate.rewrites.mirrored import REPLICA_INDEX, TfNames, is_docstring, references, tf_root
from tfmigrate.rewrites.tower_code import class_methods, line_of, loop_region, module_nodes, statement_lines

__all__ = ["REGULARIZATION_SCALE", "counted_per_replica", "counting_helper", "every_towers_regularization",
           "helpers_regularization", "regularization_blocker", "regularization_scale"]


# Layer arguments whose regularization loss is a tensor on the weights of the first tower that
# made the layer (Keras-style layers); `regularizer=`, `weights_regularizer=` and
# `biases_regularizer=` go through `tf.get_variable`, whose loss is re-read per replica.
_LAZY_REGULARIZERS = {"regularizer", "weights_regularizer", "biases_regularizer"}


# Every read regularization_blocker looks at spells one of these (an alias, where it is imported).
_READ_WORDS = ("get_total_loss", "REGULARIZATION_LOSSES", "get_regularization_loss")


def regularization_blocker(rule) -> str:
    """Why the module's regularization losses cannot be kept per replica (see
    :func:`tfmigrate.rewrites.replica_loop`'s training-state check), or ""."""
    if not rule.context.mentions(*_READ_WORDS):
        return ""  # no read of a regularization or total loss can be there
    fixed = _fixed_regularization(rule)
    scoped: list[cst.Call] = []  # reads by the tower's scope, and what they contain
    for node in module_nodes(rule):
        if isinstance(node, cst.Arg) or (fixed is not None and contains(fixed, node)):
            continue  # the collection written to is not a read of it
        if any(contains(call, node) for call in scoped):
            continue
        name = node.attr.value if isinstance(node, cst.Attribute) else (rule.imports.resolve(node.func) or "")
        if name.endswith("get_total_loss") and (isinstance(node, cst.Attribute) or _one_towers_total(node)):
            continue  # the call is what counts; one tower's total is each replica's own
        if isinstance(node, cst.Call) and id(node) in _after_loop_reads(rule) and _lazy_regularization(rule):
            return (f"line {line_of(rule, node)}: the loss after the tower loop reads the regularization losses, which "
                    "`tf.get_variable(regularizer=...)` makes to be evaluated where they are read: outside the replicas "
                    "they read a mirrored weight, which fails; add them to each tower's loss instead")
        if isinstance(node, cst.Call) and (_one_towers_regularization(rule, node) or id(node) in _handled_reads(rule)):
            scoped.append(node)
            continue
        if name.endswith("get_total_loss") or (fixed is not None and (
                name == "REGULARIZATION_LOSSES" or name.endswith(("get_regularization_loss", "get_regularization_losses")))):
            return f"line {line_of(rule, node)}: the loss reads the regularization losses, and {_regularization_why(rule, fixed)}"
    return ""


def _regularization_why(rule, fixed: cst.CSTNode | None) -> str:
    if fixed is None:
        return ("`get_total_loss()` sums every tower's losses made so far: under MirroredStrategy each replica "
                "would hold its own only (read them by the tower's scope: `get_total_loss(scope=scope)`)")
    if isinstance(fixed, cst.Call):  # `tf.add_to_collection(REGULARIZATION_LOSSES, term)`
        return (f"line {line_of(rule, fixed)} adds a term to them by hand: read without a scope, tower k's loss holds "
                "the terms of towers 0 to k, which replicas cannot reproduce (read them by the tower's scope)")
    return (f"line {line_of(rule, fixed)} makes regularization losses from the first tower's weights only: under "
            "MirroredStrategy the other replicas would not decay their copies (regularize through "
            "`tf.get_variable(regularizer=...)`, or add each tower's weight decay from the weights it reads)")


def _one_towers_total(call: cst.Call) -> bool:
    """`tf.losses.get_total_loss(scope=scope)` by the tower's name-scope value: that tower's
    losses and the regularization losses made under its scope (the first tower's, where the
    variables were made), as each replica's would be (verified on a YOLO-style probe: match)."""
    scope = argument(call, ("add_regularization_losses", "name", "scope"), "scope")
    return isinstance(scope, (cst.Name, cst.Attribute))


def _handled_reads(rule) -> frozenset[int]:
    """The ids of the reads of every term the rewrite handles, found once per module: those in a
    tower loop's body, which it counts per replica; and those in the code right after a tower
    loop (SiamFC: `total = mean(tower losses) + reg`), outside the replicas, where each
    replica's optimizer call differentiates the total by its own copy of the weights, replica
    0's reaching the terms once, as the legacy update did."""

    def compute() -> frozenset[int]:
        found: set[int] = set(_after_loop_reads(rule))
        for tower in module_tower_loops(rule.context):
            found |= {id(call) for call in every_towers_regularization(rule, tower.loop)}
            found |= {id(call) for reads in helpers_regularization(rule, tower.loop).values() for call in reads}
        return frozenset(found)

    return rule.context.memo("replica_loop.handled_reads", compute)


def _after_loop_reads(rule) -> frozenset[int]:
    """The ids of the reads of every term in the code right after a tower loop."""

    def compute() -> frozenset[int]:
        found: set[int] = set()
        for tower in module_tower_loops(rule.context):
            if tower.owner is not None:
                following = loop_region(rule.context, tower.loop, tower.owner, rule.imports).following
                found |= {id(call) for call in find(cst.IndentedBlock(body=statement_lines(following)), cst.Call)
                          if _reads_every_term(rule, call)}
        return frozenset(found)

    return rule.context.memo("tower_regularization.after_loop_reads", compute)


def _one_towers_regularization(rule, call: cst.Call) -> bool:
    """`tf.losses.get_regularization_losses(scope)`, `get_regularization_loss(scope)` or
    `tf.get_collection(tf.GraphKeys.REGULARIZATION_LOSSES, scope)` by the tower's name-scope
    value: the terms made under that tower's scope (the first tower's, where the variables were
    made; none for the others), as each replica's are. Replica 0's loss then holds the decay of
    its copy, and the replicas' summed shares are the legacy average (FaceNet-style probe: match)."""
    read = _regularization_read(rule, call)
    return read is not None and isinstance(read[1], (cst.Name, cst.Attribute))


def _reads_every_term(rule, call: cst.Call) -> bool:
    """A read of every regularization term: no scope (`get_collection` with its key alone)."""
    read = _regularization_read(rule, call)
    return read is not None and read[1] is None and (read[0] != "get_collection" or call.args[0].keyword is None)


def _regularization_read(rule, call: cst.Call) -> tuple[str, cst.BaseExpression | None] | None:
    """(The function, the scope argument or None) of a call that reads the regularization
    terms (`tf.losses.get_regularization_loss(es)`, `tf.get_collection(REGULARIZATION_LOSSES)`)."""
    name = (rule.imports.resolve(call.func) or "").rsplit(".", 1)[-1]
    if name in ("get_regularization_losses", "get_regularization_loss"):
        return name, argument(call, ("scope", "name"), "scope")
    if name == "get_collection" and call.args and "REGULARIZATION_LOSSES" in code(call.args[0].value):
        return name, argument(call, ("key", "scope"), "scope")
    return None


def _fixed_regularization(rule) -> cst.CSTNode | None:
    """Where the module makes a regularization loss that is not re-read per replica, if it does
    (found once per module: every check and edit of every tower asks)."""
    return rule.context.memo("tower_regularization.fixed", lambda: _find_fixed_regularization(rule))


def _find_fixed_regularization(rule) -> cst.CSTNode | None:
    if not rule.context.mentions("_regularizer", "REGULARIZATION_LOSSES"):
        return None
    for node in module_nodes(rule):
        if isinstance(node, cst.Attribute):
            continue
        if isinstance(node, cst.Arg):
            keyword = node.keyword.value if node.keyword is not None else ""
            if keyword.endswith("_regularizer") and keyword not in _LAZY_REGULARIZERS:
                return node
        elif method_call(node, "add_to_collection") or (rule.imports.resolve(node.func) or "").endswith("add_to_collection"):
            if any("REGULARIZATION_LOSSES" in code(a.value) for a in node.args[:1]):
                return node
    return None


def counted_per_replica(read: cst.Call) -> cst.BaseExpression:
    """A read of the regularization terms, each counted `regularization_scale` times in its gradient."""
    scale, tf_name = REGULARIZATION_SCALE, code(read.func).split(".", 1)[0]
    term = f"t * {scale} - {tf_name}.stop_gradient(t) * ({scale} - 1)"
    if code(read.func).rsplit(".", 1)[-1] == "get_regularization_loss":  # one tensor, not a list
        return cst.parse_expression(f"(lambda t: {term})({code(read)})")
    return cst.parse_expression(f"[{term} for t in {code(read)}]")


REGULARIZATION_SCALE = "regularization_scale"


def regularization_scale(tf: TfNames, run_by: str) -> cst.BaseStatement:
    """`regularization_scale`: the number of replicas in replica 0, 1 in the others (see
    :func:`every_towers_regularization`)."""
    index = REPLICA_INDEX.format(tf=tf_root(tf))
    text = f"{REGULARIZATION_SCALE} = {run_by}.num_replicas_in_sync if {index} == 0 else 1\n"
    if len(text) > 100:  # (in a helper, where the strategy is `tf.distribute.get_strategy()`)
        indent = " " * (len(REGULARIZATION_SCALE) + 4)
        text = f"{REGULARIZATION_SCALE} = ({run_by}.num_replicas_in_sync\n{indent}if {index} == 0 else 1)\n"
    line = cst.parse_statement(text)
    why = ["The regularization terms are tensors on replica 0's copy of the weights: only replica 0's",
           "loss reaches them, so it counts them once per replica (their value stays the same)."]
    return line.with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(f"# {w}")) for w in why])


def every_towers_regularization(rule, loop: cst.For) -> list[cst.Call]:
    """Reads of every regularization term in the tower body (`tf.losses.get_regularization_losses()`,
    `tf.get_collection(tf.GraphKeys.REGULARIZATION_LOSSES)`, `get_regularization_loss()`), in a
    module whose terms are Keras-style layer arguments (`kernel_regularizer=`): tensors made
    once, on replica 0's copy of the weights. Each tower added them all, so the legacy update
    holds their gradient once; a replica after the first reaches no copy of its own through
    them, so replica 0's count once per replica, with the same value: `t * n -
    stop_gradient(t) * (n - 1)`. Terms of `tf.get_variable(regularizer=...)` are read again per
    replica and need nothing: a module with both kinds stays refused."""
    if not isinstance(_fixed_regularization(rule), cst.Arg) or _lazy_regularization(rule):
        return []
    return [call for call in find(loop.body, cst.Call) if _reads_every_term(rule, call)]


def helpers_regularization(rule, loop: cst.For) -> dict[cst.FunctionDef, list[cst.Call]]:
    """The module functions (or methods of the class around the loop) the tower body calls, and
    that nothing else calls, that read every regularization term (`_tower_loss(...)` adding `tf.losses.get_regularization_losses()`,
    inception and EAST style), with those reads: counted per replica there, as in the body."""
    if not isinstance(_fixed_regularization(rule), cst.Arg) or _lazy_regularization(rule):
        return {}
    module = rule.context.module
    functions = module_functions(rule)
    methods = class_methods(rule, loop)
    found: dict[cst.FunctionDef, list[cst.Call]] = {}
    for call in find(loop.body, cst.Call):
        name = callee_name(call, receivers=("self",))
        helper = (functions if isinstance(call.func, cst.Name) else methods).get(name or "")
        if helper is None or references(module, helper.name.value) != 2:  # its def and this call
            continue
        reads = [read for read in find(helper, cst.Call) if _reads_every_term(rule, read)]
        if reads:
            found[helper] = reads
    return found


def counting_helper(helper: cst.FunctionDef, reads: list[cst.Call], tf: TfNames, edits: dict) -> cst.FunctionDef:
    """``helper`` counting the regularization terms it reads once per replica in replica 0, with
    the other ``edits`` (id(node) -> replacement) inside it."""
    counted = helper.visit(ReplaceById({**edits, **{id(read): counted_per_replica(read) for read in reads}}))
    scale = regularization_scale(tf, f"{tf('tensorflow.distribute.get_strategy')}()")
    body = list(counted.body.body)
    at = 1 if body and is_docstring(body[0]) else 0
    return counted.with_changes(body=counted.body.with_changes(body=[*body[:at], scale, *body[at:]]))


def _lazy_regularization(rule) -> bool:
    return any(isinstance(node, cst.Arg) and node.keyword is not None and node.keyword.value in _LAZY_REGULARIZERS
               for node in module_nodes(rule))
