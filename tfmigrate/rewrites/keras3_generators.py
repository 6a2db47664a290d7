"""A model off `multi_gpu_model` trained by `fit_generator` on a Python generator, on Keras 3.

Keras 3's `fit` takes a generator, but under a distribution strategy it opens an iterator on
its data to build the model, takes one batch from it and drops that iterator with the batches
it had read ahead. Fed the generator itself, training began several batches in (checked on
Keras 3.15: batches 0, 1, 6, 7, ... where Keras 2 trained 0, 1, 2, 3, ...), and every later
`fit` skipped some more. The fix trains through a `BatchesInOrder` class it writes into the
module: a `tf.data.Dataset` over the generator whose every iterator starts at the first batch
not trained yet, counted by the class, which is also a callback. Keras 2 trained a generator's
batches in the order it yields them and went on with the next one at the next epoch; so does
this.

`model.fit_generator(gen, steps_per_epoch=100, epochs=3)` becomes
`BatchesInOrder.fit(model, gen, steps_per_epoch=100, epochs=3)`.

A `keras.utils.Sequence` (a class deriving from it, an `ImageDataGenerator(...).flow(...)`)
is refused: Keras 2 read it in its own order (shuffled each epoch by default), and Keras 3
under a strategy split its batches otherwise from the second epoch on in 2 of 5 runs. Where
the argument's kind cannot be told here (a method of another module), the class checks it
when the program runs and stops on a Sequence rather than train on it otherwise.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import argument, keyword_is
from tfmigrate.cst.codegen import code_in
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import find
from tfmigrate.rule import ImportItem

__all__ = ["SEQUENCE_MAKERS", "batches_in_order_class", "generator_argument", "generator_fits", "sequence_fed"]

#: What makes a `keras.utils.Sequence` of Keras 2 (its image iterators are ones).
SEQUENCE_MAKERS = ("flow", "flow_from_directory", "flow_from_dataframe")
#: The Keras classes whose subclasses are Sequences.
SEQUENCE_BASES = ("Sequence", "PyDataset")

_BATCHES_IN_ORDER = '''
class BatchesInOrder(keras.callbacks.Callback):
    """A Python generator's batches, trained in the order Keras 2's `fit_generator` trained them.

    Keras 3's `fit` under a distribution strategy opens an iterator on its data to build the
    model, takes a batch from it and drops it with the batches it read ahead: fed the
    generator itself, it trained from a later batch on. Every iterator over `dataset` starts at
    the first batch not trained (or validated) yet, which this callback counts.
    """

    _made = {{}}  # one for each generator: a second fit goes on where the first stopped

    @classmethod
    def fit(cls, model, generator, callbacks=None, validation_data=None, **arguments):
        """Keras 2's `model.fit_generator(generator, ...)` on Keras 3."""
        training = cls._of(generator, "train")
        callbacks = [training, *(callbacks or [])]
        if hasattr(validation_data, "__next__"):  # validated on a generator's batches
            validation = cls._of(validation_data, "test", training.signature)
            callbacks.insert(1, validation)
            validation_data = validation.dataset
        return model.fit(training.dataset, validation_data=validation_data, callbacks=callbacks, **arguments)

    @classmethod
    def _of(cls, generator, stage, signature=None):
        if hasattr(generator, "__getitem__") and hasattr(generator, "__len__"):
            raise TypeError("BatchesInOrder.fit takes a Python generator; a keras.utils.Sequence "
                            "was read in another order by Keras 2")
        if id(generator) not in cls._made:
            cls._made[id(generator)] = (generator, cls(generator, stage, signature))
        return cls._made[id(generator)][1]

    def __init__(self, generator, stage, signature=None):
        super().__init__()
        self._generator = generator
        self._stage = stage  # "train" or "test": the batches counted are the stage's
        self._read = []  # batches read from the generator and not used yet, in order
        self._used = 0
        self._lock = threading.Lock()

        def spec(part):
            part = {convert}(part)
            return {spec}((None, *part.shape[1:]), part.dtype)

        # A validation generator is read first where Keras 2 read it, after the first epoch's
        # training (a generator drawing from NumPy's global random state draws in the same order),
        # so its batches are taken to be shaped as the training ones.
        self.signature = signature or {nest}(spec, self._batch(0))
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
        """`([x1, x2], y)` as `((x1, x2), y)`: tf.data reads a list as one tensor."""
        if isinstance(batch, (list, tuple)):
            return tuple(cls._tuples(part) for part in batch)
        return batch
'''


def batches_in_order_class(rule) -> tuple[cst.BaseStatement, list[ImportItem]]:
    """The `BatchesInOrder` class, through the module's own TensorFlow import: (class, imports)."""
    names, imports = {}, [ImportItem("threading"), ImportItem("keras")]
    for key, target in (("convert", "convert_to_tensor"), ("spec", "TensorSpec"),
                        ("from_generator", "data.Dataset.from_generator"), ("nest", "nest.map_structure")):
        expression, needed = rule.tf_ref(f"tensorflow.{target}")
        names[key] = code_in(rule.context.module, expression)
        imports += needed
    return cst.parse_statement(_BATCHES_IN_ORDER.format(**names)), imports


def sequence_fed(rule, fed: cst.BaseExpression) -> bool:
    """Whether ``fed`` (a `fit_generator`'s first argument) is known to be a `keras.utils.Sequence`:
    made by a module class deriving from one, or by `flow(...)`, there or where its name is
    assigned."""
    made = [fed]
    if isinstance(fed, cst.Name):
        made = [node.value for node in find(rule.context.module, cst.Assign)
                if any(isinstance(t.target, cst.Name) and t.target.value == fed.value for t in node.targets)]
    for value in made:
        if not isinstance(value, cst.Call):
            continue
        if isinstance(value.func, cst.Attribute) and value.func.attr.value in SEQUENCE_MAKERS:
            return True
        if isinstance(value.func, cst.Name) and value.func.value in _sequence_classes(rule.context.module):
            return True
    return False


def _sequence_classes(module: cst.Module) -> set[str]:
    """The module's classes that derive from a Keras Sequence (or from one of those)."""
    classes = {c.name.value: c for c in find(module, cst.ClassDef)}
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, cls in classes.items():
            bases = {(dotted_name(base.value) or "").rsplit(".", 1)[-1] for base in cls.bases}
            if name not in found and bases & (set(SEQUENCE_BASES) | found):
                found.add(name)
                changed = True
    return found


def generator_fits(calls: list[cst.Call], changes: dict) -> dict:
    """`model.fit_generator(gen, ...)` -> `BatchesInOrder.fit(model, gen, ...)` for ``calls``,
    from the renamed `model.fit(gen, ...)` that ``changes`` holds for each
    (:func:`tfmigrate.rewrites.keras3_leftovers.generator_methods`)."""
    fits = {}
    for call in calls:
        renamed = changes.get(call)
        if not isinstance(renamed, cst.Call) or not isinstance(renamed.func, cst.Attribute):
            continue
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        model = cst.Arg(renamed.func.value, comma=comma)
        fits[call] = renamed.with_changes(func=cst.parse_expression("BatchesInOrder.fit"),
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
