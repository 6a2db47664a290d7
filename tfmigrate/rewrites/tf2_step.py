"""The ``tf2`` target of the tower rewrite (TFM101, TFM106): an eager program whose training
step is a ``tf.function`` that runs a ``tf.GradientTape`` replica step through the strategy.

It starts from what the compat rewrite (:mod:`tfmigrate.rewrites.mirrored`) made of the loop: a
distributed dataset read by an initializable iterator, a replica function that computes and
applies its gradients, ``strategy.run`` + ``strategy.reduce``, and a session loop that reads
until the input runs out. That code is our own, so its shape is known exactly; this module
turns it into TF2::

    with strategy.scope():                          # no tf.Graph(): eager
        model = tf.keras.Sequential([...])          # Keras, built when made
        opt = tf.keras.optimizers.SGD(learning_rate=0.1)
        dataset = tf.data.Dataset.from_generator(...)
        inputs = strategy.experimental_distribute_dataset(dataset)
        trainable = model.trainable_variables
        opt.build(trainable)

        def tower_step(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = tower_loss(model, x, y)
                scaled_loss = loss / strategy.num_replicas_in_sync
            opt.apply_gradients(zip(tape.gradient(scaled_loss, trainable), trainable))
            return loss

        @tf.function
        def train_step(batch):
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(tower_step, args=(batch,)), axis=None)

        for step, batch in enumerate(inputs):
            loss_value = train_step(batch)
            ...

What it trains is what the step reads from the scope: a Keras model's (or layer's)
``trainable_variables``, or ``tf.Variable``s. The optimizer is built on them under the scope:
slots a Keras optimizer made in the first call of the ``tf.function`` step would be initialised
inside it, under a ``cond``, which fails with MirroredStrategy's collective all-reduce. The v1
optimizer becomes the Keras optimizer with the same update (plain and momentum SGD, and Adam
with v1's epsilon). The scaling is the compat rewrite's:
MirroredStrategy sums the replicas' gradients, so a loss whose gradients the helper averaged
is divided by the replica count, inside the tape.

It applies only where the model code allows (DESIGN ``tf2``): Keras layers built where they are
made, or functions without TF1 variable creation; no TF1-only API left anywhere in the module;
and input the compat rewrite already turned into a dataset. Anything else raises
:class:`NotTf2` with the reason, and the compat rewrite applies.
"""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass

import libcst as cst

from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import find, names_used, single_small, walk
from tfmigrate.rewrites.keras3_optimizers import TF1_OPTIMIZERS as OPTIMIZERS, keras_of_tf1_optimizer
from tfmigrate.rewrites.tower_input import INITIALIZERS
from tfmigrate.tf_api import tf1_only
from tfmigrate.rewrites.refusal import Refused

# What marks a Keras model built when it is made (its variables exist before the first step).
BUILT = re.compile(r"\bInput\(|\binput_shape\s*=|\binput_dim\s*=|\bbatch_input_shape\s*=|\.build\(")
# TF1 APIs the TF2 step cannot keep, besides those the verify detector lists.
DENIED_PREFIXES = ("tensorflow.losses.", "tensorflow.layers.", "tensorflow.contrib.", "tensorflow.summary.",
                   "tensorflow.nn.rnn_cell.")
DENIED = {"tensorflow.data.make_initializable_iterator", "tensorflow.data.make_one_shot_iterator",
          "tensorflow.data.get_output_shapes", "tensorflow.data.get_output_types"}


class NotTf2(Refused):
    """The program's code does not allow the tf2 target; the message says why."""


@dataclass
class Loop:
    """What the compat rewrite made, by name (its nodes are new, so they are found by shape)."""

    strategy: str          # `strategy`
    step: str              # the replica function, `tower_step`
    loss: str              # `loss`
    train: str             # `train_op`
    optimizer: str         # `opt`
    iterator: str          # `inputs`
    averages: bool         # the helper averaged (so the loss is divided by the replica count)
    compute_rest: tuple    # compute_gradients's arguments after the loss
    apply_rest: tuple      # apply_gradients's arguments after the gradients


