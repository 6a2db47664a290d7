from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import module_plumbing_loops
from tfmigrate.rule import DEVICE_SCOPE, FixSafety, Invalid, Rule


class PerDevicePlumbing(Rule):
    code = "TFM112"
    name = "per-device-plumbing"
    summary = "A per-device loop that moves data or updates between GPUs, not a model replica"
    triggers = ("gpu", "GPU", "device")
    requires = (DEVICE_SCOPE,)
    fix_safety = FixSafety.NONE
    informational = True

    what_it_finds = """
        A loop that opens one `tf.device` per GPU, like a tower loop, but builds no model in
        it: every call in its body only moves data or updates between devices. Benchmark
        harnesses apply each device's gradients under that device (`opt.apply_gradients` per
        GPU), input code makes a `FIFOQueue` or `StagingArea` per GPU, all-reduce code packs
        or sums each device's gradients (`tf.concat`, `tf.add_n`, `tf.identity`). Such a loop
        is not a model replica, so it is not reported as a tower loop (TFM101).
        Information only: the finding does not fail the run.
    """
    why = """
        MirroredStrategy does this work itself: it all-reduces the replicas' gradients and
        applies them to every copy of a variable, and `strategy.experimental_distribute_dataset`
        prefetches each replica's batch onto its device. Once the towers are migrated, a loop
        that still moves tensors between the old towers' devices has nothing left to move, and
        keeping it would place work by hand next to the strategy's.
    """
    example = """
        train_ops = []
        for i, device in enumerate(devices):
            with tf.device(device):
                train_ops.append(opt.apply_gradients(device_grads[i]))
        train_op = tf.group(*train_ops)
    """
    use_instead = """
        # under strategy.scope(), in the replica function
        train_op = opt.apply_gradients(grads_and_vars)  # the strategy all-reduces and updates every copy
    """
    fix_notes = """
        No fix: the loop goes when the tower loops it serves are migrated (TFM101), and
        whether anything else still needs it can only be seen in the program as a whole.
    """

    valid = [
        """\
        import tensorflow as tf
        tower_grads = []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                loss = tower_loss(images[i], labels[i])
                tower_grads.append(opt.compute_gradients(loss))
        """,
        """\
        import tensorflow as tf
        with tf.device('/cpu:0'):
            queue = tf.FIFOQueue(8, [tf.float32])
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            train_ops = []
            for i, device in enumerate(devices):
                with tf.device(device):
                    train_ops.append(opt.apply_gradients(device_grads[i]))
            """,
            line=3,
        ),
        Invalid(
            """\
            import tensorflow as tf
            queues = []
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    queues.append(tf.FIFOQueue(8, [tf.float32], shapes=[[32, 10]]))
            """,
            line=3,
        ),
        Invalid(
            # A scope of the harness's own around the apply (tensorpack's replicated trainer):
            # what opens the `with` block is not the loop's work.
            """\
            import tensorflow as tf
            train_ops = []
            for idx, grad_and_vars in enumerate(grads):
                with tf.device(raw_devices[idx]):
                    with override_to_local_variable(enable=idx > 0):
                        train_ops.append(opt.apply_gradients(grad_and_vars, name='apply_grad_{}'.format(idx)))
            """,
            line=3,
        ),
    ]

    def leave_Module(self, original_node: cst.Module) -> None:
        for loop in module_plumbing_loops(self.context):
            device = self.context.module.code_for_node(loop.scopes[0].device)
            self.report(
                loop.loop,
                f"per-device loop under `tf.device({device})` that builds no model replica, only moves "
                "data or updates between devices; MirroredStrategy all-reduces, updates every copy and "
                "prefetches to each replica itself, so this loop goes with the tower-loop migration",
            )
