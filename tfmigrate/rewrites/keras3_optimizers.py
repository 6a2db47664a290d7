"""A Keras 2 program's optimizers, as Keras 3 takes them and trains with them alike.

Part of the Keras 3 step of TFM201's fix (:mod:`tfmigrate.rewrites.keras3_leftovers` has the
rest): Keras 2's `lr=` and `decay=` in Keras 3's spelling, `.lr` reads as `.learning_rate`; the
optimizers Keras 3 steps otherwise as subclasses that step as Keras 2 did (RMSprop as
`Keras2RMSprop`; Adam and the other adaptive optimizers of a module with an `Embedding` as a
`DenseGradientAdam` that adds up each row's gradients first); and why an optimizer cannot keep
its meaning (Nadam, which Keras 3 computes otherwise; a decay a learning-rate callback would
also set; a read of the decay).
"""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from tfmigrate.cst.callargs import (
    KEYWORD_EQUAL, commas_mended, is_none, keyword_arg, keyword_is, keyword_renamed, short_name,
)
from tfmigrate.cst.codegen import code, code_in
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import assignments, find, name_nodes
from tfmigrate.rewrites.mirrored import TfNames
from tfmigrate.rule import ImportItem

__all__ = ["COMPUTED_OTHERWISE", "OPTIMIZERS", "TF1_OPTIMIZERS", "compiled_optimizer", "keras2_step_classes",
           "keras_of_tf1_optimizer", "learning_rate_reads", "optimizer_arguments", "replaced_optimizer_names",
           "tf1_compiled_optimizers"]

#: Keras 2's optimizer classes (canonical names: `tf.keras.` and `keras.` fold into `keras.`).
#: Keras 2's lower-case aliases of them (`keras.optimizers.rmsprop(lr=1e-4)`, Keras's cifar10_cnn
#: example), which Keras 3 has not.
KERAS2_ALIASES = {"sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad", "adadelta": "Adadelta", "adam": "Adam",
                  "adamax": "Adamax", "nadam": "Nadam"}
OPTIMIZERS = {f"keras.optimizers.{name}" for name in (*KERAS2_ALIASES.values(), *KERAS2_ALIASES)}
#: Callbacks that set the optimizer's learning rate, which a schedule does not let them.
LR_CALLBACKS = ("ReduceLROnPlateau", "LearningRateScheduler")
#: Optimizers Keras 3 computes otherwise than Keras 2's (checked on TF 2.21: one Dense layer, 20
#: steps, lr 0.01, tf_keras's legacy optimizer against Keras 3's; SGD, Adam, Adagrad, Adadelta
#: and Adamax agree within 5e-6 on dense gradients, not on an Embedding's: see
#: :func:`keras2_step_optimizers`; RMSprop gets a class that steps as Keras 2's), and why.
COMPUTED_OTHERWISE = {
    "Nadam": ("Keras 3's Nadam steps otherwise than Keras 2's (weights 1.7% apart after 20 steps; a held-out "
              "Kaggle kernel's loss 8e-2 in 30): build and compile the template under `strategy.scope()` by "
              "hand if Keras 3's Nadam will do, or train with an optimizer both compute alike (SGD, Adam)"),
}
#: Keras 2.0-2.3's default learning rates where Keras 3's (and tf_keras's, 0.001) differ; Keras's
#: mnist_cnn example trained with `Adadelta()`, at 1.0. (Adagrad's 0.01 is `Keras2Adagrad`'s default.)
KERAS2_DEFAULT_RATES = {"Adadelta": "1.0", "Adamax": "0.002"}
#: Optimizers whose step is not linear in the gradient (its square, its largest value).
ADAPTIVE = ("Adam", "Adamax", "Adagrad", "Adadelta")
EMBEDDINGS = {"keras.layers.Embedding", "keras.layers.embeddings.Embedding"}


#: Optimizer arguments that clip the gradients (Keras 2 had the first two; Keras 3 adds the third).
CLIPS = ("clipnorm", "clipvalue", "global_clipnorm")


