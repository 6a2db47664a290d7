from __future__ import annotations

import libcst as cst

from tfmigrate.devices import enclosing_tower, names_used, per_device_names
from tfmigrate.rule import FixSafety, Invalid, Rule


class TowerVariableReuse(Rule):
    code = "TFM103"
    name = "tower-variable-reuse"
    summary = "Variables shared between towers with reuse_variables() / reuse=..."
    triggers = ("reuse",)
    fix_safety = FixSafety.NONE

    what_it_finds = """
        Variable sharing between the towers of a hand-written multi-GPU loop:
        `tf.get_variable_scope().reuse_variables()` (or `scope.reuse_variables()`) and any
        call with a `reuse=` argument (`tf.variable_scope(..., reuse=i > 0)`,
        `reuse=bool(i != 0)`, `reuse=tf.AUTO_REUSE`, `reuse=True`, `tf.layers.dense(...,
        reuse=...)`) inside a tower loop (TFM101) or a loop over the devices (`for i in
        range(FLAGS.num_gpus)`, `for d in devices`: a loop whose iterable mentions gpu,
        device, tower or replica), when the value always shares (`True`, `AUTO_REUSE`) or is
        computed from that loop's variable.

        Not reported: `reuse=False` / `reuse=None`; `reuse=True` in ordinary code outside any
        per-device loop (a GAN discriminator called twice, an evaluation graph built after
        the training graph); `reuse=t > 0` in a loop over time steps (an unrolled RNN), even
        inside a tower.
    """
    why = """
        A tower loop builds the model once per GPU and must make every tower use the same
        variables, so it switches the variable scope to reuse after the first tower. Under
        `tf.distribute.MirroredStrategy` the model is built once, in `strategy.scope()`, and
        its variables are mirrored to every replica by the strategy: the reuse flags have
        nothing left to share, and left in place after a migration they make the first
        `tf.compat.v1.get_variable` call fail (`reuse=True` with no variable yet) or hide
        accidental duplicate variables (`AUTO_REUSE`).
    """
    example = """
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                with tf.variable_scope(tf.get_variable_scope(), reuse=i > 0):
                    loss = tower_loss(images[i], labels[i])
                tf.get_variable_scope().reuse_variables()
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()

        def step_fn(images, labels):
            return model_loss(model, images, labels)
    """
    fix_notes = """
        No automatic fix: the reuse goes away with the tower loop (TFM101) it belongs to.
        Remove it by hand only together with the loop; on its own, removing it would make
        each tower create its own variables.
    """

    valid = [
        """\
        import tensorflow as tf
        def discriminator(x, reuse=False):
            with tf.variable_scope('disc', reuse=reuse):
                return tf.layers.dense(x, 1)
        d_real = discriminator(real)
        d_fake = discriminator(fake, reuse=True)
        """,
        """\
        import tensorflow as tf
        for t in range(num_steps):
            with tf.variable_scope('rnn', reuse=t > 0):
                state = cell(inputs[t], state)
        """,
        """\
        import tensorflow as tf
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                with tf.variable_scope('tower', reuse=False):
                    out = model(x[i])
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    loss = tower_loss(i)
                    tf.get_variable_scope().reuse_variables()
            """,
            line=5,
        ),
        Invalid(
            """\
            import tensorflow.compat.v1 as tf
            for i in range(FLAGS.num_gpus):
                with tf.variable_scope('model', reuse=bool(i != 0)):
                    logits = model(images[i])
            """,
            line=3,
        ),
        Invalid(
            """\
            import tensorflow as tf
            for dev in ['/gpu:0', '/gpu:1']:
                with tf.device(dev), tf.variable_scope('m', reuse=tf.AUTO_REUSE):
                    out = model(x)
            """,
            line=3,
        ),
    ]

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "reuse_variables" and not node.args:
            if self._in_per_device_loop(node):
                self.report(
                    node,
                    "`reuse_variables()` shares variables between towers: under "
                    "MirroredStrategy the model is built once in strategy.scope() and its "
                    "variables are mirrored to every replica, so this goes with the tower loop",
                )
            return
        for arg in node.args:
            if arg.keyword is None or arg.keyword.value != "reuse":
                continue
            value = arg.value
            if isinstance(value, cst.Name) and value.value in ("False", "None"):
                return
            loop_names = self._per_device_loop_names(node)
            if loop_names is None:
                return
            # `reuse=t > 0` of an RNN's time loop inside a tower stays: only sharing that
            # follows the device loop, or that always shares, is the towers'.
            if not (names_used(value) & loop_names or _always_reuses(value, self)):
                return
            code = self.context.module.code_for_node(value)
            self.report(
                node,
                f"`reuse={code}` shares variables between towers: under MirroredStrategy the "
                "model is built once in strategy.scope() and its variables are mirrored to "
                "every replica, so this goes with the tower loop",
            )

    def _in_per_device_loop(self, node: cst.CSTNode) -> bool:
        return self._per_device_loop_names(node) is not None

    def _per_device_loop_names(self, node: cst.CSTNode) -> frozenset[str] | None:
        """Names of the per-device loops around ``node`` (a tower loop counts), else None."""
        tower = enclosing_tower(self.context, node)
        names = per_device_names(self.context, node)
        if tower is None and not names:
            return None
        return names | (frozenset(tower.loop_names) if tower else frozenset())


def _always_reuses(value: cst.BaseExpression, rule: Rule) -> bool:
    """`reuse=True` / `reuse=tf.AUTO_REUSE`: sharing whatever the loop variable."""
    if isinstance(value, cst.Name) and value.value == "True":
        return True
    return (rule.qualified(value) or "").endswith("AUTO_REUSE")
