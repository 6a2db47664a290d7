"""Run one training program, unmodified, and measure it: ``python -m tfmigrate.verify.harness``.

The harness owns the process: it configures devices, seeds and (for TF1 programs) the
``tensorflow`` -> ``tensorflow.compat.v1`` shim *before* the program imports anything, then
executes the program with :mod:`runpy` as ``__main__``. The program's stdout/stderr are its own;
the harness writes what it measured as JSON to ``--out`` and says what it did on stderr, one
line per fact, prefixed ``[tfmigrate verify]``.

What is captured, per training step:

* ``Session.run`` (``tf.compat.v1.Session`` and anything built on it, e.g. MonitoredSession):
  a run is a training step when the graph cone of its fetches (data and control inputs)
  contains an op returned by ``Optimizer.apply_gradients`` / ``minimize`` (recorded by a
  wrapper), an op in the ``TRAIN_OP`` collection, a kernel of type ``*Apply*`` (the
  optimizers' update kernels), or, for an optimizer written by hand with ``tf.assign``, an
  assignment to a trainable variable with gradients (ops under a ``gradients`` scope)
  upstream. The step's loss is the fetched float scalar (preferring a tensor that was passed
  to ``compute_gradients``, then one named ``*loss*``). When that scalar is one
  of several tower losses feeding the same ``apply_gradients`` (the legacy habit of printing
  the last tower's loss), the harness fetches all tower losses too and reports their mean --
  the loss over the global batch when towers split it evenly.
* Keras ``fit``: a callback is added to every ``fit`` call. Keras 2's graph-mode loop reports
  the batch loss; the TF2 loops (Keras 2 eager and Keras 3) report the running mean over the
  epoch, which the harness turns back into the batch loss (``k*m_k - (k-1)*m_{k-1}``).
* ``--loss-regex``: a pattern applied to each line the program prints (group ``loss`` or the
  first group); it then is the loss source and its matches count the steps.

Examples per step: for a ``Session.run`` step, the fed arrays that reach the training op
(leading dimension; placeholders on the same device are one input -- features and labels --
and those on different devices are per-tower inputs that add up); without feeds, the leading
dimension of each dataset/queue output (``IteratorGetNext``, ``QueueDequeueMany``, ...) in the
cone, static when known, else fetched with the step. For Keras: the ``size`` the graph loop
reports, else ``fit``'s batch size (the last batch of an epoch may be smaller).

With ``--in-order`` the shuffles the program's own code asks for are turned off before it runs
(:mod:`tfmigrate.verify.in_order`), and the result lists them (``shuffles_off``).

The run stops after ``--steps`` captured steps (a private ``BaseException`` that the program's
``except Exception`` cannot swallow), and the harness ends the process with ``os._exit`` so that
queue-runner threads cannot keep it alive.
"""

from __future__ import annotations

import argparse
import builtins
import functools
import json
import math
import os
import platform
import random
import re
import runpy
import sys
import threading
import time
import traceback
import types

PREFIX = "[tfmigrate verify]"
REMOVED_KERAS_NOTE = (
    "multi_gpu_model(model, gpus={gpus}) is gone since TF 2.4: it ran as Keras 2 built it, the template "
    "on each device's slice of the batch, outputs joined (one synchronous update per batch)"
)


class StopRun(BaseException):
    """Raised inside the program once enough steps were captured."""


class LegacyAPIError(ImportError):
    """A TF1 API that no compatibility shim can provide (``tf.contrib``)."""


def say(message: str) -> None:
    sys.stderr.write(f"{PREFIX} {message}\n")
    sys.stderr.flush()


def canonical_name(name: str) -> str:
    """``tower_0/hidden/weights:0`` and ``hidden/weights/replica_1:0`` -> ``hidden/weights``."""
    name = re.sub(r":\d+$", "", name)
    parts = [p for p in name.split("/") if not re.fullmatch(r"(tower|replica|clone|gpu|GPU)_?\d+", p)]
    return "/".join(parts)


# --------------------------------------------------------------------------------------------
# the measurements


class State:
    def __init__(self, args):
        self.args = args
        self.steps: list[dict] = []          # {"step", "loss", "examples", "t_start", "t_end"}
        self.regex_steps: list[dict] = []
        self.notes: list[str] = []
        self.sources: set[str] = set()
        self.weights: dict = {"mode": "dump" if args.dump_weights else "load" if args.load_weights else "none"}
        self.weights_done = False
        self.train_calls = 0                 # captured training steps, whatever the loss source
        self.regex = re.compile(args.loss_regex) if args.loss_regex else None
        self.t_prev_end = None

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            say(text)

    def record(self, loss, examples, t_start, t_end, source: str) -> None:
        self.sources.add(source)
        self.train_calls += 1
        entry = {"step": len(self.steps), "loss": None if loss is None else float(loss),
                 "examples": None if examples is None else int(examples),
                 "t_start": t_start, "t_end": t_end}
        self.steps.append(entry)
        if self.regex is None and len(self.steps) >= self.args.steps:
            raise StopRun()

    def record_regex(self, loss: float) -> None:
        now = time.perf_counter()
        self.regex_steps.append({"step": len(self.regex_steps), "loss": loss, "examples": None,
                                 "t_start": now, "t_end": now})
        if len(self.regex_steps) >= self.args.steps:
            raise StopRun()


STATE: State | None = None


# --------------------------------------------------------------------------------------------
# devices


def setup_devices(tf, count: int) -> dict:
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= count:
        tf.config.set_visible_devices(gpus[:count], "GPU")
        info = {"kind": "gpu", "count": count, "names": [f"/gpu:{i}" for i in range(count)],
                "rewrite": False}
        say(f"devices: {count} GPU(s)")
        return info
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    if gpus:
        tf.config.set_visible_devices([], "GPU")
    say(f"devices: {count} logical CPU devices (only {len(gpus)} GPU(s) visible); "
        f"'/gpu:i' placements are rewritten to '/cpu:i'")
    return {"kind": "logical_cpu", "count": count, "names": [f"/cpu:{i}" for i in range(count)],
            "rewrite": True}


def install_session_devices() -> None:
    """A TF1 session made with a config of the program's own (`tf.Session(config=tf.ConfigProto())`,
    the Keras FAQ's `set_session`) sees the logical CPUs too: its config is laid over the process's,
    which holds them (alone it saw CPU:0 only, and a tower placed on CPU:1 failed)."""
    from tensorflow.python.client import session as session_lib
    from tensorflow.python.eager import context

    original = session_lib.Session.__init__
    if getattr(original, "sees_logical_devices", False):
        return

    def __init__(self, target="", graph=None, config=None):
        if config is not None:
            merged = context.context().config
            merged.MergeFrom(config)
            config = merged
        original(self, target, graph, config)

    __init__.sees_logical_devices = True
    session_lib.Session.__init__ = __init__


_GPU = re.compile(r"(?i)(/device:|/)gpu:(\d+)")
_OTHER_CPU = re.compile(r"(?i)(/device:|/)cpu:([1-9]\d*)")  # a logical CPU standing for a GPU
_HOST_ONLY = re.compile(r"Dataset|Iterator")  # tf.data's op types (TensorSliceDataset, OneShotIterator...)


def rewrite_device_string(device: str, count: int) -> str:
    if not device or "gpu" not in device.lower():
        return device
    return _GPU.sub(lambda m: f"/device:CPU:{int(m.group(2)) % count}", device)