def optimizer_arguments(rule) -> tuple[dict, list, tuple[cst.CSTNode, str] | None]:
    """Keras 2 optimizer constructors in Keras 3's spelling: `lr=` -> `learning_rate=`, a zero
    `decay=` (or `epsilon=None`, Keras 2's "the backend epsilon") dropped, any other `decay=` as
    an `InverseTimeDecay` learning rate. Returns (changes, imports, blocker): the blocker is a
    node and why its meaning cannot be kept (arguments passed by position, which Keras 2 and 3
    order differently; a decay that a learning-rate callback would also set; gradient clipping,
    which Keras 3 under a strategy applies to each replica's part)."""
    changes, imports = {}, []
    stepping = keras2_step_optimizers(rule)
    for call in find(rule.context.module, cst.Call):
        other = _optimizer_named(rule, call, COMPUTED_OTHERWISE)
        if other is not None:
            return {}, [], (call, COMPUTED_OTHERWISE[other])
        optimizer, own_class = stepping.get(id(call), (None, None))
        named = _optimizer_named(rule, call, KERAS2_DEFAULT_RATES) if optimizer is None else optimizer
        if named is not None and _compiles_with(call, named.lower()):  # compile(optimizer='adam')
            made = own_class or f"keras.optimizers.{named}"
            rate = f"learning_rate={KERAS2_DEFAULT_RATES[named]}" if named in KERAS2_DEFAULT_RATES else ""
            changes[compiled_optimizer(call)] = cst.parse_expression(f"{made}({rate})")
            imports += [] if own_class else [ImportItem("keras")]
        if _optimizer_class(rule, call) is None:
            continue
        clipped = _clipping(rule, call)
        if clipped is not None and not (own_class or "").startswith("SummedClip"):
            return {}, [], (call, f"it clips the gradients (`{clipped.keyword.value}=`), and Keras 3 under a "
                                  "distribution strategy clips each replica's gradient before they are summed where "
                                  f"the parallel model clipped the summed one; with {optimizer} stepped as Keras 2's "
                                  "the fix cannot also clip the sum: clip by hand after the replicas' sum, or drop it")
        if any(arg.star for arg in call.args):
            return {}, [], (call, "pass its arguments by name: Keras 2 and Keras 3 order them differently")
        named = _named_by_position(rule, call)
        if named is None:
            return {}, [], (call, "pass its arguments after the learning rate by keyword: Keras 2 and Keras 3 "
                                  "order them differently")
        args = [keyword_renamed(arg, "lr", "learning_rate") for arg in named
                if not keyword_is(arg, "decay", _is_zero) and not keyword_is(arg, "epsilon", is_none)]
        args = _keras2_default_rate(_optimizer_class(rule, call), args)
        decay = next((arg for arg in args if keyword_is(arg, "decay")), None)
        if decay is not None and not (own_class or "").startswith("Decayed"):  # (the class takes `decay=`)
            args, blocker = _decayed(rule, args, decay, imports)
            if blocker is not None:
                return {}, [], (call, blocker)
        func = cst.Name(own_class) if own_class is not None else _class_spelled(call.func)
        if args != list(call.args) or func is not call.func:
            changes[call] = call.with_changes(func=func, args=commas_mended(args, call.args) if call.args else args)
    return changes, imports, None


#: Keras 2.2-2.3's optimizer parameters in order (Keras 3 orders them otherwise after the rate:
#: `Adam(lr, beta_1, beta_2, epsilon, decay)` there, `(learning_rate, beta_1, beta_2, epsilon,
#: amsgrad)` here).
KERAS2_PARAMETERS = {
    "SGD": ("lr", "momentum", "decay", "nesterov"),
    "RMSprop": ("lr", "rho", "epsilon", "decay"),
    "Adagrad": ("lr", "epsilon", "decay"),
    "Adadelta": ("lr", "rho", "epsilon", "decay"),
    "Adam": ("lr", "beta_1", "beta_2", "epsilon", "decay", "amsgrad"),
    "Adamax": ("lr", "beta_1", "beta_2", "epsilon", "decay"),
    "Nadam": ("lr", "beta_1", "beta_2", "epsilon", "schedule_decay"),
}


