from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import device_scopes, mentions_gpu, module_tower_loops
from tfmigrate.rule import Edit, FixSafety, Invalid, Rule


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
        The fix deletes the argument. It changes where gradient ops may be placed, never what
        they compute.
        With `--target tf2` it is safe: TF2 optimizers and `tf.gradients` do not take it.
        With the default `compat` target it is safe when the module places nothing on a GPU by
        hand; while a tower loop or a fixed `/gpu:N` scope remains, the flag still keeps each
        tower's backward pass on its own GPU, so removing it first could move gradient work
        onto one device (slower, same numbers): the fix is then unsafe, and is best applied
        together with the tower-loop migration (TFM101).
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
            fixed="""\
            import tensorflow as tf
            train_op = opt.minimize(
                loss)
            """,
        ),
        Invalid(
            """\
            import tensorflow.compat.v1 as tf
            grads = tf.gradients(loss, params, colocate_gradients_with_ops=FLAGS.colocate)
            """,
            line=2,
            fixed="""\
            import tensorflow.compat.v1 as tf
            grads = tf.gradients(loss, params)
            """,
        ),
    ]

    def visit_Call(self, node: cst.Call) -> None:
        for arg in node.args:
            if arg.keyword is None or arg.keyword.value != "colocate_gradients_with_ops":
                continue
            if isinstance(arg.value, cst.Name) and arg.value.value in ("False", "None"):
                continue
            value = self.context.module.code_for_node(arg.value)
            self.report(
                arg,
                f"`colocate_gradients_with_ops={value}` pins each tower's gradients to its device: "
                "under tf.distribute every replica computes its gradients on its own device and "
                "TF2 no longer accepts the argument, so remove it",
                edit=Edit(
                    {node: _without(node, arg)},
                    "remove colocate_gradients_with_ops",
                    safety=FixSafety.SAFE if self._placement_free() else FixSafety.UNSAFE,
                ),
            )

    def _placement_free(self) -> bool:
        """Whether nothing in the module is placed on a GPU by hand (see fix_notes)."""
        if self.context.target == "tf2":
            return True
        if module_tower_loops(self.context):
            return False
        scopes = device_scopes(self.context.module, self.imports)
        return not any(mentions_gpu(scope.device, self.imports) for scope in scopes)


def _without(call: cst.Call, arg: cst.Arg) -> cst.Call:
    """The call without ``arg``; the new last argument takes over the removed one's comma
    (so `f(a,\n  b=1)` becomes `f(a)` and a trailing-comma style survives)."""
    args = [a for a in call.args if a is not arg]
    if args and call.args[-1] is arg:
        args[-1] = args[-1].with_changes(comma=arg.comma)
    return call.with_changes(args=args)
