"""Part of the TFM101 rewrite: towers fed through their own placeholders read one
generator-backed ``tf.data`` pipeline of the global batch instead (TFM106).

The shape: in the tower loop's body (after the device scopes are gone), in code that always
runs (``with`` blocks included)::

    x = tf.placeholder(tf.float32, [None, 6])
    y = tf.placeholder(tf.float32, [None, 1])
    x_holders.append(x)
    y_holders.append(y)

with the lists made empty before the loop, and after the loop, once the session has run the
variables initializer, one session loop::

    for step, (xs, ys) in enumerate(batches()):        # or: for xs, ys in <source>:
        feed = {}
        for k in range(NUM_GPUS):
            feed[x_holders[k]] = xs[k * per_tower:(k + 1) * per_tower]
            feed[y_holders[k]] = ys[k * per_tower:(k + 1) * per_tower]
        _, loss_value = sess.run([train_op, loss], feed_dict=feed)
        ...

(the feed may also be a dict comprehension, ``feed.update({...})`` in the loop, or the pieces of
``np.split(xs, NUM_GPUS)``; ``per_tower`` is ``<batch> // <tower count>``). It becomes::

    dataset = tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec([None, 6], tf.float32),
        tf.TensorSpec([None, 1], tf.float32),
    ))
    inputs = tf.compat.v1.data.make_initializable_iterator(
        strategy.experimental_distribute_dataset(dataset))

    def tower_step(batch):
        x, y = batch
        ...
    loss = strategy.reduce(..., strategy.run(tower_step, args=(inputs.get_next(),)), ...)
    ...
    sess.run(tf.global_variables_initializer())
    sess.run(inputs.initializer)
    for step in itertools.count():                    # `while True:` without a step counter
        try:
            _, loss_value = sess.run([train_op, loss])
        except tf.errors.OutOfRangeError:
            break
        ...

The strategy splits each global batch into contiguous per-replica parts, replica ``k`` getting
part ``k``: exactly the slice tower ``k`` was fed, so each step trains on the same examples
with the same split. The dataset is read through an iterator initialised once (re-initialising
one from placeholders every step was measured 100x slower, DESIGN "verify").

What changes, and is accepted: the batch source is called when the iterator is initialised
(right after the variables initializer) rather than when the loop starts, and it runs inside
TensorFlow's input pipeline, interleaved with the training steps rather than before each one.

Anything that does not match exactly raises :class:`Unmatched` with the reason; the tower
rewrite then leaves the placeholders per replica, fed as before (TFM106 says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import libcst as cst

from tfmigrate.cst.codegen import code
from tfmigrate.cst.names import ImportTable
from tfmigrate.cst.traversal import children, find, name_nodes, names_used, parents_of, single_small, target_names, walk
from tfmigrate.rule import ImportItem
from tfmigrate.rewrites.tower_input import DistributedInput, find_initializer
from tfmigrate.rewrites.refusal import Refused

PLACEHOLDER = "tensorflow.placeholder"
SPLIT = "tensorflow.split"
NP_SPLIT = "numpy.split"
# Cuts a batch into unequal parts when it does not divide, unlike the strategy (4, 3, 3 where
# MirroredStrategy gives 10 examples to 3 replicas as 4, 4, 2).
NP_ARRAY_SPLIT = "numpy.array_split"
# Calls a statement before the training step may make and still run once more, harmlessly,
# when the input runs out (the step timing legacy loops do for examples/sec).
TIMERS = {"time.time", "time.perf_counter", "time.monotonic", "time.process_time", "timeit.default_timer"}


class Unmatched(Refused):
    """Per-tower placeholders in a shape this rewrite does not replace; the message says why."""


@dataclass
class FedInput(DistributedInput):
    """A :class:`DistributedInput` that also rewrites the session loop feeding the towers."""

    removed: frozenset[int] = frozenset()  # ids of tower statements that go (placeholders, appends)
    replaced: int = 0                       # id of the tower statement the unpack replaces
    placeholder_calls: frozenset[int] = frozenset()  # ids of the original placeholder calls

    def step_body(self, statements: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        transformer = _Replace({**{k: cst.RemovalSentinel.REMOVE for k in self.removed}, self.replaced: self.unpack})
        visited = [s.visit(transformer) for s in statements]
        return [s for s in visited if isinstance(s, cst.CSTNode)]


class _Replace(cst.CSTTransformer):
    def __init__(self, changes: dict[int, object]):
        super().__init__()
        self.changes = changes

    def on_leave(self, original, updated):
        if isinstance(updated, cst.IndentedBlock) and not updated.body:
            # A `with` block that held only placeholders and appends would be left empty.
            return updated.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
        return self.changes.get(id(original), updated)


def _assign(statement: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    """``name = value`` -> (name, value)."""
    small = single_small(statement)
    if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
        return small.targets[0].target.value, small.value
    return None


def _method(call: cst.CSTNode, name: str) -> bool:
    return isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == name


def _unconditional(statements) -> list[cst.BaseStatement]:
    """The statements that run whenever the tower code runs: these and, inside ``with``
    blocks, theirs (not those under ``if``/loops/``try``)."""
    found = []
    for statement in statements:
        found.append(statement)
        if isinstance(statement, cst.With) and isinstance(statement.body, cst.IndentedBlock):
            found += _unconditional(statement.body.body)
    return found


def _bound_names(node: cst.CSTNode) -> list[tuple[str, cst.CSTNode]]:
    """(name, binding node) for the names a piece of code binds: assignments, loop, `with`
    and `except` targets, definitions, parameters, imports."""
    found = []
    for current in walk(node):
        targets: list[cst.CSTNode] = []
        if isinstance(current, cst.Assign):
            targets = [t.target for t in current.targets]
        elif isinstance(current, (cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor)):
            targets = [current.target]
        elif isinstance(current, cst.AsName):
            targets = [current.name]
        elif isinstance(current, (cst.FunctionDef, cst.ClassDef, cst.Param)):
            targets = [current.name]
        elif isinstance(current, (cst.Import, cst.ImportFrom)) and not isinstance(current.names, cst.ImportStar):
            targets = [alias.name if alias.asname is None else alias.asname.name for alias in current.names]
        found += [(name, current) for target in targets for name in target_names(target)]
    return found


def _references(node: cst.CSTNode, name: str) -> list[cst.Name]:
    """The Name nodes reading or binding ``name`` under ``node``, in source order."""
    return list(name_nodes(node).get(name, ()))


@dataclass
class _Placeholder:
    name: str
    statement: cst.SimpleStatementLine  # in the replica function's statements
    dtype: cst.BaseExpression
    shape: cst.BaseExpression
    holder_list: str = ""
    append: cst.SimpleStatementLine | None = None


def _placeholder(name: str, statement, call: cst.Call, strategy: str, per_tower: bool = True) -> _Placeholder:
    """The placeholder's dtype and its shape as a global-batch TensorSpec shape (``per_tower``:
    the placeholder holds one tower's part; else it holds the global batch already)."""
    if any(a.star for a in call.args):
        raise Unmatched(f"`{name}`'s placeholder takes *args or **kwargs")
    positional = [a.value for a in call.args if a.keyword is None]
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    values = dict(zip(("dtype", "shape", "name"), positional))
    if len(positional) > 3 or set(keywords) - {"dtype", "shape", "name"} or set(keywords) & set(values):
        raise Unmatched(f"cannot read `{name}`'s placeholder arguments")
    values.update(keywords)
    dtype, shape = values.get("dtype"), values.get("shape")
    # The strategy splits a batch along its first dimension: the rank and that dimension must be known.
    if dtype is None or shape is None or not isinstance(shape, (cst.List, cst.Tuple)) or not shape.elements \
            or any(isinstance(e, cst.StarredElement) for e in shape.elements):
        raise Unmatched(f"`{name}`'s placeholder has no literal shape (the dataset needs its rank)")
    first = shape.elements[0].value
    if per_tower and not (isinstance(first, cst.Name) and first.value == "None"):
        # A fixed per-tower batch: the dataset's batch is that times the replica count (and
        # each replica's part has the tower's static shape again).
        size = code(first) if isinstance(first, (cst.Name, cst.Integer, cst.Attribute)) else f"({code(first)})"
        scaled = cst.parse_expression(f"{size} * {strategy}.num_replicas_in_sync")
        shape = shape.with_changes(elements=[shape.elements[0].with_changes(value=scaled), *shape.elements[1:]])
    return _Placeholder(name, statement, dtype, shape)


