"""Input queues a program builds by hand (TFM304), read as the batching call they amount to.

`tf.train.batch` is, inside, a queue, one enqueue op run by a QueueRunner, and a dequeue of
a batch. Public TF1 code often wrote those pieces out itself (tensorflow/models' resnet
`cifar_input`, the "reading data" lectures and blog posts):

    example_queue = tf.FIFOQueue(3 * batch_size, dtypes=[tf.float32, tf.int32], shapes=[[32, 32, 3], [1]])
    example_enqueue_op = example_queue.enqueue([image, label])
    tf.train.add_queue_runner(tf.train.QueueRunner(example_queue, [example_enqueue_op] * num_threads))
    images, labels = example_queue.dequeue_many(batch_size)

which is `images, labels = tf.train.batch([image, label], batch_size, num_threads=num_threads,
capacity=3 * batch_size, shapes=[[32, 32, 3], [1]])`: a `RandomShuffleQueue` makes it
`shuffle_batch` (its `min_after_dequeue` and `seed`), a `PaddingFIFOQueue` `dynamic_pad=True`,
`enqueue_many` `enqueue_many=True`, and `dequeue_up_to` `allow_smaller_final_batch=True`.
:func:`hand_built_queues` finds each such queue and the call it amounts to, and the pipeline
planner (``tfmigrate.rewrites.pipelines``) plans that call as it plans a batching call the
program wrote, at the dequeue's place; the queue's own statements go.

Recognised: the queue named on a line of its own, one enqueue op named on a line of its own,
one QueueRunner over them (registered with `add_queue_runner`, inline or by name) and one
dequeue of a batch, assigned or returned, all in one block (a function body or the module);
`sess.run(queue.close(...))` goes with them. The queue may be made in both branches of an
`if`/`else` (resnet: a RandomShuffleQueue to train, a FIFOQueue to evaluate): one batch, the
same `if` choosing the dataset's shuffle. Anything else done with the queue, its enqueue op
or its runner (a Python thread feeding it, `create_threads`, `queue.size()`) is refused, and
the reason is the queue's finding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import libcst as cst

from tfmigrate.cst.callargs import argument, has_star_args, unknown_keywords
from tfmigrate.cst.traversal import find, name_reads, names_used, scope_bindings, single_small
from tfmigrate.rewrites.queue_syntax import BATCH, SHUFFLE_BATCH, Blocked, assigned_names, assignment
from tfmigrate.tf_api import QUEUES

if TYPE_CHECKING:
    from tfmigrate.rule import Rule

#: The parameters of each queue class the rewrite reads.
QUEUE_PARAMS = {
    "FIFOQueue": ("capacity", "dtypes", "shapes", "names", "shared_name", "name"),
    "PaddingFIFOQueue": ("capacity", "dtypes", "shapes", "names", "shared_name", "name"),
    "RandomShuffleQueue": ("capacity", "min_after_dequeue", "dtypes", "shapes", "names", "seed", "shared_name", "name"),
}
RUNNER = ("tensorflow.train.QueueRunner", "tensorflow.train.queue_runner.QueueRunner")
ADD_RUNNER = ("tensorflow.train.add_queue_runner", "tensorflow.train.queue_runner.add_queue_runner")
_RUNNER_PARAMS = ("queue", "enqueue_ops", "close_op", "cancel_op", "queue_closed_exception_types", "queue_runner_def",
                  "import_scope")
_DEQUEUES = {"dequeue_many": False, "dequeue_up_to": True}  # -> allow_smaller_final_batch
_ENQUEUES = {"enqueue": False, "enqueue_many": True}  # -> enqueue_many


@dataclass
class HandBuiltQueue:
    """A queue the program fills with a QueueRunner and dequeues in batches."""

    queue_call: cst.Call  # `tf.FIFOQueue(...)` (the first, where an `if` chooses the queue)
    dequeue: cst.Call  # `queue.dequeue_many(batch_size)`: where the batch is taken
    batch_call: cst.Call | None = None  # the `tf.train.batch(...)` it amounts to (made here: in no module)
    qualified: str = BATCH
    statements: list[cst.BaseStatement] = field(default_factory=list)  # the queue's own: they go
    queue_calls: list[cst.Call] = field(default_factory=list)  # its constructors and its runner's calls
    blocker: str | None = None
    # `if mode == 'train': queue = tf.RandomShuffleQueue(...) else: queue = tf.FIFOQueue(...)`
    # (resnet's cifar_input): the `if`, and each branch's shuffle buffer (None: it does not shuffle).
    choice: cst.If | None = None
    shuffles: list[str | None] = field(default_factory=list)


class _Uses:
    """The uses of one name (the queue, its enqueue op, its runner) in the code that can see it."""

    def __init__(self, scope: cst.CSTNode, name: str) -> None:
        self.count = sum(1 for node in name_reads(scope, keywords=False) if node.value == name)
        self.calls = [call for call in find(scope, cst.Call) if isinstance(call.func, cst.Attribute)
                      and isinstance(call.func.value, cst.Name) and call.func.value.value == name]

    def methods(self, *names: str) -> list[cst.Call]:
        return [call for call in self.calls if call.func.attr.value in names]  # type: ignore[attr-defined]


@dataclass
class HandBuiltSearch:
    """What the search needs of the planner's survey."""

    rule: "Rule"
    calls: list[tuple[cst.Call, str]]
    place: Callable  # a call -> the block of its statement and its position there
    place_statement: Callable  # a statement -> the block it is in and its position there
    scope_of: Callable  # a statement -> the function (or module) it is in
    if_of: Callable  # a statement -> the `if` whose branch it is directly in
    code: Callable[[cst.CSTNode], str]

    def statement(self, call: cst.Call) -> cst.BaseStatement | None:
        where = self.place(call)
        return where[0][where[1]] if where is not None else None


