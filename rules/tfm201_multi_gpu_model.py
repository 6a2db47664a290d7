from __future__ import annotations

import libcst as cst

from tfmigrate.rule import FixSafety, Invalid, Rule

#: Canonical names (tfmigrate/names.py folds keras.utils.training_utils,
#: keras.utils.multi_gpu_utils, tf.keras, tensorflow.python.keras, tf.compat.v1.keras and
#: tensorflow._api.v1.keras into this one).
MULTI_GPU_MODEL = "keras.utils.multi_gpu_model"
FIT_METHODS = ("fit", "fit_generator")


def _argument(call: cst.Call, keyword: str, position: int) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if len(positional) > position:
        return positional[position].value
    return None


class MultiGpuModel(Rule):
    code = "TFM201"
    name = "multi-gpu-model"
    summary = "Keras `multi_gpu_model(...)` replicates a model by splitting each batch across GPUs"
    triggers = ("multi_gpu_model",)
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        Calls of Keras' `multi_gpu_model(model, gpus=N)`, however it was imported:
        `from keras.utils import multi_gpu_model` (also under another name),
        `keras.utils.training_utils` and `keras.utils.multi_gpu_utils` (Keras 2.0/2.1),
        `tf.keras.utils`, `tf.compat.v1.keras.utils`, `tensorflow.python.keras.utils.multi_gpu_utils`,
        `tensorflow._api.v1.keras.utils`, and imports made inside `try`/`except ImportError` or
        `if` branches (any of the imports of the name counts).
        A function of your own that happens to be called `multi_gpu_model` and is not imported
        from Keras is not reported (a split/concat helper of your own is TFM105's business).
    """
    why = """
        `multi_gpu_model` was removed in TensorFlow 2.4 (and from standalone Keras 2.4). It
        copies the model onto each GPU, slices every input batch with a `Lambda` layer and
        concatenates the outputs on the CPU, so the "parallel" model is a different model
        object from the one you save, and the CPU merge limits scaling.
        `tf.distribute.MirroredStrategy` replaces it: build and compile the *template* model
        inside `strategy.scope()` and call `fit` on it directly. The batch size you pass to
        `fit` stays the global batch size, split across replicas exactly as before
        (256 on 8 GPUs is still 32 per GPU).
    """
    example = """
        from keras.utils import multi_gpu_model

        model = build_model()
        parallel_model = multi_gpu_model(model, gpus=8)
        parallel_model.compile(loss='categorical_crossentropy', optimizer='rmsprop')
        parallel_model.fit(x, y, epochs=20, batch_size=256)
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile(loss='categorical_crossentropy', optimizer='rmsprop')
        model.fit(x, y, epochs=20, batch_size=256)
    """
    fix_notes = """
        Unsafe (no automatic fix yet): the rewrite moves the model construction and `compile`
        under `strategy.scope()` and drops the parallel model object, so every use of it
        (`fit`, `evaluate`, `save`, callbacks holding it) must move to the template model.
        Keep the same `batch_size`: it is the global batch under both. `gpus=[0, 1]` becomes
        `MirroredStrategy(devices=['/gpu:0', '/gpu:1'])`. Check the result with `tfmigrate verify`.
    """

    valid = [
        """
        import tensorflow as tf
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile(loss='mse', optimizer='sgd')
        model.fit(x, y, batch_size=256)
        """,
        """
        from mylib.parallel import multi_gpu_model
        parallel = multi_gpu_model(model, gpus=2)
        """,
        """
        def multi_gpu_model(model, gpus):
            return model
        parallel = multi_gpu_model(model, gpus=2)
        """,
    ]
    invalid = [
        Invalid(
            """
            from keras.utils import multi_gpu_model as mgm
            model = build_model()
            parallel = mgm(model, gpus=4)
            """,
            line=3,
        ),
        Invalid(
            """
            import tensorflow as tf
            parallel = tf.keras.utils.multi_gpu_model(model, 2)
            """,
            line=2,
        ),
        Invalid(
            """
            try:
                from keras.utils import multi_gpu_model
            except ImportError:
                from keras.utils.training_utils import multi_gpu_model
            parallel = multi_gpu_model(model, gpus=[0, 1])
            """,
            line=5,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self._calls: list[tuple[cst.Call, str | None]] = []  # (call, name it is assigned to)
        self._assigned: dict[int, str] = {}  # id(call) -> target name
        self._fit_batch: dict[str, str] = {}  # model name -> batch_size text in its fit

    def _code(self, node: cst.CSTNode) -> str:
        return self.context.module.code_for_node(node).strip()

    def _is_multi_gpu_model(self, call: cst.Call) -> bool:
        return MULTI_GPU_MODEL in self.imports.resolve_all(call.func)

    def visit_Assign(self, node: cst.Assign) -> None:
        if isinstance(node.value, cst.Call) and len(node.targets) == 1:
            target = node.targets[0].target
            if isinstance(target, cst.Name):
                self._assigned[id(node.value)] = target.value

    def visit_Call(self, node: cst.Call) -> None:
        if self._is_multi_gpu_model(node):
            self._calls.append((node, self._assigned.get(id(node))))
            return
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in FIT_METHODS and isinstance(func.value, cst.Name):
            batch = _argument(node, "batch_size", 3 if func.attr.value == "fit" else 99)
            if batch is not None:
                self._fit_batch.setdefault(func.value.value, self._code(batch))

    def leave_Module(self, original_node: cst.Module) -> None:
        for call, target in self._calls:
            self.report(call, self._message(call, target))

    def _message(self, call: cst.Call, target: str | None) -> str:
        gpus = _argument(call, "gpus", 1)
        if gpus is None:
            where = "on every visible GPU"
            devices = ""
        elif isinstance(gpus, cst.Integer):
            where = f"with gpus={gpus.value}"
            devices = ""
        elif isinstance(gpus, (cst.List, cst.Tuple)) and all(
            isinstance(e.value, cst.Integer) for e in gpus.elements
        ):
            ids = [e.value.value for e in gpus.elements]  # type: ignore[attr-defined]
            where = f"with gpus=[{', '.join(ids)}]"
            devices = "devices=[" + ", ".join(f"'/gpu:{i}'" for i in ids) + "]"
        else:
            where = f"with gpus={self._code(gpus)}"
            devices = ""
        template = _argument(call, "model", 0)
        template_text = f"`{self._code(template)}`" if template is not None else "the template model"
        batch = self._fit_batch.get(target) if target else None
        batch_text = (
            f"the same global batch size (batch_size={batch} in `{target}.fit`)"
            if batch is not None
            else "the same global batch size"
        )
        return (
            f"Keras `multi_gpu_model(...)` {where} (removed in TF 2.4): build and compile "
            f"{template_text} under `tf.distribute.MirroredStrategy({devices}).scope()` and fit it "
            f"directly with {batch_text}"
        )
