"""The vocabulary of the queue-pipeline rewrite (``tfmigrate.rewrites.pipelines``): the TF1
queue APIs it knows and their parameters, the refusal it raises, and the small syntax tests and
edits its planning is made of (which targets, tensors and settings it can carry into tf.data)."""

from __future__ import annotations

from typing import Callable, Sequence

import libcst as cst

from tfmigrate.cst.callargs import short_name
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import assigned_pairs, names_used, scope_bindings, single_small
from tfmigrate.cst.walker import visit_read_only
from tfmigrate.rewrites.refusal import Refused

STRING_PRODUCER = "tensorflow.train.string_input_producer"
SLICE_PRODUCER = "tensorflow.train.slice_input_producer"
RANGE_PRODUCER = "tensorflow.train.range_input_producer"
INPUT_PRODUCER = "tensorflow.train.input_producer"
#: The producers whose queue a program may dequeue itself, element by element.
DEQUEUED_PARAMS = {
    RANGE_PRODUCER: ("limit", "num_epochs", "shuffle", "seed", "capacity", "shared_name", "name"),
    INPUT_PRODUCER: ("input_tensor", "element_shape", "num_epochs", "shuffle", "seed", "capacity", "shared_name",
                     "summary_name", "name", "cancel_op"),
}
PRODUCER_PARAMS = {
    STRING_PRODUCER: ("string_tensor", "num_epochs", "shuffle", "seed", "capacity", "shared_name", "name", "cancel_op"),
    SLICE_PRODUCER: ("tensor_list", "num_epochs", "shuffle", "seed", "capacity", "shared_name", "name"),
}
BATCH = "tensorflow.train.batch"
SHUFFLE_BATCH = "tensorflow.train.shuffle_batch"
BATCH_PARAMS = {
    BATCH: ("tensors", "batch_size", "num_threads", "capacity", "enqueue_many", "shapes", "dynamic_pad", "allow_smaller_final_batch", "shared_name", "name"),
    SHUFFLE_BATCH: ("tensors", "batch_size", "capacity", "min_after_dequeue", "num_threads", "seed", "enqueue_many", "shapes", "allow_smaller_final_batch", "shared_name", "name"),
}
#: Reader -> (the tf.data dataset that reads the same files, its parameters).
READERS = {
    "tensorflow.TFRecordReader": ("TFRecordDataset", ("name", "options")),
    "tensorflow.TextLineReader": ("TextLineDataset", ("skip_header_lines", "name")),
    "tensorflow.FixedLengthRecordReader": (
        "FixedLengthRecordDataset", ("record_bytes", "header_bytes", "footer_bytes", "hop_bytes", "name", "encoding"),
    ),
    "tensorflow.WholeFileReader": ("WholeFile", ("name",)),  # no dataset class: the files' names, each read
}
WHOLE_FILE = "WholeFile"
#: `with` blocks a pipeline's statements may run into and out of (see ``_Survey.flat``).
SCOPES = ("name_scope", "variable_scope", "device")
#: What a one-shot iterator's dataset cannot hold (see ``_Planner._check_capturable``).
STATEFUL = ("Variable", "VariableV1", "get_variable", "get_local_variable", "placeholder", "placeholder_with_default",
            "match_filenames_once")
COORDINATOR = "tensorflow.train.Coordinator"
START_QUEUE_RUNNERS = "tensorflow.train.start_queue_runners"

class Blocked(Refused):
    """The pipeline does not have a shape the rewrite handles; the text says why."""


def flat_target_names(target: cst.BaseExpression) -> list[str] | None:
    """Names bound by an assignment target (a name or a flat tuple/list of names)."""
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)) and all(isinstance(e.value, cst.Name) for e in target.elements):
        return [e.value.value for e in target.elements]  # type: ignore[attr-defined]
    return None


