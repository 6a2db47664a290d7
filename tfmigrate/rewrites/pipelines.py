"""The queue-pipeline rewrite shared by TFM301, TFM302 and TFM303.

A TF1 queue input pipeline is spread over several statements that only make sense together:

    filename_queue = tf.train.string_input_producer(files, num_epochs=E, shuffle=False)   # TFM302
    reader = tf.TFRecordReader()
    _, serialized = reader.read(filename_queue)
    image, label = decode(serialized)                                                      # parse
    images, labels = tf.train.shuffle_batch([image, label], batch_size=B, capacity=C,
                                            min_after_dequeue=M, num_threads=T)            # TFM303
    ...
    coord = tf.train.Coordinator()                                                         # TFM301
    threads = tf.train.start_queue_runners(sess=sess, coord=coord)                          # TFM301

so the analysis is done once per module (``module_plan``) and yields one ``Edit`` that rewrites
every pipeline it recognises into ``tf.data`` and, when no queue input is left afterwards, removes
the Coordinator / ``start_queue_runners`` scaffolding. The three rules attach that same edit to
their findings (whichever is applied first makes the others disappear), and say what blocks the
rewrite where there is no edit.

Recognised, within one block of statements (a function body or the module; the blocks of
`with tf.name_scope(...)`, variable scopes and device scopes count as part of the block around
them, see ``_Survey.flat``):

- a producer: ``q = string_input_producer(files, num_epochs, shuffle, seed)`` read by a
  ``TFRecordReader()``, ``TextLineReader()`` or ``FixedLengthRecordReader(record_bytes, ...)``
  (``k, v = reader.read(q)``, the reader on its own line or inline), or
  ``a, b = slice_input_producer([x, y], num_epochs, shuffle, seed)`` (or the list kept under one
  name and read by position), or an index or row queue the program dequeues
  (``i = range_input_producer(n).dequeue()``, ``row = input_producer(rows).dequeue()``);
- the statements between the read and the batching call that depend on what was read: they
  become the body of a nested ``def _parse(...)`` used by ``.map`` (the others stay where they
  are);
- ``tf.train.batch`` / ``tf.train.shuffle_batch`` over those tensors, assigned or returned
  (``enqueue_many=True`` over ``tf.constant``s made in the block needs no producer).

Across functions, as public TF1 code splits a pipeline (each function rewritten once for all
its callers, or not at all: ``_Planner._settle``):

- a reader function given the queue (``read_and_decode(filename_queue)``, cifar10's
  ``read_cifar10``) decodes the record it is given instead, its call running in the map;
- a batching helper given the examples (cifar10's ``_generate_image_and_label_batch``) is given
  their dataset instead;
- a function that makes its own queue and returns its examples (``read_and_decode(filename)``)
  returns their dataset, which the caller batches;
- a reader function that batches too (``read_and_decode(filename_queue, batch_size)``) is given
  the dataset of the queue's records.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Sequence

import libcst as cst

from tfmigrate.cst.callargs import argument, has_star_args, is_false, is_none, is_true, unknown_keywords
from tfmigrate.cst.flow import reads_first
from tfmigrate.cst.traversal import (
    blank_lines_unindented, enclosing, find, fresh_name, module_parents, names_used, single_small,
)
from tfmigrate.cst.walker import visit_read_only
from tfmigrate.rewrites.queue_syntax import (
    BATCH_PARAMS, DEQUEUED_PARAMS, PRODUCER_PARAMS, RANGE_PRODUCER, READERS, SCOPES, SHUFFLE_BATCH, SLICE_PRODUCER,
    START_QUEUE_RUNNERS, STATEFUL, WHOLE_FILE, Blocked, assigned_names, assignment, batched_tensors,
    check_read_by_position, dequeue_of, flat_target_names, plain_target, queue_line,
)
from tfmigrate.rewrites.queue_functions import AcrossFunctions
from tfmigrate.rewrites.queue_hand_built import HandBuiltQueue, HandBuiltSearch, choice_statement, hand_built_queues
from tfmigrate.rewrites.queue_parts import (
    Batch, Definition, Pipeline, ProducerArgs, Read, Source, batch_arguments, own_attribute, parse_statements,
)
from tfmigrate.rewrites.queue_scaffolding import ScaffoldPlan, Scaffolding
from tfmigrate.rule import Edit, FixSafety, ImportItem
from tfmigrate.tf_api import COORDINATORS, QUEUE_INPUT

if TYPE_CHECKING:
    from tfmigrate.rule import Rule

FIX_TITLE = "rewrite the queue input pipeline with tf.data"
#: What makes a SparseTensor in a parse (see ``_Planner._check_dense``).
_SPARSE_MAKERS = ("VarLenFeature", "SparseFeature", "SparseTensor", "deserialize_many_sparse")
_TO_DENSE = ("sparse_tensor_to_dense", "to_dense", "sparse_to_dense")


@dataclass
class ModulePlan:
    pipelines: list[Pipeline]
    scaffolding_blocker: str | None
    edit: Edit | None  # every rewritable pipeline, and the scaffolding when it can go
    scaffolding_included: bool = False

    def pipeline_of(self, call: cst.Call) -> Pipeline | None:
        for pipeline in self.pipelines:
            if call is pipeline.batch_call or call is pipeline.producer_call or any(call is c for c in pipeline.queue_calls):
                return pipeline
        return None


def module_plan(rule: "Rule") -> ModulePlan:
    """The module's pipeline rewrite, computed once per file for all three rules."""
    return rule.context.memo("tfmigrate.rewrites.pipelines", lambda: _Planner(rule).plan())


# --- small syntax helpers ---------------------------------------------------------------

