from __future__ import annotations

import libcst as cst

from tfmigrate.rule import FixSafety, Invalid, Rule


class ColocateGradients(Rule):
    code = "TFM104"
    name = "colocate-gradients"
    summary = "colocate_gradients_with_ops=True: a tower-era placement hint"
    triggers = ("colocate_gradients_with_ops",)
    fix_safety = FixSafety.SAFE

    what_it_finds = """
        The `colocate_gradients_with_ops=` argument of any call (`optimizer.minimize`,
        `optimizer.compute_gradients`, `tf.gradients`, a helper that passes it on), unless
        its value is the literal `False` or `None` (the default). The finding is at the
        argument itself.
    """
    why = """
        Hand-written multi-GPU code (a `make_parallel` helper, a tower loop) sets the flag so
        that each tower's backward pass runs on that tower's GPU. Under
        `tf.distribute.MirroredStrategy` every replica computes its gradients on its own
        device already, and TF2 dropped the argument: `tf.gradients` and the Keras optimizers
        reject it, and in graph mode through `tf.compat.v1` it only pins placement.
    """
    example = """
        loss = make_parallel(model, 2, x=x, y=y)
        train_op = tf.train.AdamOptimizer(0.1).minimize(
            tf.reduce_mean(loss),
            colocate_gradients_with_ops=True)
    """
    use_instead = """
        train_op = tf.compat.v1.train.AdamOptimizer(0.1).minimize(tf.reduce_mean(loss))
    """
    fix_notes = """
        Safe: removing the argument changes where gradient ops may be placed, never what they
        compute. (The automatic fix is not written yet: the finding says what to delete.)
    """

    valid = [
        """\
        import tensorflow as tf
        train_op = tf.train.AdamOptimizer(0.1).minimize(loss)
        """,
        """\
        import tensorflow as tf
        grads = tf.gradients(loss, params, colocate_gradients_with_ops=False)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            train_op = opt.minimize(
                loss,
                colocate_gradients_with_ops=True)
            """,
            line=4,
        ),
        Invalid(
            """\
            import tensorflow.compat.v1 as tf
            grads = tf.gradients(loss, params, colocate_gradients_with_ops=FLAGS.colocate)
            """,
            line=2,
        ),
    ]

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is None or node.keyword.value != "colocate_gradients_with_ops":
            return
        if isinstance(node.value, cst.Name) and node.value.value in ("False", "None"):
            return
        value = self.context.module.code_for_node(node.value)
        self.report(
            node,
            f"`colocate_gradients_with_ops={value}` pins each tower's gradients to its device: "
            "under tf.distribute every replica computes its gradients on its own device and "
            "TF2 no longer accepts the argument, so remove it",
        )
