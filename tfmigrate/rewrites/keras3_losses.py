"""A loss returned as one mean for the batch, given per example for Keras 3.

Keras 2's parallel model computed a loss like keras's `mnist_siamese` contrastive loss,
`return K.mean(y_true * K.square(y_pred) + ...)`, once on the merged batch. Keras 3 under a
distribution strategy adds such a loss over the replicas (2 replicas: twice the loss and twice
the step; checked on TF 2.21), where it averages a loss given per example. A mean over every
element of the batch is the mean of per-example means (each example holds as many elements),
so the fix gives the mean per example, `K.mean(..., axis=-1)`, and the batch's loss is the
same (:func:`tfmigrate.analysis.keras_losses.batch_value_returned` finds it,
:func:`~tfmigrate.analysis.keras_losses.per_example_mean` says when it cannot be given so).
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.keras_losses import batch_value_returned, compiled_loss, compiled_losses, per_example_mean
from tfmigrate.cst.callargs import with_keyword
from tfmigrate.cst.traversal import find

__all__ = ["per_example_losses"]

_WHY = ("Per example (axis=-1): Keras 3 under a strategy averages per-example losses over the",
        "replicas, where it would add up one mean per replica; the batch's mean is the same.")


def per_example_losses(module: cst.Module, compiles: list[cst.Call], changes: dict) -> dict:
    """The returns of the losses ``compiles`` compile that give one mean for the batch, given
    per example (`axis=-1`, on the mean as ``changes`` make it: `ops.mean`), a function's said
    why in a comment."""
    made: dict = {}
    for compiled in compiles:
        loss = compiled_loss(compiled)
        for function in compiled_losses(module, loss) if loss is not None else ():
            found = batch_value_returned(function)
            if found is None or not found[1] or per_example_mean(module, function) is not None:
                continue
            mean = found[0]
            made[mean] = with_keyword(changes.get(mean, mean), "axis", "-1")
            line = next((line for line in find(function, cst.SimpleStatementLine)
                         if isinstance(line.body[0], cst.Return) and line.body[0].value is mean), None)
            if line is not None:  # not a lambda's
                comment = [cst.EmptyLine(comment=cst.Comment(f"# {text}")) for text in _WHY]
                made[line] = line.with_changes(leading_lines=[*line.leading_lines, *comment])
    return made