def _class_spelled(func: cst.BaseExpression) -> cst.BaseExpression:
    """`keras.optimizers.rmsprop` (a Keras 2 alias) as `keras.optimizers.RMSprop`."""
    if isinstance(func, cst.Attribute) and func.attr.value in KERAS2_ALIASES:
        return func.with_changes(attr=cst.Name(KERAS2_ALIASES[func.attr.value]))
    return func


def _keras2_default_rate(optimizer: str | None, args: list[cst.Arg]) -> list[cst.Arg]:
    """``args`` of an optimizer of :data:`KERAS2_DEFAULT_RATES` made without a rate, with Keras 2's
    default rate given (`Adadelta()` -> `Adadelta(learning_rate=1.0)`)."""
    if optimizer not in KERAS2_DEFAULT_RATES or any(arg.keyword is None or keyword_is(arg, "learning_rate")
                                                    for arg in args):
        return args
    return [keyword_arg("learning_rate", cst.parse_expression(KERAS2_DEFAULT_RATES[optimizer])), *args]


def _named_by_position(rule, call: cst.Call) -> list[cst.Arg] | None:
    """The call's arguments, those after the first passed by position named by Keras 2's order
    (`Adam(0.0002, 0.5)`, Keras-GAN's, is `Adam(0.0002, beta_1=0.5)`); None where there are
    more than Keras 2 took."""
    order = KERAS2_PARAMETERS.get(_optimizer_class(rule, call) or "", ("lr",))
    positional = [arg for arg in call.args if arg.keyword is None]
    if len(positional) > len(order):
        return None
    named = []
    for arg in call.args:
        position = next((i for i, p in enumerate(positional) if p is arg), None)
        if position is not None and position > 0:
            arg = arg.with_changes(keyword=cst.Name(order[position]), equal=KEYWORD_EQUAL)
        named.append(arg)
    return named


def learning_rate_reads(rule) -> tuple[dict, tuple[cst.CSTNode, str] | None]:
    """`model.optimizer.lr` (`K.set_value(self.model.optimizer.lr, ...)` in a callback) and
    `opt.lr` of a name bound to a Keras optimizer -> `.learning_rate`: Keras 3's optimizers
    have no `lr`. Returns (changes, blocker): an optimizer's `decay` read (a callback logging
    the decayed rate) has no Keras 3 counterpart (the decay is in the schedule now)."""
    bound = {name for assign in find(rule.context.module, cst.Assign)
             if isinstance(assign.value, cst.Call) and OPTIMIZERS & set(rule.imports.resolve_all(assign.value.func))
             for target in assign.targets if (name := dotted_name(target.target)) is not None}
    changes = {}
    for node in find(rule.context.module, cst.Attribute):
        owner = dotted_name(node.value) or ""
        if not (owner.rsplit(".", 1)[-1] == "optimizer" or owner in bound):
            continue
        if node.attr.value in ("decay", "initial_decay"):
            return {}, (node, f"`{owner}.{node.attr.value}` is read, and Keras 3's optimizers have no decay (the fix "
                              "makes it the learning rate's schedule): read `.learning_rate`, already decayed, instead")
        if node.attr.value == "lr":
            changes[node] = node.with_changes(attr=cst.Name("learning_rate"))
    return changes, None


