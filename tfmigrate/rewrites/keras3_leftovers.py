"""What a Keras program moved off `multi_gpu_model` must change to run on Keras 3.

`multi_gpu_model` is gone from TF 2.4, so the migrated program runs on today's Keras, Keras 3,
which refuses what the parallel-model programs of Keras 2 wrote (each made a held-out program
crash), or worse, takes it and trains otherwise:

- an HDF5 weights file whose name does not end in `.weights.h5` (`save_weights`,
  `load_weights`, and `ModelCheckpoint(..., save_weights_only=True)` or a subclass of it; `.h5`
  or `.hdf5`, at the call or where the module names the file);
- a flat `metrics=[...]` list compiled into a model with several outputs, which Keras 2 gave
  each output and Keras 3 refuses;
- boolean arrays fed to the model (`np.zeros(..., dtype=np.bool)`), which Keras 2 cast to floats
  and Keras 3 under a strategy fails on;
- Adam (and Adamax, Adagrad, Adadelta) in a module with an `Embedding`: Keras 3 squares each
  occurrence's gradient of a row seen more than once in a batch, Keras 2 their sum; a
  `DenseGradientAdam` subclass adds them up first;
- RMSprop, which Keras 3 steps by g / sqrt(v + eps) and Keras 2 by g / (sqrt(v) + eps): a
  `Keras2RMSprop` subclass steps as Keras 2's;
- assigning `Callback.model`, a read-only property (`self.model = self.original_model` in the
  widely copied `ModelCheckpointMGPU`);
- an optimizer's `lr=` (now `learning_rate=`), its `.lr` (now `.learning_rate`), and its
  `decay=`, which Keras 3 *ignores* with a warning: Keras 2 trained at `lr / (1 + decay * step)`,
  which is `InverseTimeDecay(lr, decay_steps=1, decay_rate=decay)`;
- `fit_generator` / `evaluate_generator` / `predict_generator` (now `fit` / `evaluate` /
  `predict`, without the worker arguments; a model off `multi_gpu_model` trained so goes
  through :mod:`tfmigrate.rewrites.keras3_generators`, evaluated or predicted on so too);
- `Model(input=..., output=...)` (now `inputs=`, `outputs=`);
- `tf.set_random_seed(n)`, TF1's seed call that Keras 2 programs made to be repeatable (the Keras
  FAQ's): `tf.random.set_seed(n)`, so that the program runs in TF2 mode, where Keras 3 trains;
- Keras 2's submodules (`keras.layers.core`, `keras.utils.np_utils`): what they held is in the
  package above;
- the backend's math (`K.sum`, `K.flatten` in a Dice loss): it is in `keras.ops` now;
- `to_categorical(...)`, float32 in Keras 2 (its `dtype=`) and float64 in Keras 3, where a
  metric multiplying float32 predictions by the labels fails;
- the labels a metric function sees, which Keras 2 cast to the predictions' type;
- `ModelCheckpoint(..., period=1)`: Keras 3 has no `period`;
- `monitor='val_acc'` (and `history['acc']`) of a model compiled with `metrics=['accuracy']`,
  which Keras 2.2 logged as `acc` and Keras 3 logs as `accuracy`;
- refused: `keras.preprocessing.text` (its `Tokenizer`) and `ImageDataGenerator`, gone without a
  replacement of the same meaning; Nadam,
  which Keras 3 computes otherwise (`keras3_optimizers.COMPUTED_OTHERWISE`); a read of an
  optimizer's `decay`; a `decay=` a learning-rate callback would also set.

The optimizers' part (`lr=`, `decay=`, `.lr`, `DenseGradientAdam`, and the optimizers refused)
is in :mod:`tfmigrate.rewrites.keras3_optimizers`.

Each function returns LibCST changes (original node -> replacement) for the rule's edit; a
replacement may hold nodes another change replaces, so the rule applies them within it
(:func:`made_within`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from tfmigrate.analysis.keras_batch_norm import frozen_assignments
from tfmigrate.analysis.keras_losses import compiled_loss
from tfmigrate.cst.callargs import (
    KEYWORD_EQUAL, argument, commas_mended, keyword_arg, keyword_is, keyword_renamed, receiver_passed, short_name,
    with_keyword,
)
from tfmigrate.cst.codegen import code, code_in, realigned_continuations
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import (
    ReplaceById, assignments, block_indentation, find, init_of, module_parents, names_used, single_small,
)
from tfmigrate.rewrites.keras3_session import SET_SESSION
from tfmigrate.rewrites.mirrored import TfNames, is_docstring
from tfmigrate.rule import ImportItem

__all__ = [
    "BACKEND_WRITTEN", "GENERATOR_METHODS", "PERIOD_CHECKPOINT", "TF2_SPELLINGS", "accuracy_log_names",
    "backend_calls", "backend_functions", "boolean_inputs", "callback_models_set", "categorical_dtypes",
    "checkpoint_periods", "continuation_lines", "frozen_after_compile", "generator_methods", "integer_sizes",
    "function_aliases", "made_within", "metric_label_casts", "model_keywords", "module_paths", "output_metrics",
    "period_checkpoint_class", "single_output_targets", "tf2_spellings", "uses_period_checkpoint", "weight_file_renames",
    "weighted_named_targets",
]

#: Keras 2's `*_generator` methods and their parameters after the generator (Keras 2.2-2.3).
GENERATOR_METHODS = {
    "fit_generator": ("fit", ("steps_per_epoch", "epochs", "verbose", "callbacks", "validation_data",
                              "validation_steps", "class_weight", "max_queue_size", "workers",
                              "use_multiprocessing", "shuffle", "initial_epoch")),
    "evaluate_generator": ("evaluate", ("steps", "callbacks", "max_queue_size", "workers", "use_multiprocessing",
                                        "verbose")),
    "predict_generator": ("predict", ("steps", "callbacks", "max_queue_size", "workers", "use_multiprocessing",
                                      "verbose")),
}
#: Arguments of the `*_generator` methods that Keras 3's `fit`/`evaluate`/`predict` do not take:
#: how many threads or processes fill the queue, which does not change what is trained.
WORKER_ARGUMENTS = ("max_queue_size", "workers", "use_multiprocessing")
#: TF1-only calls a Keras 2 program makes to set itself up, and their TF2 names: spelled so, the
#: program no longer needs TF1 mode (a Keras FAQ-style `tf.set_random_seed(1)` was all that kept
#: held-out programs there).
TF2_SPELLINGS = {"tensorflow.set_random_seed": "tensorflow.random.set_seed"}
#: Keras 2's submodules that Keras 3 does not have; what they held is in the package above.
KERAS2_SUBMODULES = {
    "keras.layers": ("core", "convolutional", "pooling", "normalization", "recurrent", "merge", "embeddings",
                     "advanced_activations", "wrappers", "noise", "local", "convolutional_recurrent"),
    "keras.utils": ("np_utils", "generic_utils", "data_utils", "io_utils", "vis_utils", "layer_utils", "conv_utils"),
}
#: Keras 2's `keras.engine` modules, which Keras 3 does not have, and where their names are now.
KERAS2_ENGINE = ("keras.engine", "keras.engine.topology", "keras.engine.base_layer", "keras.engine.input_layer",
                 "keras.engine.training", "keras.engine.network")
KERAS2_ENGINE_NAMES = {"Layer": "keras.layers", "InputSpec": "keras.layers", "Input": "keras.layers",
                       "InputLayer": "keras.layers", "Model": "keras.models"}


def weight_file_renames(module: cst.Module, weight_calls: Iterable[cst.Call], checkpoint_calls: Iterable[cst.Call],
                        models: set) -> dict:
    """`model.save_weights('w.h5')` / `load_weights('w.h5')` of one of ``models`` -> 'w.weights.h5',
    at the call or where the module binds the name it passes; and the file of each of
    ``checkpoint_calls`` (calls with `save_weights_only=True`) that makes a `ModelCheckpoint`
    (a held-out U-Net's failed at its construction), which the program then loads by the same name."""
    changes = {}
    in_callbacks = {id(node) for cls in find(module, cst.ClassDef) if _derives(cls, ("ModelCheckpoint", "Callback"))
                    for node in find(cls, cst.Call)}
    for call in weight_calls:
        saves_model = isinstance(call.func, cst.Attribute) and dotted_name(call.func.value) in models
        # a callback saves the model it was given (the template, in the widely copied checkpoint of
        # a parallel model's template): Keras 3 needs `.weights.h5` there too
        if (saves_model or id(call) in in_callbacks) and call.args:
            changes.update(_weights_h5_renamed(call.args[0].value))
            changes.update(_bound_file_renamed(module, call.args[0].value))
    for call in checkpoint_calls:
        if _is_checkpoint(module, call):
            filepath = argument(call, _checkpoint_parameters(module, call), "filepath")
            if filepath is not None:
                changes.update(_weights_h5_renamed(filepath))
                changes.update(_bound_file_renamed(module, filepath))
    # The same file read back elsewhere (`fresh.load_weights('final.h5')` of a model rebuilt to
    # evaluate) is read by its new name.
    renamed = {old.value for old in changes if isinstance(old, cst.SimpleString)}
    for string in find(module, cst.SimpleString):
        if string.value in renamed and string not in changes:
            changes.update(_weights_h5_renamed(string))
    return changes


def _checkpoint_parameters(module: cst.Module, call: cst.Call) -> tuple[str, ...]:
    """The positional parameters of the checkpoint class ``call`` makes: Keras's (`filepath`
    first), or its subclass's own `__init__`'s (`(self, template_model, filepath, **kwargs)`, a
    held-out DeepLab trainer's)."""
    name = short_name(call.func)
    for cls in find(module, cst.ClassDef):
        init = init_of(cls)
        if cls.name.value == name and init is not None:
            named = tuple(p.name.value for p in init.params.params[1:])
            # `(self, template, *args, **kwargs)` hands the rest on to ModelCheckpoint: `filepath` first
            return named + ("filepath",) if isinstance(init.params.star_arg, cst.Param) else named
    return ("filepath",)


def weighted_named_targets(module: cst.Module) -> tuple[cst.CSTNode, str] | None:
    """`fit(x, {'age': ya, 'gender': yg}, sample_weight=...)`: Keras 3.15 fails on per-example
    weights with targets given by output name, whatever form the weights take ("KeyError: 0";
    checked with a dict, a list and one array; lists of both work): (the call, why), else None."""
    for call in find(module, cst.Call):
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "fit"):
            continue
        weighted = any(keyword_is(arg, "sample_weight") for arg in call.args)
        targets = argument(call, ("x", "y"), "y")
        if weighted and isinstance(targets, cst.Dict):
            return call, ("Keras 3 fails on `sample_weight` when the targets are a dict by output name "
                          "(\"KeyError: 0\"): pass the targets and the weights as lists in the model's output order")
    return None