def denied_api(name: str | None) -> bool:
    """Whether a canonical TensorFlow name is TF1-only (gone or graph-only in TF2)."""
    if name is None or not name.startswith("tensorflow."):
        return False
    parts = name.split(".")
    return (len(parts) > 1 and tf1_only(parts[1:])) or name in DENIED or name.startswith(DENIED_PREFIXES)


def _assignment(statement: cst.CSTNode) -> tuple[cst.BaseAssignTargetExpression, cst.BaseExpression] | None:
    small = single_small(statement)
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        return small.targets[0].target, small.value
    return None


def _call_of(statement: cst.CSTNode) -> cst.Call | None:
    small = single_small(statement)
    value = small.value if isinstance(small, (cst.Assign, cst.Expr)) else None
    return value if isinstance(value, cst.Call) else None


def _is_method(call: cst.CSTNode, owner: str, method: str) -> bool:
    return (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == method
            and code(call.func.value) == owner)


class _ToTf2(cst.CSTTransformer):
    """The compat rewrite's code, made TF2 (see the module docstring)."""

    def __init__(self, loop: Loop, resolve, tf, fresh, trained: list[str]):
        super().__init__()
        self.loop, self.resolve, self.tf, self.fresh, self.trained = loop, resolve, tf, fresh, trained
        self.sessions: set[str] = set()   # names the session was bound to
        self.initializers: set[str] = set()  # `init = tf.global_variables_initializer()`
        self.train_step = fresh("train_step", "distributed_train_step")
        self.keras_optimizer = False      # the optimizer is (now) a Keras one

    # --- the graph and the session go --------------------------------------------------
    def visit_With(self, node: cst.With) -> None:
        for item in node.items:
            if self._is_session(item.item) and isinstance(item.asname, cst.AsName):
                self.sessions.add(code(item.asname.name))

    def leave_With(self, original: cst.With, updated: cst.With):
        if any(self._is_session(item.item) for item in updated.items):
            if len(updated.items) != 1:
                raise NotTf2("the session is opened together with something else in one `with`")
            body = list(updated.body.body)
            first = body[0].with_changes(leading_lines=[*updated.leading_lines, *body[0].leading_lines])
            return cst.FlattenSentinel([first, *body[1:]])
        items = [item for item in updated.items if not _is_graph(item.item)]
        if len(items) == len(updated.items):
            return updated
        items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(items=items)

    def _is_initializer(self, expression: cst.CSTNode) -> bool:
        """`tf.global_variables_initializer()` and its older name."""
        return isinstance(expression, cst.Call) and self.resolve(expression.func) in {
            f"tensorflow.{name}" for name in INITIALIZERS}

    def _is_session(self, expression: cst.CSTNode) -> bool:
        return isinstance(expression, cst.Call) and self.resolve(expression.func) in (
            "tensorflow.Session", "tensorflow.InteractiveSession")

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        assigned = _assignment(node)
        if assigned is None or not isinstance(assigned[0], cst.Name):
            return
        name, value = assigned[0].value, assigned[1]
        if self._is_session(value):
            self.sessions.add(name)
        elif self._is_initializer(value):
            self.initializers.add(name)

    def leave_SimpleStatementLine(self, original, updated):
        assigned = _assignment(updated)
        call = _call_of(updated)
        loop = self.loop
        if assigned is not None and isinstance(assigned[0], cst.Name):
            name, value = assigned[0].value, assigned[1]
            if name in self.sessions or name in self.initializers:
                return cst.RemovalSentinel.REMOVE
            if name == loop.optimizer and isinstance(value, cst.Call):
                made_by = self.resolve(value.func) or ""
                self.keras_optimizer = made_by in OPTIMIZERS or made_by.startswith("keras.optimizers.")
                if made_by in OPTIMIZERS:
                    return updated.with_deep_changes(updated.body[0], value=self._keras_optimizer(value))
            if (name == loop.iterator and isinstance(value, cst.Call) and value.args
                    and self.resolve(value.func) == "tensorflow.data.make_initializable_iterator"):
                # The distributed dataset itself is iterable in TF2.
                return updated.with_deep_changes(updated.body[0], value=value.args[0].value)
            if name == loop.loss and _is_method(value, loop.strategy, "reduce"):
                return self._train_step(updated, value)
            if name == loop.train and code(value) == f"{loop.loss}.op":
                return cst.RemovalSentinel.REMOVE
        if call is not None and isinstance(call.func, cst.Attribute) and code(call.func.value) in self.sessions:
            method = call.func.attr.value
            fetched = code(call.args[0].value) if call.args else ""
            if method == "close" or (method == "run" and (
                    fetched == f"{loop.iterator}.initializer" or fetched in self.initializers
                    or (call.args and self._is_initializer(call.args[0].value)))):
                return cst.RemovalSentinel.REMOVE
        return updated

    def leave_EmptyLine(self, original: cst.EmptyLine, updated: cst.EmptyLine) -> cst.EmptyLine:
        # The compat rewrite's own comment over the dataset: there is no session loop any more.
        if updated.comment is not None and updated.comment.value.startswith("# The session loop's batches"):
            return updated.with_changes(comment=cst.Comment(
                updated.comment.value.replace("# The session loop's", "# The training loop's", 1)))
        return updated

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        # A blank line after the train step's definition, before the loop that calls it.
        body = list(updated.body)
        for k in range(1, len(body)):
            previous = body[k - 1]
            if (isinstance(previous, cst.FunctionDef) and previous.name.value == self.train_step
                    and not any(line.comment is None for line in body[k].leading_lines)):
                body[k] = body[k].with_changes(leading_lines=[cst.EmptyLine(indent=False), *body[k].leading_lines])
        return updated.with_changes(body=body)

    # --- the optimizer ---------------------------------------------------------------------
    def _keras_optimizer(self, call: cst.Call) -> cst.BaseExpression:
        made, why = keras_of_tf1_optimizer(call, self.resolve(call.func), self.tf)
        if why is not None:
            raise NotTf2(why)
        return cst.parse_expression(made)

    # --- the replica step: a tape ----------------------------------------------------------
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        if updated.name.value != self.loop.step:
            return updated
        loop = self.loop
        body = list(updated.body.body)
        # The compat step ends with: grads = opt.compute_gradients(...); train = opt.apply_gradients(...);
        # with tf.control_dependencies([train]): return tf.identity(loss)
        if len(body) < 3 or not isinstance(body[-1], cst.With) or "control_dependencies" not in code(body[-1].items[0]):
            raise NotTf2("the tower computes its gradients inside a block (a `with` or an `if`), not at its end")
        forward = body[:-3]
        # The replica index and the batch's unpacking stay before the tape: they compute nothing.
        before = []
        parameters = {p.name.value for p in updated.params.params}
        while forward and _is_preamble(forward[0], parameters):
            before.append(forward.pop(0))
        tape, variables, scaled = self.fresh("tape"), self.fresh("trainable", "trainable_variables"), self.fresh("scaled_loss")
        inside = list(forward)
        if loop.averages:
            inside.append(cst.parse_statement(f"{scaled} = {loop.loss} / {loop.strategy}.num_replicas_in_sync\n"))
        target = scaled if loop.averages else loop.loss
        if not inside:
            raise NotTf2("the tower computes nothing before its gradients")
        statements = [
            *before,
            cst.parse_statement(f"with {self.tf('tensorflow.GradientTape')}() as {tape}:\n    pass\n").with_changes(
                body=cst.IndentedBlock(body=inside)),
            cst.parse_statement(
                f"{loop.optimizer}.apply_gradients(zip({tape}.gradient({target}, {variables}), {variables}))\n"),
            cst.parse_statement(f"return {loop.loss}\n"),
        ]
        if len(self.trained) == 1 and self.trained[0].endswith(".trainable_variables"):
            listed = self.trained[0]
        else:
            listed = "[" + ", ".join(f"*{t}" if t.endswith(".trainable_variables") else t for t in self.trained) + "]"
        build = [
            cst.parse_statement(f"{variables} = {listed}\n").with_changes(leading_lines=[
                *updated.leading_lines,
                cst.EmptyLine(comment=cst.Comment(
                    "# The optimizer makes its slots now, under the strategy's scope: made in the first")),
                cst.EmptyLine(comment=cst.Comment(
                    "# call of the tf.function step, they would be initialised inside it, conditionally.")),
            ]),
            cst.parse_statement(f"{loop.optimizer}.build({variables})\n"),
        ]
        function = updated.with_changes(body=updated.body.with_changes(body=statements),
                                        leading_lines=[cst.EmptyLine(indent=False)])
        return cst.FlattenSentinel([*build, function])

    def _train_step(self, statement: cst.SimpleStatementLine, reduce: cst.Call):
        run = reduce.args[1].value if len(reduce.args) > 1 else None
        if not (_is_method(run, self.loop.strategy, "run") and len(run.args) == 2):
            raise NotTf2("the reduced value is not the compat rewrite's strategy.run")
        batch = "batch"
        new_run = run.with_changes(args=[run.args[0], run.args[1].with_changes(
            value=cst.parse_expression(f"({batch},)"))])
        new_reduce = reduce.with_changes(args=[reduce.args[0], reduce.args[1].with_changes(value=new_run),
                                               *reduce.args[2:]])
        # One level deeper than the statement it replaces: continuation lines move right too.
        returned = code(new_reduce).replace("\n", "\n    ")
        function = cst.parse_statement(
            f"@{self.tf('tensorflow.function')}\ndef {self.train_step}({batch}):\n    return {returned}\n"
        )
        return cst.FlattenSentinel([function.with_changes(leading_lines=statement.leading_lines)])

    # --- the session loop: one call of the train step per global batch --------------------
    def leave_For(self, original: cst.For, updated: cst.For):
        read = self._read_until_the_end(updated.body)
        if read is None:
            return updated
        iterable = updated.iter
        # The compat rewrite's own `itertools.count()` (its import may not be there yet).
        if not (isinstance(iterable, cst.Call) and code(iterable.func).split(".")[-1] == "count" and not iterable.args):
            raise NotTf2("the session loop does not count its steps from 0")
        batch = self._loop_batch(updated)
        target = cst.parse_expression(f"{code(updated.target)}, {batch}")
        return updated.with_changes(
            target=target, iter=cst.parse_expression(f"enumerate({self.loop.iterator})"),
            body=updated.body.with_changes(body=read(batch)),
        )

    def leave_While(self, original: cst.While, updated: cst.While):
        read = self._read_until_the_end(updated.body)
        if read is None:
            return updated
        if not (isinstance(updated.test, cst.Name) and updated.test.value == "True"):
            raise NotTf2("the session loop is not `while True:`")
        batch = self._loop_batch(updated)
        return cst.For(
            target=cst.Name(batch), iter=cst.Name(self.loop.iterator),
            body=updated.body.with_changes(body=read(batch)),
            leading_lines=updated.leading_lines,
        )

    def _loop_batch(self, loop_node) -> str:
        used = names_used(loop_node)
        return next(n for n in ("batch", "global_batch", "next_batch") if n not in used)

    def _read_until_the_end(self, body: cst.IndentedBlock):
        """For a loop body with `try: <run the step> except OutOfRangeError: break`: a function
        making the body that calls the train step on a batch instead."""
        # The first `try` at the top of the loop body (timing statements may come before it).
        first = next((s for s in body.body if isinstance(s, cst.Try)), None)
        if not (isinstance(first, cst.Try) and len(first.handlers) == 1 and first.handlers[0].type is not None
                and (self.resolve(first.handlers[0].type) or "").endswith("errors.OutOfRangeError")):
            return None
        if len(first.body.body) != 1:
            raise NotTf2("the session loop does more than one session run inside its `try`")
        (statement,) = first.body.body
        at = list(body.body).index(first)
        call = _call_of(statement)
        if not (call is not None and isinstance(call.func, cst.Attribute) and call.func.attr.value == "run"
                and code(call.func.value) in self.sessions and len(call.args) == 1):
            raise NotTf2("the session loop's `try` holds something other than the training step's session run")
        fetches = call.args[0].value
        assigned = _assignment(statement)
        loop, step = self.loop, self.train_step

        def names(node) -> list[str] | None:
            if isinstance(node, cst.Name):
                return [node.value]
            if isinstance(node, (cst.List, cst.Tuple)):
                found = [code(e.value) for e in node.elements]
                return found if all(isinstance(e.value, cst.Name) for e in node.elements) else None
            return None

        fetched = names(fetches)
        if fetched is None or loop.train not in fetched or not set(fetched) <= {loop.train, loop.loss}:
            raise NotTf2(f"the session loop fetches `{code(fetches)}`; the tf2 train step returns only the loss")
        def body_with(made: str):
            def new_body(batch: str) -> list[cst.BaseStatement]:
                call_statement = cst.parse_statement(f"{made}{batch})\n").with_changes(
                    leading_lines=[*first.leading_lines, *statement.leading_lines])
                return [*body.body[:at], call_statement, *body.body[at + 1:]]
            return new_body

        if assigned is None:
            return body_with(f"{step}(")
        targets = names(assigned[0])
        if isinstance(fetches, cst.Name) or targets is None or len(targets) != len(fetched) or isinstance(
                assigned[0], cst.Name):
            raise NotTf2(f"cannot tell which name receives the loss in `{code(statement).strip()}`")
        received = dict(zip(fetched, targets))
        if received[loop.train] != "_" and received[loop.train] in names_used(body):
            raise NotTf2(f"the session loop reads the train op's result `{received[loop.train]}`")
        loss_name = received.get(loop.loss)
        return body_with(f"{loss_name} = {step}(" if loss_name else f"{step}(")