def keras2_step_optimizers(rule) -> dict[int, tuple[str, str]]:
    """id(call) -> (the optimizer, the class that steps as Keras 2's did) for the optimizers a
    call makes, or compiles with by name, that Keras 3 steps otherwise:

    - RMSprop anywhere: Keras 3 divides by sqrt(v + epsilon) where Keras 2 divided by sqrt(v) +
      epsilon (without momentum; with it both use sqrt(v + epsilon)): 2.4x apart after 24 steps
      of small gradients, where `Keras2RMSprop` agreed within 2e-7 (checked on TF 2.21 against
      tf_keras's legacy RMSprop, with and without momentum and centring).
    - Adagrad anywhere: Keras 2's accumulators started at zero and it stepped by lr * g / (sqrt(a)
      + epsilon); Keras 3's start at 0.1 and divide by sqrt(a + epsilon) (a 1e-3 gradient's first
      step 5% apart with zero accumulators; tf_keras's legacy Adagrad, given zero, steps as Keras
      2's): `Keras2Adagrad`, whose default rate is Keras 2's 0.01.
    - Adam and the other adaptive optimizers in a module that makes an `Embedding`: where an id
      occurs more than once in a batch, Keras 3's Adam squares each occurrence's gradient of the
      row, Keras 2 squared their sum (a row seen 3 times ended one step at -0.030 on Keras 3, 0.0
      on Keras 2; a held-out Kaggle text kernel's loss differed from the second step):
      `DenseGradientAdam` sums the rows' gradients first. (`Keras2RMSprop` does too.)
    - Any other optimizer that clips its gradients (`clipnorm=`, `clipvalue=`): Keras 3 under a
      strategy clips each replica's gradient before they are summed, the parallel model clipped
      the sum (a held-out keras-retinanet program with `clipnorm=0.001` was 2e-4 apart from the
      second step, equal with a bound never reached): `SummedClip<Name>` clips the sum. It makes
      every gradient dense to sum it, so an `Embedding`'s rows are added up first too (an Adam
      with `clipnorm=` in a module with an Embedding, a Kaggle toxic-comment kernel's, was refused)."""
    def compute() -> dict[int, tuple[str, str]]:
        embedding = _makes_embedding(rule)
        found = {}
        for call in find(rule.context.module, cst.Call):
            if _optimizer_named(rule, call, ("RMSprop",)):
                found[id(call)] = ("RMSprop", "Keras2RMSprop")
            elif _optimizer_named(rule, call, ("Adagrad",)):
                found[id(call)] = ("Adagrad", "Keras2Adagrad")
            elif _clipping(rule, call) is not None:  # (it adds up an Embedding's rows too, as DenseGradient does)
                name = _optimizer_class(rule, call)
                found[id(call)] = (name, f"SummedClip{name}")
            elif embedding and (adaptive := _optimizer_named(rule, call, ADAPTIVE)) is not None:
                found[id(call)] = (adaptive, f"DenseGradient{adaptive}")
            if _decayed_with_callback(rule, call):  # over the class above, if any
                name = _optimizer_class(rule, call)
                found[id(call)] = (name, f"Decayed{found[id(call)][1] if id(call) in found else name}")
        return found

    return rule.context.memo("keras3.keras2_step_optimizers", compute)


def _optimizer_class(rule, call: cst.Call) -> str | None:
    """The Keras optimizer class ``call`` makes (`Adam` of `keras.optimizers.Adam(...)`), else None."""
    made = next((n for n in rule.imports.resolve_all(call.func) if n in OPTIMIZERS), None)
    name = made.rsplit(".", 1)[-1] if made is not None else None
    return KERAS2_ALIASES.get(name, name)


def _decayed_with_callback(rule, call: cst.Call) -> bool:
    """A Keras optimizer made with a `decay=` (not zero) in a module whose learning-rate callback
    sets its rate: a schedule could not be set, the `Decayed<Name>` class decays what is set."""
    if _optimizer_class(rule, call) is None:
        return False
    decay = next((arg for arg in call.args if keyword_is(arg, "decay")), None)
    return decay is not None and not _is_zero(decay.value) and (
        any(rule.context.mentions(n) for n in LR_CALLBACKS) or _rate_set(rule))