def _tower_placeholders(statements, tf_api, strategy: str) -> list[_Placeholder] | None:
    """The replica function's `x = tf.placeholder(...)` statements, each collected with
    `<list>.append(x)`; None when the towers make no placeholder."""
    calls = [c for s in statements for c in find(s, cst.Call) if tf_api(c) == PLACEHOLDER]
    if not calls:
        return None
    flat = _unconditional(statements)
    holders = []
    for statement in flat:
        assigned = _assign(statement)
        if assigned is not None and isinstance(assigned[1], cst.Call) and tf_api(assigned[1]) == PLACEHOLDER:
            holders.append(_placeholder(assigned[0], statement, assigned[1], strategy))
    # A placeholder made conditionally, or not bound to a name, cannot become part of one batch.
    if len(holders) != len(calls):
        raise Unmatched("a placeholder in the tower is not `name = tf.placeholder(...)` in code that always runs")
    by_name = {h.name: h for h in holders}
    if len(by_name) != len(holders):
        raise Unmatched("two placeholders in the tower have the same name")
    for statement in flat:
        small = single_small(statement)
        if not (isinstance(small, cst.Expr) and _method(small.value, "append")):
            continue
        call = small.value
        if not (isinstance(call.func.value, cst.Name) and len(call.args) == 1 and call.args[0].keyword is None
                and not call.args[0].star and isinstance(call.args[0].value, cst.Name)):
            continue
        holder = by_name.get(call.args[0].value.value)
        if holder is None:
            continue
        # One list per placeholder, filled once per tower: then `list[k]` is tower k's placeholder.
        if holder.append is not None:
            raise Unmatched(f"`{holder.name}` is appended to a list twice in the tower")
        holder.holder_list, holder.append = call.func.value.value, statement
    for holder in holders:
        if holder.append is None:
            raise Unmatched(f"`{holder.name}` is not collected with `<list>.append({holder.name})` in the tower")
    lists = [h.holder_list for h in holders]
    if len(set(lists)) != len(lists):
        raise Unmatched("two placeholders of a tower go into the same list")
    # The lists are the program's handle on the placeholders: the tower may only fill them.
    for holder in holders:
        if sum(len(_references(s, holder.holder_list)) for s in statements) != 1:
            raise Unmatched(f"the tower uses `{holder.holder_list}` other than to append `{holder.name}`")
    # The batch is unpacked where the first placeholder was made: each name must be bound
    # there only, and read only after its own placeholder (before it, it named something else).
    order = {id(n): k for k, n in enumerate(n for s in statements for n in walk(s))}
    removed = {id(n) for h in holders for n in (*walk(h.statement), *walk(h.append))}
    for holder in holders:
        if sum(1 for s in statements for name, _ in _bound_names(s) if name == holder.name) != 1:
            raise Unmatched(f"`{holder.name}` is assigned again in the tower")
        made = order[id(holder.statement)]
        for reference in (r for s in statements for r in _references(s, holder.name)):
            if id(reference) not in removed and order[id(reference)] < made:
                raise Unmatched(f"`{holder.name}` is read in the tower before its placeholder is made")
    return holders


@dataclass
class _Feed:
    entries: dict[str, str] = field(default_factory=dict)       # placeholder list -> fed array
    per: list[cst.BaseExpression] = field(default_factory=list)  # the slice sizes (`per_tower`)
    code: list[cst.CSTNode] = field(default_factory=list)       # the feed-building code (all of it)

    def add(self, holder_list: str, array: str) -> None:
        if holder_list in self.entries:
            raise Unmatched(f"`{holder_list}` is fed twice")
        self.entries[holder_list] = array


class _FeedReader:
    """Reads the feed the session loop builds, entry by entry; Unmatched on anything else."""

    def __init__(self, lists: set[str], counts: Callable[[cst.BaseExpression], bool], tf_api, direct: bool = False):
        self.lists, self.is_count, self.tf_api = lists, counts, tf_api
        # `direct`: the keys are the placeholders themselves, each fed a whole array of the
        # batch (`{images: x, targets: y}`), not lists of per-tower placeholders.
        self.direct = direct
        self.feed = _Feed()
        self.pieces: dict[str, str] = {}  # `xs_parts = np.split(xs, N)`: name -> array
        self.splits: list[cst.BaseExpression] = []  # the `np.split` spellings used

    def split_of(self, expression: cst.BaseExpression) -> str | None:
        """The array of `np.split(A, N)` (N the tower count), or of a name assigned it."""
        if self.direct:
            return None  # the towers cut the batch themselves (`tf.split`): no numpy pieces
        if isinstance(expression, cst.Name) and expression.value in self.pieces:
            return self.pieces[expression.value]
        # np.split cuts equal contiguous parts (and fails on a batch that does not divide), what
        # the strategy does; np.array_split's unequal parts differ from the strategy's then.
        if isinstance(expression, cst.Call) and self.tf_api(expression) == NP_SPLIT and len(expression.args) == 2 \
                and all(a.keyword is None and not a.star for a in expression.args) \
                and isinstance(expression.args[0].value, cst.Name) and self.is_count(expression.args[1].value):
            self.splits.append(expression.func)
            return expression.args[0].value.value
        return None

    def key(self, expression: cst.BaseExpression, index: str, bound: dict[str, str]) -> str:
        """The placeholder list of `L[k]` (or of a name bound to L's elements)."""
        if isinstance(expression, cst.Name) and expression.value in bound:
            return bound[expression.value]
        if isinstance(expression, cst.Subscript) and isinstance(expression.value, cst.Name) \
                and expression.value.value in self.lists and _is_index(expression, index):
            return expression.value.value
        raise Unmatched(f"the feed's key `{code(expression)}` is not tower k's placeholder")

    def piece(self, expression: cst.BaseExpression, index: str | None, bound: dict[str, str]) -> str:
        """The array tower k is fed a part of: `A[k * per:(k + 1) * per]`, `np.split(A, N)[k]`."""
        if isinstance(expression, cst.Name) and expression.value in bound:
            return bound[expression.value]
        if isinstance(expression, cst.Subscript) and index is not None and len(expression.slice) == 1:
            element = expression.slice[0].slice
            if isinstance(element, cst.Slice) and isinstance(expression.value, cst.Name):
                per = _contiguous_part(element, index)
                if per is not None:
                    self.feed.per.append(per)
                    return expression.value.value
            split = self.split_of(expression.value)
            if split is not None and _is_index(expression, index):
                return split
        # Anything else (another array, a transformation of the slice, a constant) is a feed
        # the dataset cannot express.
        raise Unmatched(f"tower k is fed `{code(expression)}`, not its contiguous part of one batch array")

    def comprehension(self, node: cst.DictComp) -> None:
        """`{L[k]: A[...] for k in range(N)}`, `{h: A[...] for k, h in enumerate(L)}`,
        `{h: p for h, p in zip(L, np.split(A, N))}`."""
        loop = node.for_in
        if loop.ifs or loop.inner_for_in is not None or loop.asynchronous is not None:
            raise Unmatched("the feed comprehension filters or nests")
        index, bound = self.loop_index(loop.target, loop.iter)
        self.feed.add(self.key(node.key, index, bound), self.piece(node.value, index, bound))

    def loop_index(self, target, iterable) -> tuple[str | None, dict[str, str]]:
        """A loop over the towers: `k in range(N)`, `k, h in enumerate(L)`, `h, p in zip(L, pieces)`."""
        call = iterable if isinstance(iterable, cst.Call) else None
        name = code(call.func) if call is not None else ""
        arguments = [a.value for a in call.args] if call is not None and all(
            a.keyword is None and not a.star for a in call.args) else []
        if isinstance(target, cst.Name) and name in ("range", "xrange") and len(arguments) == 1 \
                and self.is_count(arguments[0]):
            return target.value, {}
        pair = [e.value for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else []
        if len(pair) == 2 and all(isinstance(e, cst.Name) for e in pair) and len(arguments) == 1 + (name == "zip"):
            first = arguments[0]
            if isinstance(first, cst.Name) and first.value in self.lists:
                if name == "enumerate":
                    return pair[0].value, {pair[1].value: first.value}
                if name == "zip" and self.split_of(arguments[1]) is not None:
                    return None, {pair[0].value: first.value, pair[1].value: self.split_of(arguments[1])}
        raise Unmatched(f"the feed is built over `{code(iterable)}`, not over the towers")

    def dict_value(self, value: cst.BaseExpression) -> None:
        """A whole feed: a comprehension, or a dict of `**comprehension`s (``direct``: a
        dict literal `{placeholder: array, ...}`)."""
        if self.direct:
            self.direct_value(value)
        elif isinstance(value, cst.DictComp):
            self.comprehension(value)
        elif isinstance(value, cst.Dict) and value.elements and all(
                isinstance(e, cst.StarredDictElement) and isinstance(e.value, cst.DictComp) for e in value.elements):
            for element in value.elements:
                self.comprehension(element.value)
        else:
            raise Unmatched(f"the feed `{code(value)}` is not one comprehension per placeholder list")

    def direct_value(self, value: cst.BaseExpression) -> None:
        """`{images: x, targets: y}`: each split placeholder fed one array of the batch."""
        if not (isinstance(value, cst.Dict) and all(isinstance(e, cst.DictElement) for e in value.elements)):
            raise Unmatched(f"the feed `{code(value)}` is not a dict literal of the split placeholders")
        for element in value.elements:
            key = element.key
            # Any other entry (a learning rate, a dropout rate, ...) has no place in the dataset.
            if not (isinstance(key, cst.Name) and key.value in self.lists):
                raise Unmatched(f"the feed's key `{code(key)}` is not a placeholder the towers read through `tf.split`")
            # The dataset yields the batch's arrays as drawn: a transformed array is not one of them.
            if not isinstance(element.value, cst.Name):
                raise Unmatched(f"`{key.value}` is fed `{code(element.value)}`, not an array of the batch")
            self.feed.add(key.value, element.value.value)

    def loop(self, statement: cst.For, feed: str) -> None:
        """`for k in range(N):` whose body only does `feed[L[k]] = A[...]` or `feed.update({...})`."""
        if self.direct:
            # The placeholders are not per tower: a loop building their feed is not the shape read here.
            raise Unmatched("the feed of the split placeholders is built in a loop")
        if statement.orelse is not None or statement.asynchronous is not None \
                or not isinstance(statement.body, cst.IndentedBlock):
            raise Unmatched("the loop building the feed has an else or is async")
        index, bound = self.loop_index(statement.target, statement.iter)
        for line in statement.body.body:
            small = single_small(line)
            if isinstance(small, cst.Assign) and len(small.targets) == 1:
                target = small.targets[0].target
                if isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name) \
                        and target.value.value == feed and len(target.slice) == 1 \
                        and isinstance(target.slice[0].slice, cst.Index):
                    self.feed.add(self.key(target.slice[0].slice.value, index, bound),
                                  self.piece(small.value, index, bound))
                    continue
            if isinstance(small, cst.Expr) and _method(small.value, "update") and code(small.value.func.value) == feed \
                    and len(small.value.args) == 1 and isinstance(small.value.args[0].value, cst.Dict):
                for element in small.value.args[0].value.elements:
                    if not isinstance(element, cst.DictElement):
                        raise Unmatched("the feed is updated with a `**` entry")
                    self.feed.add(self.key(element.key, index, bound), self.piece(element.value, index, bound))
                continue
            raise Unmatched(f"the loop building the feed also runs `{code(line).strip()}`")
        self.feed.code.append(statement)