def plain_target(target: cst.BaseExpression) -> bool:
    """A target the batch's results can be assigned to as they were: names or attributes
    (`images, labels = ...`, `self.images, self.labels = ...`)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return bool(target.elements) and all(isinstance(e.value, (cst.Name, cst.Attribute)) for e in target.elements)
    return isinstance(target, (cst.Name, cst.Attribute))


def assignment(statement: cst.BaseStatement) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    small = single_small(statement)
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        return small.targets[0].target, small.value
    return None


def dequeue_of(value: cst.BaseExpression, is_queue) -> bool:
    """`<queue>.dequeue()`, the queue passing ``is_queue``."""
    return (isinstance(value, cst.Call) and not value.args and isinstance(value.func, cst.Attribute)
            and value.func.attr.value == "dequeue" and is_queue(value.func.value))


def assigned_names(statement: cst.BaseStatement) -> set[str]:
    names: set[str] = set()
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            targets = []
            if isinstance(small, cst.Assign):
                targets = [t.target for t in small.targets]
            elif isinstance(small, (cst.AnnAssign, cst.AugAssign)):
                targets = [small.target]
            for target in targets:
                names |= set(flat_target_names(target) or [])
    return names


def plain_tensor(node: cst.BaseExpression) -> bool:
    """A batched tensor the rewrite can return from the map function: a name, an element of a
    producer's list or a parsed dict (`input_queue[1]`, `features["label"]`), or a record's
    field (`record.label`)."""
    if isinstance(node, cst.Name):
        return True
    if isinstance(node, cst.Attribute):
        return plain_tensor(node.value)
    if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name) and len(node.slice) == 1:
        index = node.slice[0].slice  # `queue[1]`, `features["label"]`
        return isinstance(index, cst.Index) and isinstance(index.value, (cst.Integer, cst.SimpleString))
    return False


def batched_tensors(tensors: cst.BaseExpression | None,
                    also: Callable[[cst.BaseExpression], bool] = lambda node: False) -> tuple[list[cst.BaseExpression], bool]:
    """The batched tensors, and whether they are batched as a list (`[image, label]`); ``also``
    admits other tensors than :func:`plain_tensor`'s."""
    if isinstance(tensors, (cst.List, cst.Tuple)) and tensors.elements:
        nodes = [e.value for e in tensors.elements]
        if all(plain_tensor(node) or also(node) for node in nodes):
            return nodes, True
    if isinstance(tensors, cst.Name):
        return [tensors], False
    if isinstance(tensors, cst.Call):  # `tf.train.batch(read_csv(filename_queue), ...)`
        called = f"{short_name(tensors.func) or 'the call'}(...)"
        raise Blocked(f"the batched tensors are what `{called}` returns: name them first "
                      f"(`row = {called}`, then batch `row`), which the fix can then rewrite")
    raise Blocked("the batched tensors are not a list of names (`[image, label]`)")


def portable_settings(body: Sequence[cst.BaseStatement], end: int, code: Callable[[cst.CSTNode], str],
                       local: set[str]) -> dict[str, cst.BaseExpression]:
    """The names and record fields a function's block sets, before its statement ``end``, to
    arithmetic on literals and names that are not the function's own (``local``): cifar10's
    `label_bytes = 1`, `result.height = 32` (or `= IMAGE_SIZE`), `record_bytes = label_bytes +
    image_bytes`. Their code -> the expression, its settings written out: what the caller can
    compute too. A name bound otherwise, or in a compound statement, is left out."""
    settings: dict[str, cst.BaseExpression] = {}

    def forget(target: str) -> None:  # `result = ...` also resets `result.height`
        for known in [k for k in settings if k == target or k.startswith(f"{target}.")]:
            del settings[known]

    for statement in body[:end]:  # in the order they run: the last setting before `end` holds
        pairs = assigned_pairs(statement)
        if pairs is None:
            for bound in scope_bindings(statement):
                forget(bound)
            continue
        values = [written_out(value, settings) for _, value in pairs]  # the right side runs first
        for (target_node, _), value in zip(pairs, values):
            target = code(target_node)
            forget(target)
            if _arithmetic(value, local):
                settings[target] = value
    return settings


def _arithmetic(node: cst.BaseExpression, local: set[str]) -> bool:
    """Arithmetic on numbers and on names (or their fields) that are not in ``local``."""
    if isinstance(node, (cst.Integer, cst.Float)):
        return True
    if isinstance(node, cst.Name):
        return node.value not in local
    if isinstance(node, cst.Attribute):
        return isinstance(node.value, (cst.Name, cst.Attribute)) and _arithmetic(node.value, local)
    if isinstance(node, cst.UnaryOperation):
        return isinstance(node.operator, cst.Minus) and _arithmetic(node.expression, local)
    if isinstance(node, cst.BinaryOperation):
        return isinstance(node.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.FloorDivide)) and \
            _arithmetic(node.left, local) and _arithmetic(node.right, local)
    return False