def hand_built_queues(module: HandBuiltSearch) -> list[HandBuiltQueue]:
    """Every queue the module builds by hand, each with the batching call it amounts to or the
    reason it cannot be read as one (TFM304 gives it)."""
    found, seen = [], set()
    for call, qualified in module.calls:
        if qualified not in QUEUES or QUEUES[qualified] not in QUEUE_PARAMS or id(call) in seen:
            continue
        queue = HandBuiltQueue(call, call, queue_calls=[call])
        try:
            _read(module, queue)
        except Blocked as blocked:
            queue.blocker = str(blocked)
        seen |= {id(c) for c in queue.queue_calls}
        found.append(queue)
    return found


def _read(module: HandBuiltSearch, queue: HandBuiltQueue) -> None:
    """Fill ``queue`` in, or raise Blocked (``queue.dequeue`` stays the constructor until the
    dequeue is found: the refused pipeline is the constructor's)."""
    statement = module.statement(queue.queue_call)
    assigned = assignment(statement) if statement is not None else None
    if assigned is None or assigned[1] is not queue.queue_call or not isinstance(assigned[0], cst.Name):
        raise Blocked("name the queue on a line of its own (`queue = tf.FIFOQueue(...)`)")
    name = assigned[0].value
    scope = module.scope_of(statement)
    constructors = [(c, QUEUES[q]) for c, q in module.calls if q in QUEUES and _makes(module, c, name, scope)]
    queue.queue_calls = [c for c, _ in constructors]
    uses = _Uses(scope, name)
    enqueues, closes = uses.methods(*_ENQUEUES), uses.methods("close")
    runners = [c for c, q in module.calls if q in RUNNER and _names(argument(c, _RUNNER_PARAMS, "queue"), name)]
    if not enqueues:
        raise Blocked(f"nothing in this module enqueues into `{name}`")
    if not runners:
        raise Blocked("no `QueueRunner` fills the queue: a Python thread feeding it (`sess.run(enqueue_op, "
                      "feed_dict=...)`) has no one-to-one tf.data rewrite: `tf.data.Dataset.from_generator` over "
                      "what it feeds")
    if len(enqueues) != 1 or len(runners) != 1:
        raise Blocked("the queue is filled by more than one enqueue op or `QueueRunner` (readers interleaved: "
                      "`tf.data.Dataset.interleave`)")
    dequeues = uses.methods(*_DEQUEUES)
    if len(dequeues) != 1:
        raise Blocked("the queue is not dequeued in batches once (`dequeue_many` or `dequeue_up_to`): a queue "
                      "dequeued one element at a time (`dequeue()`) buffers what `.prefetch` buffers")
    queue.dequeue = dequeues[0]
    body, index, made = _where_made(module, queue, constructors)
    if uses.count != len(constructors) + len(dequeues) + len(enqueues) + len(closes) + 1:
        raise Blocked(f"`{name}` is used otherwise than to enqueue, run, dequeue and close it")
    enqueue_statement, op = _enqueue_statement(module, body, enqueues[0])
    statements = [*made, enqueue_statement]
    threads, runner_statements, runner_calls = _runner(module, runners[0], body, op)
    if queue.choice is not None:
        threads, counts = _chosen_thread_count(module, queue.choice, threads, scope)
        statements += counts
    statements += runner_statements
    statements += _close_statements(scope, closes)
    _check_dequeue(module, queue, body, index, statements)
    queue.statements = statements
    queue.queue_calls += [runners[0], *runner_calls]
    queue.qualified, queue.batch_call = _batch_call(module, queue, constructors, enqueues[0], threads)


