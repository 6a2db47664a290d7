"""Read every input pipeline in order, in both runs: the harness's ``--in-order``.

A TF1 queue pipeline shuffles with `RandomShuffleQueue` kernels (`shuffle_batch`, the producers'
`shuffle=True`), and its tf.data rewrite with `Dataset.shuffle`: two different random streams,
which no seed makes agree. Both programs then train on the same examples in different orders,
and no step of their losses can be compared. So, as TensorFlow's own migration guide pins down
randomness before it compares two runs, each run reads its input in order: the shuffling calls
the program makes itself do everything else they did (parse, batch, pad, repeat) and do not
shuffle. What was turned off is recorded (:data:`TURNED_OFF`), so that the report can say it,
and so that a rewrite that dropped a shuffle is caught: one run shuffled and the other did not.

Only what the program's own code calls changes; the harness runs in the program's process and
this is installed before the program imports anything (see ``harness._set_up``).
"""

from __future__ import annotations

import functools
import inspect
import sys

#: What each run turned off, one entry per call: `shuffle_batch(min_after_dequeue=100)`.
TURNED_OFF: list[str] = []

#: Each shuffling batch function and the function that batches the same way in order.
_IN_ORDER_BATCH = {"shuffle_batch": "batch", "shuffle_batch_join": "batch_join",
                   "maybe_shuffle_batch": "maybe_batch", "maybe_shuffle_batch_join": "maybe_batch_join"}
_AUTOGRAPH = "tensorflow.python.autograph."
_PRODUCERS = ("string_input_producer", "slice_input_producer", "range_input_producer", "input_producer")


def install(is_user_code) -> None:
    """Turn shuffling off where the program's own code asks for it; ``is_user_code(globals)``
    tells the program's frames from TensorFlow's."""
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.data.experimental.ops import shuffle_ops
    from tensorflow.python.ops import data_flow_ops
    from tensorflow.python.training import input as queue_input

    def from_program() -> bool:
        # Code that runs under a distribution strategy (`call_for_each_replica`) is converted by
        # AutoGraph, which makes the program's calls from its own frames: look past them.
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(_AUTOGRAPH):
            frame = frame.f_back
        return frame is not None and is_user_code(frame.f_globals)

    for shuffling, in_order in _IN_ORDER_BATCH.items():
        _replace(getattr(queue_input, shuffling), _batch_in_order(getattr(queue_input, shuffling),
                                                                  getattr(queue_input, in_order), from_program))
    for producer in _PRODUCERS:
        _replace(getattr(queue_input, producer), _producer_in_order(getattr(queue_input, producer), from_program))
    _replace(data_flow_ops.RandomShuffleQueue, _queue_in_order(data_flow_ops, from_program))
    _replace(shuffle_ops.shuffle_and_repeat, _shuffle_and_repeat_in_order(shuffle_ops.shuffle_and_repeat, from_program))
    for dataset_class in (dataset_ops.DatasetV2, dataset_ops.DatasetV1):
        _dataset_in_order(dataset_class, from_program)
    _python_shuffle_in_order(from_program)


def _replace(original, replacement) -> None:
    """Put ``replacement`` wherever TensorFlow's API modules export ``original`` (`tf.train`,
    `tf.compat.v1.train`, `tf.queue`, ...), but not in the module that defines it, whose own
    calls (`slice_input_producer` calling `range_input_producer`) are not the program's."""
    defined_in = getattr(original, "__module__", None)
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if not name.startswith("tensorflow") or name == defined_in:
            continue
        for attribute, value in list(getattr(module, "__dict__", {}).items()):
            if value is original:
                setattr(module, attribute, replacement)


def _python_shuffle_in_order(from_program) -> None:
    """`random.shuffle(...)` called by the program's own code leaves the list as it is: Keras 2
    shuffled a Sequence's batches with it inside Keras (where `fit(shuffle=True)` is turned off),
    the migrated program's `BatchesInOrder` does so in the program's file."""
    import random

    original = random.shuffle
    if getattr(original, "in_order", False):
        return

    def shuffle(x, *args, **kwargs):
        if not from_program():
            return original(x, *args, **kwargs)
        if "random.shuffle(...)" not in TURNED_OFF:
            TURNED_OFF.append("random.shuffle(...)")

    shuffle.in_order = True
    random.shuffle = shuffle


def _shown(value) -> str:
    return repr(value) if isinstance(value, (int, float, str, bool)) or value is None else "a tensor"


def _batch_in_order(shuffling, in_order, from_program):
    signature, taken = inspect.signature(shuffling), set(inspect.signature(in_order).parameters)

    @functools.wraps(shuffling)
    def batch(*args, **kwargs):
        if not from_program():
            return shuffling(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        buffer = bound.arguments.get("min_after_dequeue")
        TURNED_OFF.append(f"{shuffling.__name__}(min_after_dequeue={_shown(buffer)})")
        return in_order(**{k: v for k, v in bound.arguments.items() if k in taken})

    return batch


def _producer_in_order(producer, from_program):
    signature = inspect.signature(producer)

    @functools.wraps(producer)
    def produce(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if from_program() and bound.arguments["shuffle"]:
            TURNED_OFF.append(f"{producer.__name__}(shuffle=True)")
            bound.arguments["shuffle"] = False
        return producer(*bound.args, **bound.kwargs)

    return produce


def _queue_in_order(data_flow_ops, from_program):
    shuffling = data_flow_ops.RandomShuffleQueue

    def RandomShuffleQueue(capacity, min_after_dequeue, dtypes, shapes=None, names=None, seed=None,  # noqa: N802
                           shared_name=None, name="random_shuffle_queue"):
        if not from_program():
            return shuffling(capacity, min_after_dequeue, dtypes, shapes, names, seed, shared_name, name)
        TURNED_OFF.append(f"RandomShuffleQueue(min_after_dequeue={_shown(min_after_dequeue)})")
        return data_flow_ops.FIFOQueue(capacity, dtypes, shapes=shapes, names=names, shared_name=shared_name, name=name)

    return RandomShuffleQueue


def _shuffle_and_repeat_in_order(shuffle_and_repeat, from_program):
    @functools.wraps(shuffle_and_repeat)
    def in_order(buffer_size, count=None, seed=None):
        if not from_program():
            return shuffle_and_repeat(buffer_size, count, seed)
        TURNED_OFF.append(f"shuffle_and_repeat(buffer_size={_shown(buffer_size)})")
        return lambda dataset: dataset.repeat(count)

    return in_order


def _dataset_in_order(dataset_class, from_program) -> None:
    shuffle = dataset_class.__dict__.get("shuffle")
    if shuffle is not None:
        @functools.wraps(shuffle)
        def in_order(self, buffer_size, *args, **kwargs):
            if not from_program():
                return shuffle(self, buffer_size, *args, **kwargs)
            TURNED_OFF.append(f"Dataset.shuffle(buffer_size={_shown(buffer_size)})")
            return self

        dataset_class.shuffle = in_order
    list_files = dataset_class.__dict__.get("list_files")
    if isinstance(list_files, staticmethod):
        files = list_files.__func__

        @functools.wraps(files)
        def listed_in_order(file_pattern, shuffle=None, seed=None, *args, **kwargs):
            if from_program() and shuffle is not False:
                TURNED_OFF.append("Dataset.list_files(shuffle=True)")
                shuffle = False
            return files(file_pattern, shuffle, seed, *args, **kwargs)

        dataset_class.list_files = staticmethod(listed_in_order)