def single_output_targets(module: cst.Module, compiles: list[cst.Call]) -> dict:
    """`fit(x, {'labels': y})` -> `fit(x, y)` (and in `validation_data=(x, {...})`, `evaluate`,
    the `*_on_batch` methods) where the models compile one loss each: Keras 3.15 fails on a
    one-output model's targets given by output name ("Expected float32, but got labels of type
    'str'", a held-out two-input text classifier)."""
    if not compiles or any(len(_outputs_listed(compiled_loss(call)) or ()) > 1 for call in compiles):
        return {}
    changes = {}
    for call in find(module, cst.Call):
        if not (isinstance(call.func, cst.Attribute)
                and call.func.attr.value in ("fit", "evaluate", "train_on_batch", "test_on_batch")):
            continue
        values = [argument(call, ("x", "y"), "y")]
        data = next((arg.value for arg in call.args if keyword_is(arg, "validation_data")), None)
        if isinstance(data, cst.Tuple) and len(data.elements) >= 2:
            values.append(data.elements[1].value)
        for value in values:
            if isinstance(value, cst.Dict) and len(value.elements) == 1 and isinstance(value.elements[0], cst.DictElement):
                changes[value] = value.elements[0].value
    return changes


def checkpoint_periods(module: cst.Module) -> tuple[dict, tuple[cst.CSTNode, str] | None]:
    """`ModelCheckpoint(..., period=N)` (or a subclass's): Keras 3 has no `period` (it fails at
    the construction) and counts its `save_freq` in batches. Every epoch is its default, so
    `period=1` goes; another period makes a :data:`PERIOD_CHECKPOINT` (written into the module by
    :func:`period_checkpoint_class`), which saves every N epochs as Keras 2 did: in place of
    Keras's class where it is called, as the base of the module's subclass otherwise."""
    changes = {}
    for call in find(module, cst.Call):
        period = next((arg for arg in call.args if keyword_is(arg, "period")), None)
        inherited = _checkpoint_initialized(module, call)
        if inherited is not None:  # the subclass's `super().__init__(..., period=period)`
            if period is not None:
                changes.update(_periodic_bases(module, inherited))
                if not isinstance(call.func.value, cst.Call):  # `ModelCheckpoint.__init__(self, ...)`
                    changes[call.func.value] = cst.Name(PERIOD_CHECKPOINT)
            continue
        if not _is_checkpoint(module, call):
            continue
        if period is None:
            if sum(arg.keyword is None and not arg.star for arg in call.args) > 6:  # Keras 2's 7th: `period`
                return {}, (call, "pass `period=` by keyword")
            continue
        if isinstance(period.value, cst.Integer) and period.value.evaluated_value == 1:
            kept = [arg for arg in call.args if arg is not period]
            changes[call] = call.with_changes(args=commas_mended(kept, call.args))
        elif short_name(call.func) == "ModelCheckpoint":
            changes[call] = call.with_changes(func=cst.Name(PERIOD_CHECKPOINT))
        else:
            changes.update(_periodic_bases(module, short_name(call.func)))
    return changes, None


def _checkpoint_initialized(module: cst.Module, call: cst.Call) -> str | None:
    """The module's `ModelCheckpoint` subclass whose `__init__` ``call`` is the base's
    (`super(Cls, self).__init__(...)`, `ModelCheckpoint.__init__(self, ...)`; a held-out
    autoencoder's checkpoint forwarded its own `period` so); else None."""
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "__init__"):
        return None
    base = call.func.value
    if not (isinstance(base, cst.Call) and short_name(base.func) == "super"
            or (dotted_name(base) or "").rsplit(".", 1)[-1] == "ModelCheckpoint"):
        return None
    for cls in find(module, cst.ClassDef):
        if _derives(cls, ("ModelCheckpoint",)) and any(c is call for c in find(cls, cst.Call)):
            return cls.name.value
    return None


#: The `ModelCheckpoint` subclass that saves every `period` epochs.
PERIOD_CHECKPOINT = "PeriodCheckpoint"

