"""The predictions of a model off `multi_gpu_model`, on Keras 3.

`predict_classes` and `predict_proba` are gone from Keras 3: the first becomes a
`predict_classes(model, x, ...)` function written into the module (Keras 2's: the argmax of the
predictions, or 0/1 for one sigmoid output), the second `predict`, which it was in Keras 2.

Under a distribution strategy Keras 3's `predict` splits each batch over the replicas, and a
batch of fewer rows than replicas leaves one with nothing: a recurrent layer given an empty
part fails ("Shape must be rank 1 but is rank 2" in `LSTMCell`; checked on Keras 3.15 with 2
replicas: 1 row fails; 3 rows work, and so do 33 in batches of 32; a model without an RNN
works). Keras 2's parallel model predicted such a batch on its first device. Programs that sample one row at a time after
training (the char-RNN text generators, keras's `addition_rnn`) crashed at their first
prediction. The fix calls such predictions through `predict_rows(model, x, ...)`, a function
it writes into the module, which computes fewer rows than replicas by calling the model on them
whole (`model(x, training=False)`, the same layers on the same weights) and leaves more to
`predict`.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import receiver_passed
from tfmigrate.cst.codegen import code_in
from tfmigrate.cst.traversal import find
from tfmigrate.rewrites.mirrored import TfNames
from tfmigrate.rule import ImportItem

__all__ = ["RECURRENT_LAYERS", "prediction_functions", "predictions"]

#: Keras layers that fail on a replica's empty part of a batch.
RECURRENT_LAYERS = {f"keras.layers.{name}" for name in (
    "LSTM", "GRU", "SimpleRNN", "RNN", "Bidirectional", "ConvLSTM2D", "CuDNNLSTM", "CuDNNGRU")} | {
    f"keras.layers.recurrent.{name}" for name in ("LSTM", "GRU", "SimpleRNN", "RNN")}

_PREDICT_ROWS = '''
def predict_rows(model, x, **arguments):
    """`model.predict(x, ...)` of a recurrent model under a distribution strategy: Keras 3 fails
    when there are fewer rows than replicas (a replica's empty part reaches the RNN), so those
    are computed by calling the model on them whole."""
    first = {nest}.flatten(x)[0]  # arrays have rows; a dataset or a Sequence goes to `predict`
    if not hasattr(first, "shape") or first.shape[0] >= model.distribute_strategy.num_replicas_in_sync:
        return model.predict(x, **arguments)
    return {nest}.map_structure(keras.ops.convert_to_numpy, model(x, training=False))
'''


_PREDICT_CLASSES = '''
def predict_classes(model, x, **arguments):
    """Keras 2's `Sequential.predict_classes` (gone from Keras 3): each row's most likely class,
    or 0/1 where the model has one (sigmoid) output."""
    probabilities = {predict}(x, **arguments)
    if probabilities.shape[-1] > 1:
        return probabilities.argmax(axis=-1)
    return (probabilities > 0.5).astype("int32")
'''


def prediction_functions(rule, changes: dict) -> tuple[list[cst.BaseStatement], list[ImportItem]]:
    """The functions the calls :func:`predictions` rewrote into (``changes``) call, through the
    module's own TensorFlow import: (functions, imports)."""
    called = {new.func.value for new in changes.values() if isinstance(new.func, cst.Name)}
    functions, imports, tf = [], [], TfNames(rule)
    if "predict_rows" in called:
        functions.append(cst.parse_statement(_PREDICT_ROWS.format(nest=tf("tensorflow.nest"))))
        imports = [*tf.imports, ImportItem("keras")]
    if "predict_classes" in called:
        predict = "predict_rows(model, " if "predict_rows" in called else "model.predict("
        functions.append(cst.parse_statement(_PREDICT_CLASSES.replace("{predict}(", predict)))
    return functions, imports


def predictions(rule, models: set) -> dict:
    """Predictions of ``models`` as Keras 3 makes them: `model.predict_classes(x, ...)` (gone) ->
    `predict_classes(model, x, ...)`; `model.predict_proba(x, ...)` (gone, Keras 2's `predict`)
    -> `model.predict(x, ...)`; and in a module that makes a recurrent layer, `model.predict(x,
    ...)` -> `predict_rows(model, x, ...)`."""
    calls = find(rule.context.module, cst.Call)
    recurrent = any(RECURRENT_LAYERS & set(rule.imports.resolve_all(call.func)) for call in calls)
    changes = {}
    for call in calls:
        func = call.func
        if not (isinstance(func, cst.Attribute) and call.args and code_in(rule.context.module, func.value) in models
                and not any(a.star for a in call.args)):
            continue
        method = "predict" if func.attr.value == "predict_proba" else func.attr.value
        x_alone = sum(a.keyword is None for a in call.args) == 1  # as the functions written take it
        if method == "predict_classes" and x_alone:
            changes[call] = receiver_passed(call, "predict_classes")
        elif method == "predict" and recurrent and x_alone:
            changes[call] = receiver_passed(call, "predict_rows")
        elif method != func.attr.value:
            changes[call] = call.with_changes(func=func.with_changes(attr=cst.Name(method)))
    return changes