def _is_preamble(statement: cst.CSTNode, parameters: set[str]) -> bool:
    """`x, y = batch` (a parameter unpacked) or the replica index line of the compat step."""
    assigned = _assignment(statement)
    if assigned is None:
        return False
    value = assigned[1]
    return (isinstance(value, cst.Name) and value.value in parameters) or "replica_id_in_sync_group" in code(value)


def _is_graph(expression: cst.CSTNode) -> bool:
    return (isinstance(expression, cst.Call) and isinstance(expression.func, cst.Attribute)
            and expression.func.attr.value == "as_default")


def trained_variables(node: cst.CSTNode, loop: Loop, module: cst.Module, resolve) -> list[str]:
    """What the replica step trains, as expressions for its variables: for each name it reads
    that the code under the scope binds to a Keras constructor (or to a call of a module
    function that makes one) `<name>.trainable_variables`; for a `tf.Variable`, the name."""
    step = next((f for f in find(node, cst.FunctionDef) if f.name.value == loop.step), None)
    if step is None:
        raise NotTf2("the replica function is not the compat rewrite's")
    read = names_used(step, keywords=False) - bound_names(step.body)  # what it reads from outside
    makers = {f.name.value for f in module.body if isinstance(f, cst.FunctionDef) and "keras" in code(f)}
    models: list[str] = []
    inside_step = {id(n) for n in walk(step)}
    for statement in find(node, cst.SimpleStatementLine):
        if id(statement) in inside_step:
            continue
        assigned = _assignment(statement)
        if assigned is None or not isinstance(assigned[0], cst.Name) or not isinstance(assigned[1], cst.Call):
            continue
        name, call = assigned[0].value, assigned[1]
        if name not in read or name in (loop.optimizer, loop.strategy, loop.iterator) or name in models:
            continue
        made_by = resolve(call.func) or ""
        if made_by.startswith("keras.") or (isinstance(call.func, cst.Name) and call.func.value in makers):
            models.append(f"{name}.trainable_variables")
        elif made_by == "tensorflow.Variable":
            trainable = next((a.value for a in call.args if a.keyword and a.keyword.value == "trainable"), None)
            if trainable is None or code(trainable) != "False":
                models.append(name)
        else:
            raise NotTf2(f"the tower reads `{name}`, made by `{code(call.func)}`, which is not a Keras "
                         "model or layer, nor a tf.Variable: the tape step needs to know what it trains")
    if not models:
        raise NotTf2("the tower trains no Keras model or layer, nor tf.Variable, made under the strategy scope")
    return models