_PERIOD_CHECKPOINT_CLASS = '''
class PeriodCheckpoint(keras.callbacks.ModelCheckpoint):
    """`ModelCheckpoint(..., period=N)` as Keras 2 saved: every N epochs (Keras 3 has no
    `period`, and its `save_freq` counts batches)."""

    def __init__(self, *args, period=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.period = period
        self.epochs_since_last_save = 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs_since_last_save += 1
        if self.epochs_since_last_save >= self.period:
            self.epochs_since_last_save = 0
            super().on_epoch_end(epoch, logs)
'''


def uses_period_checkpoint(changes: dict) -> bool:
    """Whether ``changes`` make or derive from a :data:`PERIOD_CHECKPOINT`."""
    return any(PERIOD_CHECKPOINT in {n.value for n in find(new, cst.Name)}
               for new in changes.values() if isinstance(new, cst.CSTNode))


def period_checkpoint_class(changes: dict) -> tuple[list[cst.BaseStatement], list[ImportItem]]:
    """The :data:`PERIOD_CHECKPOINT` class, where ``changes`` use it: ([class], imports)."""
    if not uses_period_checkpoint(changes):
        return [], []
    return [cst.parse_statement(_PERIOD_CHECKPOINT_CLASS)], [ImportItem("keras")]


def _periodic_bases(module: cst.Module, name: str) -> dict:
    """The module's checkpoint class ``name``, and those between it and Keras's, derived from
    :data:`PERIOD_CHECKPOINT` where they named `ModelCheckpoint`."""
    classes = {c.name.value: c for c in find(module, cst.ClassDef)}
    changes, pending = {}, [name]
    while pending:
        cls = classes.get(pending.pop())
        if cls is None:
            continue
        for base in cls.bases:
            named = (dotted_name(base.value) or "").rsplit(".", 1)[-1]
            if named == "ModelCheckpoint":
                changes[base] = base.with_changes(value=cst.Name(PERIOD_CHECKPOINT))
            elif named in classes and named != cls.name.value:
                pending.append(named)
    return changes


def callback_models_set(module: cst.Module) -> dict:
    """`self.model = self.original_model` in a callback class of the module -> `self.set_model(...)`,
    which sets it in Keras 2 and 3. The template is now the model `fit` trains, so the
    checkpoint saves the same model either way. In the callback's own `set_model` it is
    `super().set_model(...)` (calling itself, a held-out speech kernel's recursed forever)."""
    changes = {}
    for cls in find(module, cst.ClassDef):
        if not _derives(cls, ("ModelCheckpoint", "Callback")):
            continue
        for method in find(cls.body, cst.FunctionDef):
            setter = "super().set_model" if method.name.value == "set_model" else "self.set_model"
            for line in find(method.body, cst.SimpleStatementLine):
                small = single_small(line)
                if (isinstance(small, cst.Assign) and len(small.targets) == 1
                        and dotted_name(small.targets[0].target) == "self.model"):
                    value = module.code_for_node(small.value).strip()
                    changes[small] = cst.Expr(cst.parse_expression(f"{setter}({value})"))
    return changes


def _derives(cls: cst.ClassDef, bases: tuple[str, ...]) -> bool:
    """Whether ``cls`` names one of ``bases`` among its bases (`ModelCheckpoint`, `keras.callbacks.Callback`)."""
    return any((dotted_name(base.value) or "").rsplit(".", 1)[-1] in bases for base in cls.bases)


def _weights_h5_renamed(value: cst.BaseExpression) -> dict:
    """Each string literal in ``value`` naming an HDF5 file (`*.h5`, `*.hdf5`), as `*.weights.h5`."""
    changes = {}
    for string in find(value, cst.SimpleString):
        quote = string.value[-3:] if string.value[-3:] in ('"""', "'''") else string.value[-1]
        body = string.value[:-len(quote)]
        if body.endswith((".h5", ".hdf5")) and not body.endswith(".weights.h5"):
            changes[string] = string.with_changes(value=body.rpartition(".")[0] + ".weights.h5" + quote)
    return changes


def _bound_file_renamed(module: cst.Module, value: cst.BaseExpression, seen: frozenset = frozenset()) -> dict:
    """A weights file named through a name or attribute (`save_weights(self.weights_file)`, or a
    pattern filled in: `self.path_fmt.format(epoch=epoch)`, `pattern % epoch`): its `.h5`
    literals where the module binds it (`self.weights_file = os.path.join(d, 'w.h5')`), through
    names bound to names in turn (`path = self.filepath.format(epoch=epoch + 1, **logs)`, the
    AltModelCheckpoint callback's)."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "format":
        value = value.func.value
    elif isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Modulo):
        value = value.left
    name = dotted_name(value)
    if name is None or name in seen:
        return {}
    changes = {}
    for assign in find(module, cst.Assign):
        if any(dotted_name(t.target) == name for t in assign.targets):
            changes.update(_weights_h5_renamed(assign.value))
            changes.update(_constructor_file_renamed(module, assign))
            changes.update(_bound_file_renamed(module, assign.value, seen | {name}))
    return changes


def _constructor_file_renamed(module: cst.Module, assign: cst.Assign) -> dict:
    """`self.filepath = filepath` in a class's `__init__`: the `.h5` literals the module passes
    for that parameter where it makes the class (`TemplateCheckpoint(model, 'best.hdf5')`)."""
    parameter = assign.value.value if isinstance(assign.value, cst.Name) else None
    cls, init = next(((c, init) for c in find(module, cst.ClassDef) if (init := init_of(c)) is not None
                      and any(a is assign for a in find(init, cst.Assign))), (None, None))
    if parameter is None or cls is None:
        return {}
    names = [p.name.value for p in init.params.params][1:]
    if parameter not in names:
        return {}
    changes = {}
    for call in find(module, cst.Call):
        if isinstance(call.func, cst.Name) and call.func.value == cls.name.value:
            given = argument(call, names, parameter)
            if given is not None:
                changes.update(_weights_h5_renamed(given))
                if dotted_name(given) not in {dotted_name(t.target) for t in assign.targets}:  # no cycle
                    changes.update(_bound_file_renamed(module, given))
    return changes


def _is_checkpoint(module: cst.Module, call: cst.Call) -> bool:
    """A call of Keras's `ModelCheckpoint`, or of a class of the module derived from it."""
    name = short_name(call.func)
    if name == "ModelCheckpoint":
        return True
    return any(c.name.value == name and _derives(c, ("ModelCheckpoint",)) for c in find(module, cst.ClassDef))


def made_within(node: cst.CSTNode, changes: dict) -> cst.CSTNode:
    """``node`` (an original node, or a replacement built from original nodes) with the
    ``changes`` that fall inside it made, and those inside each replacement
    (`K.sqrt(K.mean(K.square(x)))`: every call is one change)."""
    return _made_within(node, {id(original): new for original, new in changes.items()})


def _made_within(node, changes: dict[int, object]):
    if isinstance(node, cst.FlattenSentinel):
        return cst.FlattenSentinel([_made_within(each, changes) for each in node.nodes])
    if not isinstance(node, cst.CSTNode):  # a removal
        return node
    return node.visit(_Nested(changes))


class _Nested(cst.CSTTransformer):
    def __init__(self, changes: dict[int, object]) -> None:
        super().__init__()
        self.changes = changes

    def on_leave(self, original, updated):
        new = self.changes.get(id(original))
        if new is None:
            return updated
        # What the replacement holds of the original's insides is changed too (not itself again).
        return _made_within(new, {k: v for k, v in self.changes.items() if k != id(original)})