def _check_dequeue(module: HandBuiltSearch, queue: HandBuiltQueue, body, index: int, statements) -> None:
    """The batch is taken on a line of its own, later in the block the queue is made in (where
    the dataset will be made), and what chose the queue still holds there."""
    where = module.place(queue.dequeue)
    if where is None or where[0] is not body or any(s is body[where[1]] for s in statements):
        raise Blocked("the queue is not dequeued in the block that makes it")
    if not _dequeue_statement(body[where[1]], queue.dequeue):
        raise Blocked("assign or return the dequeued batch on a line of its own")
    if queue.choice is not None:
        _check_choice_holds(queue.choice, body[index + 1:where[1]])


def _makes(module: HandBuiltSearch, call: cst.Call, name: str, scope: cst.CSTNode) -> bool:
    """``call`` is a queue constructor assigned to ``name`` on a line of its own in ``scope``."""
    statement = module.statement(call)
    assigned = assignment(statement) if statement is not None else None
    return (assigned is not None and assigned[1] is call and _names(assigned[0], name)
            and module.scope_of(statement) is scope)


def _where_made(module: HandBuiltSearch, queue: HandBuiltQueue, constructors) -> tuple[tuple, int, list]:
    """The block the queue is made in, the position there of its statement (or of the `if`
    that chooses it), and the constructors' statements."""
    made = [module.statement(c) for c, _ in constructors]
    if any(cls not in QUEUE_PARAMS for _, cls in constructors):
        raise Blocked("the queue is a `PriorityQueue`, which has no tf.data rewrite here")
    if len(made) == 1:
        body, index = module.place(constructors[0][0])
        return body, index, made
    top = module.if_of(made[0])
    if len(made) != 2 or top is None or not isinstance(top.orelse, cst.Else) or module.if_of(made[1]) is not top \
            or not any(s is made[0] for s in top.body.body) or not any(s is made[1] for s in top.orelse.body.body):
        raise Blocked("the queue is made in more places than the two branches of one `if`/`else`")
    if any(cls == "PaddingFIFOQueue" for _, cls in constructors):
        raise Blocked("an `if` chooses between a `PaddingFIFOQueue` and another queue")
    where = module.place_statement(top)
    if where is None:
        raise Blocked("the `if` that chooses the queue is not in a statement block")
    queue.choice = top
    return where[0], where[1], made


def _chosen_thread_count(module: HandBuiltSearch, choice: cst.If, threads: str, scope) -> tuple[str, list]:
    """`num_threads = 16` in each branch, read only by the runner: those lines go with the queue
    (the dataset reads in order, with or without parallel calls)."""
    counts = [s for branch in (choice.body, choice.orelse.body) for s in branch.body  # type: ignore[union-attr]
              if (a := assignment(s)) is not None and _names(a[0], threads)]
    if not counts:
        return threads, []
    if _Uses(scope, threads).count != len(counts) + 1:
        raise Blocked(f"`{threads}`, the runner's thread count, is read otherwise")
    return "1", counts


def _check_choice_holds(choice: cst.If, between) -> None:
    """The dataset tests the `if` again where the batch is taken: what it reads must not change."""
    tested = names_used(choice.test)
    changed = set().union(*(assigned_names(s) if isinstance(s, cst.SimpleStatementLine) else scope_bindings(s)
                            for s in [*choice.body.body, *choice.orelse.body.body, *between]))  # type: ignore[union-attr]
    if tested & changed:
        raise Blocked(f"`{sorted(tested & changed)[0]}`, which chooses the queue, changes before the batch is taken")


