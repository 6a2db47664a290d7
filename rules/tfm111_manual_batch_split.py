from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.batch_splits import PY_FUNCS, BatchSplit, batch_split, is_splitter, join_after
from tfmigrate.cst.traversal import contains, find, names_used
from tfmigrate.analysis.devices import (
    enclosing_tower, loop_derived_names, looks_per_device, module_tower_loops,
)
from tfmigrate.rule import PER_DEVICE, FixSafety, Invalid, Rule

NUMPY_SPLITS = {"numpy.split", "numpy.array_split"}
UNSTACKS = {"tensorflow.unstack", "tensorflow.unpack", "tensorflow.split"}
PARALLEL_STACK = "tensorflow.parallel_stack"

PLACEHOLDERS = {"tensorflow.placeholder", "tensorflow.placeholder_with_default"}

_ADVICE = (
    "MirroredStrategy splits each global batch across the replicas itself: feed the global "
    "batch once through strategy.experimental_distribute_dataset (each replica gets "
    "global_batch / num_replicas_in_sync examples)"
)


class ManualBatchSplit(Rule):
    code = "TFM111"
    name = "manual-batch-split"
    summary = "A batch cut into per-device pieces by hand (tf.split, slicing, unstack, py_func, np.split)"
    triggers = ("gpu", "GPU", "device", "DEVICE", "tower", "parallel_stack")
    # Pieces read per device (in a tower loop, a loop over the devices, under fixed GPU scopes),
    # stacked with `tf.parallel_stack`, or a split by a device count (`np.split(x, num_gpus)`).
    requires = (PER_DEVICE + r"|parallel_stack|split\s*\([^)\n]*(?i:gpu|device|tower|replica)",)
    fix_safety = FixSafety.NONE

    what_it_finds = """
        Per-device batches made by hand (a split whose towers' outputs are joined again with
        `tf.concat` is TFM105's `make_parallel`):

        - a batch cut with `tf.split` along axis 0 — TF 1.x's order, positional or keywords in
          any order (`tf.split(axis=0, num_or_size_splits=num_gpus, value=images)`), or TF 0.x's
          (`tf.split(0, num_gpus, images)`) — with `tf.unstack`, or by a Python function run
          through `tf.py_func` / `tf.numpy_function` / `tf.py_function`, when the pieces are read
          one per device: by a tower loop that indexes them with its index (`images_splits[i]`,
          `[a, b][i]`) or iterates them (`enumerate(pieces)`), or, with no loop, one piece under
          each fixed GPU scope (`a, b = tf.split(x, 2)`, `a` on '/gpu:0', `b` on '/gpu:1';
          the half-and-half split of a model built on two devices). The finding is at the cut
          and names the loop (or the device scopes) that reads it. A split along another axis
          (channels, attention heads) or whose pieces are not read per device is not reported;
        - slicing with bounds computed from the device loop's variable,
          `x[i * bs:(i + 1) * bs]` (or a stride, `examples[i::num_gpus]`), inside a tower loop
          (TFM101) or inside a loop over the devices (`for i in range(num_gpus)`) in a module
          that builds towers (reported once per loop, at the first slice, naming the loop);
        - round-robin distribution: examples appended to `per_device[i % n]` in a loop over a
          batch unstacked with `tf.unstack` (or in a module that stacks the pieces with
          `tf.parallel_stack`), reported at the loop;
        - `np.split(batch, num_gpus)` / `np.array_split(...)` with a per-device count, or in a
          module that creates one placeholder per tower, feeding those placeholders.
    """
    why = """
        `tf.distribute.MirroredStrategy` receives the global batch and gives each replica its
        share (`experimental_distribute_dataset`, `distribute_datasets_from_function`). A
        hand-made split hard-codes the number of devices, silently drops the remainder of a
        batch that does not divide evenly (or hands the last device a different size), and
        keeps the per-device inputs (placeholders, queues) that the migration removes.
    """
    example = """
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                logits = model(images[i * per_gpu:(i + 1) * per_gpu])
                tower_losses.append(loss_fn(logits, labels[i * per_gpu:(i + 1) * per_gpu]))
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch_size)
        dist_dataset = strategy.experimental_distribute_dataset(dataset)
    """
    fix_notes = """
        No automatic fix: the per-device pieces feed per-device inputs, which go with the tower
        loop (TFM101) and the per-tower placeholders (TFM106). Where TFM101 rewrites the tower
        loop that reads a `tf.split`, the cut stays and each replica reads its piece by replica
        id (or, for placeholders fed a numpy batch, the cut becomes a distributed dataset);
        feeding the global batch through `strategy.experimental_distribute_dataset` is what
        removes it. Pieces read under fixed GPU scopes, with no loop, have no replica function
        to become: build the model once under `strategy.scope()` and run it with `strategy.run`.
    """

    valid = [
        """\
        import tensorflow as tf
        for step in range(num_steps):
            batch = data[step * bs:(step + 1) * bs]
            sess.run(train_op, feed_dict={x: batch})
        """,
        """\
        import numpy as np
        train, test = np.split(data, [800])
        """,
        """\
        import tensorflow as tf
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                q, k, v = tf.split(qkv[i], 3, axis=-1)
                heads = tf.split(q, num_heads, axis=2)
                outputs.append(attend(heads[i % num_heads], k, v))
        """,
        """\
        import tensorflow as tf
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            real, fake = tf.split(batch, 2)
            loss = model(real) - model(fake)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    out.append(model(x[i * bs:(i + 1) * bs]))
            """,
            line=4,
        ),
        Invalid(
            """\
            import numpy as np
            pieces = np.split(batch_x, FLAGS.num_gpus)
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow as tf
            images_splits = tf.split(axis=0, num_or_size_splits=num_gpus, value=images)
            labels_splits = tf.split(0, num_gpus, labels)
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    grads.append(opt.compute_gradients(loss(images_splits[i], labels_splits[i])))
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow as tf
            parts = tf.py_func(split_batch, [images], [tf.float32] * num_gpus)
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    grads.append(opt.compute_gradients(loss(parts[i])))
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow as tf
            left, right = tf.split(images, 2)
            with tf.device('/gpu:0'):
                a = encoder(left)
            with tf.device('/gpu:1'):
                b = encoder(right)
            """,
            line=2,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.loops: list[cst.For] = []
        self.loop_names: dict[int, set[str]] = {}
        self.reported_loops: set[int] = set()
        self.unstacked: set[str] = set()  # names assigned from tf.unstack / tf.split
        # Round-robin dealing: `parts[i % n].append(x)`, or `k = i % n` then `parts[k].append(x)`.
        self.dealt: dict[int, tuple[cst.For, set[str]]] = {}  # id(loop) -> loop, lists dealt into
        self.modulo_names: dict[int, set[str]] = {}  # id(loop) -> names assigned `a % b` in it
        self.stacked: set[str] = set()  # names read by statements calling tf.parallel_stack
        self.statements: list[cst.SimpleStatementLine] = []
        self.numpy_splits: list[cst.Call] = []
        self.cuts: list[tuple[cst.Call, str]] = []  # tf.split / unstack / py_func calls and their API
        self.slices: list[tuple[cst.Subscript, cst.For]] = []  # per-device slices, with their loop

    # --- loops ------------------------------------------------------------------------------
    def visit_For(self, node: cst.For) -> None:
        self.loops.append(node)

    def leave_For(self, original_node: cst.For) -> None:
        self.loops.pop()

    def _names_of(self, loop: cst.For) -> set[str]:
        if id(loop) not in self.loop_names:
            tower = enclosing_tower(self.context, loop)
            if tower is not None and tower.loop is loop:
                self.loop_names[id(loop)] = set(tower.loop_names)
            elif looks_per_device(loop.iter) and module_tower_loops(self.context):
                self.loop_names[id(loop)] = loop_derived_names(loop)
            else:
                self.loop_names[id(loop)] = set()
        return self.loop_names[id(loop)]

    def visit_Subscript(self, node: cst.Subscript) -> None:
        bounds = [
            bound
            for element in node.slice
            if isinstance(element.slice, cst.Slice)
            for bound in (element.slice.lower, element.slice.upper)
            if bound is not None
        ]
        if not bounds:
            return
        used = set().union(*(names_used(b) for b in bounds))
        strided = any(
            isinstance(e.slice, cst.Slice) and e.slice.step is not None and e.slice.lower is not None
            for e in node.slice
        )  # `examples[i::num_gpus]`: every n-th example, from the device's own
        for loop in self.loops:
            if id(loop) in self.reported_loops or not (used & self._names_of(loop)):
                continue
            if not strided and not any(find(b, cst.BinaryOperation) for b in bounds):
                continue  # `x[i:]`: not a piece of a batch
            self.reported_loops.add(id(loop))
            self.slices.append((node, loop))
            return

    # --- calls ------------------------------------------------------------------------------
    def visit_Assign(self, node: cst.Assign) -> None:
        value = node.value
        if self.loops and isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Modulo):
            names = self.modulo_names.setdefault(id(self.loops[-1]), set())
            for target in node.targets:
                names |= names_used(target.target)
        if isinstance(node.value, cst.Call) and self.call_name(node.value) in UNSTACKS:
            for target in node.targets:
                self.unstacked |= names_used(target.target)

    def visit_Call(self, node: cst.Call) -> None:
        self._note_dealing(node)
        name = self.call_name(node)
        if is_splitter(name):
            self.cuts.append((node, name))
        if name == PARALLEL_STACK and self.statements:
            self.stacked |= names_used(self.statements[-1])
        elif name in NUMPY_SPLITS:
            self.numpy_splits.append(node)

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.statements.append(node)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.statements.pop()

    def _note_dealing(self, call: cst.Call) -> None:
        func = call.func
        if not (self.loops and isinstance(func, cst.Attribute) and func.attr.value == "append"):
            return
        holder = func.value
        if not isinstance(holder, cst.Subscript) or len(holder.slice) != 1:
            return
        index = holder.slice[0].slice
        if not isinstance(index, cst.Index):
            return
        loop = self.loops[-1]
        value = index.value
        if (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Modulo)) or (
            isinstance(value, cst.Name) and value.value in self.modulo_names.get(id(loop), ())
        ):
            self.dealt.setdefault(id(loop), (loop, set()))[1].update(names_used(holder.value))

    def _from_unstack(self, iterable: cst.BaseExpression) -> bool:
        if names_used(iterable) & self.unstacked:
            return True
        return any(self.call_name(c) in UNSTACKS for c in find(iterable, cst.Call))

    def leave_Module(self, original_node: cst.Module) -> None:
        for node, loop in self.slices:
            where = self._loop_words(loop)
            self.report(node, f"batch cut per device by slicing (`{self._code(node)}`) in {where}: {_ADVICE}")
        reported = self._report_cuts()
        self._report_dealing()
        self._report_numpy(reported)

    def _code(self, node: cst.CSTNode) -> str:
        code = " ".join(self.context.module.code_for_node(node).split())
        return code if len(code) <= 50 else code[:47] + "..."

    def _loop_words(self, loop: cst.For) -> str:
        line = self.position(loop).start.line
        tower = enclosing_tower(self.context, loop)
        kind = "the tower loop" if tower is not None and tower.loop is loop else "the loop"
        return f"{kind} at line {line}"

    def _report_cuts(self) -> list[BatchSplit]:
        """Batch splits read one piece per device, where TFM105 does not report them (their
        towers' outputs are not joined again)."""
        reported = []
        for call, api in self.cuts:
            split = batch_split(self.context, call, api)
            if split is None or (split.tower is not None and join_after(self.context, split.tower) is not None):
                continue
            reported.append(split)
            self.report(call, self._cut_message(split))
        return reported

    def _cut_message(self, split: BatchSplit) -> str:
        how = f"`{self._code(split.call)}`"
        if split.api in PY_FUNCS:
            how = f"a Python function run through {how}"
        if split.legacy:
            how += " (TF 0.x's argument order: axis, count, value)"
        if split.tower is not None:
            reader = f"each piece read by {self._loop_words(split.tower.loop)}"
            note = (
                "no automatic fix for the cut itself: TFM101's rewrite of that loop keeps it, each replica "
                "reading its piece by replica id, or, for placeholders fed a numpy batch, replaces it "
                "with a distributed dataset"
            )
        else:
            lines = ", ".join(str(self.position(block).start.line) for block in split.blocks)
            reader = f"one piece under each fixed GPU scope (lines {lines})"
            note = (
                "no automatic fix: there is no tower loop to become a replica function; build the model "
                "once under strategy.scope() and run it with strategy.run on the global batch"
            )
        return f"batch cut into one piece per device with {how}, {reader}: {_ADVICE} ({note})"

    def _report_dealing(self) -> None:
        for loop, dealt in self.dealt.values():
            stacked = bool(dealt & self.stacked)
            if stacked or self._from_unstack(loop.iter):
                self.report(
                    loop,
                    "batch dealt round-robin into per-device lists (`[i % n].append`"
                    + (", each stacked with tf.parallel_stack" if stacked else "")
                    + f"): {_ADVICE}",
                )

    def _report_numpy(self, reported: list[BatchSplit]) -> None:
        if not self.numpy_splits:
            return
        # The cut inside a `tf.py_func` reported above (a lambda, or the function it names).
        inside = [s.call for s in reported] + [
            function
            for s in reported
            if s.api in PY_FUNCS and s.call.args and isinstance(s.call.args[0].value, cst.Name)
            for function in find(self.context.module, cst.FunctionDef)
            if function.name.value == s.call.args[0].value.value
        ]
        per_tower_inputs = any(
            self.call_name(c) in PLACEHOLDERS
            for tower in module_tower_loops(self.context)
            for c in find(tower.loop, cst.Call)
        )
        for call in self.numpy_splits:
            if any(contains(outer, call) for outer in inside):
                continue
            count = call.args[1].value if len(call.args) > 1 else None
            if per_tower_inputs or (count is not None and looks_per_device(count)):
                code = self.context.module.code_for_node(call.func)
                self.report(
                    call,
                    f"batch cut per device with `{code}` to feed per-device inputs: {_ADVICE}",
                )