def install_device_rewrite(tf, count: int) -> None:
    """Map every GPU placement an op receives onto the logical CPU device of the same index.

    Soft placement alone would put all towers on CPU:0 (and without it the placement fails), so
    the rewrite happens where TF applies the device stack to each new op: it covers string
    specs, ``tf.DeviceSpec`` and device functions alike. MirroredStrategy's default device list
    (all GPUs, else CPU:0 only) is replaced by the logical CPUs.
    """
    from tensorflow.python.framework import ops

    original = ops.Graph._apply_device_functions

    def _apply_device_functions(self, op):
        original(self, op)
        device = op.device
        if not device:
            return
        if _HOST_ONLY.search(op.type) and ("GPU" in device.upper() or _OTHER_CPU.search(device)):
            # tf.data ops have no GPU kernels: on a GPU machine soft placement puts a tower's
            # dataset and iterator on the host, CPU:0, where TF also pins a one-shot iterator.
            # Emulated, `/cpu:i` is a real device, and the pipeline would be split across two.
            op._set_device_from_string(_OTHER_CPU.sub("/device:CPU:0", _GPU.sub("/device:CPU:0", device)))
        elif "GPU" in device.upper():
            op._set_device_from_string(rewrite_device_string(device, count))

    ops.Graph._apply_device_functions = _apply_device_functions

    # Both classes: a legacy-mode program's `tf.distribute` is compat.v1's, whose
    # MirroredStrategy is a separate class (left unpatched, its GPU device list would be
    # soft-placed onto one CPU with an all-reduce that never completes).
    for strategy_class in {tf.distribute.MirroredStrategy, tf.compat.v1.distribute.MirroredStrategy}:
        _patch_strategy(tf, strategy_class, count)


def _patch_strategy(tf, strategy_class, count: int) -> None:
    strategy_init = strategy_class.__init__

    def __init__(self, devices=None, cross_device_ops=None):
        if devices is None:
            devices = [f"/cpu:{i}" for i in range(count)]
        else:
            devices = [rewrite_device_string(str(d), count) for d in devices]
        if cross_device_ops is None and count > 1:
            # NCCL is not available for CPU devices; use the reduction MirroredStrategy picks
            # for them anyway, explicitly, to avoid its probing warnings.
            cross_device_ops = tf.distribute.ReductionToOneDevice()
        strategy_init(self, devices=devices, cross_device_ops=cross_device_ops)

    strategy_class.__init__ = __init__


# --------------------------------------------------------------------------------------------
# the TF1 shim


def _is_user_code(globals_) -> bool:
    if not globals_:
        return False
    path = globals_.get("__file__") or ""
    if not path:
        return globals_.get("__name__") == "__main__"
    path = os.path.abspath(path)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, here)}
    roots |= {os.path.abspath(p) for p in sys.path if "site-packages" in p or "dist-packages" in p}
    return not any(path == r or path.startswith(r + os.sep) for r in roots)


class _Removed:
    """Stands for a removed API (``tf.contrib...``); using it raises an error naming the API."""

    def __init__(self, path: str):
        object.__setattr__(self, "_path", path)

    def _fail(self, *_a, **_k):
        raise LegacyAPIError(
            f"{self._path} is not available: tf.contrib was removed in TensorFlow 2.0 and has no "
            f"tf.compat.v1 equivalent; port this call by hand (see `tfmigrate check`) before verifying")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Removed(f"{self._path}.{name}")

    __call__ = _fail
    __iter__ = _fail
    __enter__ = _fail
    __bool__ = _fail


def make_tf1_module(tf):
    compat = tf.compat.v1

    class TF1Module(types.ModuleType):
        def __getattr__(self, name):
            if name == "contrib":
                return _Removed("tf.contrib")
            return getattr(compat, name)

        def __dir__(self):
            return dir(compat)

    module = TF1Module("tensorflow")
    module.__version__ = tf.__version__
    module.__file__ = getattr(compat, "__file__", None)
    return module


def multi_gpu_model(model, gpus=None, cpu_merge=True, cpu_relocation=False):
    """Keras 2's `multi_gpu_model`, as it built the parallel model: the template run on each
    device's slice of the batch (the last slice takes the remainder), the outputs joined on the
    CPU into one model over the template's inputs. Layers that see the batch (BatchNormalization)
    see each device's slice, as they did, and as each replica's does under MirroredStrategy."""
    count = gpus if isinstance(gpus, int) else len(gpus or []) or 1
    if STATE is not None:
        STATE.note(REMOVED_KERAS_NOTE.format(gpus=count))
        STATE.weights["multi_gpu_model"] = count
    if count < 2:
        return model
    import tensorflow as tf
    import tf_keras

    def device_slice(data, index, parts):
        batch, rest = tf.shape(data)[:1], tf.shape(data)[1:]
        step = batch // parts
        size = batch - step * index if index == parts - 1 else step
        return tf.slice(data, tf.concat([step * index, rest * 0], 0), tf.concat([size, rest], 0))

    towers = [[] for _ in model.outputs]
    for index in range(count):
        with tf.device(f"/gpu:{index}"), tf.name_scope(f"replica_{index}"):
            pieces = [tf_keras.layers.Lambda(device_slice, arguments={"index": index, "parts": count})(x)
                      for x in model.inputs]
            outputs = model(pieces if len(pieces) > 1 else pieces[0])
            for joined, output in zip(towers, outputs if isinstance(outputs, (list, tuple)) else [outputs]):
                joined.append(output)
    with tf.device("/cpu:0"):
        merged = [tf_keras.layers.concatenate(parts, axis=0, name=name)
                  for parts, name in zip(towers, model.output_names)]
    return tf_keras.Model(model.inputs, merged)


class _Overlay(types.ModuleType):
    """A module that looks up names in ``first`` then in ``base``."""

    def __init__(self, name, first: dict, base):
        super().__init__(name)
        self._first, self._base = first, base

    def __getattr__(self, name):
        if name in self._first:
            return self._first[name]
        return getattr(self._base, name)


_KERAS2_UTILS_SUBMODULES = ("np_utils", "generic_utils", "data_utils", "io_utils", "vis_utils", "layer_utils",
                            "conv_utils")


def make_keras2_modules(tf_keras):
    """``keras`` as a Keras 2.x program knew it: tf_keras, with the optimizers that work in graph
    mode (``keras.optimizers.legacy``, which were *the* optimizers before Keras 2.11) and
    ``multi_gpu_model`` back in ``keras.utils``."""
    legacy = tf_keras.optimizers.legacy
    optimizer_names = {n: getattr(legacy, n) for n in dir(legacy) if not n.startswith("_")}
    optimizer_names.update(_keras2_defaults(legacy))
    # Keras 2's lower-case aliases (`keras.optimizers.rmsprop(lr=1e-4)`, Keras's cifar10_cnn example)
    optimizer_names.update({name.lower(): optimizer_names[name] for name in
                            ("SGD", "RMSprop", "Adagrad", "Adadelta", "Adam", "Adamax", "Nadam")})
    _name_legacy_optimizers(tf_keras, optimizer_names)
    _evaluate_in_order()
    optimizers = _Overlay("keras.optimizers", optimizer_names, tf_keras.optimizers)
    utils = _Overlay("keras.utils", {"multi_gpu_model": multi_gpu_model}, tf_keras.utils)
    # Keras 2.0-2.2's utility submodules (`from keras.utils import np_utils`): what they held is in
    # `keras.utils` itself.
    utils._first.update({name: utils for name in _KERAS2_UTILS_SUBMODULES})
    # Keras 2.0-2.2's `keras.engine` (`from keras.engine.topology import Layer`): layers and models.
    engine = _Overlay("keras.engine", {"Model": tf_keras.Model, "Sequential": tf_keras.Sequential,
                                       "Network": tf_keras.Model, "Container": tf_keras.Model}, tf_keras.layers)
    # Standalone Keras 2's TF backend (`from keras.backend.tensorflow_backend import set_session`):
    # the session functions tf_keras keeps under tf.compat.v1.keras.backend.
    from tensorflow.compat.v1.keras import backend as v1_backend

    backend = _Overlay("keras.backend", {"set_session": v1_backend.set_session,
                                         "get_session": v1_backend.get_session}, tf_keras.backend)
    backend._first["tensorflow_backend"] = backend
    top = _Overlay("keras", {"optimizers": optimizers, "utils": utils, "engine": engine, "backend": backend}, tf_keras)
    # `from keras import optimizers` imports "keras" with a fromlist: the overlay too.
    submodules = {"keras": top, "keras.optimizers": optimizers, "keras.utils": utils,
                  "keras.utils.training_utils": utils, "keras.utils.multi_gpu_utils": utils, "keras.engine": engine,
                  "keras.backend": backend, "keras.backend.tensorflow_backend": backend}
    return top, submodules


