"""A model off `multi_gpu_model` trained by `fit_generator` (a generator or a Sequence), on Keras 3.

Keras 3's `fit` takes a generator, but under a distribution strategy it opens an iterator on
its data to build the model, takes one batch from it and drops that iterator with the batches
it had read ahead. Fed the generator itself, training began several batches in (checked on
Keras 3.15: batches 0, 1, 6, 7, ... where Keras 2 trained 0, 1, 2, 3, ...), and every later
`fit` skipped some more. The fix trains through a `BatchesInOrder` class it writes into the
module: a `tf.data.Dataset` over the generator whose every iterator starts at the first batch
not trained yet, counted by the class, which is also a callback. Keras 2 trained a generator's
batches in the order it yields them and went on with the next one at the next epoch; so does
this. Its `evaluate_generator` and `predict_generator` become `BatchesInOrder.evaluate` and
`.predict`, which read the batches Keras 2 read and score them as arrays in batches of their size.
On a partial last batch Keras 2.2-2.3 weighed the batches' losses by their size (as Keras 3's
`evaluate` does), tf.keras 1.x averaged them as equals.

`model.fit_generator(gen, steps_per_epoch=100, epochs=3)` becomes
`BatchesInOrder.fit(model, gen, steps_per_epoch=100, epochs=3)`.

A `keras.utils.Sequence` (told apart when the program runs: the argument's kind often cannot
be told from the source) goes through the same class, read as Keras 2's `fit_generator` read one: pass after pass, the
order of each shuffled by Python's `random` unless `shuffle=False`, `on_epoch_end()` after each
pass (Keras 3's own reading of it under a strategy split its batches otherwise from the second
epoch on in 2 of 5 runs, the loss halved). A validation Sequence is validated on from its first
batch each time, as Keras 2 did, as arrays of its batches read once (read as a dataset it
changed the training of a held-out program's second epoch, for a reason not found). A validation generator is read first after the first
epoch's training, as Keras 2 read it; where it and the training generator draw from NumPy's
global random state, which batches each draws still depends on how far the training one is
read ahead (in Keras 2, on its queue's thread), so they may differ from Keras 2's.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import argument, keyword_is
from tfmigrate.rewrites.mirrored import TfNames
from tfmigrate.rule import ImportItem

__all__ = ["batches_in_order_class", "generator_argument", "generator_fits"]

_BATCHES_IN_ORDER = '''
class BatchesInOrder(keras.callbacks.Callback):
    """A generator's (or a Sequence's) batches, trained in the order Keras 2's `fit_generator`
    trained them.

    Keras 3's `fit` under a distribution strategy opens an iterator on its data to build the
    model, takes a batch from it and drops it with the batches it read ahead: fed the
    generator itself, it trained from a later batch on. Every iterator over `dataset` starts at
    the first batch not trained (or validated) yet, which this callback counts. A Sequence is
    read as Keras 2 read it: pass after pass, each in an order `random` shuffles (unless
    `shuffle=False`), its `on_epoch_end()` after each pass.
    """

    _made = {{}}  # one for each generator: a second fit goes on where the first stopped

    @classmethod
    def fit(cls, model, generator, callbacks=None, validation_data=None, shuffle=True, **arguments):
        """Keras 2's `model.fit_generator(generator, ...)` on Keras 3."""
        if isinstance(generator, keras.utils.PyDataset) and arguments.get("steps_per_epoch") is None:
            arguments["steps_per_epoch"] = len(generator)  # Keras 2's epoch of a Sequence: one pass
        training = cls._of(generator, "train", shuffle)
        callbacks = [training, *(callbacks or [])]
        if hasattr(validation_data, "__next__"):  # validated on a generator's batches
            validation = cls._of(validation_data, "test", False, training.signature)
            callbacks.insert(1, validation)
            validation_data = validation.dataset
        elif isinstance(validation_data, keras.utils.PyDataset):
            # Keras 2 validated on its batches from the first each time: as arrays, batch by batch
            steps = arguments.get("validation_steps") or len(validation_data)
            batches = [cls._tuples(validation_data[index]) for index in range(steps)]
            validation_data = {nest}(lambda *parts: numpy.concatenate(parts), *batches)
            arguments["validation_batch_size"] = len({flatten}(batches[0])[0])
        data = training.dataset
        if cls._by_name(training.signature) and len(model.outputs) == 1:  # Keras 2 took them; Keras 3 fails
            data = data.map(cls._one_target)
            if hasattr(validation_data, "map"):
                validation_data = validation_data.map(cls._one_target)
            elif isinstance(validation_data, tuple):
                validation_data = cls._one_target(*validation_data)
        # The order is the class's own: Keras 3 would not shuffle a dataset anyway.
        return model.fit(data, validation_data=validation_data, callbacks=callbacks, shuffle=False, **arguments)

    @classmethod
    def evaluate(cls, model, generator, steps=None, **arguments):
        """Keras 2's `model.evaluate_generator(generator, steps, ...)` on Keras 3: the batches Keras
        2 read, joined and evaluated as arrays in batches of their size (fed a generator, Keras 3
        under a strategy would read ahead of it and drop what it read)."""
        data, size = cls._arrays(generator, steps)
        arguments.setdefault("verbose", 0)  # Keras 2's default there
        data = cls._one_target(*data) if isinstance(data, tuple) else (data,)
        weights = data[2] if len(data) > 2 else None
        return model.evaluate(data[0], data[1] if len(data) > 1 else None, sample_weight=weights, batch_size=size,
                              **arguments)

    @classmethod
    def predict(cls, model, generator, steps=None, **arguments):
        """Keras 2's `model.predict_generator(generator, steps, ...)` on Keras 3, read as `evaluate` reads."""
        data, size = cls._arrays(generator, steps)
        arguments.setdefault("verbose", 0)
        return model.predict(data[0] if isinstance(data, tuple) else data, batch_size=size, **arguments)

    @classmethod
    def _arrays(cls, generator, steps):
        """The batches Keras 2 evaluated or predicted on, joined, and their size: a Sequence's from
        its first (all of them without ``steps``), a generator's next ones (after those a `fit`
        here read and has not trained or validated on)."""
        if isinstance(generator, keras.utils.PyDataset):
            batches = [cls._tuples(generator[index]) for index in range(steps or len(generator))]
        elif id(generator) in cls._made:
            reader = cls._made[id(generator)][1]
            batches = [reader._batch(reader._used) for _ in range(steps)]
            for _ in batches:
                reader._count()
        else:
            batches = [cls._tuples(next(generator)) for _ in range(steps)]
        return {nest}(lambda *parts: numpy.concatenate(parts), *batches), len({flatten}(batches[0])[0])

    @staticmethod
    def _by_name(parts):
        """Whether a batch gives one output's targets by its name: `(x, {{'ctc': y}})` (Keras's
        image_ocr example)."""
        return isinstance(parts, tuple) and len(parts) > 1 and isinstance(parts[1], dict) and len(parts[1]) == 1

    @classmethod
    def _one_target(cls, *parts):
        """`(x, {{'ctc': y}})` as `(x, y)`."""
        return (parts[0], next(iter(parts[1].values())), *parts[2:]) if cls._by_name(parts) else parts

    @classmethod
    def _of(cls, generator, stage, shuffle, signature=None):
        if id(generator) not in cls._made:
            batches = cls._passes(generator, shuffle) if isinstance(generator, keras.utils.PyDataset) else generator
            cls._made[id(generator)] = (generator, cls(batches, stage, signature))
        return cls._made[id(generator)][1]

    @staticmethod
    def _passes(sequence, shuffle):
        while True:
            order = list(range(len(sequence)))
            if shuffle:
                random.shuffle(order)
            for index in order:
                yield sequence[index]
            sequence.on_epoch_end()

    def __init__(self, generator, stage, signature=None):
        super().__init__()
        self._generator = generator
        self._stage = stage  # "train" or "test": the batches counted are the stage's
        self._read = []  # batches read from the generator and not used yet, in order
        self._used = 0
        self._lock = threading.Lock()

        def spec(first, second):  # a size the two batches differ in (a padded time axis) is left open
            first, second = {convert}(first), {convert}(second)
            sizes = [a if a == b else None for a, b in zip(first.shape[1:], second.shape[1:])]
            return {spec}((None, *sizes), first.dtype)

        # A validation generator is read first where Keras 2 read it, after the first epoch's
        # training (a generator drawing from NumPy's global random state draws in the same order),
        # so its batches are taken to be shaped as the training ones.
        if signature is None:
            first = self._batch(0)
            try:
                second = self._batch(1)
            except StopIteration:  # a generator of one batch
                second = first
            signature = {nest}(spec, first, second)
        self.signature = signature
        self.dataset = {from_generator}(self._unused, output_signature=self.signature)

    def _batch(self, number):
        with self._lock:
            while len(self._read) <= number - self._used:
                self._read.append(self._tuples(next(self._generator)))
            return self._read[max(number - self._used, 0)]

    def _unused(self):
        number = self._used
        while True:
            try:
                yield self._batch(number)
            except StopIteration:
                return
            number += 1

    def _count(self):
        with self._lock:
            del self._read[0]
            self._used += 1

    def on_train_batch_end(self, batch, logs=None):
        if self._stage == "train":
            self._count()

    def on_test_batch_end(self, batch, logs=None):
        if self._stage == "test":
            self._count()

    @classmethod
    def _tuples(cls, batch):
        """`([x1, x2], y)` as `((x1, x2), y)` (tf.data reads a list as one tensor), each array a
        copy: a Sequence's batches are often views of its arrays, and TensorFlow may write into
        the memory of an array it is handed (a held-out program's labels changed in place while
        it trained, in 1 run of 4)."""
        if isinstance(batch, (list, tuple)):
            return tuple(cls._tuples(part) for part in batch)
        if isinstance(batch, dict):
            return {{key: cls._tuples(part) for key, part in batch.items()}}
        return numpy.array(batch) if isinstance(batch, numpy.ndarray) else batch
