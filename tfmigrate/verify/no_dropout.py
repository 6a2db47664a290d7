"""Keras's dropout layers turned off for a verify run (``--keep-dropout`` keeps them).

A parallel model (`multi_gpu_model`, a hand-written `ParallelModel`) drew one dropout mask per
device slice of the batch from its template's layers; under MirroredStrategy each replica draws
its own, from other random streams. With dropout on, no migration trains step by step like its
original (a held-out Keras trainer class differed from step 0, and matched with its `Dropout`
left out of both programs); off, everything else is compared exactly. Both runs turn it off,
and each records what it turned off (:data:`TURNED_OFF`), so that the report says so and a
rewrite that dropped a dropout layer is caught: one run had one and the other did not.
"""

from __future__ import annotations

import importlib
import sys

#: What this run turned off, one entry per layer: `Dropout(rate=0.3)`.
TURNED_OFF: list[str] = []
#: id() of each layer turned off already (its calls and traces record it once), and "sample".
_SEEN: set = set()
#: The layers that drop or perturb at random in training (the spatial dropouts derive from Dropout).
_RANDOM_LAYERS = ("Dropout", "GaussianDropout", "GaussianNoise", "AlphaDropout")
#: The recurrent cells whose `dropout=` and `recurrent_dropout=` draw masks (`LSTM(32, dropout=0.2)`
#: makes an `LSTMCell(dropout=0.2)`).
_RECURRENT_CELLS = ("LSTMCell", "GRUCell", "SimpleRNNCell")


def install(legacy_keras: bool, from_program=None) -> None:
    """Make the random layers of the Keras the program runs on (``legacy_keras``: tf_keras, the
    Keras 2 of TF1-mode programs; else Keras 3) pass their inputs through, and the normal samples
    the program's own code draws through Keras (``from_program`` tells its frames: a VAE's
    `K.random_normal` in a `Lambda`, `keras.random.normal` once migrated) sit at their mean."""
    if from_program is not None:
        _sample_at_mean(legacy_keras, from_program)
    layers = importlib.import_module("tf_keras.layers" if legacy_keras else "keras.layers")
    for cls in _defining(layers, _RANDOM_LAYERS, "call"):
        cls.call = _passed_through
    for cls in _defining(layers, _RECURRENT_CELLS, "__init__"):
        if not getattr(cls.__init__, "_tfmigrate", False):
            cls.__init__ = _without_cell_dropout(cls.__init__)


def _defining(layers, names: tuple[str, ...], attribute: str) -> set[type]:
    """The classes of ``layers`` deriving from those ``names`` name, and their private bases that
    do too (Keras 3's BaseSpatialDropout), that define ``attribute`` themselves."""
    bases = tuple(cls for cls in (getattr(layers, name, None) for name in names) if cls is not None)
    return {cls for value in vars(layers).values() if isinstance(value, type) and issubclass(value, bases)
            for cls in value.__mro__ if issubclass(cls, bases) and attribute in vars(cls)}


def _passed_through(self, inputs, training=None):
    if id(self) not in _SEEN:  # each layer once, however often it is called or traced
        _SEEN.add(id(self))
        amount = next((f"{k}={getattr(self, k)}" for k in ("rate", "stddev") if hasattr(self, k)), "")
        TURNED_OFF.append(f"{type(self).__name__}({amount})")
    return inputs


def _without_cell_dropout(init):
    """A recurrent cell's `__init__` that makes it without input and recurrent dropout: a held-out
    `LSTM(32, dropout=0.2, recurrent_dropout=0.2)` program differed from step 0, its masks drawn
    from the two Kerases' different random streams."""

    def __init__(self, *args, **kwargs):
        dropped = {key: kwargs[key] for key in ("dropout", "recurrent_dropout") if kwargs.get(key)}
        if dropped and id(self) not in _SEEN:
            _SEEN.add(id(self))
            TURNED_OFF.append(f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in dropped.items())})")
        init(self, *args, **{**kwargs, **{key: 0.0 for key in dropped}})

    __init__._tfmigrate = True
    return __init__


def _sample_at_mean(legacy_keras: bool, from_program) -> None:
    """Keras's normal sampling (`K.random_normal`, `keras.random.normal`) called by the program's
    own code draws with no spread: the two Kerases draw from different random streams, so a
    VAE's reparameterised sample differed from step 0 (a held-out VAE matched 36 of 36 steps with
    the noise left out of both programs). Keras's own calls (initializers) are left alone."""
    module = importlib.import_module("tf_keras.backend" if legacy_keras else "keras.random")
    name = "random_normal" if legacy_keras else "normal"
    original = getattr(module, name, None)
    if original is None or getattr(original, "_tfmigrate", False):
        return

    def sampled(shape, mean=0.0, stddev=1.0, *args, **kwargs):
        if from_program(sys._getframe(1).f_globals):
            if "sample" not in _SEEN:
                _SEEN.add("sample")
                TURNED_OFF.append(f"normal sampling(stddev={stddev})")
            stddev = 0.0
        return original(shape, mean, stddev, *args, **kwargs)

    sampled._tfmigrate = True
    setattr(module, name, sampled)
