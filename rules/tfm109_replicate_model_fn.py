from __future__ import annotations

import libcst as cst

from tfmigrate.rule import FixSafety, Invalid, Rule

REPLICATE = {
    "tensorflow.contrib.estimator.replicate_model_fn",
    "tensorflow.contrib.estimator.python.estimator.replicate_model_fn.replicate_model_fn",
}
TOWER_OPTIMIZER = {
    "tensorflow.contrib.estimator.TowerOptimizer",
    "tensorflow.contrib.estimator.python.estimator.replicate_model_fn.TowerOptimizer",
}


class ReplicateModelFn(Rule):
    code = "TFM109"
    name = "replicate-model-fn"
    summary = "tf.contrib.estimator.replicate_model_fn / TowerOptimizer replicate a model_fn over GPUs"
    triggers = ("replicate_model_fn", "TowerOptimizer")
    fix_safety = FixSafety.NONE

    what_it_finds = """
        `tf.contrib.estimator.replicate_model_fn(model_fn, ...)`, which runs an Estimator's
        `model_fn` once per GPU, and the `tf.contrib.estimator.TowerOptimizer` its `model_fn`
        must wrap the optimizer in. The finding is at `replicate_model_fn`; a `TowerOptimizer`
        is reported on its own only in a module that does not call `replicate_model_fn`
        (the `model_fn` lives apart from the Estimator). The message says whether the towers'
        losses are summed (`loss_reduction=tf.losses.Reduction.SUM`) or averaged (the default,
        `SUM_BY_NONZERO_WEIGHTS`, since TF 1.6).
    """
    why = """
        `tf.contrib` is gone in TF2, and both were deprecated in favour of
        `tf.distribute.MirroredStrategy`. The strategy sums the replicas' gradients; where
        `replicate_model_fn` averaged them (its default), each replica's loss must be averaged
        over the global batch (`tf.nn.compute_average_loss`) to keep the same update; where it
        summed them, each replica's loss stays a mean over its own batch.
    """
    example = """
        def model_fn(features, labels, mode):
            loss = tf.losses.softmax_cross_entropy(labels, net(features))
            optimizer = tf.contrib.estimator.TowerOptimizer(tf.train.AdamOptimizer())
            return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss))

        estimator = tf.estimator.Estimator(model_fn=tf.contrib.estimator.replicate_model_fn(model_fn))
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile(optimizer='adam', loss=keras.losses.CategoricalCrossentropy())
        model.fit(make_dataset(global_batch_size), epochs=epochs)
    """
    fix_notes = """
        No automatic fix: drop `replicate_model_fn` and `TowerOptimizer` together and train the
        unreplicated model under MirroredStrategy (a Keras model, or, on TF <= 2.15, the same
        Estimator with `RunConfig(train_distribute=tf.distribute.MirroredStrategy())`).
    """

    valid = [
        """\
        import tensorflow as tf
        estimator = tf.estimator.Estimator(model_fn=model_fn,
            config=tf.estimator.RunConfig(train_distribute=tf.distribute.MirroredStrategy()))
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            replicated = tf.contrib.estimator.replicate_model_fn(
                model_fn, loss_reduction=tf.losses.Reduction.SUM)
            """,
            line=2,
        ),
        Invalid(
            """\
            from tensorflow.contrib import estimator as contrib_estimator
            opt = contrib_estimator.TowerOptimizer(base_opt)
            """,
            line=2,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.replicates: list[cst.Call] = []
        self.tower_optimizers: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        name = self.call_name(node)
        if name in REPLICATE:
            self.replicates.append(node)
        elif name in TOWER_OPTIMIZER:
            self.tower_optimizers.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        optimizers = ", ".join(str(self.position(c).start.line) for c in self.tower_optimizers)
        for call in self.replicates:
            reduction = next(
                (a.value for a in call.args if a.keyword is not None and a.keyword.value == "loss_reduction"),
                None,
            )
            if reduction is None:
                how = "averages the towers' gradients (default loss_reduction)"
                advice = "scale each replica's loss by the global batch size (tf.nn.compute_average_loss)"
            else:
                code = self.context.module.code_for_node(reduction)
                summed = code.endswith(".SUM") or code.endswith("'sum'") or code.endswith('"sum"')
                how = f"{'sums' if summed else 'averages'} the towers' gradients (`loss_reduction={code}`)"
                advice = (
                    "keep each replica's loss a mean over its own batch"
                    if summed
                    else "scale each replica's loss by the global batch size (tf.nn.compute_average_loss)"
                )
            paired = f" together with its TowerOptimizer (line {optimizers})" if optimizers else ""
            self.report(
                call,
                f"`replicate_model_fn` runs the model_fn once per GPU and {how}: drop it{paired} "
                f"and train under tf.distribute.MirroredStrategy, which sums gradients across "
                f"replicas, so {advice} to keep the same update",
            )
        if self.replicates:
            return
        for call in self.tower_optimizers:
            self.report(
                call,
                "`TowerOptimizer` gathers the towers' gradients of a model_fn replicated with "
                "replicate_model_fn: drop it with the replication and build the plain optimizer "
                "under tf.distribute.MirroredStrategy's scope",
            )