def _names(node: cst.BaseExpression | None, name: str) -> bool:
    return isinstance(node, cst.Name) and node.value == name


def _enqueue_statement(module: HandBuiltSearch, body, enqueue: cst.Call) -> tuple[cst.BaseStatement, str]:
    """`enqueue_op = queue.enqueue([...])` and the op's name."""
    where = module.place(enqueue)
    assigned = assignment(where[0][where[1]]) if where is not None else None
    if where is None or where[0] is not body or assigned is None or assigned[1] is not enqueue \
            or not isinstance(assigned[0], cst.Name):
        raise Blocked("name the enqueue op on a line of its own, in the block that makes the queue")
    op = assigned[0].value
    if _Uses(module.scope_of(body[where[1]]), op).count != 2:  # bound, and listed in the runner
        raise Blocked(f"the enqueue op `{op}` is used otherwise than by the queue's runner")
    return body[where[1]], op


def _runner(module: HandBuiltSearch, runner: cst.Call, body, op: str):
    """The runner's thread count, its statements, and its `add_queue_runner` call (if by name);
    ``op``: the queue's enqueue op, which the runner must run."""
    if has_star_args(runner) or unknown_keywords(runner, _RUNNER_PARAMS) or len(runner.args) != 2 \
            or argument(runner, _RUNNER_PARAMS, "enqueue_ops") is None:
        raise Blocked("the `QueueRunner` takes more than the queue and its enqueue ops")
    ops = argument(runner, _RUNNER_PARAMS, "enqueue_ops")
    threads = _thread_count(ops, op, module.code)
    where = module.place(runner)
    if where is None or where[0] is not body:
        raise Blocked("the `QueueRunner` is not made in the block that makes the queue")
    statement = body[where[1]]
    small = single_small(statement)
    if isinstance(small, cst.Expr) and _adds(module.rule, small.value, runner):
        return threads, [statement], [small.value]
    assigned = assignment(statement)
    if assigned is None or assigned[1] is not runner or not isinstance(assigned[0], cst.Name):
        raise Blocked("register the `QueueRunner` with `tf.train.add_queue_runner`")
    named = assigned[0].value
    uses = _Uses(module.scope_of(statement), named)
    adds = [s for s in body if isinstance(single_small(s), cst.Expr) and _adds(module.rule, single_small(s).value, named)]
    if uses.count != 2 or len(adds) != 1:
        raise Blocked(f"the `QueueRunner` `{named}` is used otherwise than registered with `tf.train.add_queue_runner` "
                      "(its threads started by `create_threads`, say)")
    return threads, [statement, adds[0]], [single_small(adds[0]).value]


def _adds(rule, value: cst.BaseExpression, runner: cst.Call | str) -> bool:
    """`tf.train.add_queue_runner(runner)`."""
    if not isinstance(value, cst.Call) or rule.call_name(value) not in ADD_RUNNER or len(value.args) != 1:
        return False
    given = value.args[0].value
    return given is runner if isinstance(runner, cst.Call) else _names(given, runner)


def _thread_count(ops: cst.BaseExpression | None, op: str, code) -> str:
    """`[enqueue_op]` -> "1", `[enqueue_op] * num_threads` -> "num_threads" (``op``: the enqueue op's name)."""
    count = "1"
    if isinstance(ops, cst.BinaryOperation) and isinstance(ops.operator, cst.Multiply):
        listed, other = (ops.left, ops.right) if isinstance(ops.left, cst.List) else (ops.right, ops.left)
        ops, count = listed, code(other)
    if not (isinstance(ops, cst.List) and len(ops.elements) == 1 and _names(ops.elements[0].value, op)):
        raise Blocked(f"the `QueueRunner`'s enqueue ops are not `[{op}]` or `[{op}] * num_threads`")
    return count


def _close_statements(scope: cst.CSTNode, closes: list[cst.Call]) -> list[cst.BaseStatement]:
    """`sess.run(queue.close(cancel_pending_enqueues=True))`: its statement, to go with the queue."""
    found = []
    for close in closes:
        for statement in find(scope, cst.SimpleStatementLine):
            small = single_small(statement)
            if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) and len(small.value.args) == 1 \
                    and small.value.args[0].value is close:
                found.append(statement)
                break
        else:
            raise Blocked("the queue is closed other than by `sess.run(queue.close(...))` on a line of its own")
    return found