#: NumPy constructors whose `dtype=` makes the array, and the spellings of a boolean dtype.
ARRAY_MAKERS = {f"numpy.{name}" for name in ("zeros", "ones", "empty", "full", "array", "asarray")}
BOOLEAN_DTYPES = {"numpy.bool", "numpy.bool_", "bool"}


def boolean_inputs(rule, models: set) -> dict:
    """`parallel.fit(x, y)` of arrays the module makes boolean (`np.zeros(..., dtype=np.bool)`,
    the one-hot text of Keras's `lstm_text_generation` example) -> `x.astype('float32')`: Keras 2
    cast them to the model's floats, Keras 3 under a distribution strategy fails on them ("Value
    for attr 'T' of bool is not in the list of allowed values", a held-out text generator)."""
    module = rule.context.module
    made: dict[str, list[bool]] = {}
    for assign in find(module, cst.Assign):
        for target in assign.targets:
            if isinstance(target.target, cst.Name):
                made.setdefault(target.target.value, []).append(_makes_booleans(rule, assign.value))
    booleans = {name for name, each in made.items() if all(each)}
    changes = {}
    for call in find(module, cst.Call) if booleans else ():
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value in ("fit", "evaluate", "predict")
                and dotted_name(call.func.value) in models):
            continue
        for arg in call.args:
            if arg.keyword is None or arg.keyword.value in ("x", "y", "validation_data"):
                for name in [arg.value, *(e.value for e in getattr(arg.value, "elements", ()))]:
                    if isinstance(name, cst.Name) and name.value in booleans:
                        changes[name] = cst.parse_expression(f"{name.value}.astype('float32')")
    return changes


def _makes_booleans(rule, value: cst.BaseExpression) -> bool:
    if not (isinstance(value, cst.Call) and ARRAY_MAKERS & set(rule.imports.resolve_all(value.func))):
        return False
    dtype = next((arg.value for arg in value.args if keyword_is(arg, "dtype")), None)
    if isinstance(dtype, cst.SimpleString):
        return dtype.evaluated_value == "bool"
    return dtype is not None and bool(BOOLEAN_DTYPES & ({dotted_name(dtype)} | set(rule.imports.resolve_all(dtype))))


def categorical_dtypes(rule) -> dict:
    """`to_categorical(y, n)` -> `to_categorical(y, n).astype('float32')` (and a `dtype=` argument,
    which Keras 3 does not take, as that `astype`): Keras 2 made float32 labels, Keras 3 makes
    float64 ones."""
    changes = {}
    for call in find(rule.context.module, cst.Call):
        if not {"keras.utils.to_categorical", "keras.utils.np_utils.to_categorical"} & set(
                rule.imports.resolve_all(call.func)) or any(a.star for a in call.args):
            continue
        dtype = next((a.value for a in call.args if keyword_is(a, "dtype")), None)
        if dtype is None and len(call.args) > 2:
            dtype = call.args[2].value
        args = [a for i, a in enumerate(call.args) if not keyword_is(a, "dtype") and i < 2]
        text = code_in(rule.context.module, dtype) if dtype is not None else "'float32'"
        changes[call] = cst.Call(cst.Attribute(call.with_changes(args=commas_mended(args, call.args)),
                                               cst.Name("astype")), [cst.Arg(cst.parse_expression(text))])
    return changes


#: Keras layers whose sizes Keras 3 takes as Python integers only (a NumPy integer failed:
#: "Received an invalid value for `units`"; Keras 2 took it), and those size parameters.
INTEGER_SIZES = {"Dense": ("units",), "Embedding": ("input_dim", "output_dim"), "GRU": ("units",),
                 "SimpleRNN": ("units",)}


def integer_sizes(rule) -> dict:
    """`Dense(np.prod(img_shape))` (Keras-GAN's generators), `Embedding(vocab_size, 32)` with
    `vocab_size = np.max(x) + 1`: the size as `int(...)`, where it is computed by NumPy (there, or
    where the module binds the name it passes)."""
    module = rule.context.module
    numpy_names = {target for target, made in assignments(rule.context).items()
                   if any(_numpy_valued(rule, assign.value) for assign in made)}
    changes = {}
    for call in find(module, cst.Call):
        sizes = next((INTEGER_SIZES[n.rsplit(".", 1)[-1]] for n in rule.imports.resolve_all(call.func)
                      if n.startswith("keras.layers.") and n.rsplit(".", 1)[-1] in INTEGER_SIZES), None)
        if sizes is None or any(a.star for a in call.args):
            continue
        for name in sizes:
            size = argument(call, sizes, name)
            if size is not None and (_numpy_valued(rule, size) or dotted_name(size) in numpy_names):
                # (a copy at the top: the change must not hold the node it replaces)
                changes[size] = cst.Call(cst.Name("int"), [cst.Arg(size.with_changes())])
    return changes