'''


def batches_in_order_class(rule) -> tuple[cst.BaseStatement, list[ImportItem]]:
    """The `BatchesInOrder` class, through the module's own TensorFlow import: (class, imports)."""
    tf = TfNames(rule)
    names = {key: tf(f"tensorflow.{target}") for key, target in (
        ("convert", "convert_to_tensor"), ("spec", "TensorSpec"), ("from_generator", "data.Dataset.from_generator"),
        ("nest", "nest.map_structure"), ("flatten", "nest.flatten"))}
    imports = [ImportItem("numpy"), ImportItem("random"), ImportItem("threading"), ImportItem("keras"), *tf.imports]
    return cst.parse_statement(_BATCHES_IN_ORDER.format(**names)), imports


def generator_fits(calls: list[cst.Call], changes: dict) -> dict:
    """`model.fit_generator(gen, ...)` -> `BatchesInOrder.fit(model, gen, ...)` for ``calls``
    (`evaluate_generator` and `predict_generator` alike), from the renamed `model.fit(gen, ...)`
    that ``changes`` holds for each (:func:`tfmigrate.rewrites.keras3_leftovers.generator_methods`)."""
    fits = {}
    for call in calls:
        renamed = changes.get(call)
        if not isinstance(renamed, cst.Call) or not isinstance(renamed.func, cst.Attribute):
            continue
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        model = cst.Arg(renamed.func.value, comma=comma)
        fits[call] = renamed.with_changes(func=cst.parse_expression(f"BatchesInOrder.{renamed.func.attr.value}"),
                                          args=[model, *_generator_first(list(renamed.args), comma)])
    return fits


def _generator_first(args: list[cst.Arg], comma: cst.Comma) -> list[cst.Arg]:
    """``args`` of `fit(x=gen, ...)` (`fit_generator(generator=gen)` renamed) with `gen` first and
    unnamed, as `BatchesInOrder.fit` takes it; each other argument keeps its comma (and comment)."""
    index = next((i for i, arg in enumerate(args) if keyword_is(arg, "x")), None)
    if index is None:
        return args
    fed = args.pop(index).with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT)
    if index > 0 and index == len(args):  # it was last: the argument before it ends the call now
        args[-1] = args[-1].with_changes(comma=fed.comma)
    return [fed if index == 0 else fed.with_changes(comma=comma), *args]


def generator_argument(call: cst.Call) -> cst.BaseExpression | None:
    """The generator a `fit_generator(...)` call trains on."""
    return argument(call, ("generator",), "generator")