def _dequeue_statement(statement: cst.BaseStatement, dequeue: cst.Call) -> bool:
    small = single_small(statement)
    assigned = assignment(statement)
    return (assigned is not None and assigned[1] is dequeue) or (isinstance(small, cst.Return) and small.value is dequeue)


def _batch_call(module: HandBuiltSearch, queue: HandBuiltQueue, constructors, enqueue: cst.Call, threads: str) -> tuple[str, cst.Call]:
    """The `tf.train.batch` (or `shuffle_batch`) call the queue and its dequeue amount to. Its
    spelling never reaches the program: the planner reads its arguments. Where an `if` chooses
    the queue, it is `batch`, and ``queue.shuffles`` says what each branch's queue shuffles."""
    settings: dict[str, str] = {}
    for ctor, cls in constructors:
        params = QUEUE_PARAMS[cls]
        if has_star_args(ctor) or unknown_keywords(ctor, params):
            raise Blocked(f"the `{cls}` takes arguments the rewrite cannot map")
        for unsupported in ("names", "shared_name"):
            if argument(ctor, params, unsupported) is not None:
                raise Blocked(f"a queue with `{unsupported}=` has no tf.data rewrite here")
        shapes = argument(ctor, params, "shapes")
        if settings.setdefault("shapes", module.code(shapes) if shapes is not None else "") != (
                module.code(shapes) if shapes is not None else ""):
            raise Blocked("the queues of the `if` hold different shapes")
        queue.shuffles.append(_shuffle(module, ctor, cls))
    if len(enqueue.args) != 1 or enqueue.args[0].keyword not in (None, "vals"):
        raise Blocked("the enqueue op takes more than the tensors it enqueues")
    dequeue = queue.dequeue
    if len(dequeue.args) != 1 or dequeue.args[0].keyword not in (None, "n"):
        raise Blocked("the dequeue takes more than the batch size")
    written = [module.code(enqueue.args[0].value), f"batch_size={module.code(dequeue.args[0].value)}",
               f"num_threads={threads}"]
    if settings["shapes"]:
        written.append(f"shapes={settings['shapes']}")
    if _ENQUEUES[enqueue.func.attr.value]:  # type: ignore[attr-defined]
        written.append("enqueue_many=True")
    if constructors[0][1] == "PaddingFIFOQueue":
        written.append("dynamic_pad=True")
    if _DEQUEUES[dequeue.func.attr.value]:  # type: ignore[attr-defined]
        written.append("allow_smaller_final_batch=True")
    if queue.choice is None and queue.shuffles[0] is not None:
        written.append(f"min_after_dequeue={queue.shuffles[0]}")
        return SHUFFLE_BATCH, cst.parse_expression(f"tf.train.shuffle_batch({', '.join(written)})")  # type: ignore[return-value]
    return BATCH, cst.parse_expression(f"tf.train.batch({', '.join(written)})")  # type: ignore[return-value]


def _shuffle(module: HandBuiltSearch, ctor: cst.Call, cls: str) -> str | None:
    """A RandomShuffleQueue's shuffle: its buffer (`min_after_dequeue`) and seed; None for a FIFO queue."""
    if cls != "RandomShuffleQueue":
        return None
    params = QUEUE_PARAMS[cls]
    buffer = argument(ctor, params, "min_after_dequeue")
    if buffer is None:
        raise Blocked("the `RandomShuffleQueue` has no `min_after_dequeue`")
    seed = argument(ctor, params, "seed")
    return module.code(buffer) + (f", seed={module.code(seed)}" if seed is not None else "")


def choice_statement(queue: HandBuiltQueue, dataset: str) -> cst.If:
    """`if mode == 'train': dataset = dataset.shuffle(...)`: the branches' queues, as the dataset shuffles."""
    assert queue.choice is not None
    branches = [f"{dataset} = {dataset}.shuffle({shuffle})" if shuffle is not None else "pass"
                for shuffle in queue.shuffles]
    code = cst.Module([]).code_for_node(queue.choice.test)
    text = f"if {code}:\n    {branches[0]}\n"
    if queue.shuffles[0] is None:
        text = f"if not ({code}):\n    {branches[1]}\n"
    elif queue.shuffles[1] is not None:
        text += f"else:\n    {branches[1]}\n"
    return cst.ensure_type(cst.parse_statement(text), cst.If)