def _rate_set(rule) -> bool:
    """Whether the module sets an optimizer's rate by hand: `K.set_value(model.optimizer.lr, x)`
    (a hand-written step-decay callback, keras's cifar10 style; its schedule-made rate has no
    `assign`, and a held-out program crashed so)."""
    return rule.context.memo("keras3_optimizers.rate_set", lambda: any(
        short_name(call.func) == "set_value" and call.args
        and isinstance(call.args[0].value, cst.Attribute) and call.args[0].value.attr.value in ("lr", "learning_rate")
        for call in find(rule.context.module, cst.Call)))


def replaced_optimizer_names(rule) -> set[str]:
    """The names the module calls optimizers by (`RMSprop` of `from keras.optimizers import
    RMSprop`) that :func:`keras2_step_optimizers` replaces by its classes: their imports go
    where nothing else uses them."""
    stepping = keras2_step_optimizers(rule)
    return {call.func.value for call in find(rule.context.module, cst.Call)
            if id(call) in stepping and isinstance(call.func, cst.Name)}


def keras2_step_classes(rule) -> tuple[list[cst.BaseStatement], list[ImportItem]]:
    """The classes :func:`keras2_step_optimizers` names (one each), to write after the module's
    imports (:func:`tfmigrate.cst.codegen.placed_after_imports`): (classes, imports)."""
    optimizers = sorted(set(keras2_step_optimizers(rule).values()))
    if not optimizers:
        return [], []
    tf = TfNames(rule)
    names = {key: tf(f"tensorflow.{target}") for key, target in (
        ("indexed", "IndexedSlices"), ("dense", "convert_to_tensor"), ("replica_context", "distribute.get_replica_context"),
        ("clip_by_norm", "clip_by_norm"), ("clip_by_value", "clip_by_value"))}
    templates = {"Keras2RMSprop": _KERAS2_RMSPROP, "Keras2Adagrad": _KERAS2_ADAGRAD, "DenseGradient": _DENSE_GRADIENT,
                 "SummedClip": _SUMMED_CLIP}
    written: dict[str, str] = {}  # class name -> its text
    for optimizer, own_class in optimizers:
        base = own_class.removeprefix("Decayed")
        if base != optimizer:  # a class of its own, which the decayed one derives from
            written[base] = next(t for k, t in templates.items() if base.startswith(k)).format(name=optimizer, **names)
        if own_class.startswith("Decayed"):
            parent = f"keras.optimizers.{optimizer}" if base == optimizer else base
            written[own_class] = _DECAYED.format(name=own_class, parent=parent, optimizer=optimizer)
    return [cst.parse_statement(text) for text in written.values()], tf.imports + [ImportItem("keras")]


#: What both classes do with an `Embedding`'s gradients by row: add up each row's first, as Keras 2 did.
_DENSE_APPLY = '''
    def apply(self, grads, trainable_variables=None):
        grads = [{dense}(g) if isinstance(g, {indexed}) else g for g in grads]
        return super().apply(grads, trainable_variables)
'''

_DENSE_GRADIENT = '''
class DenseGradient{name}(keras.optimizers.{name}):
    """{name} as Keras 2 stepped an `Embedding`: a row's gradients added up before they are
    squared (Keras 3's {name} squares each occurrence's in the batch)."""
''' + _DENSE_APPLY

_DECAYED = '''
class {name}({parent}):
    """{optimizer} with Keras 2's `decay=`: each step at lr / (1 + decay * iterations), where lr is
    what a learning-rate callback sets (Keras 3 has no `decay=`; a callback cannot set a schedule)."""

    def __init__(self, *args, decay=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.decay = decay

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        steps = keras.ops.cast(self.iterations, learning_rate.dtype)
        return super()._backend_update_step(grads, trainable_variables, learning_rate / (1.0 + self.decay * steps))
'''

