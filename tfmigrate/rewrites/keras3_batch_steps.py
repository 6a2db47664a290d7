"""`train_on_batch` of a model with batch normalization, on Keras 3 under a strategy.

Keras 2's parallel model split each batch over the GPUs, and each GPU's slice was normalized by
its own statistics. Keras 3's `train_on_batch` under a distribution strategy runs the whole
batch on every replica (checked equal to one device): another loss from the first step. `fit`
splits its batch over the replicas as the parallel model did. So each
`model.train_on_batch(x, y, ...)` of the migrated model becomes `train_split(model, x, y, ...)`,
a function written into the module that fits that one batch, whole, for one epoch, and returns
what `train_on_batch` returned: the loss, or the loss and the metrics. (A batch of an odd size
may be split otherwise: Keras 2 gave the first GPU the smaller slice.)
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import receiver_passed

__all__ = ["TRAIN_SPLIT", "split_batch_steps"]

TRAIN_SPLIT = '''
def train_split(model, x, y=None, sample_weight=None, class_weight=None, reset_metrics=True):
    """`model.train_on_batch(...)` of a model with batch normalization, as Keras 2's parallel
    model trained it: the batch split over the replicas, each part normalized by its own
    statistics (Keras 3's `train_on_batch` under a strategy runs the whole batch on every
    replica). Returns what `train_on_batch` returns: the loss, or the loss and the metrics
    (of this batch alone, as `reset_metrics=True` gave them)."""
    rows = len(keras.tree.flatten(x)[0])
    history = model.fit(x, y, sample_weight=sample_weight, class_weight=class_weight, batch_size=rows, epochs=1,
                        verbose=0, shuffle=False)
    values = [logged[-1] for logged in history.history.values()]
    return values[0] if len(values) == 1 else values
'''


def split_batch_steps(stepped: list[cst.Call], changes: dict) -> dict:
    """Each call of ``stepped`` (`model.train_on_batch(...)`) -> `train_split(model, ...)`, but
    where ``changes`` made it `train_as_compiled(model, ...)` (a model frozen after it was
    compiled), which trains through `train_split` itself."""
    made = {}
    for call in stepped:
        if call in changes:
            continue
        made[call] = receiver_passed(call, "train_split")
    return made