def _is_index(subscript: cst.Subscript, index: str | None) -> bool:
    if index is None or len(subscript.slice) != 1 or not isinstance(subscript.slice[0].slice, cst.Index):
        return False
    value = subscript.slice[0].slice.value
    return isinstance(value, cst.Name) and value.value == index


def _linear(expression: cst.BaseExpression, index: str) -> dict[tuple[str, ...], int] | None:
    """An expression as a sum of products over the index and other atoms (by their code):
    `(k + 1) * per` -> {(k, per): 1, (per,): 1}. None for anything but +, * and integers."""
    if isinstance(expression, cst.Integer):
        return {(): int(expression.value, 0)}
    if isinstance(expression, cst.BinaryOperation) and isinstance(expression.operator, (cst.Add, cst.Multiply)):
        left, right = _linear(expression.left, index), _linear(expression.right, index)
        if left is None or right is None:
            return None
        result: dict[tuple[str, ...], int] = {}
        if isinstance(expression.operator, cst.Add):
            for term in (left, right):
                for monomial, coefficient in term.items():
                    result[monomial] = result.get(monomial, 0) + coefficient
        else:
            for a, x in left.items():
                for b, y in right.items():
                    monomial = tuple(sorted(a + b))
                    result[monomial] = result.get(monomial, 0) + x * y
        return {m: c for m, c in result.items() if c}
    if isinstance(expression, (cst.Name, cst.Attribute, cst.BinaryOperation, cst.Call)):
        return {(code(expression),): 1}
    return None


def _contiguous_part(element: cst.Slice, index: str) -> cst.BaseExpression | None:
    """`per` when the slice is `[k * per:(k + 1) * per]` (in any arrangement of the arithmetic)."""
    if element.lower is None or element.upper is None or element.step is not None:
        return None
    lower, upper = _linear(element.lower, index), _linear(element.upper, index)
    if lower is None or upper is None or len(lower) != 1:
        return None
    ((monomial, coefficient),) = lower.items()
    if coefficient != 1 or len(monomial) != 2 or index not in monomial:
        return None
    per = monomial[0] if monomial[1] == index else monomial[1]
    if per == index or upper != {monomial: 1, (per,): 1}:
        return None
    for node in walk(element.lower):
        if isinstance(node, (cst.Name, cst.Attribute, cst.BinaryOperation, cst.Call)) and code(node) == per:
            return node
    return None


def _integer_constant(name: cst.BaseExpression, module: cst.Module) -> int | None:
    """The value of a module-level `NAME = <int>` assigned nowhere else."""
    if not isinstance(name, cst.Name):
        return None
    values = [value for s in module.body if (assigned := _assign(s)) is not None and assigned[0] == name.value
              for value in [assigned[1]]]
    if len(values) != 1 or not isinstance(values[0], cst.Integer):
        return None
    if sum(1 for bound, _ in _bound_names(module) if bound == name.value) != 1:
        return None
    return int(values[0].value, 0)