_SUMMED_CLIP = '''
class SummedClip{name}(keras.optimizers.{name}):
    """{name} clipping the gradients summed over the replicas, as Keras 2's parallel model clipped
    them (Keras 3 under a distribution strategy clips each replica's part before the sum)."""

    def __init__(self, *args, clipnorm=None, clipvalue=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.summed_clipnorm, self.summed_clipvalue = clipnorm, clipvalue

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        summed = [{dense}(grads[i]) for i in present]
        context = {replica_context}()
        replicas = context.num_replicas_in_sync if context is not None else 1
        if replicas > 1 and summed:
            summed = context.all_reduce("sum", summed)
        if self.summed_clipnorm:
            summed = [{clip_by_norm}(g, self.summed_clipnorm) for g in summed]
        if self.summed_clipvalue:
            summed = [{clip_by_value}(g, -self.summed_clipvalue, self.summed_clipvalue) for g in summed]
        for i, g in zip(present, summed):  # the optimizer sums the replicas' parts again: each gives its share
            grads[i] = g / replicas
        return super().apply(grads, trainable_variables)
'''

_KERAS2_RMSPROP = '''
class Keras2RMSprop(keras.optimizers.RMSprop):
    """RMSprop as Keras 2 stepped: by lr * g / (sqrt(v) + epsilon) without momentum (Keras 3's
    RMSprop divides by sqrt(v + epsilon)), and an `Embedding`'s gradients added up by row first."""
''' + _DENSE_APPLY + '''
    def update_step(self, gradient, variable, learning_rate):
        if self.momentum > 0:  # Keras 2 stepped by lr * g / sqrt(v + epsilon) then, as Keras 3 does
            return super().update_step(gradient, variable, learning_rate)
        rate = keras.ops.cast(learning_rate, variable.dtype)
        gradient = keras.ops.cast(gradient, variable.dtype)
        index = self._get_variable_index(variable)
        velocity = self._velocities[index]
        self.assign(velocity, self.rho * velocity + (1 - self.rho) * keras.ops.square(gradient))
        denominator = velocity
        if self.centered:
            average = self._average_gradients[index]
            self.assign(average, self.rho * average + (1 - self.rho) * gradient)
            denominator = velocity - keras.ops.square(average)
        self.assign_sub(variable, rate * gradient / (keras.ops.sqrt(denominator) + self.epsilon))
'''


_KERAS2_ADAGRAD = '''
class Keras2Adagrad(keras.optimizers.Adagrad):
    """Adagrad as Keras 2 stepped: its accumulators from zero, by lr * g / (sqrt(a) + epsilon)
    (Keras 3's start at 0.1 and divide by sqrt(a + epsilon)), at Keras 2's default rate 0.01,
    and an `Embedding`'s gradients added up by row first."""

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.0, **kwargs):
        super().__init__(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value, **kwargs)
''' + _DENSE_APPLY + '''
    def update_step(self, gradient, variable, learning_rate):
        rate = keras.ops.cast(learning_rate, variable.dtype)
        gradient = keras.ops.cast(gradient, variable.dtype)
        accumulator = self._accumulators[self._get_variable_index(variable)]
        self.assign_add(accumulator, keras.ops.square(gradient))
        self.assign_sub(variable, rate * gradient / (keras.ops.sqrt(accumulator) + self.epsilon))
'''


def _clipping(rule, call: cst.Call) -> cst.Arg | None:
    """The argument by which a Keras optimizer ``call`` clips its gradients (`clipnorm=1.0`), else None."""
    if _optimizer_class(rule, call) is None:
        return None
    return next((arg for arg in call.args if any(keyword_is(arg, k, lambda v: not is_none(v)) for k in CLIPS)), None)


def _optimizer_named(rule, call: cst.Call, names: Iterable[str]) -> str | None:
    """The one of ``names`` that ``call`` makes (`keras.optimizers.Adam(...)`) or compiles with
    by name (`compile(optimizer='adam')`), else None."""
    made = _optimizer_class(rule, call)
    return next((name for name in names if _compiles_with(call, name.lower()) or name == made), None)


