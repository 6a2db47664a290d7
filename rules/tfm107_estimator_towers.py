from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import tower_loop_at
from tfmigrate.analysis.training import uses_estimators
from tfmigrate.rule import DEVICE_SCOPE, FixSafety, Invalid, Rule

ESTIMATORS = {
    "tensorflow.estimator.Estimator",
    "tensorflow.contrib.learn.Estimator",
    "tensorflow.contrib.tpu.TPUEstimator",
    "tensorflow_estimator.python.estimator.estimator.Estimator",
    "tensorflow_estimator.estimator.Estimator",
}
# The parameters of an Estimator `model_fn` (`labels`, `params`, `config` are optional).
_MODEL_FN_PARAMS = {"features", "mode"}


class EstimatorTowers(Rule):
    code = "TFM107"
    name = "estimator-tower-model-fn"
    summary = "An Estimator model_fn builds one tower per GPU itself"
    triggers = ("device",)  # a model_fn is only reported when it builds towers (TFM101 needs tf.device)
    requires = (DEVICE_SCOPE,)
    fix_safety = FixSafety.NONE

    what_it_finds = """
        An Estimator `model_fn` that contains a tower loop (TFM101): a function passed as
        `model_fn=` to `tf.estimator.Estimator` (or `tf.contrib.learn.Estimator`), or one with
        the `model_fn` signature (`features`, `labels`, `mode`[, `params`]) in a module that uses
        the Estimator API (elsewhere such a function is a Session program's own), whose body loops
        over the GPUs and opens one `tf.device` per tower (the shape of the TF1 CIFAR-10
        Estimator example, with `local_device_setter` and a `GreedyLoadBalancingStrategy`).
        The finding is at the `def` of the `model_fn`; the loop itself is TFM101.
    """
    why = """
        Towers inside a `model_fn` cannot be migrated like a Session program's: the Estimator
        owns the graph, the session and the input, and `tf.estimator` is gone from TensorFlow
        2.16. The hand-written towers, gradient averaging and input splitting all go; the
        `model_fn` body becomes the per-replica computation of a Keras model (or of a custom
        training loop) under `tf.distribute.MirroredStrategy`, and `input_fn` becomes a
        `tf.data.Dataset` distributed by the strategy.
    """
    example = """
        def model_fn(features, labels, mode, params):
            tower_losses, tower_grads = [], []
            for i in range(params['num_gpus']):
                with tf.device('/gpu:%d' % i):
                    loss = tower_loss(features[i], labels[i])
                    tower_losses.append(loss)
                    tower_grads.append(opt.compute_gradients(loss))
            train_op = opt.apply_gradients(average_gradients(tower_grads))
            return tf.estimator.EstimatorSpec(mode, loss=tf.reduce_mean(tower_losses), train_op=train_op)

        classifier = tf.estimator.Estimator(model_fn=model_fn, params={'num_gpus': 2})
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()  # the layers of model_fn, for one replica
            model.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy())
        model.fit(make_dataset(global_batch_size), epochs=epochs)
    """
    fix_notes = """
        No automatic fix: the Estimator's `input_fn`, hooks, `EstimatorSpec` outputs and export
        code all change with it. On TensorFlow up to 2.15 a first step is to keep the Estimator,
        write the `model_fn` for one replica and pass
        `tf.estimator.RunConfig(train_distribute=tf.distribute.MirroredStrategy())`: the
        strategy then sums the replicas' gradients, so each replica's loss must be averaged over
        the global batch (`tf.nn.compute_average_loss`) where the towers averaged their
        gradients.
    """

    valid = [
        """\
        import tensorflow as tf
        def model_fn(features, labels, mode, params):
            logits = tf.layers.dense(features['x'], 10)
            loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
            return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=opt.minimize(loss))
        """,
        """\
        import tensorflow as tf
        def build(images, num_gpus):
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    outputs.append(net(images[i]))
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            def my_model(features, labels, mode, params):
                for i in range(params['num_gpus']):
                    with tf.device('/gpu:%d' % i):
                        losses.append(net(features[i], labels[i]))
                return tf.estimator.EstimatorSpec(mode, loss=tf.add_n(losses))
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow as tf
            def build(x, y, m):
                for i in range(2):
                    with tf.device('/gpu:%d' % i):
                        losses.append(net(x[i], y[i]))
            est = tf.estimator.Estimator(model_fn=build)
            """,
            line=2,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.functions: list[cst.FunctionDef] = []
        self.towers: dict[int, tuple[cst.FunctionDef, list[cst.For]]] = {}  # by function
        self.passed: set[str] = set()  # names passed as model_fn= to an Estimator

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()

    def visit_For(self, node: cst.For) -> None:
        if self.functions and tower_loop_at(self.context, node) is not None:
            for function in self.functions:
                self.towers.setdefault(id(function), (function, []))[1].append(node)

    def visit_Call(self, node: cst.Call) -> None:
        if self.call_name(node) not in ESTIMATORS:
            return
        for index, arg in enumerate(node.args):
            if (arg.keyword is not None and arg.keyword.value == "model_fn") or (arg.keyword is None and index == 0):
                value = arg.value
                if isinstance(value, cst.Name):
                    self.passed.add(value.value)
                elif isinstance(value, cst.Attribute):
                    self.passed.add(value.attr.value)

    def leave_Module(self, original_node: cst.Module) -> None:
        for function, loops in self.towers.values():
            params = {p.name.value for p in function.params.params}
            # The signature alone makes a model_fn only in a module that uses Estimators (a Session
            # program's own `model_fn(features, labels, mode, params)` is a plain function).
            if not ((_MODEL_FN_PARAMS <= params and uses_estimators(self)) or function.name.value in self.passed):
                continue
            lines = ", ".join(str(self.position(loop).start.line) for loop in loops)
            self.report(
                function,
                f"Estimator model_fn `{function.name.value}` builds its own towers (tower loop at "
                f"line {lines}): write it for one replica and run it under "
                "tf.distribute.MirroredStrategy — as a Keras model or custom training loop (tf.estimator "
                "is gone in TF 2.16), or on TF <= 2.15 with "
                "RunConfig(train_distribute=MirroredStrategy()) — dropping the device loop, the "
                "gradient averaging and the input splitting",
            )