def _numpy_valued(rule, value: cst.BaseExpression) -> bool:
    """Whether ``value`` computes with NumPy (`np.prod(shape)`, `np.max(x) + 1`), and is not
    already made an `int`."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "int":
        return False
    return any((rule.imports.resolve(call.func) or "").startswith("numpy.") for call in find(value, cst.Call))


_TRAIN_AS_COMPILED = '''
def train_as_compiled(model, *args, **kwargs):
    """`model.train_on_batch(...)` of a model frozen (`model.trainable = False`) after it was
    compiled, as Keras 2 trained it: its weights, trainable when it was compiled (Keras 3 reads
    the flag when it trains, and would train none of them)."""
    frozen = model.trainable
    model.trainable = True
    try:
        return model.train_on_batch(*args, **kwargs)
    finally:
        model.trainable = frozen
'''


def frozen_after_compile(rule, models: set, split: bool = False) -> tuple[dict, list[cst.BaseStatement], tuple | None]:
    """A GAN's discriminator, compiled and then frozen (`self.discriminator.trainable = False`)
    to compile the combined model (Keras-GAN's layout): Keras 2 kept training it through its own
    `train_on_batch`, whose weights were fixed when it was compiled; Keras 3 reads the flag when it
    trains and trained nothing (checked). Each `train_on_batch` of one of ``models`` (the
    template and the parallel model, the same model once migrated) -> `train_as_compiled(model,
    ...)`, written into the module (which, ``split``, trains through `train_split`: a model with
    batch normalization, :mod:`tfmigrate.rewrites.keras3_batch_steps`). Returns (changes, [the
    function], blocker): its `fit` is refused."""
    module = rule.context.module
    frozen = [assign for assign, target in frozen_assignments(module) if dotted_name(target.value) in models]
    compiled = [call for call in find(module, cst.Call) if isinstance(call.func, cst.Attribute)
                and call.func.attr.value == "compile" and dotted_name(call.func.value) in models]
    first_compiled = min((rule.position(call).start.line for call in compiled), default=None)
    if first_compiled is None or not any(rule.position(assign).start.line > first_compiled for assign in frozen):
        return {}, [], None  # (frozen before it is compiled: Keras 2 trained none of it either)
    changes = {}
    for call in find(module, cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and dotted_name(func.value) in models):
            continue
        if func.attr.value in ("fit", "fit_generator"):
            return {}, [], (call, "the model is frozen after it is compiled (`.trainable = False`), and Keras 3 reads "
                                  "the flag when it trains (it would train none of its weights, where Keras 2 trained "
                                  "those trainable at compile time): set `trainable` back to True around its training")
        if func.attr.value == "train_on_batch":
            changes[call] = receiver_passed(call, "train_as_compiled")
    written = _TRAIN_AS_COMPILED.replace("model.train_on_batch(", "train_split(model, ") if split else _TRAIN_AS_COMPILED
    return changes, ([cst.parse_statement(written)] if changes else []), None


def generator_methods(module: cst.Module, skipped: set = frozenset()) -> dict:
    """`model.fit_generator(gen, 100, epochs=3, workers=4)` -> `model.fit(gen, steps_per_epoch=100,
    epochs=3)`: Keras 3's `fit` takes a generator itself; the arguments after it are named (its
    positions differ) and the worker arguments dropped. The calls of the ``skipped`` models are
    left to the fix that wraps them (:mod:`tfmigrate.rewrites.keras3_generators`)."""
    changes = {}
    for call in find(module, cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value in GENERATOR_METHODS) or any(a.star for a in call.args):
            continue
        if dotted_name(func.value) in skipped:
            continue
        method, params = GENERATOR_METHODS[func.attr.value]
        args, position = [], 0
        for arg in call.args:
            if arg.keyword is None:
                if position > len(params):
                    break
                if position > 0:  # the generator stays first; what follows it is named
                    arg = arg.with_changes(keyword=cst.Name(params[position - 1]), equal=KEYWORD_EQUAL)
                position += 1
            if keyword_is(arg, "generator"):
                arg = keyword_renamed(arg, "generator", "x")
            if arg.keyword is None or arg.keyword.value not in WORKER_ARGUMENTS:
                args.append(arg)
        else:
            changes[call] = call.with_changes(func=func.with_changes(attr=cst.Name(method)),
                                              args=commas_mended(args, call.args))
    return changes


def tf2_spellings(rule) -> tuple[dict, list[ImportItem]]:
    """`tf.set_random_seed(1)` -> `tf.random.set_seed(1)` (:data:`TF2_SPELLINGS`), reached through
    the module's own TensorFlow import: (changes, imports to add). Asked by the edit and by the
    imports it removes: worked out once per module."""
    def compute() -> tuple[dict, list[ImportItem]]:
        changes: dict = {}
        imports: list[ImportItem] = []
        for call in find(rule.context.module, cst.Call):
            spelled = TF2_SPELLINGS.get(rule.imports.resolve(call.func) or "")
            if spelled is not None:
                changes[call.func], needed = rule.tf_ref(spelled)
                imports += needed
        return changes, imports

    return rule.context.memo("keras3.tf2_spellings", compute)


def model_keywords(rule) -> dict:
    """`Model(input=inputs, output=outputs)` (Keras 1, still taken by Keras 2) -> `inputs=`, `outputs=`."""
    changes = {}
    for call in find(rule.context.module, cst.Call):
        if not {"keras.models.Model", "keras.Model", "keras.engine.training.Model"} & set(
                rule.imports.resolve_all(call.func)):
            continue
        args = [keyword_renamed(keyword_renamed(arg, "input", "inputs"), "output", "outputs") for arg in call.args]
        if args != list(call.args):
            changes[call] = call.with_changes(args=args)
    return changes


def module_paths(module: cst.Module) -> dict:
    """`from keras.layers.core import Dense` -> `from keras.layers import Dense`; `from
    keras.engine.topology import Layer` -> `from keras.layers import Layer`; `from keras.utils
    import np_utils` -> `from keras import utils as np_utils` (on a line of its own);
    `keras.utils.np_utils.to_categorical` -> `keras.utils.to_categorical`."""
    changes = {}
    for line in find(module, cst.SimpleStatementLine):
        node = single_small(line)
        name = dotted_name(node.module) if isinstance(node, cst.ImportFrom) and node.module and not node.relative else None
        package, _, sub = (name or "").rpartition(".")
        if sub in KERAS2_SUBMODULES.get(package, ()):
            changes[node] = node.with_changes(module=cst.parse_expression(package))
        elif name in KERAS2_ENGINE and not isinstance(node.names, cst.ImportStar):
            # `from keras.engine.topology import Layer` (a custom layer's): one home for all the names
            homes = {KERAS2_ENGINE_NAMES.get(dotted_name(a.name) or "") for a in node.names}
            if len(homes) == 1 and None not in homes:
                changes[node] = node.with_changes(module=cst.parse_expression(homes.pop()))
        elif name in KERAS2_SUBMODULES and not isinstance(node.names, cst.ImportStar):
            submodules = [a for a in node.names if isinstance(a.name, cst.Name) and a.name.value in KERAS2_SUBMODULES[name]]
            if submodules:
                changes[line] = _submodules_apart(line, node, name, submodules)
    for node in find(module, cst.Attribute):
        package = dotted_name(node.value) or ""
        if node.attr.value in KERAS2_SUBMODULES.get(package, ()):
            changes[node] = node.value
    return changes


#: Keras 2's short names of its loss and metric functions, which Keras 3 has only in full.
FUNCTION_ALIASES = {"mse": "mean_squared_error", "mae": "mean_absolute_error", "mape": "mean_absolute_percentage_error",
                    "msle": "mean_squared_logarithmic_error", "kld": "kl_divergence", "logcosh": "log_cosh"}


def function_aliases(module: cst.Module) -> dict:
    """`from keras.losses import mse` -> `from keras.losses import mean_squared_error as mse`, and
    `keras.losses.mse(...)` -> `keras.losses.mean_squared_error(...)` (`keras.metrics` alike):
    Keras 3 dropped the short names (a held-out VAE failed to import `mse`)."""
    changes = {}
    for node in find(module, cst.ImportFrom):
        if node.relative or dotted_name(node.module) not in ("keras.losses", "keras.metrics") or isinstance(
                node.names, cst.ImportStar):
            continue
        names = [alias.with_changes(name=cst.Name(FUNCTION_ALIASES[alias.name.value]),
                                    asname=alias.asname or cst.AsName(name=cst.Name(alias.name.value)))
                 if isinstance(alias.name, cst.Name) and alias.name.value in FUNCTION_ALIASES else alias
                 for alias in node.names]
        if names != list(node.names):
            changes[node] = node.with_changes(names=names)
    for node in find(module, cst.Attribute):
        if dotted_name(node.value) in ("keras.losses", "keras.metrics") and node.attr.value in FUNCTION_ALIASES:
            changes[node] = node.with_changes(attr=cst.Name(FUNCTION_ALIASES[node.attr.value]))
    return changes


def _submodules_apart(line: cst.SimpleStatementLine, node: cst.ImportFrom, package: str, submodules: list):
    """`from keras.utils import multi_gpu_model, np_utils` -> that line without `np_utils`, then
    `from keras import utils as np_utils`."""
    head, _, last = package.rpartition(".")
    lines = [cst.parse_statement(f"from {head} import {last} as "
                                 f"{alias.asname.name.value if alias.asname else alias.name.value}\n")  # type: ignore[union-attr]
             for alias in submodules]
    kept = [alias for alias in node.names if alias not in submodules]
    if not kept:
        return cst.FlattenSentinel([lines[0].with_changes(leading_lines=line.leading_lines), *lines[1:]])
    kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return cst.FlattenSentinel([line.with_changes(body=[node.with_changes(names=kept)]), *lines])


#: What Keras 3's `keras.backend` still has.
BACKEND_KEPT = {"backend", "clear_session", "epsilon", "floatx", "get_uid", "image_data_format", "is_keras_tensor",
                "set_epsilon", "set_floatx", "set_image_data_format", "standardize_dtype"}
#: Keras 2 backend functions and the `keras.ops` function that takes the same arguments.
BACKEND_OPS = {name: name for name in (
    "sum", "mean", "square", "sqrt", "abs", "log", "exp", "clip", "maximum", "minimum", "dot", "cast", "round",
    "greater", "greater_equal", "less", "less_equal", "equal", "not_equal", "sign", "max", "min", "tanh",
    "sigmoid", "softmax", "relu", "binary_crossentropy", "categorical_crossentropy", "zeros_like", "ones_like",
    "floor", "std", "var", "prod", "any", "all", "transpose", "reshape", "stack", "squeeze", "log1p", "cos", "sin",
    "argmax", "argmin", "concatenate", "expand_dims", "shape",
)} | {"pow": "power", "switch": "where", "int_shape": "shape", "reverse": "flip"}
#: Keras 2 backend random functions and their `keras.random` namesakes (same parameters).
BACKEND_RANDOM = {"random_normal": "normal", "random_uniform": "uniform"}
#: Where Keras 2's default axis was the last and `keras.ops`'s is another (or none).
BACKEND_LAST_AXIS = {"argmax": 1, "argmin": 1, "concatenate": 1, "expand_dims": 1}
#: Keras 2 modules that Keras 3 dropped without a replacement.
GONE_MODULES = {"keras.preprocessing.text": "tokenize with `keras.layers.TextVectorization`"}
#: Keras 2 classes that Keras 3 dropped without a replacement of the same meaning (checked on 3.15:
#: `keras.preprocessing.image` keeps only its image file functions).
#: Keras 2 backend functions Keras 3 has not, and the function of the same meaning the fix
#: writes into the module (:func:`backend_functions`).
BACKEND_WRITTEN = {"ctc_batch_cost": "ctc_batch_cost", "function": "backend_function", "batch_dot": "batch_dot"}

_BACKEND_FUNCTIONS = {
    "ctc_batch_cost": '''
def ctc_batch_cost(y_true, y_pred, input_length, label_length):
    """Keras 2's `K.ctc_batch_cost` (gone from Keras 3): each example's CTC loss, shaped (batch, 1),
    of softmax outputs `y_pred` (batch, time, classes) whose last class is the blank."""
    label_length = {tf}.cast({tf}.squeeze(label_length, axis=-1), {tf}.int32)
    input_length = {tf}.cast({tf}.squeeze(input_length, axis=-1), {tf}.int32)
    logits = {tf}.math.log(y_pred + keras.backend.epsilon())
    loss = {tf}.nn.ctc_loss(labels={tf}.cast(y_true, {tf}.int32), logits=logits, label_length=label_length,
                          logit_length=input_length, logits_time_major=False, blank_index=-1)
    return {tf}.expand_dims(loss, 1)
''',
    "batch_dot": '''
def batch_dot(x, y, axes=None):
    """Keras 2's `K.batch_dot` (gone from Keras 3): for each example, `x` and `y` multiplied and
    summed over one axis of each (`axes`; by default x's last and y's second to last, y's last
    for a matrix), the other axes of x then of y kept; a vector per example comes back (batch, 1)."""
    x_rank, y_rank = len(x.shape), len(y.shape)
    if axes is None:
        axes = (x_rank - 1, y_rank - 1 if y_rank == 2 else y_rank - 2)
    if isinstance(axes, int):
        axes = (axes, axes)
    x_axis, y_axis = axes[0] % x_rank, axes[1] % y_rank
    names = iter("cdefghijklmnopqrstuvwxyz")  # a: the examples, b: the axis summed over
    x_names = "".join("a" if i == 0 else "b" if i == x_axis else next(names) for i in range(x_rank))
    y_names = "".join("a" if i == 0 else "b" if i == y_axis else next(names) for i in range(y_rank))
    kept = "".join(name for name in x_names + y_names if name not in "ab")
    result = keras.ops.einsum(f"{x_names},{y_names}->a{kept}", x, y)
    return keras.ops.expand_dims(result, 1) if len(result.shape) == 1 else result
''',
    "function": '''
def backend_function(inputs, outputs, learning_phase_at=None):
    """Keras 2's `K.function(inputs, outputs)` (gone from Keras 3): a function of a list of input
    arrays returning the outputs' values as arrays, in inference mode; where Keras 2's learning
    phase was one of the inputs (its place `learning_phase_at`), the value given there says
    whether to run in training mode."""
    model = keras.Model(inputs, outputs)

    def run(values):
        values, training = list(values), False
        if learning_phase_at is not None:
            training = bool(values.pop(learning_phase_at))
        return [keras.ops.convert_to_numpy(value) for value in {tf}.nest.flatten(model(values, training=training))]

    return run
''',
}


def _learning_phase_inputs(rule) -> dict[int, int]:
    """id(`K.learning_phase()`) -> its place, where it is one of the inputs listed to a
    `K.function([x, K.learning_phase()], ...)` (Keras 2's way to choose the mode per call)."""
    found = {}
    for call in find(rule.context.module, cst.Call):
        if rule.imports.resolve(call.func) != "keras.backend.function" or not call.args:
            continue
        listed = call.args[0].value
        if not isinstance(listed, cst.List):
            continue
        for place, element in enumerate(listed.elements):
            if isinstance(element.value, cst.Call) and rule.imports.resolve(element.value.func) == "keras.backend.learning_phase":
                found[id(element.value)] = place
    return found


def _written_call(call: cst.Call, written: str, phases: dict[int, int]) -> cst.Call:
    """``call`` of the function written in its place; `K.function`'s learning phase input, where
    it has one, given by its place (`learning_phase_at=1`)."""
    args = list(call.args)
    listed = args[0].value if args else None
    phase = next((e for e in listed.elements if id(e.value) in phases), None) if isinstance(listed, cst.List) else None
    if phase is not None:
        kept = [e for e in listed.elements if e is not phase]
        kept[-1:] = [kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)] if kept else []
        args[0] = args[0].with_changes(value=listed.with_changes(elements=kept))
        args = [*args[:-1], args[-1].with_changes(comma=_COMMA),
                keyword_arg("learning_phase_at", cst.Integer(str(phases[id(phase.value)])))]
    return call.with_changes(func=cst.Name(written), args=args)