class _Survey(cst.CSTVisitor):
    """One walk of the module: every statement block, and for each call the block statement it
    is in; every call with its resolved name; every Name node; whether tf.data is used; for each
    statement, the function it is in and the `if` whose branch it is directly in."""

    def __init__(self, rule: "Rule") -> None:
        self.rule = rule
        self.of_call: dict[int, tuple[tuple[cst.BaseStatement, ...], int]] = {}
        self.calls: list[tuple[cst.Call, str]] = []
        self.names: list[cst.Name] = []
        self.uses_tf_data = False
        self._where: dict[int, tuple[tuple[cst.BaseStatement, ...], int]] = {}
        self._stack: list[tuple[tuple[cst.BaseStatement, ...], int]] = []
        self.scopes: set[int] = set()  # the `with` statements that only name, scope or place ops (see ``flat``)
        self.function_of: dict[int, cst.FunctionDef] = {}  # a statement -> the function it is in
        self.if_of: dict[int, cst.If] = {}  # a statement directly in a branch, or an `elif` -> its `if`
        self._functions: list[cst.FunctionDef] = []

    def _record(self, body: Sequence[cst.BaseStatement]) -> None:
        block = tuple(self.flat(body))
        if block and id(block[0]) in self._where:  # a scope's block, seen as part of the block around it
            return
        for index, statement in enumerate(block):
            self._where[id(statement)] = (block, index)

    def flat(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """``body`` with the statements of its `with tf.name_scope(...)` (variable scope, device)
        blocks in their place: such a scope names and places ops, it does not order them, and an
        input pipeline often runs into and out of one (cifar10's `data_augmentation`)."""
        flat: list[cst.BaseStatement] = []
        for statement in body:
            if isinstance(statement, cst.With) and self.scope_only(statement):
                self.scopes.add(id(statement))
                flat.extend(self.flat(statement.body.body))
            else:
                flat.append(statement)
        return flat

    def scope_only(self, statement: cst.With) -> bool:
        for item in statement.items:
            qualified = self.rule.call_name(item.item) or ""
            if not (qualified.startswith("tensorflow.") and qualified.rsplit(".", 1)[1] in SCOPES):
                return False
        return isinstance(statement.body, cst.IndentedBlock)

    def place(self, statement: cst.CSTNode | None) -> tuple[tuple[cst.BaseStatement, ...], int] | None:
        """The block ``statement`` is in (seen through scopes) and its position there."""
        return self._where.get(id(statement))

    def on_visit(self, node: cst.CSTNode) -> bool:
        kind = type(node)
        if kind is cst.Module or kind is cst.IndentedBlock:
            self._record(node.body)
            if self._functions:
                for statement in node.body:
                    self.function_of[id(statement)] = self._functions[-1]
        elif kind is cst.FunctionDef:
            self._functions.append(node)
        elif kind is cst.If:
            branches = [node.body, node.orelse.body] if isinstance(node.orelse, cst.Else) else [node.body]
            for branch in branches:
                for statement in branch.body:
                    self.if_of[id(statement)] = node
            if isinstance(node.orelse, cst.If):
                self.if_of[id(node.orelse)] = node
        where = self._where.get(id(node))
        if where is not None:
            self._stack.append(where)
        if kind is cst.Call:
            if self._stack:
                self.of_call[id(node)] = self._stack[-1]
            qualified = self.rule.call_name(node)
            if qualified is not None:
                self.calls.append((node, qualified))
                if qualified.startswith("tensorflow.data."):
                    self.uses_tf_data = True
        elif kind is cst.Name:
            self.names.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if id(original_node) in self._where:
            self._stack.pop()
        if type(original_node) is cst.FunctionDef:
            self._functions.pop()


# --- the analysis -----------------------------------------------------------------------


class _Planner(AcrossFunctions):
    def __init__(self, rule: "Rule") -> None:
        self.rule = rule
        self.module = rule.context.module
        self.blocks = self.calls = _Survey(rule)
        visit_read_only(self.module, self.blocks)
        self._refs: dict[str, str] = {}  # a TensorFlow API's full name -> its spelling here
        self._taken: dict[int, set[str]] = {}  # a function (or the module) -> the names in it, and those given there
        self._handed: dict[int, Pipeline] = {}  # a batching helper's call -> its caller's pipeline
        self._helper_names: dict[int, str] = {}  # a batching helper -> the name its dataset parameter takes
        self._defined: list[Definition] | None = None
        self._branch_datasets: dict[int, tuple[list[cst.BaseStatement], str, list[str]]] = {}  # an `if` -> its dataset
        self._examples_plans: dict[int, tuple[Pipeline, list[str], bool] | Blocked] = {}  # a function returning examples -> its rewrite
        self._hand_built: dict[int, HandBuiltQueue] = {}  # the batching call a hand-built queue amounts to -> the queue
        self.imports: list = []

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node).strip()

    def ref(self, target: str) -> str:
        """How this module spells a TensorFlow API (``target``: its full name), once per name."""
        if target not in self._refs:
            expression, imports = self.rule.tf_ref(target)
            for item in imports:
                if item not in self.imports:
                    self.imports.append(item)
            self._refs[target] = self.module.code_for_node(expression)
        return self._refs[target]

    # -- plan --
    def plan(self) -> ModulePlan:
        pipelines = []
        batching = [(call, qualified) for call, qualified in self.calls.calls if qualified in BATCH_PARAMS or (
            qualified.startswith("tensorflow.train.") and qualified.rsplit(".", 1)[1] in (
                "batch_join", "shuffle_batch_join", "maybe_batch", "maybe_shuffle_batch", "maybe_batch_join", "maybe_shuffle_batch_join",
            ))]
        survey = HandBuiltSearch(self.rule, self.calls.calls, lambda node: self.blocks.of_call.get(id(node)),
                                 self.blocks.place, self._scope_of, self._if_of, self.code)
        for queue in hand_built_queues(survey):
            if queue.blocker is not None:
                pipelines.append(Pipeline(batch_call=queue.dequeue, blocker=queue.blocker, queue_calls=queue.queue_calls))
                continue
            # The batching call is planned at the dequeue's place, as if the program had written it there.
            self.blocks.of_call[id(queue.batch_call)] = self.blocks.of_call[id(queue.dequeue)]
            self._hand_built[id(queue.batch_call)] = queue
            batching.append((queue.batch_call, queue.qualified))
        for call, qualified in batching:
            pipeline = Pipeline(batch_call=call)
            queue = self._hand_built.get(id(call))
            if queue is not None:
                pipeline.queue_calls = queue.queue_calls
            top = self._deciding_if(call)
            if top is not None:
                pipeline.groups.add(f"the `if` on line {self.rule.position(top).start.line}")
            try:
                self._pipeline(pipeline, qualified)
                if queue is not None:
                    self._keep_lines_above(pipeline, queue)
            except Blocked as blocked:
                pipeline.blocker = str(blocked)
                self._link_producer(pipeline)
            pipelines.append(pipeline)
        pipelines += self._handed.values()
        self._settle(pipelines)
        batched = {id(p.producer_call) for p in pipelines if p.blocker is None}
        for call, qualified in self.calls.calls:
            if qualified in DEQUEUED_PARAMS and id(call) not in batched:
                dequeued = self._dequeued(call)
                if dequeued is not None:  # first: the producer's own pipeline, where a batch pipeline over it is refused
                    pipelines.insert(0, self._dequeued_pipeline(call, qualified, *dequeued))
        rewritable = [p for p in pipelines if p.blocker is None]
        covered = {id(p.batch_call) for p in rewritable} | {id(p.producer_call) for p in rewritable} | {
            id(c) for p in rewritable for c in p.queue_calls}
        scaffolding_blocker = None
        remaining = [
            qualified for call, qualified in self.calls.calls
            if qualified in QUEUE_INPUT and qualified != START_QUEUE_RUNNERS and id(call) not in covered
            and qualified not in COORDINATORS
        ]
        scaffolding = None
        if remaining:
            short = sorted({q.rsplit(".", 1)[1] for q in remaining})
            scaffolding_blocker = (
                f"queue input remains that the fix does not rewrite ({', '.join(f'`{s}`' for s in short)}); "
                "the threads can only go once every queue is a tf.data pipeline"
            )
        elif not rewritable and not self.calls.uses_tf_data:
            scaffolding_blocker = (
                "the queues these threads run are built in another module; migrate that input to tf.data first"
            )
        else:
            try:
                scaffolding = Scaffolding(self.calls, self.module).plan()
            except Blocked as blocked:
                scaffolding_blocker = str(blocked)
        edit = None
        if rewritable or scaffolding is not None:
            edit = Edit(
                _RewrittenModule(self.module, _Rewrite(rewritable, scaffolding, self.blocks.scopes)), FIX_TITLE, add_imports=self.imports,
                remove_imports=self._from_imports(rewritable), safety=FixSafety.UNSAFE,
            )
        return ModulePlan(pipelines, scaffolding_blocker, edit, scaffolding is not None)

    # -- an index queue read alone: `i = tf.train.range_input_producer(n).dequeue()` --
    def _dequeued(self, call: cst.Call) -> tuple[cst.Call, int] | None:
        """The `.dequeue()` of the producer's queue and the index of its statement in the
        producer's block: called right away (`i = producer(n).dequeue()`), or the queue named
        on a line of its own and dequeued once, later in the block (`q = producer(n)`, then
        `i = q.dequeue()`, the queue's name read nowhere else)."""
        if id(call) not in self.blocks.of_call:
            return None
        body, index = self.blocks.of_call[id(call)]
        assigned = assignment(body[index])
        if assigned is not None and dequeue_of(assigned[1], lambda queue: queue is call):
            return assigned[1], index
        if assigned is None or assigned[1] is not call or not isinstance(assigned[0], cst.Name):
            return None
        queue = assigned[0].value
        if sum(1 for n in self.calls.names if n.value == queue) != 2:  # bound here, read once
            return None
        for later in range(index + 1, len(body)):
            read = assignment(body[later])
            if read is not None and dequeue_of(read[1], lambda q: isinstance(q, cst.Name) and q.value == queue):
                return read[1], later
        return None

    def _dequeued_pipeline(self, call: cst.Call, qualified: str, dequeue: cst.Call, index: int) -> Pipeline:
        """A producer's queue the program dequeues itself, element by element (the PTB
        tutorial's reader: `i = range_input_producer(epoch_size).dequeue()`, one window of the
        data per step; `row = input_producer(rows).dequeue()`): a dataset of the same
        elements, repeated (and shuffled) as the producer did, read by a one-shot iterator.
        ``dequeue`` and ``index``: what :meth:`_dequeued` found."""
        pipeline = Pipeline(batch_call=dequeue, producer_call=call)
        body, produced = self.blocks.of_call[id(call)]
        try:
            pipeline.removed = queue_line(body, produced, index, call)
            producer = self._producer_args(body[index], call, qualified)
        except Blocked as blocked:
            pipeline.blocker = str(blocked)
            return pipeline
        name, chain = self._dequeued_chain(producer, qualified)
        iterator = self.ref("tensorflow.compat.v1.data.make_one_shot_iterator")
        target = self.code(assignment(body[index])[0])
        dataset_name = self._free(name, body[index])
        lines = "\n".join(f"    {piece}" for piece in chain)
        dataset = cst.parse_statement(f"{dataset_name} = (\n{lines}\n)\n").with_changes(leading_lines=body[index].leading_lines)
        consume = cst.parse_statement(f"{target} = {iterator}({dataset_name}).get_next()\n").with_changes(
            trailing_whitespace=body[index].trailing_whitespace)
        pipeline.replaced = {id(body[index]): [dataset, consume]}
        return pipeline

    def _dequeued_source(self, body, p: int, b: int, call: cst.Call, qualified: str) -> Source:
        """An index or row queue the program dequeues itself, then works on what it read and
        batches it (`idx = index_queue.dequeue()`, `row = tf.gather(table, idx)`, then
        `tf.train.batch([row], ...)`): the producer's dataset, mapped and batched."""
        found = self._dequeued(call)
        if found is None or found[1] >= b:
            raise Blocked("the producer's queue is not dequeued once, with `.dequeue()`, before the batching call")
        index = found[1]
        removed = queue_line(body, p, index, call) + [body[index]]
        producer = self._producer_args(body[index], call, qualified)
        if not isinstance(producer.target, cst.Name):
            raise Blocked("assign the `dequeue()` to a name")
        _, chain = self._dequeued_chain(producer, qualified)
        consumed = {self.code(body[p].body[0].targets[0].target)} if index != p else set()  # type: ignore[attr-defined]
        return Source(chain[0], [producer.target.value], chain[1:], removed, {producer.target.value}, consumed)

    def _dequeued_chain(self, producer: ProducerArgs, qualified: str) -> tuple[str, list[str]]:
        """The dataset's name and its chain: the source, shuffle, repeat (and the int32 cast of
        a range's positions)."""
        source = self.code(producer.source)
        if qualified == RANGE_PRODUCER:
            # The producer took an int32 tensor for the limit (`(batch_len - 1) // num_steps`); a range takes int64.
            count = source if isinstance(producer.source, cst.Integer) else \
                f"{self.ref('tensorflow.cast')}({source}, {producer.int64})"
            name, chain = "positions", [f"{self.ref('tensorflow.data.Dataset.range')}({count})"]
        else:
            count = f"{self.ref('tensorflow.shape')}({source}, out_type={producer.int64})[0]"
            name, chain = "elements", [f"{self.ref('tensorflow.data.Dataset.from_tensor_slices')}({source})"]
        if producer.shuffle:
            chain.append(f".shuffle({count}{producer.seed_text})")
        chain.append(producer.repeat)
        if qualified == RANGE_PRODUCER:  # the queue held int32 positions; a range counts in int64
            chain.append(f".map(lambda i: {self.ref('tensorflow.cast')}(i, {self.ref('tensorflow.int32')}))")
        if producer.element_shape is not None:  # the queue's shape: the static shape of what it gave
            shape = self.code(producer.element_shape)
            chain.append(f".map(lambda element: {self.ref('tensorflow.ensure_shape')}(element, {shape}))")
        return name, chain

    def _from_imports(self, pipelines: list[Pipeline]) -> list[ImportItem]:
        """`from tensorflow.compat.v1.train import batch`: removed once nothing uses it."""
        items: list[ImportItem] = []
        for pipeline in pipelines:
            for call in (pipeline.batch_call, pipeline.producer_call):
                if call is None or not isinstance(call.func, cst.Name):
                    continue
                bound = call.func.value
                for target in self.rule.imports.all_bindings.get(bound, []):
                    module, _, name = target.rpartition(".")
                    item = ImportItem(module, name, None if name == bound else bound)
                    if module and item not in items:
                        items.append(item)
        return items

    def _pipeline(self, pipeline: Pipeline, qualified: str) -> None:
        """Plan the rewrite of one pipeline into ``pipeline``, or raise Blocked with the reason."""
        batch = self._batch(pipeline.batch_call, qualified)
        producer = self._producer(batch.body, batch.index)
        queue = self._hand_built.get(id(batch.call))
        own = list(queue.statements) if queue is not None else []  # a hand-built queue's statements go
        if producer is None and batch.enqueue_many:
            source = self._constant_source(batch)
            pipeline.removed = own
            pipeline.replaced = {id(batch.statement): self._replacement(batch, source, [])}
            return
        if producer is None and queue is not None:
            raise Blocked("the enqueued tensors are neither read from files by a producer and reader in this block "
                          "nor `tf.constant`s enqueued with `enqueue_many`; build the tf.data pipeline by hand")
        if producer is None and (self._batching_helper(pipeline, batch) or self._examples_function(pipeline, batch)
                                 or self._queue_parameter(pipeline, batch) or self._examples_attributes(pipeline, batch)):
            return
        if producer is None:
            raise Blocked(
                "the batched tensors are not produced in this function (no `string_input_producer` + reader or "
                "`slice_input_producer` before it in the same block); build the tf.data pipeline by hand"
            )
        p, producer_call, producer_name = producer
        pipeline.producer_call = producer_call
        source = self._source(batch.body, p, batch.index, producer_call, producer_name)
        source.removed = [*source.removed, *own]
        if queue is not None and queue.choice is not None:
            self._strip_choice(queue, source)
        parse = parse_statements(batch, source, p)
        pipeline.removed = list(source.removed) + parse
        pipeline.renamed = source.renamed
        pipeline.groups |= source.groups
        pipeline.covers |= source.covers
        top = self._deciding_if(batch.call)
        if top is not None and self._all_before(parse, top):  # each branch only batches
            pipeline.before = {id(top): self._shared_dataset(top, batch, source, parse)}
            batches = Source(self._branch_datasets[id(top)][1], list(batch.returned), [], [], set(), set())
            pipeline.replaced = {id(batch.statement): self._replacement(batch, batches, [], name="batches")}
            return
        new_statements = self._replacement(batch, source, [source.rewritten.get(id(s), s) for s in parse])
        pipeline.replaced = {id(batch.statement): new_statements}

    def _strip_choice(self, queue: HandBuiltQueue, source: Source) -> None:
        """The `if` that chose the queue, without the queue: as the map function runs it (where
        it works on what was read: resnet's per-mode preprocessing), or gone (where the queue
        was all it did)."""
        choice, own = queue.choice, {id(statement) for statement in queue.statements}
        body, orelse = choice.body, choice.orelse.body  # type: ignore[union-attr]
        kept = [[statement for statement in branch.body if id(statement) not in own] for branch in (body, orelse)]
        if not any(kept):
            source.removed = [*source.removed, choice]
            return
        padded = [statements or [cst.SimpleStatementLine([cst.Pass()])] for statements in kept]
        source.rewritten[id(choice)] = choice.with_changes(
            body=body.with_changes(body=padded[0]),
            orelse=choice.orelse.with_changes(body=orelse.with_changes(body=padded[1])))  # type: ignore[union-attr]

    def _keep_lines_above(self, pipeline: Pipeline, queue: HandBuiltQueue) -> None:
        """The blank lines and comments above a hand-built queue's statements, where they run up to
        the dequeue (`# ---- input queue ----`), stay above the dataset that takes their place."""
        body, index = self.blocks.of_call[id(queue.dequeue)]
        removed = {id(statement) for statement in pipeline.removed}
        start = index
        while start > 0 and id(body[start - 1]) in removed:
            start -= 1
        new = pipeline.replaced.get(id(body[index]))
        if start < index and new and not new[0].leading_lines:
            new[0] = new[0].with_changes(leading_lines=body[start].leading_lines)

    def _all_before(self, statements: list[cst.BaseStatement], top: cst.If) -> bool:
        """Whether ``statements`` all run before the `if` ``top``, in the block it is in."""
        block, index = self.blocks.place(top) or ((), -1)
        return all(any(s is earlier for earlier in block[:index]) for s in statements)

    def _shared_dataset(self, top: cst.If, batch: Batch, source: Source, parse: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """The examples' dataset, made once before an `if` whose branches batch it (`if shuffle:
        shuffle_batch(...) else: batch(...)`): its statements; every branch must batch the same tensors."""
        if id(top) not in self._branch_datasets:
            made = self._replacement(batch, source, [source.rewritten.get(id(s), s) for s in parse],
                                     lambda dataset: cst.SimpleStatementLine([cst.Pass()]), name="examples")
            made = made[:-1]  # the dataset made: no call to hand it to
            made[0] = made[0].with_changes(leading_lines=top.leading_lines)
            name = cst.ensure_type(single_small(made[-1]), cst.Assign).targets[0].target.value  # type: ignore[attr-defined]
            self._branch_datasets[id(top)] = (made, name, batch.returned)
        made, _, returned = self._branch_datasets[id(top)]
        if returned != batch.returned:
            raise Blocked("the branches of the `if` batch different tensors")
        return made

    def _link_producer(self, pipeline: Pipeline) -> None:
        """A refused pipeline's producer, where it was not reached, so that its finding gives the
        batching call's reason rather than saying it is not batched."""
        if pipeline.producer_call is not None or id(pipeline.batch_call) not in self.blocks.of_call:
            return
        try:
            producer = self._producer(*self._path(pipeline.batch_call))
        except Blocked:
            return
        if producer is not None:
            pipeline.producer_call = producer[1]


    def _batch(self, call: cst.Call, qualified: str) -> Batch:
        """Check the batching call and its statement, and gather what the rewrite needs of them."""
        params, smaller = batch_arguments(call, qualified)
        if id(call) not in self.blocks.of_call:
            raise Blocked("the batching call is not in a statement block")
        body, b = self._path(call)
        statement = body[b]
        small = single_small(statement)
        assigned = assignment(statement)
        written = self._hand_built[id(call)].dequeue if id(call) in self._hand_built else call  # what the statement holds
        if assigned is not None and assigned[1] is written and plain_target(assigned[0]):
            outputs = assigned[0]
        elif isinstance(small, cst.Return) and small.value is written:
            outputs = None
        else:
            raise Blocked("assign or return the batching call on a line of its own")
        enqueue_many = is_true(argument(call, params, "enqueue_many"))
        # `enqueue_many([tf.constant(x), tf.constant(y)])`: rows of constants, written in the call (see _constant_source).
        tensors, as_tuple = batched_tensors(argument(call, params, "tensors"),
                                            lambda node: enqueue_many and self._constant(node))
        return Batch(call, qualified, params, smaller, body, b, statement, outputs, tensors,
                      [self.code(t) for t in tensors], as_tuple, enqueue_many, argument(call, params, "num_threads"))

    def _path(self, call: cst.Call) -> tuple[tuple[cst.BaseStatement, ...], int]:
        """The statements around ``call``'s statement as they run, and its position among them:
        its block, or where it is in a branch of an `if` (`if shuffle: ... else: ...`), the
        block the `if` is in with that branch in the `if`'s place."""
        body, index = self.blocks.of_call[id(call)]
        branch = self._branch(body[index])
        if branch is not None:
            outer, i = branch
            if self._guard(outer[i]):  # `if shuffle: return shuffle_batch(...)`: what follows is not reached
                return (*outer[:i], *body), i + index
            return (*outer[:i], *body, *outer[i + 1:]), i + index
        guard = self._guard_before(body, index)
        if guard is not None:  # after `if shuffle: return ...`: the `if` was passed over
            g = next(j for j, s in enumerate(body) if s is guard)
            return (*body[:g], *body[g + 1:]), index - 1
        return body, index

    def _deciding_if(self, call: cst.Call) -> cst.If | None:
        """The `if` that decides whether ``call``'s statement runs: the one whose branch it is in,
        or a guard before it that returns otherwise (`if shuffle: return shuffle_batch(...)`)."""
        if id(call) not in self.blocks.of_call:
            return None
        body, index = self.blocks.of_call[id(call)]
        return self._if_of(body[index]) or self._guard_before(body, index)

    def _guard(self, statement: cst.BaseStatement) -> bool:
        """`if C: ... return X` with no `else`: what follows it in the block is its `else`."""
        return isinstance(statement, cst.If) and statement.orelse is None and bool(statement.body.body) \
            and isinstance(single_small(statement.body.body[-1]), cst.Return)

    def _guard_before(self, body, index: int) -> cst.If | None:
        """The closest guard `if` before ``body[index]`` that batches in its branch (`if shuffle:
        return shuffle_batch(...)`, then `return batch(...)`)."""
        for statement in reversed(body[:index]):
            if self._guard(statement) and any(self.rule.call_name(c) in BATCH_PARAMS for c in find(statement, cst.Call)):
                return statement
        return None

    def _branch(self, statement: cst.BaseStatement) -> tuple[tuple[cst.BaseStatement, ...], int] | None:
        """For a statement in a branch of an `if` (cifar10's and SRGAN's `if shuffle:
        shuffle_batch(...) else: batch(...)`), the block the `if` is in and its position. Each
        branch must batch too (or only raise): the input made before the `if` goes, for all of
        them; the pipelines of one `if` are rewritten together or not at all (see ``plan``)."""
        top = self._if_of(statement)
        place = self.blocks.place(top) if top is not None else None
        if place is None:
            return None
        branches, current = [], top
        while isinstance(current, cst.If):
            branches.append(list(current.body.body))
            current = current.orelse.body if isinstance(current.orelse, cst.Else) else current.orelse
        if current is not None:
            branches.append(list(current.body))
        if self._guard(top):  # its `else` is the rest of the block
            branches.append(list(place[0][place[1] + 1:]))
        for statements in branches:
            if not any(isinstance(c, cst.Call) and self.rule.call_name(c) in BATCH_PARAMS
                       for s in statements for c in find(s, cst.Call)) and not all(
                    isinstance(single_small(s), (cst.Raise, cst.Pass)) for s in statements):
                raise Blocked("a branch of the `if` around the batching call neither batches the input nor raises")
        return place

    def _if_of(self, statement: cst.CSTNode) -> cst.If | None:
        """The outermost `if` of the `if`/`elif`/`else` chain whose branch ``statement`` is directly in."""
        owner = self.blocks.if_of.get(id(statement))
        while owner is not None and id(owner) in self.blocks.if_of and self.blocks.if_of[id(owner)].orelse is owner:
            owner = self.blocks.if_of[id(owner)]  # an `elif`: the `if` it continues
        return owner

    def _replacement(self, batch: Batch, source: Source, parse: list[cst.BaseStatement],
                     hand_on: Callable[[str], cst.BaseStatement] | None = None, name: str = "dataset") -> list[cst.BaseStatement]:
        """What replaces the batching statement: [the parse function,] the dataset and its next
        element. With ``hand_on`` (the call of a batching helper, given the dataset's name), the
        dataset is not batched here but handed on."""
        threads = batch.threads
        if hand_on is None and is_true(argument(batch.call, batch.params, "dynamic_pad")):
            self._check_dense([*batch.body[:batch.index], *parse])
        parse_fn = self._free("_parse", batch.statement)
        dataset = self._free(name, batch.statement)
        returned = self._shaped(batch, source.rows) if hand_on is None else batch.returned
        # `tf.train.batch(queue, ...)` batches a slice producer's list whole: the dataset's tuples.
        whole = source.params == [f"*{returned[0]}"] and len(returned) == 1 and not batch.as_tuple
        needs_map = bool(parse) or not whole and returned != source.params
        if needs_map:
            parallel = ""
            if threads is not None and not (isinstance(threads, cst.Integer) and threads.value == "1"):
                parallel = f", num_parallel_calls={self.code(threads)}"
            source.chain.append(f".map({parse_fn}{parallel})")
        if hand_on is None:
            if batch.enqueue_many and not source.rows:  # what was enqueued were batches of examples
                source.chain.append(".unbatch()")
            self._batching_chain(batch, source.chain)
        chain = " ".join([source.text, *source.chain])
        self._check_capturable(set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", chain)), parse)
        new_statements: list[cst.BaseStatement] = []
        if needs_map:
            new_statements.append(self._parse_function(parse_fn, source.params, parse, returned))
        made = self._dataset_statements(dataset, source.text, source.chain, self._hand_built.get(id(batch.call)))
        if needs_map:
            made[0] = made[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        iterator = self.ref("tensorflow.compat.v1.data.make_one_shot_iterator")
        next_element = f"{iterator}({dataset}).get_next()"
        if hand_on is not None:
            consume = hand_on(dataset)
        elif batch.outputs is not None:
            consume = cst.parse_statement(f"{self.code(batch.outputs)} = {next_element}\n")
        else:
            consume = cst.parse_statement(f"return {next_element}\n")
        consume = consume.with_changes(trailing_whitespace=batch.statement.trailing_whitespace, leading_lines=())
        new_statements += [*made, consume]
        new_statements[0] = new_statements[0].with_changes(leading_lines=batch.statement.leading_lines)
        return new_statements

    def _dataset_statements(self, dataset: str, text: str, chain: list[str], queue: HandBuiltQueue | None) -> list:
        """`dataset = (source .map ... .batch ... .prefetch)`; where an `if` chose a hand-built
        queue that shuffles (resnet's cifar_input), the same `if` chooses the shuffle between the
        map and the batch."""
        if queue is None or queue.choice is None or not any(queue.shuffles):
            lines = "\n".join(f"    {piece}" for piece in [text, *chain])
            return [cst.parse_statement(f"{dataset} = (\n{lines}\n)\n")]
        head, batching = chain[:-2], chain[-2:]  # `.batch(...)`, `.prefetch(...)`
        lines = "\n".join(f"    {piece}" for piece in [text, *head])
        return [cst.parse_statement(f"{dataset} = (\n{lines}\n)\n"), choice_statement(queue, dataset),
                cst.parse_statement(f"{dataset} = {dataset}{''.join(batching)}\n")]

    def _check_dense(self, statements: list[cst.BaseStatement]) -> None:
        """`dynamic_pad=True` batched a SparseTensor as a SparseTensor (DeepSpeech's `VarLenFeature`
        labels beside padded features); `padded_batch` takes dense tensors only (a TypeError).
        ``statements``: those the batch's tensors are made by (the block before it, the parse)."""
        shorts = [(self.rule.call_name(c) or "").rsplit(".", 1)[-1] for s in statements for c in find(s, cst.Call)]
        if any(short in _TO_DENSE for short in shorts):
            return  # `tf.sparse_tensor_to_dense(parsed["labels"])`: what is batched is dense
        for short in shorts:
            if short in _SPARSE_MAKERS:
                raise Blocked(f"`dynamic_pad=True` batches what `{short}` makes, a SparseTensor, which `padded_batch` "
                              "does not take (the queue batched it as a SparseTensor); batch it by hand")

    def _check_capturable(self, dataset: set[str], parse: list[cst.BaseStatement]) -> None:
        """A one-shot iterator's dataset can hold constants and arrays but not a variable or a
        placeholder (`Cannot capture a stateful node`): refuse where the dataset or its map
        function reads a name the function (or module) binds to one (fully_connected_preloaded_var's
        `input_images = tf.Variable(images_initializer, collections=[])`)."""
        parse_free = set().union(*(names_used(s) for s in parse)) - set().union(*(assigned_names(s) for s in parse))
        read = dataset | parse_free  # the dataset's names: what its text names (a word in a string too)
        for call, qualified in self.calls.calls:  # anywhere in the module: a name bound to one is suspect
            if not qualified.startswith("tensorflow.") or qualified.rsplit(".", 1)[1] not in STATEFUL:
                continue
            body, index = self.blocks.of_call.get(id(call), ((), -1))
            statement = body[index] if index >= 0 else None
            for small in statement.body if isinstance(statement, cst.SimpleStatementLine) else ():
                if not (isinstance(small, cst.Assign) and small.value is call):
                    continue
                bound = {n for t in small.targets for n in flat_target_names(t.target) or []}
                for name in sorted(bound & read):
                    raise Blocked(f"the dataset would read `{name}`, a `{qualified.rsplit('.', 1)[1]}`, which a one-shot "
                                  "iterator cannot hold; make the dataset from the data that initialises it, or read it with "
                                  "`make_initializable_iterator` and run the iterator's initializer")

    def _shaped(self, batch: Batch, rows: bool = False) -> list[str]:
        """What the map function returns: the batched tensors, each checked against its entry in
        `shapes=` (which the queue enforced and gave the batch as its static shape). The rows of
        constants (``rows``) have their static shapes already: the queue could only check them."""
        shapes = argument(batch.call, batch.params, "shapes")
        if shapes is None or rows:
            return batch.returned
        if batch.enqueue_many:
            raise Blocked("`shapes=` with `enqueue_many=True` is not rewritten automatically")
        if not isinstance(shapes, (cst.List, cst.Tuple)) or len(shapes.elements) != len(batch.returned):
            raise Blocked("`shapes=` is not a list with one shape per batched tensor")
        ensure_shape = self.ref("tensorflow.ensure_shape")
        return [f"{ensure_shape}({tensor}, {self.code(shape.value)})" for tensor, shape in zip(batch.returned, shapes.elements)]

    def _batching_chain(self, batch: Batch, chain: list[str]) -> None:
        """Append the shuffle buffer, the batch and the prefetch to the dataset's ``chain``."""
        call, params = batch.call, batch.params
        if batch.qualified == SHUFFLE_BATCH:
            buffer = argument(call, params, "min_after_dequeue")
            if buffer is None:
                raise Blocked("`shuffle_batch` without `min_after_dequeue`")
            seed = argument(call, params, "seed")
            chain.append(f".shuffle({self.code(buffer)}" + (f", seed={self.code(seed)}" if seed is not None else "") + ")")
        batch_size = argument(call, params, "batch_size")
        if batch_size is None:
            raise Blocked("no `batch_size`")
        drop = "" if is_true(batch.smaller) else ", drop_remainder=True"
        # `dynamic_pad=True` padded each batch's tensors to their longest, with zeros (empty strings): so does padded_batch.
        method = "padded_batch" if is_true(argument(call, params, "dynamic_pad")) else "batch"
        chain.append(f".{method}({self.code(batch_size)}{drop})")
        chain.append(f".prefetch({self.ref('tensorflow.data.AUTOTUNE')})")

    def _scope_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The function ``node`` (a statement of a block, or a function's block) is in, else the module."""
        if isinstance(node, cst.IndentedBlock):
            node = node.body[0] if node.body else node
        function = self.blocks.function_of.get(id(node))
        if function is None and id(node) not in self.blocks.function_of and self.blocks.place(node) is None:
            function = enclosing(node, module_parents(self.rule.context), cst.FunctionDef)  # not a statement: look up
        return function or self.module

    def _free(self, name: str, near: cst.CSTNode) -> str:
        """``name``, or ``name_2``, ... : one no code of the function around ``near`` uses (of the
        module, at its top level), nor another name this plan gave there."""
        scope = self._scope_of(near)
        taken = self._taken.get(id(scope))
        if taken is None:
            taken = self._taken[id(scope)] = set(names_used(scope))  # a field's name (`self.image`) is no clash
        return fresh_name(None, name, taken)

    def _producer(self, body, b: int):
        """The closest producer statement before ``b``: (index, call, qualified)."""
        for index in range(b - 1, -1, -1):
            assigned = assignment(body[index])
            if assigned is None or not isinstance(assigned[1], cst.Call):
                continue
            call = assigned[1]
            if dequeue_of(call, lambda queue: isinstance(queue, cst.Call)):  # `producer(n).dequeue()`
                call = call.func.value  # type: ignore[attr-defined]
            qualified = self.rule.call_name(call)
            if qualified in PRODUCER_PARAMS or qualified in DEQUEUED_PARAMS:
                return index, call, qualified
            if qualified is not None and qualified.startswith("tensorflow.train.") and qualified.endswith("_input_producer"):
                raise Blocked(f"`{qualified.rsplit('.', 1)[1]}` has no automatic rewrite (only string and slice producers)")
        return None

    def _source(self, body, p: int, b: int, call: cst.Call, qualified: str) -> Source:
        """The dataset source and the producer's shuffle/repeat, and what the map receives."""
        if qualified in DEQUEUED_PARAMS:
            return self._dequeued_source(body, p, b, call, qualified)
        producer = self._producer_args(body[p], call, qualified)
        removed: list[cst.BaseStatement] = [body[p]]
        if qualified == SLICE_PRODUCER:
            return self._slice_source(producer, removed, body[p + 1:b + 1])
        # string_input_producer: find `k, v = reader.read(queue)` and the reader.
        return self._files_source(body, p, b, producer, removed)

    def _constant_source(self, batch: Batch) -> Source:
        """`tf.train.batch([x, y], enqueue_many=True)` over `x = tf.constant(...)`, ... made
        earlier in the block: the queue runner enqueued all their rows again and again, in
        order; the dataset of their rows, repeated, does the same. (Other tensors could hold
        other rows at each enqueue, which a dataset made once would not see.)"""
        constants = {}
        for statement in batch.body[:batch.index]:
            for name in assigned_names(statement):
                constants.pop(name, None)
            assigned = assignment(statement)
            if assigned is not None and isinstance(assigned[0], cst.Name) and self._constant(assigned[1]):
                constants[assigned[0].value] = assigned[1]
        if not batch.as_tuple or not all(t.value in constants if isinstance(t, cst.Name) else self._constant(t)
                                         for t in batch.tensors):
            raise Blocked(
                "the batched tensors are neither produced in this function (no `string_input_producer` + reader or "
                "`slice_input_producer` before it in the same block) nor `tf.constant`s made there; build the "
                "tf.data pipeline by hand"
            )
        names = batch.returned[0] if len(batch.returned) == 1 else f"({', '.join(batch.returned)})"
        source_text = f"{self.ref('tensorflow.data.Dataset.from_tensor_slices')}({names})"
        return Source(source_text, list(batch.returned), [".repeat()"], [], set(batch.returned), set(), rows=True)

    def _constant(self, node: cst.BaseExpression) -> bool:
        """`tf.constant(...)`."""
        return isinstance(node, cst.Call) and self.rule.call_name(node) == "tensorflow.constant"

    def _producer_args(self, statement: cst.BaseStatement, call: cst.Call, qualified: str) -> ProducerArgs:
        """Check the producer call's arguments; its target, input, epochs and shuffling."""
        params = PRODUCER_PARAMS.get(qualified) or DEQUEUED_PARAMS[qualified]
        if has_star_args(call) or unknown_keywords(call, params):
            raise Blocked("the producer passes arguments the rewrite cannot map")
        for unsupported in ("shared_name", "cancel_op"):
            if argument(call, params, unsupported) is not None:
                raise Blocked(f"the producer's `{unsupported}=` has no tf.data equivalent")
        target, _ = assignment(statement)  # type: ignore[misc]
        source = argument(call, params, params[0])
        if source is None:
            raise Blocked("the producer has no input")
        epochs = argument(call, params, "num_epochs")
        repeat = ".repeat()" if is_none(epochs) else f".repeat({self.code(epochs)})"
        shuffle = not is_false(argument(call, params, "shuffle"))
        seed = argument(call, params, "seed")
        seed_text = f", seed={self.code(seed)}" if seed is not None else ""
        int64 = self.ref("tensorflow.int64")
        element_shape = argument(call, params, "element_shape") if "element_shape" in params else None
        return ProducerArgs(target, source, repeat, shuffle, seed_text, int64, element_shape)

    def _slice_source(self, producer: ProducerArgs, removed: list[cst.BaseStatement], uses: Sequence[cst.BaseStatement]) -> Source:
        """`x, y = slice_input_producer([x, y])`: the tensors' slices, one name per tensor; or
        `queue = slice_input_producer([x, y])` read by position (`queue[0]`): the map function
        takes the slices as that one tuple (``uses``: the statements up to the batching call)."""
        target, source, int64 = producer.target, producer.source, producer.int64
        chain: list[str] = []
        if not isinstance(source, (cst.List, cst.Tuple)):
            raise Blocked("pass `slice_input_producer` a list of tensors (`[x, y]`)")
        names = flat_target_names(target)
        rewritten: dict[int, cst.BaseStatement] = {}
        if own_attribute(target):  # `self.queue = slice_input_producer(...)`: read as a name in the map function
            local = self._free(target.attr.value, uses[0])  # type: ignore[attr-defined]
            rewritten = self._fields_named(uses, self.code(target), local)
            uses = [rewritten.get(id(u), u) for u in uses]
            target = cst.Name(local)
        if isinstance(target, cst.Name):
            check_read_by_position(target.value, uses, uses[-1], self._reads_by_position)
            params, tainted = [f"*{target.value}"], {target.value}
        elif names is not None and len(names) == len(source.elements):
            params, tainted = names, set(names)
        else:
            raise Blocked("unpack `slice_input_producer([x, y])` into one name per tensor")
        parts = [self.code(e.value) for e in source.elements]
        # One tensor's slices are the elements themselves: `tf.train.batch([x])` gives a tensor, not a list.
        source_text = f"{self.ref('tensorflow.data.Dataset.from_tensor_slices')}({', '.join(parts)})" if len(parts) == 1 else \
            f"{self.ref('tensorflow.data.Dataset.from_tensor_slices')}(({', '.join(parts)}))"
        if producer.shuffle:
            chain.append(f".shuffle({self.ref('tensorflow.shape')}({parts[0]}, out_type={int64})[0]{producer.seed_text})")
        chain.append(producer.repeat)
        return Source(source_text, params, chain, removed, tainted, set(), rewritten=rewritten)

    def _fields_named(self, statements: Sequence[cst.BaseStatement], field: str, local: str) -> dict[int, cst.BaseStatement]:
        """The ``statements`` that read the object's ``field`` (`self.queue`), reading ``local``
        instead (by the id of each original); refused where the module reads that field anywhere
        else (it is set once, by the producer)."""
        rewritten: dict[int, cst.BaseStatement] = {}
        seen = 0
        for statement in statements:
            nodes = [a for a in find(statement, cst.Attribute) if self.code(a) == field]
            seen += len(nodes)
            changed = statement
            for node in nodes:
                changed = changed.deep_replace(node, cst.Name(local))
            if nodes:
                rewritten[id(statement)] = changed
        if sum(1 for a in find(self.module, cst.Attribute) if self.code(a) == field) != seen + 1:
            raise Blocked(f"`{field}` is used elsewhere too")
        return rewritten

    def _reads_by_position(self, call: cst.Call, arg: cst.Arg) -> bool:
        """Whether ``call`` hands the slices to a function of the module that only reads its
        parameter by position (or unpacks it), so that it can be given the map function's tuple."""
        function = self._callee(call)
        if function is None:
            return False
        try:
            param = self._parameter_of(call, function, arg)
            check_read_by_position(param.name.value, self.blocks.flat(function.body.body), None)
        except Blocked:
            return False
        return True

    def _files_source(self, body, p: int, b: int, producer: ProducerArgs, removed: list[cst.BaseStatement]) -> Source:
        """`q = string_input_producer(files)` and its reader: the reader's dataset over the files."""
        target = producer.target
        if not isinstance(target, cst.Name):
            raise Blocked("assign the filename queue to a name")
        queue = target.value
        read = self._read(body, p, b, queue)
        if read is None:
            return self._reader_function_source(body, p, b, producer, removed)
        removed.append(body[read.index])
        reader_call = self._reader_call(body, read, removed)
        dataset_class, extra, skip = self._reader_dataset(reader_call)
        keys = []
        if dataset_class == WHOLE_FILE and isinstance(read.key, cst.Name) and reads_first(body[read.index + 1:], {read.key.value}):
            keys = [read.key.value]  # a whole file's key is its name: the dataset keeps it
        else:
            self._check_key_unused(read.key, body[read.index + 1:])
        source_text, chain = self._files_chain(producer, dataset_class, extra, skip, keyed=bool(keys))
        consumed = {queue} | ({read.reader_name} if read.reader_name else set())
        return Source(source_text, [*keys, read.value_name], chain, removed, {*keys, read.value_name}, consumed)

    def _reader_call(self, body, read: Read, removed: list[cst.BaseStatement]) -> cst.Call:
        """The reader `read` reads from: built inline, or the closest `reader = tf.XReader(...)`
        before it in ``body`` (that statement is added to ``removed``), or the one a method
        keeps on the object (CycleGAN's `self.reader = tf.TFRecordReader()` in `__init__`; that
        statement goes too where nothing else reads `self.reader`)."""
        if read.reader_name is not None and read.reader_name.startswith("self."):
            attribute = read.reader_name.split(".", 1)[1]
            made = [a for a in find(self.module, cst.Assign) if len(a.targets) == 1
                    and own_attribute(a.targets[0].target) and a.targets[0].target.attr.value == attribute]
            if len(made) != 1 or not isinstance(made[0].value, cst.Call):
                raise Blocked(f"`{read.reader_name}` is not made once, by a reader call, in this module")
            uses = [a for a in find(self.module, cst.Attribute) if own_attribute(a) and a.attr.value == attribute]
            if len(uses) == 2:  # made and read here only
                removed.append(module_parents(self.rule.context)[id(made[0])])
            return made[0].value
        if read.reader_name is not None:
            for index in range(read.index - 1, -1, -1):
                assigned = assignment(body[index])
                if assigned is not None and isinstance(assigned[0], cst.Name) and assigned[0].value == read.reader_name and isinstance(assigned[1], cst.Call):
                    removed.append(body[index])
                    return assigned[1]
        if read.reader_call is None:
            raise Blocked("the reader is not created in the same block")
        return read.reader_call


    def _read(self, body, p: int, b: int, queue: str) -> Read | None:
        """The first `key, value = reader.read(queue)` between the producer and the batching call."""
        for index in range(p + 1, b):
            assigned = assignment(body[index])
            if assigned is None or not isinstance(assigned[1], cst.Call):
                continue
            func = assigned[1].func
            if isinstance(func, cst.Attribute) and func.attr.value == "read" and [self.code(a.value) for a in assigned[1].args] == [queue]:
                target = assigned[0]
                if not (isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 2
                        and isinstance(target.elements[1].value, cst.Name)):
                    raise Blocked("unpack the read into `key, value = reader.read(queue)`")
                reader_call = reader_name = None
                if isinstance(func.value, cst.Call):
                    reader_call = func.value
                elif isinstance(func.value, cst.Name):
                    reader_name = func.value.value
                elif own_attribute(func.value):
                    reader_name = self.code(func.value)
                return Read(index, target.elements[1].value.value, reader_call, reader_name, target.elements[0].value)
        return None

    def _check_key_unused(self, key: cst.BaseExpression, later: Sequence[cst.BaseStatement]) -> None:
        """tf.data datasets yield the records, not their keys: the key `reader.read` gave must be
        unused, under its name after the read, or as a field of a record object (cifar10's
        `result.key`) anywhere in the module."""
        if isinstance(key, cst.Name):
            if key.value != "_" and reads_first(later, {key.value}):
                raise Blocked("the record key from `reader.read` is used; tf.data datasets yield the values only")
        elif isinstance(key, cst.Attribute):
            if any(a is not key and a.attr.value == key.attr.value for a in find(self.module, cst.Attribute)):
                raise Blocked(f"the record key `{self.code(key)}` from `reader.read` may be read (`.{key.attr.value}`); "
                              "tf.data datasets yield the values only")
        else:
            raise Blocked("unpack the read into `key, value = reader.read(queue)`")

    def _reader_dataset(self, reader_call: cst.Call) -> tuple[str, str, str]:
        """The tf.data dataset class that reads what the reader reads, its extra arguments, and
        what it skips at the start of each file (`.skip(1)` for `skip_header_lines=1`)."""
        reader = self.rule.call_name(reader_call)
        if reader not in READERS:
            short = (reader or "the reader").rsplit(".", 1)[-1]
            raise Blocked(f"`{short}` has no automatic rewrite (TFRecord, TextLine, FixedLengthRecord and WholeFile readers do)")
        dataset_class, reader_params = READERS[reader]
        if has_star_args(reader_call) or unknown_keywords(reader_call, reader_params):
            raise Blocked("the reader passes arguments the rewrite cannot map")
        extra = ""
        if dataset_class == "FixedLengthRecordDataset":
            record_bytes = argument(reader_call, reader_params, "record_bytes")
            if record_bytes is None or argument(reader_call, reader_params, "hop_bytes") is not None or argument(reader_call, reader_params, "encoding") is not None:
                raise Blocked("`FixedLengthRecordReader` with `hop_bytes`/`encoding` (or without `record_bytes`)")
            extra = f", {self.code(record_bytes)}"
            for keyword in ("header_bytes", "footer_bytes"):
                value = argument(reader_call, reader_params, keyword)
                if value is not None:
                    extra += f", {keyword}={self.code(value)}"
        skip = ""
        if dataset_class == "TextLineDataset" and argument(reader_call, reader_params, "skip_header_lines") is not None:
            skip = f".skip({self.code(argument(reader_call, reader_params, 'skip_header_lines'))})"
        elif any(argument(reader_call, reader_params, k) is not None for k in reader_params
                 if k not in ("name", "record_bytes", "header_bytes", "footer_bytes")):
            raise Blocked("the reader's options (`options=`) are not rewritten automatically")
        return dataset_class, extra, skip

    def _files_chain(self, producer: ProducerArgs, dataset_class: str, extra: str, skip: str,
                     keyed: bool = False) -> tuple[str, list[str]]:
        """The dataset over the producer's files, and its shuffle/repeat chain (``keyed``: a
        whole file's name is kept with its contents)."""
        chain: list[str] = []
        files = self._files(producer.source)
        if dataset_class == WHOLE_FILE:  # one record per file: its contents
            if producer.shuffle:
                chain.append(f".shuffle({self.ref('tensorflow.size')}({files}, out_type={producer.int64}){producer.seed_text})")
            read_file = self.ref("tensorflow.io.read_file")
            chain += [producer.repeat, f".map(lambda filename: (filename, {read_file}(filename)))" if keyed else f".map({read_file})"]
            return f"{self.ref('tensorflow.data.Dataset.from_tensor_slices')}({files})", chain
        dataset = self.ref(f"tensorflow.data.{dataset_class}")
        if producer.shuffle or skip:
            # The producer reshuffles the file names every epoch and one reader reads them in turn
            # (a header skipped in each).
            source_text = f"{self.ref('tensorflow.data.Dataset.from_tensor_slices')}({files})"
            if producer.shuffle:
                chain.append(f".shuffle({self.ref('tensorflow.size')}({files}, out_type={producer.int64}){producer.seed_text})")
            chain.append(producer.repeat)
            if extra or skip:
                chain.append(f".flat_map(lambda filename: {dataset}(filename{extra}){skip})")
            else:
                chain.append(f".flat_map({dataset})")
        else:
            source_text = f"{dataset}({files}{extra})"
            chain.append(producer.repeat)
        return source_text, chain

    def _files(self, source: cst.BaseExpression) -> str:
        """The producer's file names as the dataset reads them: `tf.train.match_filenames_once(p)`
        keeps the names matched once in a local variable, which a one-shot iterator cannot
        capture (a held-out PNG reader failed); `tf.io.matching_files(p)`, the op that variable
        is initialised from, gives the same names."""
        if isinstance(source, cst.Call) and self.rule.call_name(source) == "tensorflow.train.match_filenames_once":
            pattern = argument(source, ("pattern", "name"), "pattern")
            if pattern is not None:
                return f"{self.ref('tensorflow.io.matching_files')}({self.code(pattern)})"
        return self.code(source)

    def _parse_function(self, name, params, parse, returned) -> cst.FunctionDef:
        # `tf.train.batch([image])` gives the batched tensor itself, as a dataset of tensors does.
        result = ", ".join(returned)
        body = [blank_lines_unindented(s) for s in parse]
        if body:
            body[0] = body[0].with_changes(leading_lines=[ln for ln in body[0].leading_lines if ln.comment is not None])
        body.append(cst.parse_statement(f"return {result}\n"))
        header = cst.parse_statement(f"def {name}({', '.join(params)}):\n    pass\n")
        function = cst.ensure_type(header, cst.FunctionDef)
        return function.with_changes(body=cst.IndentedBlock(body=body), leading_lines=())


class _RewrittenModule(Mapping):
    """The edit's one change, {module: the module rewritten}, made when the fix engine reads it:
    `check` only says that there is a fix, and the rewrite walks the whole module."""

    def __init__(self, module: cst.Module, rewrite: cst.CSTTransformer) -> None:
        self._module, self._rewrite = module, rewrite
        self._rewritten: cst.Module | None = None

    def __getitem__(self, node: cst.CSTNode) -> cst.Module:
        if node is not self._module:
            raise KeyError(node)
        if self._rewritten is None:
            self._rewritten = self._module.visit(self._rewrite)
        return self._rewritten

    def __iter__(self):
        yield self._module

    def __len__(self) -> int:
        return 1


# --- applying it ------------------------------------------------------------------------

class _Rewrite(cst.CSTTransformer):
    def __init__(self, pipelines: list[Pipeline], scaffolding: ScaffoldPlan | None, scopes: set[int]) -> None:
        super().__init__()
        self.scopes = scopes  # `with tf.name_scope(...)` statements: one left empty goes
        self.remove = {id(s) for p in pipelines for s in p.removed}
        self.replace: dict[int, list[cst.BaseStatement]] = {}
        for pipeline in pipelines:
            self.replace.update(pipeline.replaced)
        self.scaffolding = scaffolding or ScaffoldPlan()
        self.remove |= self.scaffolding.remove
        self._padding: set[int] = set()
        self._created = {id(s) for p in pipelines for new in p.replaced.values() for s in new if isinstance(s, cst.FunctionDef)}
        self.renamed = {key: name for p in pipelines for key, name in p.renamed.items()}
        self.dropped = {key for p in pipelines for key in p.dropped}
        self.before = {key: made for p in pipelines for key, made in p.before.items()}

    def leave_Param(self, original_node, updated_node):
        if id(original_node) in self.dropped:
            return cst.RemovalSentinel.REMOVE
        if id(original_node) in self.renamed:
            return updated_node.with_changes(name=cst.Name(self.renamed[id(original_node)]))
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if id(original_node) in self.replace:
            return cst.FlattenSentinel(self.replace[id(original_node)])
        if id(original_node) in self.remove:
            return cst.RemovalSentinel.REMOVE
        if id(original_node) in self.scaffolding.reraise:
            return updated_node.with_changes(body=[cst.Raise()])
        return updated_node

    def leave_If(self, original_node, updated_node):
        if id(original_node) in self.remove:
            return cst.RemovalSentinel.REMOVE
        if id(original_node) in self.before:  # the dataset its branches batch
            return cst.FlattenSentinel([*self.before[id(original_node)], updated_node.with_changes(leading_lines=())])
        return updated_node

    def leave_While(self, original_node, updated_node):
        if id(original_node) in self.scaffolding.while_tests:
            return updated_node.with_changes(test=self.scaffolding.while_tests[id(original_node)])
        return updated_node

    def leave_With(self, original_node, updated_node):
        if id(original_node) in self.remove:  # moved into a map function
            return cst.RemovalSentinel.REMOVE
        # A name scope (or device) left holding nothing but the `pass` put there goes too.
        if id(original_node) in self.scopes and self._emptied(updated_node.body) and all(
                item.asname is None for item in updated_node.items):
            return cst.RemovalSentinel.REMOVE
        return updated_node

    def leave_Try(self, original_node, updated_node):
        if id(original_node) in self.remove:  # moved into a map function
            return cst.RemovalSentinel.REMOVE
        # An emptied `finally:` goes here, not in leave_Finally: a Try left with neither handlers
        # nor finally cannot even be built (LibCST validates it), so it becomes its body.
        if updated_node.finalbody is None or not self._emptied(updated_node.finalbody.body):
            return updated_node
        if updated_node.handlers:
            return updated_node.with_changes(finalbody=None)
        body = list(updated_node.body.body)
        body[0] = body[0].with_changes(leading_lines=[*updated_node.leading_lines, *body[0].leading_lines])
        return cst.FlattenSentinel(body)

    def leave_Module(self, original_node, updated_node):
        return updated_node.with_changes(body=self._space_functions(updated_node.body))

    def _space_functions(self, statements):
        body = list(statements)
        for index, statement in enumerate(body):
            if isinstance(statement, cst.FunctionDef) and id(statement) in self._created:
                # A blank line before the new nested function, unless it opens the block.
                comments = [line for line in statement.leading_lines if line.comment is not None]
                blank = [cst.EmptyLine(indent=False)] if index else []
                body[index] = statement.with_changes(leading_lines=[*blank, *comments])
        return body

    def leave_IndentedBlock(self, original_node, updated_node):
        body = self._space_functions(updated_node.body)
        if body and original_node.body and id(original_node.body[0]) in self.remove:
            # The block's first statement went: no blank line opens the block now.
            lines = list(body[0].leading_lines)
            while lines and lines[0].comment is None:
                lines.pop(0)
            body[0] = body[0].with_changes(leading_lines=lines)
        updated_node = updated_node.with_changes(body=body)
        if not updated_node.body:  # everything in it went: `pass` keeps it valid
            padding = cst.SimpleStatementLine([cst.Pass()])
            self._padding.add(id(padding))
            return updated_node.with_changes(body=[padding])
        return updated_node

    def _emptied(self, block: cst.BaseSuite) -> bool:
        body = getattr(block, "body", ())
        return len(body) == 1 and id(body[0]) in self._padding