def _yields_tuples(function: cst.FunctionDef, arity: int | None) -> bool:
    """Whether every value the generator yields is a tuple of ``arity`` items (what
    from_generator's tuple signature reads); any yield when ``arity`` is None."""
    yields = []
    stack = list(children(function.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            continue
        if isinstance(node, cst.Yield):
            yields.append(node)
        stack.extend(children(node))
    if not yields:
        return False
    if arity is None:
        return all(y.value is not None and not isinstance(y.value, cst.From) for y in yields)
    return all(isinstance(y.value, cst.Tuple) and len(y.value.elements) == arity
               and not any(isinstance(e, cst.StarredElement) for e in y.value.elements) for y in yields)


def plan(
    statements: list[cst.BaseStatement], loop: cst.For, before: list[cst.BaseStatement], owner: cst.CSTNode,
    after_loop: Callable[[cst.CSTNode], bool], *, strategy: str, tf: Callable[[str], str],
    tf_api: Callable[[cst.Call], str | None], fresh: Callable[..., str], imports, module: cst.Module,
) -> FedInput | None:
    """The generator-backed input for tower code ``statements`` that makes its own placeholders
    (or, see :func:`_plan_split`, reads the `tf.split` pieces of placeholders made before the loop).

    None when the towers make no placeholder and read no split placeholder; Unmatched (with the
    reason) when they do, in a shape this does not replace. ``loop``: the original tower loop;
    the other arguments as for :func:`tfmigrate.rewrites.tower_input.plan`; ``imports``: the module's
    import table.
    """
    holders = _tower_placeholders(statements, tf_api, strategy)
    if holders is None:
        return _plan_split(statements, loop, before, owner, after_loop, strategy=strategy, tf=tf,
                           tf_api=tf_api, fresh=fresh, imports=imports, module=module)
    lists = {h.holder_list: h for h in holders}

    # --- the lists: made empty before the loop, in its block, and used by nothing but the feed
    inits = []
    for name in lists:
        made = [s for s in before if _list_init_names(s) is not None and name in _list_init_names(s)]
        if len(made) != 1:
            raise Unmatched(f"`{name}` is not made an empty list before the tower loop, in its block")
        if made[0] not in inits:
            inits.append(made[0])
    for statement in inits:
        # The whole statement goes, so it may only make these lists.
        if not set(_list_init_names(statement)) <= set(lists):
            raise Unmatched(f"`{code(statement).strip()}` also makes lists that are not placeholder lists")

    session = _session_input(
        lists, loop, owner, module, after_loop, strategy=strategy, tf=tf, tf_api=tf_api, fresh=fresh,
        imports=imports, direct=False, what="the placeholder lists", scope=module,
        elsewhere="`{}` is used elsewhere in the module", fed_comment="# the slice its tower was fed.",
    )
    names = [h.name for h in session.ordered]
    target = names[0] if isinstance(session.batch, cst.Name) else ", ".join(names) + ("," if len(names) == 1 else "")
    comments = [line for h in holders for s in (h.statement, h.append) for line in s.leading_lines
                if line.comment is not None]
    first = min(holders, key=lambda h: _position(statements, h.statement))
    unpack = cst.parse_statement(f"{target} = {session.parameter}\n").with_changes(leading_lines=comments)

    region = dict(session.region)
    region.update({id(s): cst.RemovalSentinel.REMOVE for s in inits})
    return FedInput(
        iterator_statement=session.iterator_statement, parameter=session.parameter, unpack=unpack, dropped=(),
        get_next=session.get_next, initializer=session.initializer, initialize=session.initialize,
        prelude=(session.dataset_statement,), region=region, anchors=(session.session_loop, *inits),
        imports=session.imports, remove_imports=session.remove_imports, note=session.note,
        removed=frozenset(id(s) for h in holders for s in (h.statement, h.append) if s is not first.statement),
        replaced=id(first.statement),
        placeholder_calls=frozenset(
            id(c) for c in find(loop.body, cst.Call) if tf_api(c) == PLACEHOLDER
        ),
    )


@dataclass
class _Session:
    """The session loop read through a distributed dataset: what both shapes share."""

    ordered: list[_Placeholder]         # the fed placeholders, in the order of the batch's arrays
    batch: cst.BaseExpression           # the loop's batch target (`(xs, ys)` or `batch`)
    parameter: str                      # the replica function's parameter
    get_next: str
    dataset_statement: cst.BaseStatement
    iterator_statement: cst.BaseStatement
    initializer: cst.BaseStatement
    initialize: cst.BaseStatement
    session_loop: cst.For
    region: dict[int, object]
    imports: tuple
    remove_imports: tuple
    note: str = " and feed it from a tf.data.Dataset.from_generator over the session loop's batches"


@dataclass
class _Request:
    """What :func:`_session_input` was asked: its parameters, bundled."""

    lists: dict[str, _Placeholder]
    loop: cst.For
    owner: cst.CSTNode
    module: cst.Module
    after_loop: Callable[[cst.CSTNode], bool]
    strategy: str
    tf: Callable[[str], str]
    tf_api: Callable[[cst.Call], str | None]
    fresh: Callable[..., str]
    imports: ImportTable
    direct: bool
    what: str
    scope: cst.CSTNode
    elsewhere: str
    fed_comment: str


@dataclass
class _Found:
    """The facts about the session loop found so far, section by section of :func:`_session_input`."""

    # the session loop
    order: dict[int, int]               # id(node) -> its position in a walk of the owner
    readers: list[cst.Name]             # the references to the lists after the tower loop
    session_loop: cst.For
    initializer: cst.BaseStatement      # `sess.run(tf.global_variables_initializer())`
    session: str                        # the session it runs in
    # its header
    counter: str | None = None
    start: cst.BaseExpression | None = None
    source: cst.BaseExpression | None = None
    batch: cst.BaseExpression | None = None
    arrays: list[str] = field(default_factory=list)
    # the training step
    run: cst.Call | None = None
    body: list[cst.BaseStatement] = field(default_factory=list)
    at: int = 0                         # the step's position in the body
    feed_argument: cst.BaseExpression | None = None
    # the feed
    tower_count: set[str] = field(default_factory=set)
    reader: _FeedReader | None = None
    feed_name: str | None = None
    removed_lines: list[cst.BaseStatement] = field(default_factory=list)
    kept_before: list[cst.BaseStatement] = field(default_factory=list)
    feed_code: list[cst.CSTNode] = field(default_factory=list)
    # the slice sizes and the source
    per_statements: list[cst.BaseStatement] = field(default_factory=list)
    itertools_name: str | None = None


def _session_input(
    lists: dict[str, _Placeholder], loop: cst.For, owner: cst.CSTNode, module: cst.Module,
    after_loop: Callable[[cst.CSTNode], bool], *, strategy: str, tf: Callable[[str], str],
    tf_api: Callable[[cst.Call], str | None], fresh: Callable[..., str], imports, direct: bool, what: str,
    scope: cst.CSTNode, elsewhere: str, fed_comment: str,
) -> _Session:
    """The session loop that feeds ``lists`` (the feed's keys: placeholder lists indexed by
    tower, or with ``direct`` the placeholders themselves, each fed a whole array of the batch),
    rewritten to read a generator-backed distributed dataset of the same batches.

    ``what`` names the keys in reasons; each key is referenced in ``scope`` twice before the
    loop (made and filled, or made and split) and otherwise only by the feed (``elsewhere``
    formats the reason when not).
    """
    asked = _Request(
        lists, loop, owner, module, after_loop, strategy=strategy, tf=tf, tf_api=tf_api, fresh=fresh,
        imports=imports, direct=direct, what=what, scope=scope, elsewhere=elsewhere, fed_comment=fed_comment,
    )
    # The checks run in this order: the first that fails gives the reason.
    found = _find_session_loop(asked)
    _read_header(asked, found)
    _find_training_step(asked, found)
    _read_feed(asked, found)
    _check_feed_only_names(asked, found)
    _find_slice_statements(asked, found)
    _check_source(asked, found)
    return _new_session(asked, found)


def _find_session_loop(asked: _Request) -> _Found:
    """Find the one loop after the tower loop that reads the lists, after the variables initializer."""
    what, owner, lists = asked.what, asked.owner, asked.lists
    parents = parents_of(owner)
    order = {id(n): k for k, n in enumerate(walk(owner))}
    readers = [r for name in lists for r in _references(owner, name) if asked.after_loop(r)]
    if not readers:
        raise Unmatched(f"{what} are not fed after the tower loop")
    session_loops = set()
    for reader in readers:
        outermost, node = None, reader
        while id(node) in parents:
            node = parents[id(node)]
            if node is owner:
                break
            if isinstance(node, cst.For):
                outermost = node
            elif isinstance(node, cst.While):
                # One dataset, initialised once, serves one pass over the batches.
                raise Unmatched(f"{what} are fed inside a `while` loop")
            elif isinstance(node, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                raise Unmatched(f"{what} are read in a nested function")
        if outermost is None:
            raise Unmatched(f"{what} are used outside a `for` loop over the batches")
        session_loops.add(id(outermost))
        session_loop = outermost
    if len(session_loops) != 1:
        raise Unmatched(f"{what} are read in more than one loop")
    # Each key: made once, filled (or split) once, read in the session loop only.
    for name in lists:
        if len(_references(asked.scope, name)) != 2 + sum(1 for r in readers if r.value == name):
            raise Unmatched(asked.elsewhere.format(name))
    if session_loop.orelse is not None or session_loop.asynchronous is not None \
            or not isinstance(session_loop.body, cst.IndentedBlock):
        raise Unmatched("the session loop has an `else` (it would no longer run when the batches run out)")

    # The dataset is read through an iterator initialised where the variables are, so the loop
    # must come after that initializer, in the same session.
    initialized = find_initializer(owner, asked.tf_api, asked.after_loop)
    if initialized is None:
        raise Unmatched("no single `sess.run(tf.global_variables_initializer())` after the tower loop")
    initializer, session = initialized
    if order[id(initializer)] > order[id(session_loop)]:
        raise Unmatched("the variables are initialised after the session loop")
    return _Found(order=order, readers=readers, session_loop=session_loop, initializer=initializer, session=session)


def _read_header(asked: _Request, found: _Found) -> None:
    """Read the session loop's header `for [step,] <batch> in [enumerate(]<source>[, start)]`."""
    counter = start = None
    source, batch = found.session_loop.iter, found.session_loop.target
    if isinstance(source, cst.Call) and code(source.func) == "enumerate" \
            and asked.imports.resolve(source.func) is None:
        arguments = source.args
        keywords = [None if a.keyword is None else a.keyword.value for a in arguments]
        if not (isinstance(batch, cst.Tuple) and len(batch.elements) == 2 and isinstance(batch.elements[0].value, cst.Name)
                and not any(a.star for a in arguments) and keywords in ([None], [None, None], [None, "start"])):
            raise Unmatched(f"cannot read the session loop's header `for {code(batch)} in {code(source)}`")
        counter = batch.elements[0].value.value
        start = arguments[1].value if len(arguments) == 2 else None
        source, batch = arguments[0].value, batch.elements[1].value
    if isinstance(batch, cst.Name):
        arrays = [batch.value]
    elif isinstance(batch, (cst.Tuple, cst.List)) and all(isinstance(e.value, cst.Name) for e in batch.elements):
        arrays = [e.value.value for e in batch.elements]
    else:
        raise Unmatched(f"the session loop's batch `{code(batch)}` is not one name or a tuple of names")
    if len(set(arrays)) != len(arrays):
        raise Unmatched("the session loop's batch binds a name twice")
    found.counter, found.start, found.source, found.batch, found.arrays = counter, start, source, batch, arrays


def _find_training_step(asked: _Request, found: _Found) -> None:
    """Find the training step: the one `sess.run(..., feed_dict=feed)` statement of the session loop."""
    session_loop, session = found.session_loop, found.session
    runs = [c for c in find(session_loop.body, cst.Call) if _method(c, "run") and _feed_argument(c) is not None]
    if len(runs) != 1:
        raise Unmatched(f"the session loop runs {len(runs)} `run(..., feed_dict=...)` calls, not one")
    run = runs[0]
    if code(run.func.value) != session:
        raise Unmatched(f"the training step runs in `{code(run.func.value)}`, not the session `{session}` initialised")
    body = list(session_loop.body.body)
    at = next((k for k, s in enumerate(body) if any(c is run for c in find(s, cst.Call))), None)
    if at is None or not isinstance(body[at], cst.SimpleStatementLine):
        if at is not None and isinstance(body[at], cst.For) and any(
                any(c is run for c in find(s, cst.Call)) for s in body[at].body.body
                if isinstance(body[at].body, cst.IndentedBlock) and isinstance(s, cst.SimpleStatementLine)):
            # One dataset, initialised once, serves one pass over the batches: not an epoch loop's.
            raise Unmatched("the loop over the batches is inside another loop")
        # Under an `if` or in a `try` it would not run once per batch drawn.
        raise Unmatched("the training step is not a statement of the loop over the batches itself")
    feed_argument = _feed_argument(run)
    if isinstance(feed_argument, cst.Name) and feed_argument.value in asked.lists:
        raise Unmatched("a placeholder list is passed as the feed")
    found.run, found.body, found.at, found.feed_argument = run, body, at, feed_argument


def _read_feed(asked: _Request, found: _Found) -> None:
    """Read the feed, built in statements before the step or written in the call, and match it to the batch."""
    lists, feed_argument = asked.lists, found.feed_argument
    tower_loop_count = _tower_count(asked.loop)
    reader = _FeedReader(set(lists), lambda n: _is_count(n, tower_loop_count, set(lists)), asked.tf_api,
                         direct=asked.direct)
    feed_name = feed_argument.value if isinstance(feed_argument, cst.Name) else None
    removed_lines: list[cst.BaseStatement] = []
    kept_before: list[cst.BaseStatement] = []
    for statement in found.body[:found.at]:
        assigned = _assign(statement)
        if feed_name is not None and assigned is not None and assigned[0] == feed_name:
            value = assigned[1]
            if not (isinstance(value, cst.Dict) and not value.elements or code(value) == "dict()"):
                reader.dict_value(value)
            reader.feed.code.append(statement)
            removed_lines.append(statement)
        elif feed_name is not None and isinstance(statement, cst.For) and _references(statement, feed_name):
            reader.loop(statement, feed_name)
            removed_lines.append(statement)
        elif assigned is not None and reader.split_of(assigned[1]) is not None:
            reader.pieces[assigned[0]] = reader.split_of(assigned[1])
            reader.feed.code.append(statement)
            removed_lines.append(statement)
        elif _harmless(statement, asked.imports):
            kept_before.append(statement)
        elif any(asked.tf_api(c) == NP_ARRAY_SPLIT for c in find(statement, cst.Call)):
            raise Unmatched("the batch is cut with np.array_split, whose parts differ from the strategy's "
                            "when the batch does not divide evenly")
        else:
            # It ran after the batch was drawn; now it would also run once more when the input
            # runs out, before the step raises.
            raise Unmatched(f"the session loop runs `{code(statement).strip()}` before the training step")
    if feed_name is None:
        reader.dict_value(feed_argument)
    feed = reader.feed
    if set(feed.entries) != set(lists):
        missing = sorted(set(lists) - set(feed.entries))
        raise Unmatched(f"the feed does not feed {', '.join(f'`{m}`' for m in missing)} (or feeds other things)")
    fed = sorted(feed.entries.values())
    if fed != sorted(found.arrays):
        raise Unmatched(
            f"the towers are fed from {', '.join(f'`{a}`' for a in fed)}, not from each array of the batch "
            f"`{code(found.batch)}` once"
        )
    found.tower_count, found.reader, found.feed_name = tower_loop_count, reader, feed_name
    found.removed_lines, found.kept_before = removed_lines, kept_before
    found.feed_code = [*feed.code, feed_argument]


def _check_feed_only_names(asked: _Request, found: _Found) -> None:
    """Check that the lists, arrays, feed and pieces serve the feed only, and that what stays is not read later."""
    # The arrays, the feed and its pieces are read by the feed-building code only: nothing else
    # may see a batch that now never reaches Python. The lists go: only that code may read them.
    owner, arrays, feed_code, order = asked.owner, found.arrays, found.feed_code, found.order
    for name in asked.lists:
        if sum(len(_references(node, name)) for node in feed_code) != sum(1 for r in found.readers if r.value == name):
            raise Unmatched(f"the session loop reads `{name}` other than to build the feed")
    for name in [*arrays, *([found.feed_name] if found.feed_name else []), *found.reader.pieces]:
        inside = sum(len(_references(node, name)) for node in feed_code)
        bound = 1 if name in arrays else 0
        if len(_references(owner, name)) != inside + bound:
            raise Unmatched(f"`{name}` is used other than to feed the towers")
    # Statements kept before the step run once more at the end: what they set must not be used after the loop.
    end = max(order[id(n)] for n in walk(found.session_loop))
    counter = found.counter
    for name in {n for s in found.kept_before for n, _ in _bound_names(s)} | ({counter} if counter else set()):
        if any(order[id(r)] > end for r in _references(owner, name)):
            raise Unmatched(f"`{name}` is read after the session loop, where it would have changed")


def _find_slice_statements(asked: _Request, found: _Found) -> None:
    """Check the slice sizes `per = <batch> // <tower count>` and find the statements only the feed used."""
    removable = []
    for per in found.reader.feed.per:
        removable += _check_per(per, asked.owner, asked.module, found.tower_count, set(asked.lists), found.order,
                                found.session_loop)
    per_statements = []
    for name, statement in removable:
        inside = sum(len(_references(node, name)) for node in found.feed_code)
        if len(_references(asked.module, name)) == inside + 1 and statement not in per_statements:
            per_statements.append(statement)  # only the feed used it
    found.per_statements = per_statements


def _check_source(asked: _Request, found: _Found) -> None:
    """Check the batch source, evaluated when the iterator is initialised, right after the variables."""
    owner, source, start, counter, order = asked.owner, found.source, found.start, found.counter, found.order
    owner_bindings = _bound_names(owner)
    for name in names_used(source) | (names_used(start) if start is not None else set()):
        for bound, node in owner_bindings:
            if bound == name and order.get(id(node), -1) >= order[id(asked.loop)]:
                raise Unmatched(f"the batch source reads `{name}`, which is set after the tower loop")
    if isinstance(source, cst.Name) and len(_references(owner, source.value)) != 1 + sum(
            1 for bound, _ in owner_bindings if bound == source.value):
        raise Unmatched(f"the batch source `{source.value}` is used elsewhere")
    if counter is not None and any(_references(s, counter) for s in found.body):
        bound_to = asked.imports.bindings.get("itertools")
        if bound_to not in (None, "itertools") or (bound_to is None and _references(asked.module, "itertools")):
            raise Unmatched("the name `itertools` is taken")
        found.itertools_name = "itertools"


def _new_session(asked: _Request, found: _Found) -> _Session:
    """Build the new code: the dataset, its iterator, and the session loop reading it."""
    tf, fresh, batch = asked.tf, asked.fresh, found.batch
    by_array = {array: asked.lists[holder_list] for holder_list, array in found.reader.feed.entries.items()}
    ordered = [by_array[a] for a in found.arrays]
    spec = tf("tensorflow.TensorSpec")
    specs = [f"{spec}({code(h.shape)}, {code(h.dtype)})" for h in ordered]
    generator = _generator(found.source, batch, found.arrays, asked.module)
    dataset = fresh("dataset", "feed_dataset", "batch_dataset")
    iterator = fresh("inputs", "input_iterator", "replica_inputs")
    parameter = fresh("batch", "replica_batch")
    from_generator = tf("tensorflow.data.Dataset.from_generator")
    if isinstance(batch, cst.Name):
        dataset_code = f"{dataset} = {from_generator}(\n    {generator}, output_signature={specs[0]})\n"
    elif generator.isidentifier():
        items = "".join(f"    {s},\n" for s in specs)
        dataset_code = f"{dataset} = {from_generator}({generator}, output_signature=(\n{items}))\n"
    else:
        items = "".join(f"        {s},\n" for s in specs)
        dataset_code = f"{dataset} = {from_generator}(\n    {generator},\n    output_signature=(\n{items}    ))\n"
    dataset_statement = cst.parse_statement(dataset_code).with_changes(leading_lines=[
        cst.EmptyLine(comment=cst.Comment(
            "# The session loop's batches: the strategy gives each replica its contiguous part,"
        )),
        cst.EmptyLine(comment=cst.Comment(asked.fed_comment)),
    ])
    iterator_statement = cst.parse_statement(
        f"{iterator} = {tf('tensorflow.compat.v1.data.make_initializable_iterator')}(\n"
        f"    {asked.strategy}.experimental_distribute_dataset({dataset}))\n"
    )
    region: dict[int, object] = {id(found.session_loop): _new_session_loop(asked, found)}
    region.update({id(s): cst.RemovalSentinel.REMOVE for s in found.per_statements})
    return _Session(
        ordered=ordered, batch=batch, parameter=parameter, get_next=f"{iterator}.get_next()",
        dataset_statement=dataset_statement, iterator_statement=iterator_statement, initializer=found.initializer,
        initialize=cst.parse_statement(f"{found.session}.run({iterator}.initializer)\n"),
        session_loop=found.session_loop, region=region,
        imports=(ImportItem("itertools"),) if found.itertools_name else (),
        remove_imports=tuple(_numpy_imports(found.reader.splits, asked.imports)),
    )


def _new_session_loop(asked: _Request, found: _Found) -> cst.BaseStatement:
    """Build the new session loop: the step reads the iterator until it runs out."""
    session_loop, body, at, run = found.session_loop, found.body, found.at, found.run
    out_of_range = asked.tf("tensorflow.errors.OutOfRangeError")
    step = body[at].visit(_Replace({id(run): _without_feed(run)}))
    guarded = cst.parse_statement(f"while True:\n    try:\n        pass\n    except {out_of_range}:\n        break\n")
    guarded = guarded.body.body[0]
    guarded = guarded.with_changes(
        body=guarded.body.with_changes(body=[step.with_changes(leading_lines=())]),
        leading_lines=step.leading_lines,
    )
    removed_ids = {id(s) for s in found.removed_lines}
    new_body = [guarded if k == at else s for k, s in enumerate(body) if id(s) not in removed_ids]
    block = session_loop.body.with_changes(body=new_body)
    if found.itertools_name is not None:
        start, counter = found.start, found.counter
        count = f"{found.itertools_name}.count({code(start) if start is not None else ''})"
        return session_loop.with_changes(target=cst.Name(counter), iter=cst.parse_expression(count), body=block)
    return cst.While(test=cst.Name("True"), body=block, leading_lines=session_loop.leading_lines)


# --- placeholders made before the loop, cut with tf.split ---------------------------------

class SplitUnmatched(Unmatched):
    """Placeholders made before the tower loop and cut with `tf.split`, in a shape this rewrite
    does not replace: the replicas keep reading their pieces, fed each step (TFM101 says why)."""


@dataclass
class SplitFedInput(FedInput):
    """The input of towers that read ``x_parts[i]`` of ``x_parts = tf.split(images, N)``."""

    reads: dict[int, str] = field(default_factory=dict)  # id(`x_parts[i]`) -> the replica's name for it

    def step_body(self, statements: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        transformer = _Replace({k: cst.Name(name) for k, name in self.reads.items()})
        return [self.unpack, *(s.visit(transformer) for s in statements)]


def _assigned_calls(statement: cst.CSTNode) -> list[tuple[str, cst.Call]]:
    """`name = call(...)` -> [(name, call)]; `a, b = f(...), g(...)` -> [(a, f(...)), (b, g(...))]."""
    assigned = _assign(statement)
    if assigned is not None:
        return [assigned] if isinstance(assigned[1], cst.Call) else []
    small = single_small(statement)
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
        return []
    target, value = small.targets[0].target, small.value
    if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)) \
            and len(target.elements) == len(value.elements) \
            and all(isinstance(t, cst.Element) and isinstance(t.value, cst.Name) for t in target.elements) \
            and all(isinstance(v, cst.Element) and isinstance(v.value, cst.Call) for v in value.elements):
        return [(t.value.value, v.value) for t, v in zip(target.elements, value.elements)]
    return []


def _loop_index(loop: cst.For) -> str | None:
    """The tower index: `i` of `for i in range(N)` or `for i, d in enumerate(D)`."""
    target, iterable = loop.target, loop.iter
    func = code(iterable.func) if isinstance(iterable, cst.Call) else ""
    if isinstance(target, cst.Name) and func in ("range", "xrange"):
        return target.value
    if isinstance(target, cst.Tuple) and len(target.elements) == 2 and isinstance(target.elements[0].value, cst.Name) \
            and func == "enumerate":
        return target.elements[0].value.value
    return None


def _split_arguments(name: str, call: cst.Call) -> dict[str, cst.BaseExpression]:
    """`tf.split(value, num_or_size_splits, axis=0, num=None, name=...)`'s arguments by name."""
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    values = dict(zip(("value", "num_or_size_splits", "axis"), positional))
    # `num` (the count of a size list TensorFlow cannot infer) and starred arguments leave the
    # pieces unknown here.
    if any(a.star for a in call.args) or len(positional) > 3 \
            or set(keywords) - {"value", "num_or_size_splits", "axis", "name"} or set(keywords) & set(values) \
            or len(positional) + len(set(keywords) & {"value", "num_or_size_splits"}) < 2:
        raise Unmatched(f"cannot read the arguments of `{name} = {code(call)}`")
    values.update(keywords)
    return values


def _plan_split(
    statements: list[cst.BaseStatement], loop: cst.For, before: list[cst.BaseStatement], owner: cst.CSTNode,
    after_loop: Callable[[cst.CSTNode], bool], *, strategy: str, tf: Callable[[str], str],
    tf_api: Callable[[cst.Call], str | None], fresh: Callable[..., str], imports, module: cst.Module,
) -> SplitFedInput | None:
    """The textbook shape: global placeholders made before the tower loop, cut with
    ``x_parts = tf.split(images, N)``, tower ``i`` reading ``x_parts[i]``, and the session loop
    feeding ``{images: x, targets: y}`` with the arrays of each batch it draws::

        images = tf.placeholder(tf.float32, [None, 8])
        targets = tf.placeholder(tf.float32, [None, 1])
        x_parts = tf.split(images, NUM_GPUS)
        y_parts = tf.split(targets, NUM_GPUS)
        for i in range(NUM_GPUS):
            ... tower_model(x_parts[i]) ... y_parts[i] ...
        ...
        for step, (x, y) in enumerate(make_batches()):
            _, loss_value = sess.run([train_op, loss], feed_dict={images: x, targets: y})

    The placeholders and the splits go; the batch source becomes the same generator-backed
    distributed dataset as for per-tower placeholders, and the replica function binds its part
    of the batch to the placeholders' names (``images, targets = batch``), read where the tower
    read its piece (``tower_model(images)``): under the strategy, the replica's input *is* what
    the placeholder stood for, at the replica's share. ``tf.split(x, N)`` cuts N equal
    contiguous parts along axis 0, replica k's part of each global batch under
    MirroredStrategy, so each replica trains on the piece its tower did.

    None when the towers read no `tf.split` piece of a placeholder; SplitUnmatched otherwise
    when anything differs.
    """
    index = _loop_index(loop)
    splits: dict[str, tuple[cst.SimpleStatementLine, cst.Call]] = {}
    for statement in before:
        for name, call in _assigned_calls(statement):
            if tf_api(call) == SPLIT:
                splits[name] = (statement, call)
    read = {name: found for name in splits if (found := [r for s in statements for r in _references(s, name)])}
    if index is None or not read:
        return None
    placeholders = {
        name: (s, call) for s in find(owner, cst.SimpleStatementLine) for name, call in _assigned_calls(s)
        if tf_api(call) == PLACEHOLDER
    }

    def splits_placeholder(call: cst.Call) -> bool:
        value = next((a.value for a in call.args if a.keyword is None or a.keyword.value == "value"), None)
        return isinstance(value, cst.Name) and value.value in placeholders

    if not any(splits_placeholder(splits[name][1]) for name in read):
        return None  # the pieces of tensors the program does not feed (queue batches, arguments)
    try:
        return _split_input(
            statements, loop, index, before, owner, after_loop, {name: splits[name] for name in read}, placeholders,
            strategy=strategy, tf=tf, tf_api=tf_api, fresh=fresh, imports=imports, module=module,
        )
    except Unmatched as reason:
        raise SplitUnmatched(str(reason)) from None


def _split_input(statements, loop, index, before, owner, after_loop, splits, placeholders, *,
                 strategy, tf, tf_api, fresh, imports, module) -> SplitFedInput:
    owner_bindings = _bound_names(owner)
    count = _tower_count(loop)
    # The replica index replaces the loop variable: `x_parts[i]` is replica i's piece only if
    # the tower never rebinds `i`.
    if any(name == index for s in statements for name, _ in _bound_names(s)):
        raise Unmatched(f"the tower assigns the loop variable `{index}`")
    holders: dict[str, _Placeholder] = {}   # placeholder name -> its spec
    reads: dict[int, str] = {}              # id(`x_parts[i]`) -> placeholder name
    removed: list[cst.SimpleStatementLine] = []
    for name, (statement, call) in splits.items():
        placeholder, own = _split_pieces(name, call, statements, loop, index, owner, owner_bindings, count, placeholders)
        # One split per placeholder: the replica's part gets the placeholder's name.
        if placeholder in holders:
            raise Unmatched(f"`{placeholder}` is cut by more than one `tf.split`")
        made, made_call = placeholders[placeholder]
        # The placeholder goes where the dataset is made: with the loop's other set-up, in its block.
        if not any(s is made for s in before):
            raise Unmatched(f"the placeholder `{placeholder}` is not made before the tower loop, in its block")
        holders[placeholder] = _placeholder(placeholder, made, made_call, strategy, per_tower=False)
        reads.update({id(n): placeholder for n in own})
        removed += [s for s in (made, statement) if not any(s is r for r in removed)]
    _check_goes_whole(removed, splits, holders, statements)

    session = _session_input(
        holders, loop, owner, module, after_loop, strategy=strategy, tf=tf, tf_api=tf_api, fresh=fresh,
        imports=imports, direct=True, what="the split placeholders", scope=owner,
        elsewhere="`{}` is used other than by its `tf.split` and the feed",
        fed_comment="# the piece `tf.split` cut for its tower.",
    )
    return _split_fed_input(session, removed, reads)


def _split_pieces(name, call, statements, loop, index, owner, owner_bindings, count, placeholders):
    """Check one `x_parts = tf.split(x, n)` of the tower loop: the placeholder it cuts, and the
    tower's own pieces `x_parts[i]` (refused unless every check holds)."""
    arguments = _split_arguments(name, call)
    value, parts, axis = arguments["value"], arguments["num_or_size_splits"], arguments.get("axis")
    # Only a placeholder's pieces can come from the batches the session loop feeds.
    if not (isinstance(value, cst.Name) and value.value in placeholders):
        raise Unmatched(f"`{name}` cuts `{code(value)}`, not a placeholder the session loop feeds")
    placeholder = value.value
    # The strategy cuts each batch along its first axis; pieces along another are other examples.
    if axis is not None and not (isinstance(axis, cst.Integer) and int(axis.value, 0) == 0):
        raise Unmatched(f"`{name}` cuts `{placeholder}` along axis `{code(axis)}`, not the batch axis 0 "
                        "that the strategy splits")
    # A list of sizes may be unequal (and is fixed): the strategy's parts are equal.
    if isinstance(parts, (cst.List, cst.Tuple)):
        raise Unmatched(f"`{name}` cuts `{placeholder}` into the sizes `{code(parts)}`, not into equal parts")
    # One piece per tower is what makes piece i the replica's part; any other count is not.
    if not _is_count(parts, count, set()):
        raise Unmatched(f"`{name}` cuts `{placeholder}` into `{code(parts)}` pieces, not one per tower "
                        f"(`{' / '.join(sorted(count)) or code(loop.iter)}`)")
    # The pieces go with the split: it must be the only binding of the name, read only by the towers.
    if sum(1 for bound, _ in owner_bindings if bound == name) != 1:
        raise Unmatched(f"`{name}` is assigned more than once")
    if len(_references(owner, name)) != 1 + len(_references(loop, name)):
        raise Unmatched(f"`{name}` is used outside the tower loop")
    pieces = [n for s in statements for n in walk(s)
              if isinstance(n, cst.Subscript) and isinstance(n.value, cst.Name) and n.value.value == name]
    own = [n for n in pieces if _is_index(n, index)]
    # Each tower reads its own piece: `x_parts[0]` or `x_parts` whole are other examples.
    if len(own) != len(_references(loop, name)):
        raise Unmatched(f"the tower reads `{name}` other than as its own piece `{name}[{index}]`")
    return placeholder, own


def _check_goes_whole(removed, splits, holders, statements) -> None:
    # A statement that goes whole (`x_parts, y_parts = tf.split(...), tf.split(...)`) may only
    # make what goes with it.
    for statement in removed:
        kept = [name for name, _ in _assigned_calls(statement) if name not in splits and name not in holders]
        if kept:
            raise Unmatched(f"`{code(statement).strip()}` also makes {', '.join(f'`{k}`' for k in kept)}, "
                            "which the towers do not read as their pieces")
    # The replica binds the placeholders' names: the tower must not already use them.
    for placeholder in holders:
        if any(_references(s, placeholder) for s in statements):
            raise Unmatched(f"the tower uses the name `{placeholder}` besides its pieces")


def _split_fed_input(session, removed, reads) -> SplitFedInput:
    """The split-fed input, from the session loop's dataset: the removed splits' comments stay
    above the dataset that replaces them."""
    names = [h.name for h in session.ordered]
    target = names[0] if isinstance(session.batch, cst.Name) else ", ".join(names) + ("," if len(names) == 1 else "")
    unpack = cst.parse_statement(f"{target} = {session.parameter}\n")
    # Comments above the statements that go stay, above the dataset that replaces them.
    comments = [line for s in removed for line in s.leading_lines if line.comment is not None]
    dataset_statement = session.dataset_statement.with_changes(
        leading_lines=[*comments, *session.dataset_statement.leading_lines])
    region = dict(session.region)
    region.update({id(s): cst.RemovalSentinel.REMOVE for s in removed})
    return SplitFedInput(
        iterator_statement=session.iterator_statement, parameter=session.parameter, unpack=unpack, dropped=(),
        get_next=session.get_next, initializer=session.initializer, initialize=session.initialize,
        prelude=(dataset_statement,), region=region, anchors=(session.session_loop, *removed),
        imports=session.imports, remove_imports=session.remove_imports,
        note=" and feed it from a tf.data.Dataset.from_generator over the session loop's batches "
             "in place of the split placeholders",
        reads=reads,
    )


def _numpy_imports(splits: list[cst.BaseExpression], imports) -> list[ImportItem]:
    """The imports the removed `np.split` calls went through (`import numpy as np`, `from
    numpy import split`); the fix engine removes those that end up unused."""
    found: list[ImportItem] = []
    for func in splits:
        head = func
        while isinstance(head, cst.Attribute):
            head = head.value
        bound = imports.bindings.get(head.value) if isinstance(head, cst.Name) else None
        if bound is None:
            continue
        if "." not in bound:  # `import numpy [as np]`
            item = ImportItem(bound, alias=None if head.value == bound else head.value)
        else:  # `from numpy import split [as cut]`
            module, _, name = bound.rpartition(".")
            item = ImportItem(module, name, alias=None if head.value == name else head.value)
        if item not in found:
            found.append(item)
    return found


def _position(statements, statement) -> int:
    return next(k for k, n in enumerate(n for s in statements for n in walk(s)) if n is statement)


def _list_init_names(statement: cst.CSTNode) -> list[str] | None:
    """`a = []` -> [a]; `a, b = [], []` -> [a, b]; else None."""
    small = single_small(statement)
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
        return None
    target, value = small.targets[0].target, small.value
    if isinstance(target, cst.Name) and isinstance(value, cst.List) and not value.elements:
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)) \
            and len(target.elements) == len(value.elements) \
            and all(isinstance(t.value, cst.Name) for t in target.elements) \
            and all(isinstance(v.value, cst.List) and not v.value.elements for v in value.elements):
        return [t.value.value for t in target.elements]
    return None