def backend_functions(rule, changes: dict) -> tuple[list[cst.BaseStatement], list[ImportItem]]:
    """The functions of :data:`BACKEND_WRITTEN` that ``changes`` call: ([functions], imports)."""
    called = {new.func.value for new in changes.values() if isinstance(new, cst.Call) and isinstance(new.func, cst.Name)}
    wanted = [name for name, written in BACKEND_WRITTEN.items() if written in called]
    if not wanted:
        return [], []
    tf = TfNames(rule)
    spelled = [re.sub(r"\{tf\}((?:\.\w+)+)", lambda m: tf("tensorflow" + m.group(1)), _BACKEND_FUNCTIONS[name])
               for name in wanted]  # `{tf}.nn.ctc_loss` as the module spells TensorFlow
    return [cst.parse_statement(text) for text in spelled], [*tf.imports, ImportItem("keras")]


GONE_NAMES = {
    "keras.preprocessing.image.ImageDataGenerator":
        "augment with Keras 3's preprocessing layers (`keras.layers.RandomFlip`, ...) or a `tf.data` pipeline",
}


def backend_calls(rule, names: set) -> tuple[dict, list, tuple[cst.CSTNode, str] | None]:
    """`K.sum(...)` -> `ops.sum(...)` (`from keras import ops`): Keras 3's backend keeps only its
    settings (`K.epsilon()` stays), its math is in `keras.ops`; `K.flatten(x)` is
    `ops.reshape(x, (-1,))` (`K.batch_flatten(x)` `ops.reshape(x, (ops.shape(x)[0], -1))`),
    `K.get_value(v)` `ops.convert_to_numpy(v)`, `K.set_value(v, x)` `v.assign(x)` and
    `K.cast_to_floatx(x)` Keras 2's `numpy.asarray(x, dtype=K.floatx())`. ``names`` are the
    module's names: where `ops` is one, `keras_ops`. A module or class Keras 3 dropped (:data:`GONE_MODULES`, :data:`GONE_NAMES`) blocks the fix. Returns
    (changes, imports, blocker) as :func:`optimizer_arguments` does."""
    ops = "ops" if "ops" not in names else "keras_ops"
    changes = {}
    phases = _learning_phase_inputs(rule)
    for node in find(rule.context.module, cst.ImportFrom):
        module = dotted_name(node.module) if node.module is not None and not node.relative else None
        if module in GONE_MODULES:
            return {}, [], (node, f"`{module}` is gone from Keras 3, which the migrated program runs on: "
                                  f"{GONE_MODULES[module]} first")
    for call in find(rule.context.module, cst.Call):
        func = call.func
        gone = rule.imports.resolve(func) or ""
        if gone in GONE_NAMES:
            return {}, [], (call, f"`{gone}` is gone from Keras 3, which the migrated program runs on: "
                                  f"{GONE_NAMES[gone]} first")
        if not (isinstance(func, cst.Attribute) and rule.imports.resolve(func.value) == "keras.backend"):
            continue
        name = func.attr.value
        if name in BACKEND_KEPT or rule.imports.resolve(func) in SET_SESSION:  # the latter: keras3_session's
            continue
        if id(call) in phases:
            continue  # an input of `K.function`: the written function takes its place
        replacement = _backend_replacement(call, name, ops)
        if name in BACKEND_WRITTEN and not any(a.star for a in call.args):
            if BACKEND_WRITTEN[name] in names_used(rule.context.module):  # (not `K.ctc_batch_cost`'s attribute)
                return {}, [], (call, f"`{BACKEND_WRITTEN[name]}`, the function the fix would write for "
                                      f"`{code_in(rule.context.module, func)}`, is a name of the module")
            replacement = _written_call(call, BACKEND_WRITTEN[name], phases)
        if replacement is None:
            return {}, [], (call, f"`{code_in(rule.context.module, func)}` is gone from Keras 3's backend, which the migrated program "
                                  "runs on: write it with `keras.ops` first")
        changes[call] = replacement
    spelled = [code_in(rule.context.module, new.func) for new in changes.values()]
    # (`K.set_value(v, x)` becomes `v.assign(x)`: no `ops` to import for it)
    imports = [ImportItem("keras", "ops", None if ops == "ops" else ops)] if any(
        s.startswith(f"{ops}.") for s in spelled) else []
    if any(s.startswith(("keras.random.", "keras.Variable")) for s in spelled):
        imports.append(ImportItem("keras"))
    if "numpy.asarray" in spelled:  # `K.cast_to_floatx(x)`
        imports.append(ImportItem("numpy"))
    return changes, imports, None


