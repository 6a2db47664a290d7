"""A recurrent model off `multi_gpu_model` predicting a few rows, on Keras 3.

Under a distribution strategy Keras 3's `predict` splits each batch over the replicas, and a
batch of fewer rows than replicas leaves one with nothing: a recurrent layer given an empty
part fails ("Shape must be rank 1 but is rank 2" in `LSTMCell`; checked on Keras 3.15 with 2
replicas: 1 row fails; 3 rows work, and so do 33 in batches of 32; a model without an RNN works). Keras 2's parallel model
predicted such a batch on its first device. Programs that sample one row at a time after
training (the char-RNN text generators, keras's `addition_rnn`) crashed at their first
prediction. The fix calls such predictions through `predict_rows(model, x, ...)`, a function
it writes into the module, which computes fewer rows than replicas by calling the model on them
whole (`model(x, training=False)`, the same layers on the same weights) and leaves more to
`predict`.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.codegen import code_in
from tfmigrate.cst.traversal import find
from tfmigrate.rule import ImportItem

__all__ = ["RECURRENT_LAYERS", "predict_rows_function", "recurrent_predictions"]

#: Keras layers that fail on a replica's empty part of a batch.
RECURRENT_LAYERS = {f"keras.layers.{name}" for name in (
    "LSTM", "GRU", "SimpleRNN", "RNN", "Bidirectional", "ConvLSTM2D", "CuDNNLSTM", "CuDNNGRU")} | {
    f"keras.layers.recurrent.{name}" for name in ("LSTM", "GRU", "SimpleRNN", "RNN")}

_PREDICT_ROWS = '''
def predict_rows(model, x, **arguments):
    """`model.predict(x, ...)` of a recurrent model under a distribution strategy: Keras 3 fails
    when there are fewer rows than replicas (a replica's empty part reaches the RNN), so those
    are computed by calling the model on them whole."""
    if len({nest}.flatten(x)[0]) >= model.distribute_strategy.num_replicas_in_sync:
        return model.predict(x, **arguments)
    return {nest}.map_structure(keras.ops.convert_to_numpy, model(x, training=False))
'''


def predict_rows_function(rule) -> tuple[cst.BaseStatement, list[ImportItem]]:
    """The `predict_rows` function, through the module's own TensorFlow import: (function, imports)."""
    nest, imports = rule.tf_ref("tensorflow.nest")
    function = cst.parse_statement(_PREDICT_ROWS.format(nest=code_in(rule.context.module, nest)))
    return function, imports + [ImportItem("keras")]


def recurrent_predictions(rule, models: set) -> dict:
    """`model.predict(x, ...)` -> `predict_rows(model, x, ...)` for ``models`` in a module that
    makes a recurrent layer; {} elsewhere."""
    calls = find(rule.context.module, cst.Call)
    if not any(RECURRENT_LAYERS & set(rule.imports.resolve_all(call.func)) for call in calls):
        return {}
    comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    changes = {}
    for call in calls:
        func = call.func
        if (isinstance(func, cst.Attribute) and func.attr.value == "predict" and call.args
                and code_in(rule.context.module, func.value) in models and not any(a.star for a in call.args)
                and sum(a.keyword is None for a in call.args) == 1):  # x alone, as `predict_rows` takes it
            changes[call] = call.with_changes(func=cst.Name("predict_rows"),
                                              args=[cst.Arg(func.value, comma=comma), *call.args])
    return changes
