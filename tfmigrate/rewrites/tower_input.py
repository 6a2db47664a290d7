"""Part of the TFM101 rewrite: each tower reading its own shard of one tf.data pipeline
becomes one pipeline of the global batch that MirroredStrategy splits across the replicas.

The shape, in the tower loop's body (after the device scopes are gone)::

    shard = dataset.shard(NUM_GPUS, i).batch(PER_GPU_BATCH)      # map/prefetch/... around batch
    features, labels = tf.data.make_one_shot_iterator(shard).get_next()

with ``dataset`` assigned before the loop and one ``sess.run(tf.global_variables_initializer())``
after it, becomes::

    inputs = tf.compat.v1.data.make_initializable_iterator(strategy.experimental_distribute_dataset(
        dataset.batch(PER_GPU_BATCH * strategy.num_replicas_in_sync)))

    def tower_step(batch):
        features, labels = batch
        ...
    loss = strategy.reduce(..., strategy.run(tower_step, args=(inputs.get_next(),)), ...)
    ...
    sess.run(tf.global_variables_initializer())
    sess.run(inputs.initializer)

A step of the original reads element ``i + N * k`` of each global slice into replica ``i``; the
new one gives replica ``i`` the ``i``-th contiguous part of the same slice. Each step sees the
same examples, and the averaged gradient over them is the same. A distributed dataset cannot
be read through a one-shot iterator, hence the initializable one, initialised where the program
initialises its variables. Any other shape is left as it was (each replica keeps reading its
own shard, which trains the same): this is an improvement of the rewrite, never a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import libcst as cst

from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import find, names_used

# Dataset methods that may follow the shard: per-element or per-batch, order-preserving.
KEPT_METHODS = {"map", "batch", "prefetch", "repeat", "cache", "filter"}
INITIALIZERS = {"global_variables_initializer", "initialize_all_variables"}


@dataclass
class DistributedInput:
    iterator_statement: cst.BaseStatement  # `inputs = make_initializable_iterator(...)`
    parameter: str                         # the replica function's parameter: the replica's batch
    unpack: cst.BaseStatement              # `features, labels = batch`
    dropped: tuple[int, int]               # the tower statements it replaces (indexes)
    get_next: str                          # `inputs.get_next()`
    initializer: cst.BaseStatement         # the program's `sess.run(<variables initializer>)` (original)
    initialize: cst.BaseStatement          # `sess.run(inputs.initializer)`, to follow it
    # Used by tfmigrate.rewrites.tower_feeds, which also rewrites code outside the tower loop:
    prelude: tuple[cst.BaseStatement, ...] = ()  # statements before the iterator's (the dataset)
    region: dict[int, object] = field(default_factory=dict)  # id(node after the loop) -> replacement
    anchors: tuple[cst.CSTNode, ...] = ()  # nodes the rewrite changes, besides the initializer
    imports: tuple = ()                    # ImportItems the rewrite needs
    remove_imports: tuple = ()             # ImportItems it may leave unused (removed only if so)
    note: str = ""                         # what the fix title adds

    def step_body(self, statements: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """The replica function's statements: the batch unpacked in place of the tower's reads."""
        return [self.unpack] + [s for k, s in enumerate(statements) if k not in self.dropped]


def _single_assign(statement: cst.CSTNode) -> cst.Assign | None:
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        small = statement.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            return small
    return None


def _method(call: cst.CSTNode) -> str | None:
    if isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute):
        return call.func.attr.value
    return None


def _global_chain(expression: cst.BaseExpression, index: str, replicas: str) -> tuple[cst.BaseExpression, str] | None:
    """``dataset.shard(N, i).<methods>`` -> (``dataset.<methods>`` with the batch made
    global, the dataset's name), or None when it is not that shape."""
    chain: list[cst.Call] = []
    node = expression
    while _method(node) in KEPT_METHODS:
        chain.append(node)
        node = node.func.value
    if _method(node) != "shard" or not isinstance(node.func.value, cst.Name):
        return None
    args = node.args
    if len(args) != 2 or any(a.star for a in args) or names_used(args[1].value) != {index} \
            or not isinstance(args[1].value, cst.Name):
        return None
    batches = [call for call in chain if _method(call) == "batch"]
    size_arg = batches[0].args[0] if len(batches) == 1 and batches[0].args else None
    if size_arg is None or (size_arg.keyword is not None and size_arg.keyword.value != "batch_size"):
        return None
    rebuilt: cst.BaseExpression = node.func.value
    for call in reversed(chain):
        if call is batches[0]:
            size = call.args[0].value
            if not isinstance(size, (cst.Name, cst.Integer, cst.Attribute)):
                size = cst.parse_expression(f"({code(size)})")
            global_size = cst.parse_expression(f"{code(size)} * {replicas}")
            call = call.with_changes(args=[call.args[0].with_changes(value=global_size), *call.args[1:]])
        rebuilt = call.with_changes(func=call.func.with_changes(value=rebuilt))
    return rebuilt, node.func.value.value


def _reads_shard(value: cst.BaseExpression, shard: str, tf_api: Callable[[cst.Call], str | None]) -> bool:
    """``tf.data.make_one_shot_iterator(shard).get_next()`` or ``shard.make_one_shot_iterator().get_next()``."""
    if _method(value) != "get_next" or value.args:
        return False
    inner = value.func.value
    if not isinstance(inner, cst.Call):
        return False
    if _method(inner) == "make_one_shot_iterator" and not inner.args:
        return isinstance(inner.func.value, cst.Name) and inner.func.value.value == shard
    name = tf_api(inner) or ""
    return (name.endswith("data.make_one_shot_iterator") and len(inner.args) == 1
            and isinstance(inner.args[0].value, cst.Name) and inner.args[0].value.value == shard)


def _is_initializer(expression: cst.BaseExpression, tf_api) -> bool:
    return isinstance(expression, cst.Call) and (tf_api(expression) or "").rsplit(".", 1)[-1] in INITIALIZERS


def _variables_initializer(statement: cst.CSTNode, tf_api, initializer_names: set[str]) -> str | None:
    """The session expression of ``sess.run(tf.global_variables_initializer())`` (or of
    ``sess.run(init)`` with ``init = tf.global_variables_initializer()``), else None."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
            and isinstance(statement.body[0], cst.Expr)):
        return None
    call = statement.body[0].value
    if _method(call) != "run" or len(call.args) != 1 or call.args[0].keyword is not None:
        return None
    argument = call.args[0].value
    if not (_is_initializer(argument, tf_api)
            or (isinstance(argument, cst.Name) and argument.value in initializer_names)):
        return None
    return code(call.func.value)


def find_initializer(owner: cst.CSTNode, tf_api, after_loop) -> tuple[cst.BaseStatement, str] | None:
    """The one ``sess.run(<variables initializer>)`` statement after the loop, and its session
    expression (``sess``); None when there is none or more than one."""
    lines = find(owner, cst.SimpleStatementLine)
    initializer_names = {
        assign.targets[0].target.value for s in lines
        if (assign := _single_assign(s)) is not None and isinstance(assign.targets[0].target, cst.Name)
        and _is_initializer(assign.value, tf_api)
    }
    initializers = [
        (s, session) for s in lines
        if (session := _variables_initializer(s, tf_api, initializer_names)) is not None and after_loop(s)
    ]
    return initializers[0] if len(initializers) == 1 else None


def plan(
    statements: list[cst.BaseStatement], index: str | None, before: list[cst.BaseStatement],
    owner: cst.CSTNode, after_loop: Callable[[cst.CSTNode], bool], *, strategy: str, tf: Callable[[str], str],
    tf_api: Callable[[cst.Call], str | None], fresh: Callable[..., str],
) -> DistributedInput | None:
    """The distributed input for the tower code ``statements``, or None (leave it as it is).

    ``before``: the statements before the loop in its block (where the dataset must be made);
    ``owner``: the function (or module) holding the loop, searched for the initializer;
    ``after_loop(node)``: whether a node comes after the loop; ``fresh(*candidates)``: an unused name.
    """
    if index is None:
        return None
    replicas = f"{strategy}.num_replicas_in_sync"
    for k, statement in enumerate(statements[:-1]):
        shard_assign = _single_assign(statement)
        if shard_assign is None or not isinstance(shard_assign.targets[0].target, cst.Name):
            continue
        found = _global_chain(shard_assign.value, index, replicas)
        if found is None:
            continue
        chain, dataset = found
        shard = shard_assign.targets[0].target.value
        read = _single_assign(statements[k + 1])
        if read is None or not _reads_shard(read.value, shard, tf_api):
            return None
        later = statements[k + 2:]
        if any(shard in names_used(s) for s in later) or any(shard in names_used(s) for s in statements[:k]):
            return None
        if not any(
            (assign := _single_assign(s)) is not None and dataset in names_used(assign.targets[0].target)
            for s in before
        ):
            return None  # the dataset is not made before the loop, in the same block
        found = find_initializer(owner, tf_api, after_loop)
        if found is None:
            return None
        initializer, session = found
        iterator = fresh("inputs", "input_iterator", "replica_inputs")
        parameter = fresh("batch", "replica_batch")
        iterator_statement = cst.parse_statement(
            f"{iterator} = {tf('tensorflow.compat.v1.data.make_initializable_iterator')}"
            f"({strategy}.experimental_distribute_dataset(\n    {code(chain)}))\n"
        )
        comments = [line for s in statements[k:k + 2] for line in s.leading_lines if line.comment is not None]
        unpack = cst.parse_statement(f"{code(read.targets[0].target)} = {parameter}\n").with_changes(
            leading_lines=comments
        )
        return DistributedInput(
            iterator_statement=iterator_statement, parameter=parameter, unpack=unpack, dropped=(k, k + 1),
            get_next=f"{iterator}.get_next()", initializer=initializer,
            initialize=cst.parse_statement(f"{session}.run({iterator}.initializer)\n"),
        )
    return None