def _compiles_with(call: cst.Call, name: str) -> bool:
    """`model.compile(optimizer='rmsprop', ...)` (or the name first, by position)."""
    value = compiled_optimizer(call)
    return isinstance(value, cst.SimpleString) and str(value.evaluated_value).lower() == name


def shared_optimizer(rule) -> tuple[cst.CSTNode, str] | None:
    """An optimizer made once and compiled into two models (Keras-GAN's `optimizer = Adam(...)` for
    the discriminator and the combined model): Keras 3 builds an optimizer for one set of
    variables and fails on the other's ("Unknown variable"), and Keras 2 counted one step count
    for both (Adam's bias correction read it), which two optimizers would not. (the second
    compile, why), else None."""
    module = rule.context.module
    bound = assignments(rule.context)
    compiled: dict[str, str] = {}  # optimizer name -> the model first compiled with it
    for call in find(module, cst.Call):
        optimizer = compiled_optimizer(call)
        name = dotted_name(optimizer) if optimizer is not None else None
        if name is None or len(bound.get(name, ())) != 1:  # made once
            continue
        model = code_in(module, call.func.value)
        if compiled.setdefault(name, model) != model:
            return call, (f"`{name}` is compiled into `{compiled[name]}` and `{model}`: Keras 3 builds an optimizer for "
                          "one model's variables (the second fails), and Keras 2 counted one step count for both: "
                          "give each model its own optimizer")
    return None


#: The TF1 optimizers whose Keras counterpart makes the same update, and how their arguments map:
#: the positional order of the TF1 signature, TF1 keyword -> Keras keyword (None: dropped), and
#: defaults that differ. Keras's Adam is TF1's "epsilon hat" form; only the default epsilon
#: differs (1e-7 against 1e-8). Momentum's update, at a constant rate, is Keras SGD's (Nesterov's too).
TF1_OPTIMIZERS = {
    "tensorflow.train.GradientDescentOptimizer": (
        "SGD", ["learning_rate"], {"learning_rate": "learning_rate", "use_locking": None, "name": "name"}, {},
    ),
    "tensorflow.train.MomentumOptimizer": (
        "SGD", ["learning_rate", "momentum"],
        {"learning_rate": "learning_rate", "momentum": "momentum", "use_locking": None, "name": "name",
         "use_nesterov": "nesterov"}, {},
    ),
    "tensorflow.train.AdamOptimizer": (
        "Adam", ["learning_rate", "beta1", "beta2", "epsilon"],
        {"learning_rate": "learning_rate", "beta1": "beta_1", "beta2": "beta_2", "epsilon": "epsilon",
         "use_locking": None, "name": "name"},
        {"epsilon": "1e-8"},
    ),
}


def keras_of_tf1_optimizer(call: cst.Call, qualified: str, spell) -> tuple[str | None, str | None]:
    """The code of the Keras optimizer making the same update as the TF1 one ``call`` makes
    (``qualified``, a key of :data:`TF1_OPTIMIZERS`), TensorFlow names spelled by ``spell``:
    (code, None), or (None, why not)."""
    keras_name, positional, keywords, defaults = TF1_OPTIMIZERS[qualified]
    arguments: dict[str, str] = {}
    for k, arg in enumerate(call.args):
        if arg.star:
            return None, "the optimizer is made with *args or **kwargs"
        v1_name = arg.keyword.value if arg.keyword else (positional[k] if k < len(positional) else None)
        if v1_name not in keywords:
            return None, f"the optimizer's argument `{code(arg)}` has no Keras counterpart with the same update"
        if keywords[v1_name] is not None:
            arguments[keywords[v1_name]] = code(arg.value)
    for keyword, value in defaults.items():
        arguments.setdefault(keyword, value)
    made = ", ".join(f"{k}={v}" for k, v in arguments.items())
    return f"{spell('tensorflow.keras.optimizers.' + keras_name)}({made})", None


