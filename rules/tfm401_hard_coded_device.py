from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import device_scope_arg, enclosing_tower, fixed_gpu
from tfmigrate.rule import FIXED_GPU, FixSafety, Invalid, Rule


class HardCodedDevice(Rule):
    code = "TFM401"
    name = "hard-coded-device"
    summary = "Ops pinned to fixed GPUs outside a tower loop (model parallelism)"
    triggers = ("gpu", "GPU", "Gpu")
    requires = (FIXED_GPU,)
    fix_safety = FixSafety.NONE
    informational = True

    what_it_finds = """
        `with tf.device(...)` scopes (also `tf.device_scope`, `graph.device`) that name a
        fixed GPU — `'/gpu:1'`, `'/device:GPU:1'`, `'/job:worker/task:0/gpu:1'`,
        `tf.DeviceSpec(device_type='GPU', device_index=1)` — outside any tower loop: parts of
        one model placed on different GPUs, i.e. model parallelism.

        To stay quiet on ordinary code, a module is reported only when its fixed placements
        name at least two distinct GPUs; then every such placement is reported. A lone
        `tf.device('/gpu:0')` (or `/cpu:0`) is not. `'/gpu:0'` and `'/device:GPU:0'` are the
        same GPU. Placements computed at run time (`'/gpu:%d' % k`, a variable) are not fixed.
        Information only: the finding does not fail the run.
    """
    why = """
        `tf.distribute.MirroredStrategy` is data parallelism: it replicates the whole model on
        every device and does not move layers to devices for you. A program that splits one
        model across GPUs by hand keeps that placement after a migration, and the placement
        decides how it can be distributed: either the model fits on one device and the fixed
        placements can go in favour of replication, or it does not and the placements (or a
        model-parallel strategy such as DTensor) are needed.
    """
    example = """
        shared_lstm = keras.layers.LSTM(64)
        with tf.device('/gpu:0'):
            encoded_a = shared_lstm(input_a)
        with tf.device('/gpu:1'):
            encoded_b = shared_lstm(input_b)
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            shared_lstm = keras.layers.LSTM(64)
            encoded_a = shared_lstm(input_a)
            encoded_b = shared_lstm(input_b)
    """
    fix_notes = """
        No fix: whether the placement should stay is a decision about the model's size, not
        something the code shows.
    """

    valid = [
        """\
        import tensorflow as tf
        with tf.device('/gpu:0'):
            logits = model(images)
        with tf.device('/cpu:0'):
            dataset = make_dataset()
        """,
        """\
        import tensorflow as tf
        with tf.device('/gpu:0'):
            a = layer(x)
        with tf.device('/device:GPU:0'):
            b = layer(y)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            with tf.device('/gpu:0'):
                a = encoder(x)
            with tf.device(tf.DeviceSpec(device_type='GPU', device_index=1)):
                b = decoder(a)
            """,
            line=4,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.placements: list[tuple[cst.Call, str]] = []

    def visit_With(self, node: cst.With) -> None:
        for item in node.items:
            device = device_scope_arg(item.item, self.imports)
            if device is None:
                continue
            gpu = fixed_gpu(device, self.imports)
            if gpu is not None and enclosing_tower(self.context, item.item) is None:
                self.placements.append((item.item, gpu))

    def leave_Module(self, original_node: cst.Module) -> None:
        gpus = sorted({gpu for _, gpu in self.placements})
        if len(gpus) < 2:
            return
        listed = ", ".join(gpus)
        for call, gpu in self.placements:
            self.report(
                call,
                f"model parallelism: ops pinned to `{gpu}` (this module places ops on "
                f"{listed}); MirroredStrategy replicates the whole model on every device, so "
                "keep this placement only if the model does not fit on one device",
            )