def _evaluate_in_order() -> None:
    """tf_keras's graph-mode `fit` validates through its batch loop with `shuffle` left at its
    default, True: it shuffled the validation rows with NumPy's global random state each epoch.
    Keras 2.2-2.3 (standalone, what `import keras` programs ran on) and Keras 3 validate in order
    without drawing; the draws changed no loss but moved the random state, and a program's next
    `np.random` data (a second training phase's) differed from its migration's. Evaluation and
    prediction read in order here, as Keras 2 read them."""
    from tf_keras.src.engine import training_arrays_v1
    from tf_keras.src.utils.mode_keys import ModeKeys

    original = training_arrays_v1.model_iteration
    if getattr(original, "_tfmigrate", False):
        return

    def model_iteration(*args, **kwargs):
        if kwargs.get("mode", ModeKeys.TRAIN) != ModeKeys.TRAIN:
            kwargs["shuffle"] = False
        return original(*args, **kwargs)

    model_iteration._tfmigrate = True
    training_arrays_v1.model_iteration = model_iteration
    # `evaluate` and `predict` go through these partials of the original loop
    training_arrays_v1.test_loop = functools.partial(model_iteration, mode=ModeKeys.TEST)
    training_arrays_v1.predict_loop = functools.partial(model_iteration, mode=ModeKeys.PREDICT)


#: Keras 2.0-2.3's default learning rates (and Adagrad's accumulators, which started at zero) where
#: tf_keras's legacy optimizers changed them (to 0.001, and 0.1 for the accumulators).
KERAS2_DEFAULTS = {"Adadelta": {"learning_rate": 1.0}, "Adagrad": {"learning_rate": 0.01, "initial_accumulator_value": 0.0},
                   "Adamax": {"learning_rate": 0.002}, "Nadam": {"learning_rate": 0.002}}


def _keras2_defaults(legacy) -> dict:
    """The legacy optimizer classes of :data:`KERAS2_DEFAULTS` with Keras 2's defaults: a Keras 2
    program's `Adadelta()` (Keras's mnist_cnn example) trained at 1.0, not tf_keras's 0.001."""
    import inspect

    classes = {}
    for name, defaults in KERAS2_DEFAULTS.items():
        base = getattr(legacy, name)
        order = [p for p in inspect.signature(base.__init__).parameters if p != "self"]

        def __init__(self, *args, _base=base, _defaults=defaults, _order=order, **kwargs):
            if "lr" in kwargs:  # Keras 2's name for it
                kwargs["learning_rate"] = kwargs.pop("lr")
            given = set(_order[:len(args)]) | set(kwargs)
            _base.__init__(self, *args, **{k: v for k, v in _defaults.items() if k not in given}, **kwargs)

        classes[name] = type(name, (base,), {"__init__": __init__, "__module__": base.__module__})
    return classes


def _name_legacy_optimizers(tf_keras, classes: dict) -> None:
    """`compile(optimizer='rmsprop')` gives the legacy optimizer too, as Keras 2.x's only
    `RMSprop` was: tf_keras in TF2 gave its new one, which divides by sqrt(v + epsilon) where
    Keras 2 divided by sqrt(v) + epsilon (a Keras 2 seq2seq program's loss moved 1e-3 at step 1);
    and a name of :data:`KERAS2_DEFAULTS` its class with Keras 2's defaults (``classes``)."""
    from tf_keras.src import optimizers

    get = optimizers.get
    if getattr(get, "names_legacy", False):
        return
    by_name = {name.lower(): classes[name] for name in KERAS2_DEFAULTS}

    def get_legacy(identifier, **kwargs):
        if isinstance(identifier, str) and identifier.lower() in by_name:
            return by_name[identifier.lower()]()
        if isinstance(identifier, (str, dict)):
            kwargs.setdefault("use_legacy_optimizer", True)
        return get(identifier, **kwargs)

    get_legacy.names_legacy = True
    optimizers.get = get_legacy


def keras2_module(name: str, submodules: dict):
    """The module a Keras 2 program's ``import keras.X`` means, in tf_keras. Keras 2.0-2.2 kept its
    names in submodules tf_keras has not (`keras.layers.core`, `keras.layers.merge`,
    `keras.utils.np_utils`, `keras.engine.topology`): what they held is in the package above."""
    import importlib

    parts = name.split(".")
    while True:
        current = ".".join(parts)
        if current in submodules:
            return submodules[current]
        try:
            return importlib.import_module("tf_keras" + current[len("keras"):])
        except ModuleNotFoundError:
            if len(parts) <= 2:
                raise
            parts.pop()


def install_tf1_shim(tf, keras_module) -> None:
    """``import tensorflow`` in the program's own files gives compat.v1 (v2 behaviour is off);
    ``import keras`` gives Keras 2 (``tf_keras``) with ``multi_gpu_model`` restored as above.
    Library code keeps the real modules: the switch looks at the importing file."""
    install_import_shim(make_tf1_module(tf), keras_module)


def install_import_shim(tf1, keras_module) -> None:
    """The import switch of :func:`install_tf1_shim`; with ``tf1`` None, ``import tensorflow``
    stays TF2 and only Keras is switched (a TF 2.0-2.3 program's `multi_gpu_model`)."""
    real_import = builtins.__import__

    keras_proxy, submodules = (make_keras2_modules(keras_module) if keras_module is not None else (None, {}))
    if keras_proxy is not None and tf1 is not None:
        tf1.keras = keras_proxy  # `tf.keras.utils.multi_gpu_model(...)` too

    def keras_target(name):
        return keras2_module(name, submodules)

    def shim_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and _is_user_code(globals):
            if name == "tensorflow" and tf1 is not None:
                return tf1
            if name.startswith("tensorflow.contrib"):
                raise LegacyAPIError(
                    f"{name} is not available: tf.contrib was removed in TensorFlow 2.0; port it "
                    f"by hand before verifying")
            for prefix in ("tensorflow.compat.v1.keras", "tensorflow.keras"):
                # `from tensorflow.keras.utils import multi_gpu_model`: the same Keras as `import keras`.
                if keras_module is not None and fromlist and (name == prefix or name.startswith(prefix + ".")):
                    return keras_target("keras" + name[len(prefix):])
            if keras_module is not None and (name == "keras" or name.startswith("keras.")):
                target = keras_target(name)
                if fromlist:
                    return target
                return keras_proxy
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = shim_import


# --------------------------------------------------------------------------------------------
# Session.run capture


TRAIN_KERNEL = re.compile(r"^(Resource)?(Sparse)?Apply")
# A hand-written optimizer's update: an assignment (to a trainable variable) fed by gradients.
ASSIGN_KERNELS = {"Assign", "AssignSub", "AssignAdd", "AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp"}
GRADIENT_SCOPE = re.compile(r"(^|/)gradients(_\d+)?/")
REPLICA_COPY = re.compile(r"/replica_\d+$")


def variable_name(name: str) -> str:
    """A variable's (or its op's) name, the same for every replica's copy: `w:0`,
    `w/replica_1` -> `w`."""
    return REPLICA_COPY.sub("", name.split(":")[0])


SOURCE_OPS = {
    "IteratorGetNext", "IteratorGetNextSync", "MultiDeviceIteratorGetNextFromShard",
    "QueueDequeueMany", "QueueDequeueManyV2", "QueueDequeueUpTo", "QueueDequeueUpToV2",
    "QueueDequeue", "QueueDequeueV2", "OptionalGetValue",
}