def written_out(node, settings: dict[str, cst.BaseExpression]):
    """``node`` with the names and fields in ``settings`` replaced by their expressions (in
    parentheses where they are operations); keyword names stay."""
    if not settings:
        return node

    class WriteOut(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            return _setting(original, updated)

        def leave_Attribute(self, original, updated):
            return _setting(original, updated.with_changes(attr=original.attr))  # `x.height`: no name read

        def leave_Arg(self, original, updated):
            value = updated.value
            if value is not original.value and isinstance(original.value, (cst.Name, cst.Attribute)):
                value = value.with_changes(lpar=[], rpar=[])  # the whole argument: no parentheses
            return updated.with_changes(keyword=original.keyword, value=value)  # a keyword is a parameter's name

    def _setting(original, updated):
        value = settings.get(code(original))
        if value is None:
            return updated
        if isinstance(value, cst.BinaryOperation):
            return value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return value

    return node.visit(WriteOut())


def called_name(call: cst.Call) -> cst.Name:
    """The name a call of a module function (`f(...)`) or method (`self.f(...)`) uses."""
    return call.func.attr if isinstance(call.func, cst.Attribute) else call.func  # type: ignore[return-value]


def handed_call(call: cst.Call, arguments: list[cst.Arg], dataset: str) -> cst.Call:
    """A batching helper's call given the dataset for its first example and without the others."""
    args = []
    for arg in call.args:
        if arg is arguments[0]:
            args.append(arg.with_changes(value=cst.Name(dataset)))
        elif not any(arg is other for other in arguments[1:]):
            args.append(arg)
    if args and call.args and args[-1] is not call.args[-1]:
        args[-1] = args[-1].with_changes(comma=call.args[-1].comma)
    return call.with_changes(args=args)


def queue_line(body: Sequence[cst.BaseStatement], produced: int, dequeued: int, call: cst.Call) -> list[cst.BaseStatement]:
    """`q = producer(n)` on a line of its own, dequeued later (`i = q.dequeue()`): that line,
    which goes. Refused when the producer's arguments are set again before the dequeue, where
    the dataset that replaces both will read them."""
    if produced == dequeued:
        return []
    rebound = set().union(*(assigned_names(s) for s in body[produced + 1:dequeued])) & names_used(call)
    if rebound:
        raise Blocked(f"`{sorted(rebound)[0]}` is set again between the producer and its `dequeue()`")
    return [body[produced]]


def check_read_by_position(queue: str, statements: Sequence[cst.BaseStatement], batching: cst.BaseStatement | None,
                           passes: Callable[[cst.Call, cst.Arg], bool] | None = None) -> None:
    """The producer's list of slices, kept under one name, is only read by position
    (`queue[0]`, `queue[-1]`, `queue[1:]`), unpacked, batched whole (`tf.train.batch(queue,
    ...)` in ``batching``), or handed whole to a function that ``passes`` says reads it so too
    (DeepLab's `read_images_from_disk(input_queue, ...)`): what a tuple of them does the same."""
    unsupported: list[str] = []

    class Uses(cst.CSTVisitor):
        def __init__(self, batching: bool) -> None:
            super().__init__()
            self.batching = batching

        def visit_Arg(self, node: cst.Arg) -> bool:
            return not (self.batching and isinstance(node.value, cst.Name) and node.value.value == queue)

        def visit_Call(self, node: cst.Call) -> bool:
            if passes is None:
                return True
            visit_read_only(node.func, self)
            for arg in node.args:
                if not (isinstance(arg.value, cst.Name) and arg.value.value == queue and passes(node, arg)):
                    visit_read_only(arg, self)
            return False

        def visit_Subscript(self, node: cst.Subscript) -> bool:
            if isinstance(node.value, cst.Name) and node.value.value == queue:
                for element in node.slice:
                    visit_read_only(element, self)
                return False
            return True

        def visit_Assign(self, node: cst.Assign) -> bool:
            if isinstance(node.value, cst.Name) and node.value.value == queue and all(
                    isinstance(t.target, (cst.Tuple, cst.List)) for t in node.targets):
                return False  # `image, label = queue`
            return True

        def visit_Attribute(self, node: cst.Attribute) -> bool:
            visit_read_only(node.value, self)
            return False

        def visit_Name(self, node: cst.Name) -> None:
            if node.value == queue:
                unsupported.append(node.value)

    for statement in statements:
        visit_read_only(statement, Uses(statement is batching))
    if unsupported:
        raise Blocked(f"`{queue}`, the producer's list of slices, is used otherwise than by position (`{queue}[0]`)")
