from __future__ import annotations

import libcst as cst

from tfmigrate.devices import (
    enclosing_tower,
    find,
    loop_derived_names,
    looks_per_device,
    module_tower_loops,
    names_used,
)
from tfmigrate.rule import FixSafety, Invalid, Rule

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
    summary = "A batch cut into per-device pieces by hand, without tf.split"
    triggers = ("gpu", "GPU", "device", "tower", "parallel_stack", "split")
    fix_safety = FixSafety.NONE

    what_it_finds = """
        Per-device batches made by hand (the `tf.split` spelling is TFM105's and TFM101's):

        - slicing with bounds computed from the device loop's variable,
          `x[i * bs:(i + 1) * bs]`, inside a tower loop (TFM101) or inside a loop over the
          devices (`for i in range(num_gpus)`) in a module that builds towers (reported once per
          loop, at the first slice);
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
        loop (TFM101) and the per-tower placeholders (TFM106).
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
        for loop in self.loops:
            if id(loop) in self.reported_loops or not (used & self._names_of(loop)):
                continue
            if not any(find(b, cst.BinaryOperation) for b in bounds):
                continue  # `x[i:]`: not a piece of a batch
            self.reported_loops.add(id(loop))
            code = self.context.module.code_for_node(node)
            if len(code) > 50:
                code = code[:47] + "..."
            self.report(node, f"batch cut per device by slicing (`{code}`): {_ADVICE}")
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
        for loop, dealt in self.dealt.values():
            stacked = bool(dealt & self.stacked)
            if stacked or self._from_unstack(loop.iter):
                self.report(
                    loop,
                    "batch dealt round-robin into per-device lists (`[i % n].append`"
                    + (", each stacked with tf.parallel_stack" if stacked else "")
                    + f"): {_ADVICE}",
                )
        if not self.numpy_splits:
            return
        per_tower_inputs = any(
            self.call_name(c) in PLACEHOLDERS
            for tower in module_tower_loops(self.context)
            for c in find(tower.loop, cst.Call)
        )
        for call in self.numpy_splits:
            count = call.args[1].value if len(call.args) > 1 else None
            if per_tower_inputs or (count is not None and looks_per_device(count)):
                code = self.context.module.code_for_node(call.func)
                self.report(
                    call,
                    f"batch cut per device with `{code}` to feed per-device inputs: {_ADVICE}",
                )