def _feed_argument(call: cst.Call) -> cst.BaseExpression | None:
    for k, arg in enumerate(call.args):
        if (arg.keyword is not None and arg.keyword.value == "feed_dict") or (arg.keyword is None and k == 1 and not arg.star):
            return arg.value
    return None


def _without_feed(run: cst.Call) -> cst.Call:
    """The call without its feed (a positional feed must be the last positional argument)."""
    args = list(run.args)
    k = next(k for k, a in enumerate(args) if a.value is _feed_argument(run))
    if args[k].keyword is None and any(a.keyword is None for a in args[k + 1:]):
        raise Unmatched("the training step passes arguments after its positional feed")
    del args[k]
    if args:
        args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return run.with_changes(args=args)


def _tower_count(loop: cst.For) -> set[str]:
    """Spellings of the number of towers: `N` of `range(N)`, `len(D)` of `enumerate(D)`."""
    iterable = loop.iter
    if isinstance(iterable, cst.Call) and iterable.args and code(iterable.func) in ("range", "xrange") \
            and len(iterable.args) == 1:
        return {code(iterable.args[0].value)}
    if isinstance(iterable, cst.Call) and code(iterable.func) == "enumerate" and len(iterable.args) == 1:
        return {f"len({code(iterable.args[0].value)})"}
    if isinstance(iterable, (cst.Name, cst.Attribute)):
        return {f"len({code(iterable)})"}
    return set()