def tf1_compiled_optimizers(rule) -> tuple[dict, list[ImportItem]]:
    """`compile(optimizer=tf.train.AdamOptimizer(0.001))` (or a name bound once to it and read
    only by `compile`) -> `tf.keras.optimizers.Adam(learning_rate=0.001, epsilon=1e-8)`: the
    same step (Adam's epsilon is TF1's 1e-8, Keras's 1e-7; momentum as Keras's SGD steps it at a
    constant rate), and no TF1 API left to keep the program in TF1 mode. Not in a module with an
    `Embedding` (TF1's Adam added up a row's gradients, Keras 3's squares each: see
    :func:`keras2_step_optimizers`). (changes, imports), worked out once per module."""

    def compute() -> tuple[dict, list[ImportItem]]:
        module = rule.context.module
        if _makes_embedding(rule):
            return {}, []
        bound = assignments(rule.context)
        compiles = [call for call in find(module, cst.Call) if compiled_optimizer(call) is not None]
        passed = {id(compiled_optimizer(call)) for call in compiles}  # the optimizers `compile` is given
        changes: dict = {}
        tf = TfNames(rule)
        for call in compiles:
            made = compiled_optimizer(call)
            if isinstance(made, cst.Name) and len(bound.get(made.value, ())) == 1 and _read_by_compile_only(
                    module, made.value, passed):
                made = bound[made.value][0].value
            qualified = rule.imports.resolve(made.func) if isinstance(made, cst.Call) else None
            if qualified not in TF1_OPTIMIZERS or made in changes:
                continue
            keras_call, why = keras_of_tf1_optimizer(made, qualified, tf)
            if why is None:
                changes[made] = cst.parse_expression(keras_call)
        return changes, tf.imports if changes else []

    return rule.context.memo("keras3.tf1_compiled_optimizers", compute)


def _read_by_compile_only(module: cst.Module, name: str, passed: set[int]) -> bool:
    """Whether ``module`` reads ``name`` only as the optimizer `compile(...)` calls are given
    (``passed``, by id)."""
    reads = [node for node in name_nodes(module).get(name, ()) if id(node) not in passed]
    return len(reads) == 1  # its binding


def _makes_embedding(rule) -> bool:
    """Whether the module makes a Keras `Embedding` (whose rows' gradients optimizers treat apart)."""
    return rule.context.memo("keras3.makes_embedding", lambda: any(
        EMBEDDINGS & set(rule.imports.resolve_all(call.func)) for call in find(rule.context.module, cst.Call)))


def compiled_optimizer(call: cst.Call) -> cst.BaseExpression | None:
    """The optimizer a `compile(...)` call passes (by keyword, or first by position)."""
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "compile"):
        return None
    return next((a.value for a in call.args if keyword_is(a, "optimizer")),
                call.args[0].value if call.args and call.args[0].keyword is None else None)


def _decayed(rule, args: list[cst.Arg], decay: cst.Arg, imports: list) -> tuple[list[cst.Arg], str | None]:
    """``args`` with the learning rate as Keras 2's time decay of it, or why it cannot be. (With
    a learning-rate callback, which cannot set a schedule, a `Decayed<Name>` class decays the
    rate instead: :func:`keras2_step_optimizers`.)"""
    rate = next((arg for arg in args if arg.keyword is None or keyword_is(arg, "learning_rate")), None)
    if rate is None:
        return args, ("its `decay=` decays Keras 2's default learning rate, which Keras versions set apart: "
                      "pass `learning_rate=` (Keras 3 ignores `decay=`)")
    schedule, needed = rule.tf_ref("tensorflow.keras.optimizers.schedules.InverseTimeDecay")
    imports += needed
    code = rule.context.module.code_for_node
    value = cst.parse_expression(f"{code(schedule)}({code(rate.value)}, decay_steps=1, "
                                 f"decay_rate={code(decay.value)})")
    return [arg.with_changes(value=value) if arg is rate else arg for arg in args if arg is not decay], None


def _is_zero(value: cst.BaseExpression) -> bool:
    return isinstance(value, (cst.Integer, cst.Float)) and float(value.evaluated_value) == 0.0