def convert(node: cst.CSTNode, loop: Loop, *, resolve, tf, fresh, module: cst.Module) -> cst.CSTNode:
    """``node`` (the compat rewrite of the function or `with` holding the loop) made TF2."""
    transformer = _ToTf2(loop, resolve, tf, fresh, trained_variables(node, loop, module, resolve))
    converted = node.visit(transformer)
    if not transformer.keras_optimizer:
        raise NotTf2(f"the optimizer `{loop.optimizer}` is not made under the strategy scope by a v1 optimizer "
                     "with a Keras counterpart (GradientDescent, Momentum, Adam)")
    left = names_used(converted)
    for session in transformer.sessions:
        if session in left:
            raise NotTf2(f"the session `{session}` is used for more than the training loop")
    if loop.train in left:
        raise NotTf2(f"`{loop.train}` is used for more than the training loop's session run")
    return converted


# What the conversion itself replaces: allowed in the compat code it starts from.
CONVERTED = {"tensorflow.Session", "tensorflow.InteractiveSession", "tensorflow.data.make_initializable_iterator",
             *(f"tensorflow.{name}" for name in INITIALIZERS), *OPTIMIZERS}


def check_api(parts: list[cst.CSTNode], resolve, *, skipped=(), allowed=frozenset()) -> None:
    """NotTf2 naming the first TF1-only API (other than ``allowed``) used in ``parts`` outside
    the nodes ``skipped``."""
    skipped_ids = {id(n) for r in skipped for n in walk(r)}
    for part in parts:
        nodes = list(walk(part))
        inner = {id(n.value) for n in nodes if isinstance(n, cst.Attribute)}  # `tf.train` of `tf.train.X`
        for node in nodes:
            if id(node) in skipped_ids or id(node) in inner or not isinstance(node, (cst.Attribute, cst.Name)):
                continue
            name = resolve(node)
            if denied_api(name) and name not in allowed:
                raise NotTf2(f"the program uses `{code(node)}` ({name}), which TF2 does not have; "
                             "the tf2 target needs the whole program in TF2")


