"""The pieces a queue-pipeline plan (``tfmigrate.rewrites.pipelines``) is made of: the plan of one
pipeline, what its steps share (the batching call, the producer's arguments, the read, the
dataset's source), and the checks on the statements between the read and the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.cst.callargs import argument, has_star_args, is_false, is_true, unknown_keywords
from tfmigrate.cst.flow import reads_first
from tfmigrate.cst.traversal import find, names_used, scope_bindings
from tfmigrate.rewrites.queue_syntax import BATCH_PARAMS, Blocked, assigned_names, flat_target_names


@dataclass
class Pipeline:
    batch_call: cst.Call  # the batching call; for an index queue read alone, its `.dequeue()`
    producer_call: cst.Call | None = None
    blocker: str | None = None
    # Filled in when the pipeline can be rewritten:
    removed: list[cst.BaseStatement] = field(default_factory=list)
    replaced: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    renamed: dict[int, str] = field(default_factory=dict)  # a reader function's queue parameter (id) -> the record's name
    dropped: set[int] = field(default_factory=set)  # a batching helper's example parameters (ids) but the first
    groups: set[str] = field(default_factory=set)  # the reader functions and batching helpers it rewrites
    covers: set[int] = field(default_factory=set)  # the uses of them (Name nodes) that it rewrites
    before: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)  # an `if` (id) -> what goes before it
    # A queue the program built by hand (``queue_hand_built``): its constructor and its runner's calls, which go too.
    queue_calls: list[cst.Call] = field(default_factory=list)


@dataclass
class Batch:
    """One batching call and its statement: what the steps of ``_Planner._pipeline`` share."""

    call: cst.Call
    qualified: str
    params: tuple[str, ...]
    smaller: cst.BaseExpression | None  # `allow_smaller_final_batch`
    body: tuple[cst.BaseStatement, ...]  # the block the call is in
    index: int  # the position of its statement in ``body``
    statement: cst.BaseStatement
    outputs: cst.BaseExpression | None  # the assignment target; None for `return`
    tensors: list[cst.BaseExpression]  # the batched tensors, as passed
    returned: list[str]  # their code: names, a producer's element by position (`queue[1]`), a record's field
    as_tuple: bool  # batched as a list (`[image, label]`) rather than one name
    enqueue_many: bool  # each tensor is a batch of examples, not one
    threads: cst.BaseExpression | None  # `num_threads`

    @property
    def returned_names(self) -> set[str]:
        return set().union(*(names_used(tensor) for tensor in self.tensors))


@dataclass
class Definition:
    """A function of the module, or a method of one of its classes."""

    function: cst.FunctionDef
    owner: str | None  # the class
    bound: bool  # takes `self` (or `cls`) first


@dataclass
class ProducerArgs:
    """What the producer call asks for: its target and input, the epochs, the shuffling."""

    target: cst.BaseExpression
    source: cst.BaseExpression
    repeat: str  # `.repeat()` or `.repeat(E)`
    shuffle: bool
    seed_text: str  # `, seed=S` or ""
    int64: str  # how `tf.int64` is spelled here
    element_shape: cst.BaseExpression | None = None  # `input_producer(element_shape=...)`


@dataclass
class Read:
    """`key, value = reader.read(queue)`: where it is, the value's name and the reader."""

    index: int
    value_name: str
    reader_call: cst.Call | None  # the reader built inline: `tf.TFRecordReader().read(queue)`
    reader_name: str | None  # the reader by name: `reader.read(queue)`
    key: cst.BaseExpression  # where the record's key goes


@dataclass
class Source:
    """The dataset's source and its chain so far, and what the pipeline takes from the block."""

    text: str  # `tf.data.TFRecordDataset(files)`, ...
    params: list[str]  # what the `.map` function receives
    chain: list[str]  # `.shuffle(...)`, `.repeat(...)`, ...
    removed: list[cst.BaseStatement]  # the producer, the read, the reader
    tainted: set[str]  # the names holding what was read
    consumed: set[str]  # the queue and the reader: nothing else may use them
    rows: bool = False  # it yields the rows of what `enqueue_many=True` batched already
    # The call of a reader function as the map function runs it, given the record for the queue.
    rewritten: dict[int, cst.BaseStatement] = field(default_factory=dict)
    renamed: dict[int, str] = field(default_factory=dict)  # see Pipeline.renamed
    groups: set[str] = field(default_factory=set)  # see Pipeline.groups
    covers: set[int] = field(default_factory=set)  # see Pipeline.covers