def metric_label_casts(rule, names: set, compiles: list[cst.Call]) -> tuple[dict, list]:
    """`y_true = ops.cast(y_true, y_pred.dtype)` first in each metric function of the module that
    ``compiles`` name (`metrics=[precision, recall]`): Keras 2 cast the labels to the
    predictions' type before a metric saw them, Keras 3 hands them over as they are (float64
    labels from NumPy; `y_true * y_pred` failed in a held-out IMDB script's precision).
    Returns (changes, imports)."""
    ops = "ops" if "ops" not in names else "keras_ops"
    functions = {s.name.value: s for s in rule.context.module.body if isinstance(s, cst.FunctionDef)}
    changes = {}
    for call in compiles:
        metrics = next((a.value for a in call.args if keyword_is(a, "metrics")), None)
        for name in find(metrics, cst.Name) if isinstance(metrics, (cst.List, cst.Tuple)) else ():
            function = functions.get(name.value)
            params = [p.name.value for p in function.params.params] if function is not None else []
            if len(params) != 2 or not isinstance(function.body, cst.IndentedBlock):
                continue
            cast = cst.parse_statement(f"{params[0]} = {ops}.cast({params[0]}, {params[1]}.dtype)\n")
            body = list(function.body.body)
            at = 1 if body and is_docstring(body[0]) else 0
            if at < len(body) and _casts_labels(body[at], params):
                continue  # cast already (a second finding's pass)
            changes[function] = function.with_changes(body=function.body.with_changes(body=[*body[:at], cast, *body[at:]]))
    imports = [ImportItem("keras", "ops", None if ops == "ops" else ops)] if changes else []
    return changes, imports


def _casts_labels(statement: cst.BaseStatement, params: list[str]) -> bool:
    """`y_true = ops.cast(y_true, y_pred.dtype)` (any module's `cast`)."""
    small = single_small(statement)
    return (isinstance(small, cst.Assign) and code(small.targets[0].target) == params[0]
            and isinstance(small.value, cst.Call) and short_name(small.value.func) == "cast"
            and bool(small.value.args) and code(small.value.args[0].value) == params[0])


def output_metrics(compiles: list[cst.Call]) -> dict:
    """`compile(loss={'main': ..., 'aux': ...}, metrics=['accuracy'])` -> `metrics={'main':
    ['accuracy'], 'aux': ['accuracy']}` (with a list of losses, a list of metric lists): Keras 2
    computed a flat list's metrics on every output, Keras 3 takes one for a model of one output
    only (a held-out two-headed model failed: "tuple arity mismatch"). The outputs are read
    from `loss`, or from `loss_weights` where one loss is given for them all; that loss is then
    given once per output too, as Keras 3 weighs only a loss per weight ("`loss_weights` must
    match the number of losses"; a held-out captcha model of four heads)."""
    changes = {}
    for call in compiles:
        loss = next((arg.value for arg in call.args if keyword_is(arg, "loss")), None)
        weights = next((arg.value for arg in call.args if keyword_is(arg, "loss_weights")), None)
        metrics = next((arg.value for arg in call.args if keyword_is(arg, "metrics")), None)
        outputs = _outputs_listed(loss) or _outputs_listed(weights)
        if outputs is None:
            continue
        if loss is not None and not _outputs_listed(loss) and isinstance(loss, (cst.SimpleString, cst.Name,
                                                                                 cst.Attribute)):
            changes[loss] = _per_output(outputs, loss)
        if isinstance(metrics, cst.List) and not any(
                isinstance(e, cst.StarredElement) or isinstance(e.value, (cst.List, cst.Tuple, cst.Dict))
                for e in metrics.elements):
            changes[metrics] = _per_output(outputs, cst.List(_on_one_line(metrics.elements)))
    return changes