def _is_count(expression: cst.BaseExpression, tower_count: set[str], lists: set[str]) -> bool:
    """The number of towers: as the tower loop spells it, or `len(<placeholder list>)`."""
    text = code(expression)
    return text in tower_count or any(text == f"len({name})" for name in lists)


def _check_per(per: cst.BaseExpression, owner, module, tower_count, lists, order, session_loop):
    """Check that the slice size is `<batch> // <tower count>`, so that the N slices are the
    whole batch (when the batch divides) as the strategy's parts are; returns the
    (name, statement) that defines it, for removal when only the feed used it."""
    definition, found = per, []
    if isinstance(per, cst.Name):
        sites = [(s, v) for s in find(owner, cst.SimpleStatementLine)
                 if (assigned := _assign(s)) is not None and assigned[0] == per.value for v in [assigned[1]]]
        where = owner
        if not sites and owner is not module:
            sites = [(s, v) for s in module.body if (assigned := _assign(s)) is not None and assigned[0] == per.value
                     for v in [assigned[1]]]
            where = module
        if len(sites) != 1 or sum(1 for n, _ in _bound_names(where) if n == per.value) != 1:
            raise Unmatched(f"the slice size `{per.value}` is not assigned once")
        statement, definition = sites[0]
        if where is owner and order[id(statement)] > order[id(session_loop)]:
            raise Unmatched(f"the slice size `{per.value}` is assigned after the session loop")
        found = [(per.value, statement)] if where is owner else []
    if not (isinstance(definition, cst.BinaryOperation) and isinstance(definition.operator, cst.FloorDivide)
            and _is_count(definition.right, tower_count, lists)):
        raise Unmatched(f"the slice size `{code(per)}` is not `<batch> // <number of towers>`")
    # Known sizes: a batch that does not divide leaves a remainder no tower was fed.
    batch, towers = _integer_constant(definition.left, module), _integer_constant(definition.right, module)
    if batch is not None and towers and batch % towers:
        raise Unmatched(f"the batch of {batch} does not divide into {towers} towers: the towers dropped the rest")
    return found