def check_loop(loop: Loop) -> None:
    """NotTf2 when the gradient calls carry more than the tape step keeps."""
    if loop.compute_rest:
        raise NotTf2("compute_gradients is given more than the loss (a var_list?); the tape's gradients are "
                     "for every trainable variable the loss used")
    if loop.apply_rest:
        raise NotTf2("apply_gradients is given more than the gradients (a global_step?); the Keras optimizer "
                     "counts its own steps in `optimizer.iterations`")


def bound_names(node: cst.CSTNode) -> set[str]:
    """Names bound anywhere under ``node``: assigned, parameters, defined, `as` names, loop targets."""
    bound: set[str] = set()
    for current in walk(node):
        if isinstance(current, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign)):
            bound |= names_used(current.target)
        elif isinstance(current, (cst.For, cst.CompFor)):
            bound |= names_used(current.target)
        elif isinstance(current, cst.AsName):
            bound |= names_used(current.name)
        elif isinstance(current, cst.Param):
            bound.add(current.name.value)
        elif isinstance(current, (cst.FunctionDef, cst.ClassDef)):
            bound.add(current.name.value)
    return bound


def check_model_code(module: cst.Module, kept: list[cst.CSTNode],
                     step: cst.FunctionDef, scope_body: cst.CSTNode, strategy: str, resolve) -> None:
    """Refuse (NotTf2) unless the program can run as TF2: no TF1-only API anywhere it keeps,
    and the replica step reads only what is made under the strategy scope, module-level
    functions, classes, imports and constants.

    ``kept`` is the converted code (the module around it was checked before the conversion);
    ``step`` the (converted) replica function; ``scope_body`` what runs under the strategy scope."""
    check_api(kept, resolve)
    module_level: dict[str, cst.CSTNode | None] = {}
    for statement in module.body:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            module_level[statement.name.value] = None
        elif isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                    for alias in small.names:
                        bound = alias.asname.name if alias.asname else alias.name
                        module_level[code(bound).split(".")[0]] = None
                elif isinstance(small, cst.Assign):
                    for target in small.targets:
                        for name in names_used(target.target):
                            module_level[name] = small.value
    allowed = bound_names(scope_body) | set(dir(builtins)) | {strategy}
    for name in sorted(names_used(step, keywords=False) - allowed):
        if name not in module_level:
            raise NotTf2(f"the tower reads `{name}`, made outside the strategy scope; its variables would "
                         "not be mirrored (make it under the scope, in the function that trains)")
        value = module_level[name]
        if value is not None and find(value, cst.Call):
            raise NotTf2(f"the tower reads `{name}`, made at module level outside the strategy scope; "
                         "its variables would not be mirrored")
    text = module.code
    if "keras" in text and not BUILT.search(text):
        raise NotTf2("the Keras model is built on its first call; give it an input shape (`tf.keras.Input` "
                     "or `input_shape=`) so that its variables exist before the distributed step")