def _outputs_listed(value) -> list | None:
    """The outputs a `loss=` or `loss_weights=` dict names (its keys), or a list of more than one
    counts (its elements); None for anything else."""
    if isinstance(value, cst.Dict) and value.elements and all(isinstance(e, cst.DictElement) for e in value.elements):
        return [e.key for e in value.elements]
    if isinstance(value, (cst.List, cst.Tuple)) and len(value.elements) > 1 and not any(
            isinstance(e, cst.StarredElement) for e in value.elements):
        return [None] * len(value.elements)
    return None


def _per_output(outputs: list, value: cst.BaseExpression) -> cst.BaseExpression:
    """``value`` once per output: a dict by the outputs' names, else a list."""
    if outputs[0] is not None:
        return cst.Dict(_on_one_line([cst.DictElement(key.deep_clone(), value.deep_clone()) for key in outputs]))
    return cst.List(_on_one_line([cst.Element(value.deep_clone()) for _ in outputs]))


def accuracy_log_names(module: cst.Module, compiles: list[cst.Call]) -> dict:
    """`monitor='val_acc'` (and `history.history['acc']`, `logs.get('val_acc')`) -> `'val_accuracy'`
    where the model compiles `metrics=['accuracy']`: Keras 2 up to 2.2 logged that metric as
    `acc`, Keras 3 logs it as `accuracy`, and a callback monitoring a name it cannot find never
    acts (Keras 3's `ModelCheckpoint` refused one: it could not tell whether to maximize it)."""
    accuracy = any(isinstance(e, cst.Element) and isinstance(e.value, cst.SimpleString)
                   and e.value.evaluated_value == "accuracy"
                   for call in compiles for arg in call.args if keyword_is(arg, "metrics")
                   and isinstance(arg.value, cst.List) for e in arg.value.elements)
    if not accuracy:
        return {}
    named = [arg.value for arg in find(module, cst.Arg) if keyword_is(arg, "monitor")]
    named += [e.slice.value for e in find(module, cst.SubscriptElement) if isinstance(e.slice, cst.Index)]
    named += [c.args[0].value for c in find(module, cst.Call) if isinstance(c.func, cst.Attribute)
              and c.func.attr.value == "get" and c.args]
    renamed = {"acc": "accuracy", "val_acc": "val_accuracy"}
    return {s: s.with_changes(value=s.value.replace(s.evaluated_value, renamed[s.evaluated_value]))
            for s in named if isinstance(s, cst.SimpleString) and s.evaluated_value in renamed}


def _on_one_line(elements) -> list:
    """``elements`` of a list or dict as `a, b, c`, whatever lines they were on."""
    return [e.with_changes(comma=_COMMA if i < len(elements) - 1 else cst.MaybeSentinel.DEFAULT)
            for i, e in enumerate(elements)]


def _around(template: str, value: cst.BaseExpression) -> cst.BaseExpression:
    """``template`` (an expression reading `_x_`) around ``value`` itself, not a copy of its code:
    the changes inside ``value`` (a backend call in it, `K.batch_flatten(K.square(x))`) still
    apply there."""
    expression = cst.parse_expression(template)
    return expression.visit(ReplaceById({id(name): value for name in find(expression, cst.Name) if name.value == "_x_"}))


def _backend_replacement(call: cst.Call, name: str, ops: str) -> cst.Call | None:
    args = list(call.args)
    if name == "flatten" and len(args) == 1:
        return call.with_changes(func=cst.parse_expression(f"{ops}.reshape"),
                                 args=[args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                                       cst.Arg(cst.parse_expression("(-1,)"))])
    if name == "batch_flatten" and len(args) == 1 and args[0].keyword is None:  # each example's values in a row
        return _around(f"{ops}.reshape(_x_, ({ops}.shape(_x_)[0], -1))", args[0].value)
    if name == "get_value" and len(args) == 1:
        return call.with_changes(func=cst.parse_expression(f"{ops}.convert_to_numpy"))
    if name == "cast_to_floatx" and len(args) == 1 and args[0].keyword is None:
        # Keras 2's own: `numpy.asarray(x, dtype=floatx())` (Keras 3 keeps `floatx`).
        return _around(f"numpy.asarray(_x_, dtype={code(call.func.value)}.floatx())", args[0].value)
    if name == "set_value" and len(args) == 2 and not any(a.keyword or a.star for a in args):
        return call.with_changes(func=cst.Attribute(args[0].value, cst.Name("assign")),
                                 args=[args[1].with_changes(comma=cst.MaybeSentinel.DEFAULT)])
    if any(a.star for a in args):
        return None
    if name == "variable" and not argument(call, _VARIABLE_PARAMETERS, "constraint"):
        return _keras_variable(call)
    if name == "constant" and len(args) <= 2 and all(a.keyword is None or a.keyword.value == "dtype" for a in args):
        return call.with_changes(func=cst.parse_expression(f"{ops}.convert_to_tensor"))
    if name == "l2_normalize" and len(args) <= 2:
        # tf.nn.l2_normalize: x / sqrt(max(sum(x^2), 1e-12)) over `axis` (all axes by default);
        # ops.normalize divides by max(norm, epsilon): the same with epsilon 1e-6.
        new = call.with_changes(func=cst.parse_expression(f"{ops}.normalize"))
        if len(args) < 2 and not any(keyword_is(a, "axis") for a in args):
            new = with_keyword(new, "axis", "None")
        return with_keyword(new, "epsilon", "1e-6")
    if name in BACKEND_RANDOM:  # the same parameters, in `keras.random`
        return call.with_changes(func=cst.parse_expression(f"keras.random.{BACKEND_RANDOM[name]}"))
    if name not in BACKEND_OPS:
        return None
    new = call.with_changes(func=cst.parse_expression(f"{ops}.{BACKEND_OPS[name]}"))
    if name == "reverse":  # `K.reverse(x, axes)`: `ops.flip(x, axis)` takes an axis or several too
        new = new.with_changes(args=[keyword_renamed(arg, "axes", "axis") for arg in new.args])
    if name in BACKEND_LAST_AXIS and len(args) <= BACKEND_LAST_AXIS[name] and not any(
            keyword_is(a, "axis") for a in args):
        new = with_keyword(new, "axis", "-1")
    return new


#: Keras 2's `K.variable` parameters, in order.
_VARIABLE_PARAMETERS = ("value", "dtype", "name", "constraint")


def _keras_variable(call: cst.Call) -> cst.Call:
    """`K.variable(value, dtype, name)` -> `keras.Variable(value, dtype=..., name=...)`: Keras 2
    made it in `floatx()` unless told, Keras 3 keeps the value's type (float64 from NumPy)."""
    value, dtype, name = (argument(call, _VARIABLE_PARAMETERS, key) for key in _VARIABLE_PARAMETERS[:3])
    args = [cst.Arg(value), keyword_arg("dtype", dtype or cst.parse_expression("keras.config.floatx()"))]
    return call.with_changes(func=cst.parse_expression("keras.Variable"),
                             args=[*args, keyword_arg("name", name)] if name is not None else args)


def continuation_lines(rule, changes: dict) -> dict:
    """The continuation lines of the changed calls over several lines that ``changes`` gives
    another callee (`fit_generator` -> `fit`, `K.mean` -> `ops.mean`), realigned."""
    renamed = []
    for old, new in changes.items():
        if isinstance(old, cst.Call) and isinstance(new, cst.Call):
            where = rule.position(old)
            if where.start.line != where.end.line:
                block = block_indentation(old, module_parents(rule.context), rule.context.module)
                renamed.append((old, new, where.start.column, block))
    return realigned_continuations(renamed)


_COMMA = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