def _harmless(statement: cst.CSTNode, imports) -> bool:
    """`name = <expression>` whose only calls read a clock (`start = time.time()`)."""
    small = single_small(statement)
    if not (isinstance(small, cst.Assign) and all(isinstance(t.target, cst.Name) for t in small.targets)):
        return False
    return all(imports.resolve(c.func) in TIMERS for c in find(small.value, cst.Call)) and not find(
        small.value, cst.Yield, cst.Await, cst.NamedExpr)


def _generator(source: cst.BaseExpression, batch: cst.BaseExpression, arrays: list[str], module: cst.Module) -> str:
    """A callable returning the batch source, for from_generator. A generator function of this
    module whose every yield is a tuple of the batch's arity is used as it is; anything else is
    repacked in a generator expression, since from_generator reads a list as one tensor, not a
    tuple of them."""
    arity = None if isinstance(batch, cst.Name) else len(arrays)
    if isinstance(source, cst.Call) and isinstance(source.func, cst.Name):
        function = next((s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == source.func.value), None)
        if function is not None and _yields_tuples(function, arity) and sum(
                1 for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == source.func.value) == 1:
            return source.func.value if not source.args else f"lambda: {code(source)}"
    if arity is None:
        return f"lambda: {code(source)}"
    names = ", ".join(arrays) + ("," if arity == 1 else "")
    return f"lambda: (({names}) for {names} in {code(source)})"