def batch_arguments(call: cst.Call, qualified: str) -> tuple[tuple[str, ...], cst.BaseExpression | None]:
    """Check that the batching call's arguments map onto tf.data; its parameters and `allow_smaller_final_batch`."""
    short = qualified.rsplit(".", 1)[1]
    if qualified not in BATCH_PARAMS:
        raise Blocked(f"`{short}` has no one-to-one tf.data rewrite here (only `batch` and `shuffle_batch` are rewritten)")
    params = BATCH_PARAMS[qualified]
    if has_star_args(call) or unknown_keywords(call, params):
        raise Blocked("the batching call passes arguments the rewrite cannot map")
    dynamic_pad = argument(call, params, "dynamic_pad")
    if dynamic_pad is not None and not (is_true(dynamic_pad) or is_false(dynamic_pad)):
        raise Blocked("`dynamic_pad` is not a literal True/False")
    enqueue_many = argument(call, params, "enqueue_many")
    if enqueue_many is not None and not (is_true(enqueue_many) or is_false(enqueue_many)):
        raise Blocked("`enqueue_many` is not a literal True/False")
    if argument(call, params, "shared_name") is not None:
        raise Blocked("a shared batching queue (`shared_name=`) has no tf.data equivalent")
    smaller = argument(call, params, "allow_smaller_final_batch")
    if smaller is not None and not (is_true(smaller) or is_false(smaller)):
        raise Blocked("`allow_smaller_final_batch` is not a literal True/False")
    return params, smaller


def parse_statements(batch: Batch, source: Source, p: int) -> list[cst.BaseStatement]:
    """The statements between the producer and the batching call that work on what was read."""
    body, tainted = batch.body, source.tainted
    parse: list[cst.BaseStatement] = []
    for index in range(p + 1, batch.index):
        current = body[index]
        if current in source.removed:
            continue
        used = names_used(source.rewritten.get(id(current), current))  # as the map function will read it
        if used & source.consumed:
            raise Blocked("the input queue or reader is used by another statement")
        if used & tainted:
            # Python runs once while the map function is traced, as it did while the graph was built:
            # a loop over frames unrolls the same. What leaves the block (return, or a break of a loop around it) cannot move.
            loop = isinstance(current, (cst.For, cst.While))
            if not isinstance(current, (cst.SimpleStatementLine, cst.If, cst.With, cst.Try, cst.For, cst.While)) or find(
                    current, cst.Return, cst.Yield, cst.Global, cst.Nonlocal) or (not loop and find(current, cst.Break, cst.Continue)):
                raise Blocked("a statement between the read and the batching call that cannot move into the map "
                              "function (one that returns, or breaks or continues a loop around it)")
            changed = _outer_changes(current, tainted)
            if changed:
                raise Blocked(f"`{changed}` is made outside what would move into the map function and changed there "
                              "(it would hold the map function's tensors)")
            parse.append(current)
            moved = source.rewritten.get(id(current), current)  # what it binds as the map function runs it
            tainted |= assigned_names(moved) if isinstance(moved, cst.SimpleStatementLine) else scope_bindings(moved)
    check_pipeline_uses(batch, source.consumed, tainted)
    return parse


#: Methods that change the object they are called on.
_MUTATORS = frozenset({"append", "extend", "insert", "update", "add", "pop", "remove", "setdefault", "clear"})


def _outer_changes(statement: cst.BaseStatement, tainted: set[str]) -> str | None:
    """A list or dict made outside what was read that ``statement`` changes (`image_seq.append(image)`):
    in the map function it would be filled with the function's tensors, at trace time."""
    for call in find(statement, cst.Call):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in _MUTATORS and isinstance(func.value, cst.Name) \
                and func.value.value not in tainted and func.value.value not in scope_bindings(statement):
            return func.value.value
    return None


def check_pipeline_uses(batch: Batch, consumed: set[str], parse_names: set[str]) -> None:
    """The parsed tensors only feed the batch, and nothing of the pipeline is used after it."""
    call, body, b = batch.call, batch.body, batch.index
    if not batch.returned_names <= parse_names:
        raise Blocked("the batched tensors do not all come from the reader or producer")
    tensors = [*batch.tensors, argument(call, batch.params, "tensors")]
    if names_used(call, keywords=False) & (parse_names - batch.returned_names) or any(
        names_used(arg.value) & parse_names for arg in call.args if not any(arg.value is t for t in tensors)
    ):
        raise Blocked("the batching arguments depend on the parsed tensors")
    rebound = set(flat_target_names(batch.outputs) or []) if batch.outputs is not None else set()
    # Read again before being bound afresh (`_, loss = sess.run(...)` binds a parse's `_` anew).
    if reads_first(body[b + 1:], (parse_names | consumed) - rebound):
        raise Blocked("a tensor of the queue pipeline is used after the batching call")


def own_attribute(node: cst.BaseExpression) -> bool:
    """`self.x`."""
    return isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self"