def flatten_fetches(tf, structure) -> list:
    """``tf.nest.flatten`` of Session.run fetches (or of what the run returned), also for a dict
    whose keys do not sort: MonitoredSession fetches `{'caller': ..., <hook>: ...}`, which
    nest cannot order; such a dict is read in insertion order, the order its result keeps."""
    try:
        return tf.nest.flatten(structure)
    except TypeError:
        if isinstance(structure, dict):
            return [leaf for value in structure.values() for leaf in flatten_fetches(tf, value)]
        if isinstance(structure, (list, tuple)):
            return [leaf for value in structure for leaf in flatten_fetches(tf, value)]
        raise


def cone(roots):
    """All ops reachable backwards (data and control inputs) from the given ops."""
    seen, stack = set(), list(roots)
    ops_ = []
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        ops_.append(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


class Recorder:
    """Wraps the v1 Optimizer and Session.run."""

    def __init__(self, tf, state: State):
        self.tf = tf
        self.state = state
        self.apply_ops: dict[int, dict] = {}       # id(graph) -> {op: [loss tensors]}
        self.global_steps: dict[int, set] = {}     # id(graph) -> the names of the steps the updates count
        self.grad_losses: dict[int, list] = {}     # id(graph) -> [(loss, set(grad tensors), replica)]
        # Under MirroredStrategy the k-th apply_gradients of every replica is one update, but each
        # replica gets its own op back: (id(graph), k) -> the losses they share, and
        # (id(graph), replica id) -> how many updates that replica has made.
        self.replica_updates: dict[tuple, list] = {}
        self.replica_calls: dict[tuple, int] = {}
        self.cache: dict = {}
        # Per thread: a feeder thread's `sess.run(enqueue_op, ...)` (tacotron's DataFeeder, KittiSeg)
        # runs beside the training loop's, and one shared flag made a training step go unrecorded.
        self._thread = threading.local()

    @property
    def in_run(self) -> bool:
        """Whether this thread is inside a Session.run already (a nested run is the program's own)."""
        return getattr(self._thread, "in_run", False)

    @in_run.setter
    def in_run(self, value: bool) -> None:
        self._thread.in_run = value

    # -- optimizer ------------------------------------------------------------------------
    def install_optimizer(self):
        tf = self.tf
        opt_cls = tf.compat.v1.train.Optimizer
        orig_compute, orig_apply = opt_cls.compute_gradients, opt_cls.apply_gradients
        rec = self

        def compute_gradients(opt, loss, *args, **kwargs):
            result = orig_compute(opt, loss, *args, **kwargs)
            try:
                if not callable(loss) and hasattr(loss, "graph"):
                    replica = (tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context())
                    grads = {g for g, _ in result if g is not None and hasattr(g, "op")}
                    rec.grad_losses.setdefault(id(loss.graph), []).append((loss, {g.op for g in grads}, replica))
            except Exception:  # never let bookkeeping break the program
                pass
            return result

        def apply_gradients(opt, grads_and_vars, *args, **kwargs):
            grads_and_vars = list(grads_and_vars)
            result = orig_apply(opt, grads_and_vars, *args, **kwargs)
            try:
                rec.note_global_step(kwargs.get("global_step", args[0] if args else None), result)
                op = result if hasattr(result, "node_def") else getattr(result, "op", None)
                if op is not None:
                    roots = [g.op for g, _ in grads_and_vars if g is not None and hasattr(g, "op")]
                    upstream = cone(roots)
                    losses = [(loss, replica) for loss, gops, replica in rec.grad_losses.get(id(op.graph), [])
                              if gops & upstream]
                    # A replica's update made from every replica's gradients (their average, taken
                    # by the program) is not one replica's share: its losses are averaged, not summed.
                    if sum(replica for _, replica in losses) > 1:
                        losses = [(loss, False) for loss, _ in losses]
                    # Under MirroredStrategy each replica's apply_gradients returns an update op
                    # with its own loss upstream: keep every replica's, not the last.
                    known = rec.apply_ops.setdefault(id(op.graph), {}).setdefault(op, rec.update_of(op))
                    known.extend(item for item in losses if not any(item[0] is k[0] for k in known))
            except Exception:
                pass
            return result

        opt_cls.compute_gradients = compute_gradients
        opt_cls.apply_gradients = apply_gradients

    def note_global_step(self, step, update) -> None:
        """Remember the variable an update counts its steps in: a fetched step count is no loss."""
        graph = getattr(update, "graph", None)
        name = getattr(step, "name", None)
        if graph is not None and isinstance(name, str):
            self.global_steps.setdefault(id(graph), set()).add(variable_name(name))

    def _step_names(self, graph) -> set[str]:
        """The global steps of ``graph``: those an update was given, and the graph's own."""
        collected = graph.get_collection(self.tf.compat.v1.GraphKeys.GLOBAL_STEP)
        return set(self.global_steps.get(id(graph), ())) | {variable_name(step.name) for step in collected}

    @staticmethod
    def _reads_step(element, steps: set[str]) -> bool:
        """Whether ``element`` is one of ``steps`` (read through `Identity`/`ReadVariableOp`)."""
        op = element.op
        while variable_name(op.name) not in steps and op.type in ("Identity", "ReadVariableOp") and op.inputs:
            op = op.inputs[0].op
        return variable_name(op.name) in steps

    def update_of(self, op) -> list:
        """The list of losses behind ``op``: shared by the replicas' ops of one update."""
        tf = self.tf
        context = tf.distribute.get_replica_context() if tf.distribute.has_strategy() else None
        if context is None or tf.distribute.in_cross_replica_context():
            return []
        replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        count = self.replica_calls.get((id(op.graph), replica), 0)
        self.replica_calls[(id(op.graph), replica)] = count + 1
        return self.replica_updates.setdefault((id(op.graph), count), [])

    # -- Session.run -----------------------------------------------------------------------
    def install_session(self):
        from tensorflow.python.client import session as session_lib

        original = session_lib.BaseSession.run
        rec = self

        def run(sess, fetches, feed_dict=None, options=None, run_metadata=None):
            if rec.in_run:
                return original(sess, fetches, feed_dict, options, run_metadata)
            rec.in_run = True
            try:
                plan = rec.plan(sess.graph, fetches)
            except Exception as exc:  # analysis failed: run untouched
                rec.state.note(f"could not analyse a Session.run ({type(exc).__name__}: {exc})")
                plan = None
            finally:
                rec.in_run = False
            if plan is None:
                return original(sess, fetches, feed_dict, options, run_metadata)
            rec.in_run = True
            try:
                if not rec.state.weights_done:
                    rec.state.weights_done = True
                    handle_session_weights(rec.tf, rec.state, sess, original, plan["graph"])
                extras = plan["extras"]
                t_start = time.perf_counter()
                result, extra_values = original(sess, (fetches, extras), feed_dict, options, run_metadata)
                t_end = time.perf_counter()
            finally:
                rec.in_run = False
            loss = rec.loss_of(plan, result, extra_values)
            examples = rec.examples_of(plan, feed_dict, sess.graph, extra_values)
            rec.state.record(loss, examples, t_start, t_end, "session")
            return result

        session_lib.BaseSession.run = run

    def plan(self, graph, fetches):
        """How to read a Session.run's loss and batch size; None when the run is not a training step."""
        elements = self._fetch_elements(graph, fetches)
        key = (id(graph), tuple(getattr(e, "name", None) for e in elements))
        if key in self.cache:
            return self.cache[key]
        roots = [e if hasattr(e, "node_def") else e.op for e in elements if e is not None and hasattr(e, "graph")]
        upstream = cone(roots)
        recorded = self.apply_ops.get(id(graph), {})
        train_marks = {op for op in recorded if op in upstream}
        train_collection = self._train_collection(graph, upstream)
        kernels = [op for op in upstream if TRAIN_KERNEL.match(op.type)] or self._hand_written_updates(graph, upstream)
        if not (train_marks or train_collection or kernels):
            self.cache[key] = None
            return None
        tower_losses, replica = self._tower_losses(train_marks, recorded)
        candidates = self._loss_candidates(elements, recorded, tower_losses)
        plan = {"graph": graph, "loss_index": None, "extras": {}, "how": None, "sources": [],
                "placeholders": {op.name: op.device for op in upstream if op.type in ("Placeholder", "PlaceholderWithDefault")}}
        self._choose_loss(plan, candidates, tower_losses, replica)
        self._batch_sources(plan, upstream)
        self.state.note(f"Session.run training step: loss = {plan['how']}")
        self.cache[key] = plan
        return plan

    def _fetch_elements(self, graph, fetches) -> list:
        """The graph element of each flattened fetch (None where it is not one)."""
        flat = flatten_fetches(self.tf, fetches)
        elements = []
        for item in flat:
            try:
                elements.append(graph.as_graph_element(item, allow_tensor=True, allow_operation=True))
            except Exception:
                elements.append(None)
        return elements

    def _hand_written_updates(self, graph, upstream) -> list:
        """Assignments to trainable variables computed from gradients: an optimizer written
        with `tf.assign` (OpenAI's `adam_updates`). A data-dependent initialisation assigns
        trainable variables too, but no gradient reaches it."""
        if not any(GRADIENT_SCOPE.search(op.name) for op in upstream):
            return []
        # By name: a mirrored variable's copies are `<name>/replica_<k>`.
        trainable = {v.name.split(":")[0] for v in graph.get_collection(self.tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
        return [op for op in upstream if op.type in ASSIGN_KERNELS and op.inputs
                and variable_name(op.inputs[0].op.name) in trainable]

    def _train_collection(self, graph, upstream) -> set:
        """The ops of the graph's TRAIN_OP collection that the fetches depend on."""
        train_collection = set()
        for item in graph.get_collection(self.tf.compat.v1.GraphKeys.TRAIN_OP):
            op = item if hasattr(item, "node_def") else getattr(item, "op", None)
            if op is not None and op in upstream:
                train_collection.add(op)
        return train_collection

    def _tower_losses(self, train_marks, recorded):
        """The losses behind the fetched updates, and whether any was a replica's own loss."""
        tower_losses: list = []
        replica = False
        for op in train_marks:
            for loss, is_replica in recorded[op]:
                if loss not in tower_losses:
                    tower_losses.append(loss)
                replica = replica or is_replica
        return tower_losses, replica

    def _loss_candidates(self, elements, recorded, tower_losses) -> list:
        """The fetched float scalars that may be the loss, as (rank, index, element), best first."""
        candidates = []
        steps: set[str] | None = None  # the graph's global steps, looked up once
        for index, element in enumerate(elements):
            if element is None or hasattr(element, "node_def"):
                continue
            dtype = getattr(element, "dtype", None)
            if dtype is None or not dtype.is_floating:
                continue
            steps = self._step_names(element.graph) if steps is None else steps
            if element.op in recorded or self._reads_step(element, steps):
                continue  # a float global step, or its increment (an update's own output)
            shape = element.shape
            if shape.rank not in (0, None):
                continue
            rank = 0 if element in tower_losses else 1 if "loss" in element.name.lower() else 2
            candidates.append((rank, index, element))
        candidates.sort(key=lambda c: (c[0], c[1]))
        return candidates

    def _choose_loss(self, plan: dict, candidates: list, tower_losses: list, replica: bool) -> None:
        """Set in ``plan`` where the step's loss comes from: a fetched scalar or the tower losses."""
        if candidates:
            rank, index, element = candidates[0]
            plan["loss_index"] = index
            plan["how"] = f"fetched scalar {element.name}"
            # One tower's (or replica's) own loss was fetched: report the mean over all of them.
            if rank == 0 and len(tower_losses) > 1:
                plan["extras"]["towers"] = list(tower_losses)
                plan["how"] = (f"mean of the {len(tower_losses)} tower losses passed to compute_gradients "
                               f"(the program fetched {element.name})")
        elif tower_losses:
            plan["extras"]["towers"] = list(tower_losses)
            plan["how"] = (f"{'sum' if replica else 'mean'} of the {len(tower_losses)} losses passed to "
                           f"compute_gradients (no loss fetched)")
            plan["replica_sum"] = replica
        else:
            plan["how"] = "no loss fetched or found"

    def _batch_sources(self, plan: dict, upstream) -> None:
        """Set in ``plan`` the batch sizes of the dataset/queue outputs upstream (for runs with no feed)."""
        sizes = []
        for op in sorted((op for op in upstream if op.type in SOURCE_OPS), key=lambda o: o.name):
            for out in op.outputs:
                if out.shape.rank is not None and out.shape.rank >= 1:
                    dim = self.tf.compat.dimension_value(out.shape[0])  # a v1 Dimension(None) is not None
                    if dim is not None:
                        plan["sources"].append(int(dim))
                    else:
                        sizes.append(out)
                    break
        if sizes:
            plan["extras"]["sizes"] = sizes

    def loss_of(self, plan, result, extra_values):
        import numpy as np

        towers = extra_values.get("towers") if isinstance(extra_values, dict) else None
        if towers:
            values = [float(np.asarray(v).reshape(-1)[0]) for v in towers]
            return sum(values) if plan.get("replica_sum") else sum(values) / len(values)
        if plan["loss_index"] is not None:
            value = flatten_fetches(self.tf, result)[plan["loss_index"]]
            array = np.asarray(value)
            if array.size == 1:
                return float(array.reshape(-1)[0])
        return None

    def examples_of(self, plan, feed_dict, graph, extra_values):
        import numpy as np

        if feed_dict:
            groups: dict = {}
            for key, value in feed_dict.items():
                try:
                    element = graph.as_graph_element(key)
                except Exception:
                    continue
                op = element if hasattr(element, "node_def") else element.op
                if op.name not in plan["placeholders"]:
                    continue
                shape = np.shape(value)
                if len(shape) >= 1:
                    device = plan["placeholders"][op.name]
                    groups[device] = max(groups.get(device, 0), int(shape[0]))
            if groups:
                return sum(groups.values())
        total = sum(plan["sources"])
        sizes = extra_values.get("sizes") if isinstance(extra_values, dict) else None
        for value in sizes or []:
            total += int(np.shape(value)[0])
        return total or None


def handle_session_weights(tf, state: State, sess, run, graph) -> None:
    """Before the first training step: dump (OLD) or load (NEW) the trainable variables."""
    variables = graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    named: dict = {}
    for var in variables:
        named.setdefault(canonical_name(var.name), var)
    args = state.args
    if args.dump_weights:
        keys = list(named)
        values = run(sess, [getattr(named[k], "_primary", named[k]) for k in keys])
        save_weights(args.dump_weights, dict(zip(keys, values)), state)
    elif args.load_weights:
        saved = load_weights(args.load_weights)
        if saved is None:
            return
        feed, fetches = {}, []
        assignments = match_weights(saved, {k: tuple(v.shape.as_list()) for k, v in named.items()}, state)
        for name, source in assignments.items():
            var = named[name]
            components = list(getattr(var, "values", None) or [var]) if hasattr(var, "_primary") else [var]
            for component in components:
                initializer = component.initializer
                feed[initializer.inputs[1]] = saved[source]
                fetches.append(initializer)
        if fetches:
            run(sess, fetches, feed)


def save_weights(path: str, values: dict, state: State) -> None:
    import numpy as np

    arrays = {f"w{i}": np.asarray(v) for i, v in enumerate(values.values())}
    np.savez(path, __names__=np.array(list(values), dtype=object), **arrays)
    state.weights.update({"dumped": len(values), "names": list(values)})
    say(f"initial weights: saved {len(values)} trainable variables")


def load_weights(path: str):
    import numpy as np

    if not os.path.exists(path):
        return None
    data = np.load(path, allow_pickle=True)
    names = list(data["__names__"])
    return {name: data[f"w{i}"] for i, name in enumerate(names)}


def match_weights(saved: dict, shapes: dict, state: State) -> dict:
    """Map this program's variable names to saved names: by canonical name and shape, else
    (same count, same shapes in order) by position."""
    mapping = {n: n for n, shape in shapes.items() if n in saved and tuple(saved[n].shape) == shape}
    how = "name"
    if len(mapping) < len(shapes) and len(saved) == len(shapes):
        ordered = list(zip(shapes.items(), saved.items()))
        if all(tuple(sv.shape) == shp for (_, shp), (_, sv) in ordered):
            mapping = {n: s for (n, _), (s, _) in ordered}
            how = "order"
    state.weights.update({
        "loaded": len(mapping), "variables": len(shapes), "saved": len(saved), "matched_by": how,
        "unmatched": sorted(set(shapes) - set(mapping)),
    })
    say(f"initial weights: {len(mapping)} of {len(shapes)} trainable variables set from OLD (by {how})")
    return mapping


# --------------------------------------------------------------------------------------------
# Keras fit capture


def install_keras(state: State, flavours: list) -> None:
    for flavour in flavours:
        try:
            if flavour == "tf_keras":
                import tf_keras
                from tf_keras.src.engine import training, training_v1

                classes = [training.Model, training_v1.Model]
                callback_base = tf_keras.callbacks.Callback
            else:
                import keras

                classes = [keras.Model]
                callback_base = keras.callbacks.Callback
        except Exception as exc:  # pragma: no cover - depends on installed packages
            say(f"cannot hook {flavour}: {exc}")
            continue
        for cls in classes:
            _wrap_fit(cls, callback_base, flavour, state)
            _wrap_train_on_batch(cls, flavour, state)
            _wrap_predict(cls, flavour, state)


def _wrap_fit(cls, callback_base, flavour, state: State) -> None:
    original = getattr(cls, "fit", None)
    if original is None or getattr(original, "_tfmigrate", False):
        return
    import inspect

    signature = inspect.signature(original)

    def fit(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
            batch_size = bound.arguments.get("batch_size")
            x = bound.arguments.get("x")
            callbacks = list(bound.arguments.get("callbacks") or [])
        except TypeError:
            return original(self, *args, **kwargs)
        if batch_size is None and hasattr(x, "shape"):
            batch_size = 32
        if batch_size is None and hasattr(x, "element_spec"):
            try:
                spec = x.element_spec[0] if isinstance(x.element_spec, tuple) else x.element_spec
                batch_size = spec.shape[0]
            except Exception:
                batch_size = None
        callbacks.append(_make_callback(callback_base, flavour, state, batch_size, x,
                                        bound.arguments.get("validation_split") or 0.0))
        bound.arguments["callbacks"] = callbacks
        # A generator or a dataset is not shuffled by fit: its `shuffle=True` is nothing to turn off.
        streamed = hasattr(x, "__next__") or hasattr(x, "element_spec")
        if (state.args.in_order and "shuffle" in signature.parameters and bound.arguments.get("shuffle", True)
                and not streamed):
            # Keras 2 and Keras 3 shuffle arrays each epoch from different random streams (a
            # held-out Kaggle kernel's migration agreed for one epoch, then 20% apart): in order.
            from tfmigrate.verify.in_order import TURNED_OFF

            TURNED_OFF.append(f"fit(shuffle={bound.arguments.get('shuffle', True)!r})")
            bound.arguments["shuffle"] = False
        _FITTING[0] += 1
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            _FITTING[0] -= 1

    fit._tfmigrate = True
    setattr(cls, "fit", fit)


#: How many `fit` calls are running (a Keras 2 `fit_generator` may step through `train_on_batch`:
#: those steps are fit's, recorded by its callback).
_FITTING = [0]


def _wrap_train_on_batch(cls, flavour, state: State) -> None:
    """`model.train_on_batch(x, y)` called by the program (Keras-GAN's loops, warm-up steps before
    `fit`): each call one step, its loss what the call returns (the loss first, then the
    metrics); the model's weights are set from OLD's before the first step, as for `fit`."""
    original = getattr(cls, "train_on_batch", None)
    if original is None or getattr(original, "_tfmigrate", False):
        return

    def train_on_batch(self, x, *args, **kwargs):
        if _FITTING[0]:
            return original(self, x, *args, **kwargs)
        _weights_from_old_once(state, self, flavour, ready=self.built)
        start = time.perf_counter()
        result = original(self, x, *args, **kwargs)
        end = time.perf_counter()
        loss = result
        if isinstance(loss, dict):
            loss = loss.get("loss")
        elif isinstance(loss, (list, tuple)):
            loss = loss[0] if loss else None
        state.note("Keras train_on_batch: loss as the call returns it")
        state.record(loss, _rows(x), start, end, "keras")
        return result

    train_on_batch._tfmigrate = True
    setattr(cls, "train_on_batch", train_on_batch)


def _wrap_predict(cls, flavour, state: State) -> None:
    """`model.predict(...)` before any training (a GAN's generator making the discriminator's
    first fake batch): the weights are set from OLD's there, before they are first read."""
    original = getattr(cls, "predict", None)
    if original is None or getattr(original, "_tfmigrate", False):
        return

    def predict(self, *args, **kwargs):
        _weights_from_old_once(state, self, flavour, ready=self.built)
        return original(self, *args, **kwargs)

    predict._tfmigrate = True
    setattr(cls, "predict", predict)


def _rows(x) -> int | None:
    """The examples in a batch of arrays (or a list or dict of them)."""
    if isinstance(x, dict):
        x = next(iter(x.values()), None)
    elif isinstance(x, (list, tuple)):
        x = x[0] if x else None
    try:
        return int(x.shape[0])
    except Exception:
        return None


def _trained_rows(total: int, validation_split: float) -> int:
    """How many of ``total`` rows Keras 3's `fit(..., validation_split=...)` trains on, by its own
    split (3.15 rounds down; a count one off read a partial batch's loss 12% off)."""
    try:
        import numpy
        from keras.src.trainers.data_adapters.array_slicing import train_validation_split

        (trained,), _ = train_validation_split((numpy.empty((total, 1)),), validation_split=validation_split)
        return int(trained.shape[0])
    except Exception:  # another Keras: its documented split
        return math.floor(total * (1.0 - validation_split))


def _make_callback(base, flavour, state: State, batch_size, x, validation_split: float = 0.0):
    total = None
    try:
        total = int(x.shape[0]) if hasattr(x, "shape") else None
    except Exception:
        total = None
    if total and validation_split:  # the examples fit trains on (read by the running mean's recovery below)
        total = _trained_rows(total, validation_split)

    class Capture(base):
        def __init__(self):
            super().__init__()
            self.previous_mean = 0.0
            self.t_prev = None

        def on_train_begin(self, logs=None):
            _weights_from_old_once(state, self.model, flavour)
            self.t_prev = time.perf_counter()

        def on_epoch_begin(self, epoch, logs=None):
            self.previous_mean = 0.0
            self.seen = 0
            self.tracked = (0.0, 0.0)

        def on_train_batch_begin(self, batch, logs=None):
            self.t_prev = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            logs = logs or {}
            examples = logs.get("size")
            if examples is None and batch_size:
                examples = batch_size
                if total:
                    per_epoch = -(-total // batch_size)
                    if batch % per_epoch == per_epoch - 1 and total % batch_size:
                        examples = total % batch_size
            value = logs.get("loss")
            loss = None
            if value is not None:
                value = float(value)
                tracked = _loss_tracked(self.model)
                if "size" in logs:          # graph-mode loop: the batch's own loss
                    loss = value
                    state.note("Keras fit: loss per batch as reported by the graph-mode loop")
                elif tracked is not None and tracked[1] > self.tracked[1]:
                    # Keras 3's loss tracker: the batch's summed loss over its examples, exactly
                    # (a dataset's partial batch in mid-run was read as a whole one otherwise).
                    examples = tracked[1] - self.tracked[1]
                    loss = (tracked[0] - self.tracked[0]) / examples
                    self.tracked = tracked
                    state.note("Keras fit: batch loss read from Keras's loss tracker (its total and count)")
                else:                       # TF2 loops: running mean over the epoch, by examples
                    loss = _batch_loss(value, self.previous_mean, self.seen, examples, batch)
                    self.previous_mean = value
                    self.seen += examples or 0
                    state.note("Keras fit: batch loss recovered from the running mean fit reports")
            state.record(loss, examples, self.t_prev, now, "keras")

    return Capture()


def _loss_tracked(model) -> tuple[float, float] | None:
    """Keras 3's running loss of the epoch as (total, count): the loss summed over the examples
    so far, and their number; None where the model keeps no such tracker (tf_keras)."""
    tracker = getattr(model, "_loss_tracker", None)
    total, count = getattr(tracker, "total", None), getattr(tracker, "count", None)
    if total is None or count is None:
        return None
    try:
        import numpy as np

        return float(np.asarray(total)), float(np.asarray(count))
    except Exception:
        return None


def _batch_loss(mean: float, previous_mean: float, seen: int, examples: int | None, batch: int) -> float:
    """One batch's loss from the epoch's running mean after it (``mean``) and before it: Keras 3
    weighs each batch by its examples (a partial last batch counts less), so by examples where
    they are known, else as batches of one size."""
    if examples:
        return ((seen + examples) * mean - seen * previous_mean) / examples
    return (batch + 1) * mean - batch * previous_mean


def _weights_from_old_once(state: State, model, flavour, ready: bool = True) -> None:
    """The program's Keras weights set from OLD's (dumped by OLD) at the first of its models'
    `fit`, `train_on_batch` or `predict` calls where they exist (``ready``: a model called
    directly may not be built yet)."""
    if not state.weights_done and ready:
        state.weights_done = True
        handle_keras_weights(state, model, flavour)


def handle_keras_weights(state: State, model, flavour) -> None:
    import numpy as np

    # The frozen layers' weights too (`layer.trainable = False` before compile, a fine-tuning
    # program's): their initial values differed between the runs, and the losses from step 0.
    # (Moving statistics come along; both runs start them alike. Neither Keras lists seed states.)
    variables = list(model.trainable_weights) + list(model.non_trainable_weights)
    named: dict = {}
    for var in variables:
        name = getattr(var, "path", None) or var.name
        named.setdefault(canonical_name(name), var)
    graph_mode = flavour == "tf_keras" and not _executing_eagerly()
    args = state.args
    if args.dump_weights:
        every = {**named, **_other_models_weights(model, flavour)}
        if graph_mode:
            from tf_keras import backend

            values = backend.batch_get_value(list(every.values()))
        else:
            values = [np.asarray(v.numpy()) for v in every.values()]
        save_weights(args.dump_weights, dict(zip(every, values)), state)
    elif args.load_weights:
        saved = load_weights(args.load_weights)
        if saved is None:
            return
        own = {k: v for k, v in saved.items() if not k.startswith(_OTHER)}
        # Only where OLD had other models: the scan walks every live object (and in NEW meets
        # Keras 3's inner functional graphs of each Sequential, which hold the same weights).
        others = _other_models_weights(model, flavour) if len(own) < len(saved) else {}
        mapping = {k: (named[k], saved[s]) for k, s in match_weights(
            own, {k: tuple(v.shape) for k, v in named.items()}, state).items()}
        matched = {k: (var, saved[k]) for k, var in others.items()
                   if k in saved and tuple(saved[k].shape) == tuple(var.shape)}
        mapping.update(matched)
        state.weights.update({"other_models": len(matched), "other_models_unmatched": sorted(set(others) - set(matched))})
        if graph_mode:
            from tf_keras import backend

            backend.batch_set_value(list(mapping.values()))
        else:
            for var, value in mapping.values():
                var.assign(value)


#: Where the saved weights of the program's other models are named.
_OTHER = "other models/"


def _other_models_weights(model, flavour) -> dict:
    """The weights of the program's other Keras models (a GAN's generator, which predicts the
    discriminator's batches before it trains), named by layer and weight (`dense_2/kernel`:
    Keras 2 and 3 number their layers alike, in the order they are made) where that is unique;
    else the runs would start them apart, and differ from the step that reads them."""
    import gc

    if flavour == "tf_keras":
        from tf_keras.src.engine.training import Model
    else:
        from keras import Model
    seen = {id(v) for v in model.weights}
    found: dict = {}
    twice: set = set()
    for other in gc.get_objects():
        # (the type itself: `isinstance` may ask a lazily loaded module for its class, and load it)
        if not issubclass(type(other), Model) or other is model:
            continue
        for var in other.weights:
            if id(var) in seen:
                continue
            seen.add(id(var))
            key = _OTHER + "/".join(canonical_name(getattr(var, "path", None) or var.name).split("/")[-2:])
            twice.update({key} & set(found))
            found[key] = var
    return {key: var for key, var in found.items() if key not in twice}


# --------------------------------------------------------------------------------------------
# TF2 custom training loops: a tf.function train step called from the program


class EagerVariables:
    """The variables the program creates, seen through a variable creator scope entered before
    it starts (the outermost creator, so MirroredStrategy's per-device components come one by
    one, the primary first)."""

    def __init__(self, tf):
        self.created: list = []

        def creator(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            self.created.append(variable)
            return variable

        self.scope = tf.variable_creator_scope(creator)
        self.scope.__enter__()

    def trainable(self) -> dict:
        """canonical name -> [the variable and its per-replica components], in creation order."""
        groups: dict[str, list] = {}
        last = None
        for variable in self.created:
            if not getattr(variable, "trainable", False):
                continue
            name = canonical_name(variable.name)
            if last is not None and re.search(r"/replica_\d+(:\d+)?$", variable.name) and last[0] == name:
                groups[last[1]].append(variable)
                continue
            key, count = name, 1
            while key in groups:  # Keras 3 names a kernel `kernel` in every layer
                key, count = f"{name}#{count}", count + 1
            groups[key] = [variable]
            last = (name, key)
        return groups


def handle_eager_weights(state: State, variables: EagerVariables) -> None:
    import numpy as np

    groups = variables.trainable()
    args = state.args
    if args.dump_weights:
        save_weights(args.dump_weights, {k: np.asarray(v[0].numpy()) for k, v in groups.items()}, state)
    elif args.load_weights:
        saved = load_weights(args.load_weights)
        if saved is None:
            return
        mapping = match_weights(saved, {k: tuple(v[0].shape) for k, v in groups.items()}, state)
        for name, source in mapping.items():
            for component in groups[name]:
                component.assign(saved[source])


def _examples(args) -> int | None:
    """The global batch of a train step's first argument: a tensor, or per-replica values."""
    import tensorflow as tf

    leaves = tf.nest.flatten(args)
    if not leaves:
        return None
    first = leaves[0]
    parts = getattr(first, "values", None)
    parts = parts if isinstance(parts, tuple) else (first,)
    try:
        return sum(int(part.shape[0]) for part in parts)
    except (TypeError, IndexError, AttributeError):
        return None


def install_tf_function(tf, state: State) -> None:
    """Record each call of a ``tf.function`` that the program makes at its top level (eagerly)
    and that returns a scalar: a training step, its loss the scalar. The initial weights are
    dumped or loaded before the first such call."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    variables = EagerVariables(tf)
    original = polymorphic_function.Function.__call__

    def __call__(self, *args, **kwargs):
        if not (tf.executing_eagerly() and _is_user_code(sys._getframe(1).f_globals)):
            return original(self, *args, **kwargs)
        if not state.weights_done:
            state.weights_done = True
            handle_eager_weights(state, variables)
        t_start = time.perf_counter()
        result = original(self, *args, **kwargs)
        shape = getattr(result, "shape", None)
        if shape is None or len(shape) != 0:
            return result
        loss = float(result)  # waits for the step, so the time below is the step's
        state.record(loss, _examples(args), t_start, time.perf_counter(), "tf.function")
        return result

    polymorphic_function.Function.__call__ = __call__


def _executing_eagerly() -> bool:
    import tensorflow as tf

    return tf.compat.v1.executing_eagerly_outside_functions()


# --------------------------------------------------------------------------------------------
# stdout tee for --loss-regex


class LineWatcher:
    def __init__(self, stream, state: State):
        self.stream = stream
        self.state = state
        self.buffer = ""

    def write(self, text):
        written = self.stream.write(text)
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            match = self.state.regex.search(line)
            if match:
                group = match.group("loss") if "loss" in match.groupdict() else (
                    match.group(1) if match.groups() else match.group(0))
                try:
                    value = float(group)
                except (TypeError, ValueError):
                    continue
                self.stream.flush()
                self.state.record_regex(value)
        return written

    def __getattr__(self, name):
        return getattr(self.stream, name)


# --------------------------------------------------------------------------------------------
# main


def print_program_traceback(exc: BaseException) -> None:
    """The traceback without the harness's and runpy's own frames."""
    here = os.path.abspath(__file__)
    tb = exc.__traceback__
    while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) == here
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
    sys.stderr.flush()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m tfmigrate.verify.harness")
    parser.add_argument("program")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--legacy", action="store_true")
    parser.add_argument("--keras", action="store_true")
    parser.add_argument("--keras2", action="store_true")  # TF1 layers through tf.compat.v1 (see detect.py)
    parser.add_argument("--restore-multi-gpu-model", action="store_true")  # a TF 2.0-2.3 Keras program (detect.py)
    parser.add_argument("--dump-weights")
    parser.add_argument("--load-weights")
    parser.add_argument("--loss-regex")
    parser.add_argument("--in-order", action="store_true")  # input pipelines read in order (see in_order.py)
    parser.add_argument("--no-dropout", action="store_true")  # Keras dropout layers off (see no_dropout.py)
    parser.add_argument("program_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.program_args and args.program_args[0] == "--":
        args.program_args = args.program_args[1:]
    return args


def main(argv=None) -> int:
    """Set the process up, run the program, write what was measured to ``--out`` and end the process."""
    global STATE
    args = parse_args(sys.argv[1:] if argv is None else argv)
    state = STATE = State(args)
    result = {"program": os.path.abspath(args.program), "legacy": args.legacy, "ok": False,
              "error": None, "finished": None}
    started = time.perf_counter()
    try:
        _set_up(state, result)
        result["setup_s"] = time.perf_counter() - started
        result["finished"] = _run_program(args)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - everything is reported
        if isinstance(exc, KeyboardInterrupt):
            result["error"] = "interrupted"
        else:
            print_program_traceback(exc)
            result["error"] = f"{type(exc).__name__}: {exc}"
    _write_result(state, result, started)
    os._exit(0 if result["ok"] else 1)


def _set_up(state: State, result: dict) -> None:
    """Seeds, devices, the TF1 shim and the capture hooks, before the program imports anything."""
    args = state.args
    if args.legacy or args.keras2:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    random.seed(args.seed)
    import numpy as np

    np.random.seed(args.seed)
    import tensorflow as tf

    result["devices"] = setup_devices(tf, args.devices)
    tf.random.set_seed(args.seed)
    tf.config.experimental.enable_op_determinism()
    _seed_new_graphs(args)
    if result["devices"]["rewrite"]:
        install_device_rewrite(tf, args.devices)
        install_session_devices()
    if args.legacy:
        _enter_legacy_mode(tf, args)
    elif args.restore_multi_gpu_model:
        _restore_multi_gpu_model()
    if args.in_order:
        from tfmigrate.verify import in_order

        in_order.install(_is_user_code)
    if args.no_dropout and (args.keras or args.keras2 or args.restore_multi_gpu_model):
        from tfmigrate.verify import no_dropout

        no_dropout.install(legacy_keras=bool(args.legacy or args.keras2), from_program=_is_user_code)
    _install_capture(tf, state)
    result["versions"] = {"tensorflow": tf.__version__, "numpy": np.__version__,
                          "python": platform.python_version()}
    if state.regex is not None:
        sys.stdout = LineWatcher(sys.stdout, state)
    sys.argv = [args.program] + list(args.program_args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.program)))


def _seed_new_graphs(args) -> None:
    """Give every new ``tf.Graph`` the run's seed as its graph-level seed."""
    from tensorflow.python.framework import ops

    graph_init = ops.Graph.__init__

    def seeded_graph_init(self, *a, **k):
        graph_init(self, *a, **k)
        if type(self) is ops.Graph:
            self.seed = args.seed

    ops.Graph.__init__ = seeded_graph_init


def _enter_legacy_mode(tf, args) -> None:
    """Turn v2 behaviour off and install the TF1 shim (with Keras 2 for Keras programs)."""
    keras_module = None
    tf.compat.v1.disable_v2_behavior()
    tf.compat.v1.set_random_seed(args.seed)
    if args.keras:
        import tf_keras

        tf_keras.utils.multi_gpu_model = multi_gpu_model
        keras_module = tf_keras
    install_tf1_shim(tf, keras_module)
    say("legacy mode: `import tensorflow` is tensorflow.compat.v1 with v2 behaviour disabled"
        + ("; Keras is Keras 2 (tf_keras)" if args.keras else ""))


def _restore_multi_gpu_model() -> None:
    """A TF 2.0-2.3 Keras program: TF2 as it is, Keras 2 (``tf_keras``) with `multi_gpu_model`
    back (built as Keras 2 built it, see :func:`multi_gpu_model`) for `import keras` and `tf.keras`."""
    import tf_keras

    tf_keras.utils.multi_gpu_model = multi_gpu_model
    install_import_shim(None, tf_keras)
    say("TF2 as written; Keras is Keras 2 (tf_keras) with multi_gpu_model restored (a TF 2.0-2.3 program)")


def _install_capture(tf, state: State) -> None:
    """Hook the optimizer, Session.run, top-level tf.functions and Keras fit to record steps."""
    args = state.args
    recorder = Recorder(tf, state)
    recorder.install_optimizer()
    recorder.install_session()
    if not args.legacy:
        install_tf_function(tf, state)
    if args.keras:
        flavours = ["tf_keras"]
        if not args.legacy and os.environ.get("TF_USE_LEGACY_KERAS") not in ("1", "true", "True"):
            flavours.append("keras")
        install_keras(state, flavours)


def _run_program(args) -> str:
    """Run the program as ``__main__``; how it finished (a nonzero exit status propagates)."""
    try:
        runpy.run_path(args.program, run_name="__main__")
        return "program ended"
    except StopRun:
        return f"stopped after {args.steps} steps"
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0):
            raise
        return "program exited"


def _write_result(state: State, result: dict, started: float) -> None:
    """Add the captured steps, notes and weights to ``result`` and write it as JSON to ``--out``."""
    args = state.args
    steps = state.regex_steps if state.regex is not None else state.steps
    if args.in_order:
        from tfmigrate.verify.in_order import TURNED_OFF

        result["shuffles_off"] = list(TURNED_OFF)
    if args.no_dropout:
        from tfmigrate.verify.no_dropout import TURNED_OFF as DROPOUT_OFF

        result["dropout_off"] = list(DROPOUT_OFF)
    if state.regex is not None and state.steps:
        # timing and batch sizes from the training runs we saw, loss from the printed lines
        result["train_steps"] = state.steps
    result.update({
        "steps": steps, "notes": state.notes, "weights": state.weights,
        "loss_source": "regex" if state.regex is not None else "+".join(sorted(state.sources)) or None,
        "wall_s": time.perf_counter() - started,
    })
    try:
        sys.stdout.flush()
    except Exception:
        pass
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1, default=str)
    sys.stderr.flush()


if __name__ == "__main__":
    main()
