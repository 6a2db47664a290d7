from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from tfmigrate.analysis.batch_splits import keras_parallel_class, keras_parallel_helper
from tfmigrate.analysis.keras_batch_norm import frozen_batch_norm, whole_batch_steps
from tfmigrate.analysis.keras_guards import StatementBlocks, fallback_guards, single_assign
from tfmigrate.analysis.keras_losses import masked_steps, model_tensors_in_losses
from tfmigrate.analysis.passed_models import passed_models, returned_models
from tfmigrate.cst.callargs import argument, has_star_args, is_none, is_true, keyword_is, method_call
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import (
    blank_lines_unindented, contains, enclosing, find, init_of, module_parents, placed_after_imports, single_small,
)
from tfmigrate.rewrites.mirrored import is_docstring
from tfmigrate.rewrites.tower_code import functions_called
from tfmigrate.rewrites.keras3_batch_steps import TRAIN_SPLIT, split_batch_steps
from tfmigrate.rewrites.keras3_losses import on_whole_batch_function, per_example_losses, whole_batch_functions
from tfmigrate.rewrites.keras3_predict import prediction_functions, predictions
from tfmigrate.rewrites.keras3_session import session_setup
from tfmigrate.rewrites.keras3_generators import batches_in_order_class, generator_argument, generator_fits
from tfmigrate.rewrites.keras3_leftovers import (
    GENERATOR_METHODS, TF2_SPELLINGS, accuracy_log_names, backend_calls, backend_functions, boolean_inputs,
    callback_models_set, categorical_dtypes, checkpoint_periods, continuation_lines, frozen_after_compile,
    function_aliases, generator_methods, integer_sizes, made_within, metric_label_casts, model_keywords, module_paths,
    output_metrics, period_checkpoint_class, single_output_targets, tf2_spellings, uses_period_checkpoint,
    weight_file_renames, weighted_named_targets,
)
from tfmigrate.rewrites.keras3_optimizers import (
    OPTIMIZERS, compiled_optimizer, keras2_step_classes, learning_rate_reads, optimizer_arguments,
    replaced_optimizer_names, shared_optimizer, tf1_compiled_optimizers,
)
from tfmigrate.rule import Edit, FixSafety, ImportItem, Invalid, Rule
from tfmigrate.tf_api import tf1_only
from tfmigrate.cst.walker import visit_read_only

#: Canonical names (tfmigrate/names.py folds keras.utils.training_utils,
#: keras.utils.multi_gpu_utils, tf.keras, tensorflow.python.keras, tf.compat.v1.keras and
#: tensorflow._api.v1.keras into this one).
MULTI_GPU_MODEL = "keras.utils.multi_gpu_model"
FIT_METHODS = ("fit", "fit_generator")


#: multi_gpu_model(model, gpus=None, cpu_merge=True, cpu_relocation=False)
PARAMS = ("model", "gpus", "cpu_merge", "cpu_relocation")
#: What clears Keras's global state (`K.clear_session()`).
CLEAR_SESSION = ("keras.backend.clear_session", "tensorflow.keras.backend.clear_session")
#: Model.fit / fit_generator positional parameters up to batch_size.
FIT_PARAMS = {"fit": ("x", "y", "batch_size"), "fit_generator": ()}
#: What TF1-mode Keras (tf_keras's v1 training loop) raises NotImplementedError (or ValueError) on
#: under a distribution strategy: methods, and keyword arguments of `fit` and `compile`.
TF1_STRATEGY_UNSUPPORTED_METHODS = ("train_on_batch", "test_on_batch", "predict_on_batch")
TF1_STRATEGY_UNSUPPORTED_KEYWORDS = {"fit": ("class_weight",),
                                     "compile": ("sample_weight_mode", "weighted_metrics", "target_tensors")}
#: Calls on the model after which `compile` is no longer moved under the scope.
USES = ("fit", "fit_generator", "evaluate", "evaluate_generator", "predict", "predict_generator",
        "train_on_batch", "test_on_batch", "predict_on_batch", "save", "save_weights")


def _method_call(statement: cst.BaseStatement) -> tuple[str, str] | None:
    """``obj.method(...)`` as the only statement of a line: (obj, method)."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    small = statement.body[0]
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        func = small.value.func
        if isinstance(func, cst.Attribute) and dotted_name(func.value) is not None:
            return dotted_name(func.value), func.attr.value
    return None


def _references(node: cst.CSTNode) -> set[str]:
    """The names and dotted attributes of names (`self.parallel`) ``node`` mentions."""
    return {dotted for n in find(node, cst.Name, cst.Attribute) if (dotted := dotted_name(n)) is not None}


def _returns_call(statement: cst.BaseStatement, call: cst.Call) -> bool:
    """Whether ``statement`` returns ``call``'s result, alone or in a tuple (`return template,
    multi_gpu_model(template, gpus=n)`)."""
    small = single_small(statement)
    if not isinstance(small, cst.Return) or small.value is None:
        return False
    values = [e.value for e in small.value.elements] if isinstance(small.value, cst.Tuple) else [small.value]
    return any(value is call for value in values)


def _unpacked(statement: cst.BaseStatement) -> set[str]:
    """The names a line unpacks a builder's results into (`model, test_func = build_crnn()`, the
    training and prediction models of CTC and YOLO code)."""
    small = single_small(statement)
    if not isinstance(small, cst.Assign) or len(small.targets) != 1:
        return set()
    target = small.targets[0].target
    elements = target.elements if isinstance(target, (cst.Tuple, cst.List)) else []
    return {name for element in elements if (name := dotted_name(element.value)) is not None}


#: Builtins that compute data, and make no layer.
_DATA_BUILTINS = {"len", "int", "float", "str", "tuple", "list", "dict", "set", "sorted", "max", "min", "sum", "range",
                  "zip", "enumerate", "abs", "round"}
#: Modules whose functions compute data or paths, never a layer (`os.path.join(TMP, 'model.h5')`).
_DATA_MODULES = ("numpy.", "os.", "math.", "json.", "pickle.", "random.", "glob.", "time.", "datetime.")


@dataclass
class _Placed:
    """Where one `multi_gpu_model` line's edit goes, as :meth:`MultiGpuModel._edit` works it out."""

    call: cst.Call
    body: tuple  # the statements of the block the line (or its guard) is in
    index: int  # the line's (or guard's) position there
    last: int  # the `compile` right after it, else ``index``
    lines: list  # the statements from ``index`` to ``last`` as they run under the scope
    strategy: str  # the name the strategy is bound to
    devices: str  # MirroredStrategy's arguments
    blocks: StatementBlocks
    keras3: dict  # what the module changes to train the same on Keras 3


class MultiGpuModel(Rule):
    code = "TFM201"
    name = "multi-gpu-model"
    summary = "Keras `multi_gpu_model(...)` replicates a model by splitting each batch across GPUs"
    triggers = ("multi_gpu_model", "Lambda")  # Lambda: a hand-written `make_parallel` helper
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        Calls of Keras' `multi_gpu_model(model, gpus=N)`, however it was imported:
        `from keras.utils import multi_gpu_model` (also under another name),
        `keras.utils.training_utils` and `keras.utils.multi_gpu_utils` (Keras 2.0/2.1),
        `tf.keras.utils`, `tf.compat.v1.keras.utils`, `tensorflow.python.keras.utils.multi_gpu_utils`,
        `tensorflow._api.v1.keras.utils`, and imports made inside `try`/`except ImportError` or
        `if` branches (any of the imports of the name counts).
        A function of your own that happens to be called `multi_gpu_model` and is not imported
        from Keras is not reported (a split/concat helper of your own is TFM105's business).
        Calls of a hand-written Keras `make_parallel(model, gpu_count)` of the module (the
        keras-extras gist: a tower loop slicing each input with `Lambda` layers, a `Model`
        returned around the template's inputs) are reported too, and so are constructions of a
        `Model` subclass of the module that does the same around the template (Mask R-CNN's
        `ParallelModel(model, gpu_count)`): the helper does what `multi_gpu_model` does, and
        TFM105 finds its slicing.
    """
    why = """
        `multi_gpu_model` was removed in TensorFlow 2.4 (and from standalone Keras 2.4). It
        copies the model onto each GPU, slices every input batch with a `Lambda` layer and
        concatenates the outputs on the CPU, so the "parallel" model is a different model
        object from the one you save, and the CPU merge limits scaling.
        `tf.distribute.MirroredStrategy` replaces it: build and compile the *template* model
        inside `strategy.scope()` and call `fit` on it directly. The batch size you pass to
        `fit` stays the global batch size, split across replicas exactly as before
        (256 on 8 GPUs is still 32 per GPU).
    """
    example = """
        from keras.utils import multi_gpu_model

        model = build_model()
        parallel_model = multi_gpu_model(model, gpus=8)
        parallel_model.compile(loss='categorical_crossentropy', optimizer='adam')
        parallel_model.fit(x, y, epochs=20, batch_size=256)
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile(loss='categorical_crossentropy', optimizer='adam')
        model.fit(x, y, epochs=20, batch_size=256)
    """
    fix_notes = """
        Unsafe. For `parallel = multi_gpu_model(model, gpus=N)` (any import path, `gpus` by
        keyword or position, `cpu_merge`/`cpu_relocation` dropped) where `model` is assigned
        earlier *in the same block* (or `self.parallel = multi_gpu_model(self.template, ...)` in a
        method): `strategy = tf.distribute.MirroredStrategy()` is inserted
        before that assignment, and everything from the assignment down to the
        `parallel.compile(...)` (or `model.compile(...)`) that follows moves, comments
        included, under `with strategy.scope():`. The parallel name is bound to the template
        (`parallel = model`), so `parallel.fit(...)`, `evaluate`, `predict` and callbacks keep
        working, with the same `batch_size`: it is the global batch under both. A template
        built under `with tf.device('/cpu:0'):` (the Keras docs' recipe, only needed for the
        CPU merge) is unwrapped. `gpus=[0, 1]` becomes
        `MirroredStrategy(devices=["/gpu:0", "/gpu:1"])`; a count (`gpus=4`, `gpus=n`) becomes
        `MirroredStrategy()`, which uses every visible GPU (limit them with
        `CUDA_VISIBLE_DEVICES`). A fallback for fewer GPUs, `try: parallel = multi_gpu_model(...)`
        `except ValueError: parallel = model` (or, where the parallel model takes the template's
        name, a bare `except: pass`), is what the strategy does anyway and goes with the call;
        so does a parallel model made only for several GPUs (`if gpus > 1: model =
        multi_gpu_model(model, ...)`, or `... else: parallel = model`), and such a `try` inside
        such an `if`. The template built in a `with tf.device('/cpu:0'):` block and named
        after it (`self.model = model`) is built under the scope, the block unwrapped; a
        `self.parallel_model.compile(...)` in another method of the class (`train()`) runs,
        with the optimizer it makes, under `self.parallel_model.distribute_strategy.scope()`.
        `save_weights('w.h5')` (or `.hdf5`) becomes `'w.weights.h5'`, the only HDF5 name
        Keras 3 takes for weights, and so does the file of a `ModelCheckpoint(...,
        save_weights_only=True)` (or of a subclass of it), where the module names it, and a
        pattern a callback fills in and saves to (`path = self.pattern.format(epoch=epoch)`,
        the file passed where the callback is made). A flat
        `metrics=[...]` list of a model with several outputs (a `loss=` dict or list) is given
        to each output, as Keras 2 did and Keras 3 asks. In a module with an `Embedding`, Adam
        (Adamax, Adagrad, Adadelta) becomes a `DenseGradientAdam` subclass written after the
        imports, which adds up each row's gradients before it steps: Keras 3 squares each
        occurrence's gradient of a row seen more than once in a batch, Keras 2 their sum. A callback of the module that swaps
        in the template (`self.model = self.original_model`, the widely copied
        `ModelCheckpointMGPU`) sets it with `self.set_model(...)`: Keras 3's `Callback.model`
        cannot be assigned. A hand-written helper (or `ParallelModel` class, or a `ModelMGPU`
        class whose `__init__` makes `multi_gpu_model` around the template and takes its
        attributes) called once goes with its call, and the imports only it read (`Lambda`);
        used anywhere else, it is refused with the line.
        A template the function with `multi_gpu_model` receives as a parameter (`def
        train(model, ...)`, Keras's mnist_transfer_cnn with GPUs added) is built under the scope
        where each caller builds it (once for calls that pass the same model), and the function
        compiles it under the model's own strategy (`with model.distribute_strategy.scope():`,
        Keras 3 makes the optimizer where `compile` runs); a function passed around, a caller
        passing an expression, or a model not built in the caller's block is refused, naming it.
        A function that returns the parallel model (`return template, multi_gpu_model(template,
        gpus=n)`, or a name bound to it) for its callers to compile (`get_model()` in an
        argparse `train.py`) builds the template under the scope and returns it in the parallel
        model's place; each caller, which must bind what it returns to names, compiles under the
        model's own strategy, with the statements that make what `compile` reads (the optimizer).
        A second parallel model built in the same block (a GAN's combined model, which holds
        the discriminator) is built under the strategy made for the first: models sharing layers
        need one strategy.
        The migrated program runs on Keras 3, so the fix moves Keras 2's spellings onto it:
        optimizer `lr=` becomes `learning_rate=` (and `.lr` `.learning_rate`), and arguments after
        the rate passed by position are named by Keras 2's order (`Adam(0.0002, 0.5)` is
        `Adam(0.0002, beta_1=0.5)`: the orders part after `epsilon`); Keras 2's lower-case aliases
        (`keras.optimizers.rmsprop(...)`) become the classes; `Adadelta()` and `Adamax()`
        made without a rate (or by name) get Keras 2's default rate (1.0 and 0.002, Keras 3's is
        0.001), and Adagrad becomes `Keras2Adagrad`, written into the module, which steps as Keras
        2's did (accumulators from zero, lr * g / (sqrt(a) + eps), 0.01 by default); a layer size NumPy computes
        (`Dense(np.prod(shape))`, an `Embedding` size bound to `np.max(x) + 1`) becomes `int(...)`,
        which Keras 3 requires; a model compiled and then frozen (`.trainable = False`, a GAN's
        discriminator before the combined model is compiled) trains through `train_as_compiled`,
        written into the module, which Keras 2's `train_on_batch` did (the weights trainable at its
        compile; Keras 3 reads the flag when it trains and trained none; its `fit` is refused); `decay=d`, which
        Keras 3 ignores with a warning, becomes the learning rate
        `InverseTimeDecay(lr, decay_steps=1, decay_rate=d)` (Keras 2's `lr / (1 + d * step)`); a
        zero `decay=` and `epsilon=None` go; backend math (`K.sum`, `K.square`, `K.flatten`) moves
        to `keras.ops`, and `K.ctc_batch_cost` and `K.function`, which Keras 3 has not, call
        functions of the same meaning written into the module; `to_categorical(...)` stays
        float32 (`.astype('float32')`: Keras 3 makes float64 labels); `Model(input=, output=)` takes `inputs=`, `outputs=`; Keras 2 module
        paths (`keras.layers.core`, `keras.utils.np_utils`) become the package above; a metric
        function compiled into the model casts the labels to the predictions' type first, as
        Keras 2 did; `ModelCheckpoint(..., period=1)` loses `period`, and another period saves
        through a `PeriodCheckpoint` class written into the module, which counts the epochs as
        Keras 2 did (Keras 3 counts `save_freq` in batches); another model's
        `fit_generator` becomes `fit` with its arguments named and no worker arguments;
        `tf.set_random_seed(n)` becomes `tf.random.set_seed(n)`, a TF1 optimizer compiled into the
        model (`compile(optimizer=tf.train.AdamOptimizer(0.001))`, TF 1.x's Keras guide; or a name
        bound to it that only `compile` reads) the Keras one of the same step
        (`tf.keras.optimizers.Adam(learning_rate=0.001, epsilon=1e-8)`; `MomentumOptimizer`,
        `GradientDescentOptimizer` as `SGD`), and a Keras session set-up
        (`tf.ConfigProto`, `tf.Session`, `set_session`) the `tf.config` settings of its options
        (memory growth, soft placement, log placement, thread counts), so that the program
        leaves TF1 mode. An optimizer that clips its gradients (`clipnorm=`, `clipvalue=`) becomes
        a `SummedClip<Name>` subclass that clips the gradients summed over the replicas, as the
        parallel model clipped them (Keras 3's own clips each replica's part before the sum).
        `train_on_batch` of a model with batch normalization becomes `train_split(model, ...)`,
        written into the module, which fits that one batch: Keras 3's `train_on_batch` under a
        strategy runs the whole batch on every replica, where the parallel model normalized each
        GPU's slice by its own statistics, as `fit`'s replicas do.
        A `decay=` in a module whose learning-rate callback (`ReduceLROnPlateau`,
        `LearningRateScheduler`) sets the rate becomes a `Decayed<Name>` subclass stepping at
        lr / (1 + decay * iterations) of the rate the callback set, as Keras 2 did (a schedule
        cannot be set). `K.variable(v)` becomes `keras.Variable(v, dtype=keras.config.floatx())`
        (Keras 2 made it in floatx unless told). `K.function([x, K.learning_phase()], ...)` becomes
        `backend_function([x], ..., learning_phase_at=1)`, which reads the mode from that place.
        The parallel model's `fit_generator(gen, ...)` becomes `BatchesInOrder.fit(model, gen,
        ...)`, a class written into the module: Keras 3's `fit` under a strategy opens an
        iterator to build the model and drops the batches it read ahead (fed a generator itself,
        it trained batches 0, 1, 6, 7, ... where Keras 2 trained 0, 1, 2, 3, ...), and refused a
        generator yielding lists; the class feeds a `tf.data.Dataset` whose iterators start at
        the first batch not trained yet (a validation generator's likewise), and reads a
        `keras.utils.Sequence` as Keras 2's enqueuer did (pass after pass, shuffled by `random`
        unless `shuffle=False`, `on_epoch_end()` after each pass); a one-output model's targets
        given by the output's name (`{'ctc': zeros}`), which Keras 3 fails on, are taken as the
        one target, as Keras 2 took them.
        The `multi_gpu_model` import is removed once unused (inside a
        `try`/`except ImportError` that leaves `pass` behind: delete it by hand).

        No fix where the template is not built in the same block or by the callers of the
        function (a model made in another function, a call inside an expression such as a
        list): the variables must be created under the scope, and only the code that
        creates the model can do that. The message then says where to put the scope. No
        fix either where the model trains from a Python generator (`fit_generator`) in TF1 mode:
        under a distribution strategy TF1-mode Keras trains only from `tf.data`. No fix in a module
        that keeps TF1 APIs (`tf.logging`, a session read by `sess.run`, a session option with no
        TF2 setting of the same meaning): it runs in TF1 mode, where Keras
        under a strategy validates and evaluates whole batches only (`validation_data=` of 96
        samples in batches of 30 failed), raises NotImplementedError for `class_weight=`, the
        `*_on_batch` methods and compile's `sample_weight_mode`, `weighted_metrics` and
        `target_tensors`, and trains a partial last batch as another loss, carrying the rest of
        the epoch into the next (101 samples in batches of 32 for 3 epochs ran 10 steps for 12):
        move the module to TF2 APIs first (`tf.random.set_seed`). In TF2, validation takes a
        partial batch; the last partial training batch of an epoch differs slightly (each
        replica averages its own unequal part where the parallel model averaged the merged
        batch); whole batches train the same.
        No fix where Keras 3 would not keep the program's meaning: optimizer arguments after the
        learning rate passed by position (Keras 2 and 3 order them differently); a `decay=` without a
        learning rate; a read of
        an optimizer's `decay`; Nadam (weights 1.7% apart after 20 steps; RMSprop, which Keras 3
        also steps otherwise, by g / sqrt(v + eps) where Keras 2 stepped by g / (sqrt(v) + eps),
        becomes a `Keras2RMSprop` subclass that steps as Keras 2's did); a backend function with
        no `keras.ops` equivalent; `keras.preprocessing.text` (gone); a loss that computes one
        value for the whole batch (see below) where the examples are weighted, or where the model
        steps by `train_on_batch` (Keras 3 runs the whole batch on every replica and would add
        it over them); an activity regularizer (the parallel model added
        it once per device slice); time steps masked (`Embedding(mask_zero=True)`, `Masking`) in
        a model with a per-step output (the parallel model averaged the loss over the batch's
        unmasked steps, Keras 3 over each replica's, then the replicas); a model compiled away
        from where it is made (but for another method's `self.` model), or returned to a caller
        that does not bind it to names or compiles it elsewhere (Keras 3 makes the optimizer
        where `compile` runs); `ImageDataGenerator`, gone from Keras 3; `sample_weight=` with targets given
        as a dict by output name (Keras 3.15 fails: "KeyError: 0"); layers frozen that surely
        hold batch normalization (all layers of an application built with it, a model whose
        builder makes it; Keras 3 runs a frozen `BatchNormalization` in inference mode, Keras 2
        normalized by the batch's statistics while training).
        A loss or metric that computes one value for the whole batch (a Dice or IoU loss dividing
        `K.sum`s with no `axis`; an RMSE's root of the batch's mean) was computed once on the
        parallel model's merged outputs, where MirroredStrategy computes it per replica, another
        loss (and Keras 3 adds a loss of one value over the replicas: twice the loss and the
        step). It is given (by name, as a lambda or as a factory's call) through an
        `on_whole_batch` function written into the module: each
        replica gathers the whole batch first (`all_gather`, whose gradient goes back to each
        replica's part) and a loss returns its share; checked on TF 2.21, the losses, metric and
        weights of one device on the whole batch, to float precision. A loss that is one bare
        mean (`return K.mean(...)`) is given per example instead (`axis=-1`, the same mean).
        Check the result with `tfmigrate verify`.
    """

    valid = [
        """
        import tensorflow as tf
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile(loss='mse', optimizer='sgd')
        model.fit(x, y, batch_size=256)
        """,
        """
        from mylib.parallel import multi_gpu_model
        parallel = multi_gpu_model(model, gpus=2)
        """,
        """
        def multi_gpu_model(model, gpus):
            return model
        parallel = multi_gpu_model(model, gpus=2)
        """,
    ]
    invalid = [
        Invalid(
            """
            from keras.utils import multi_gpu_model as mgm
            model = build_model()
            parallel = mgm(model, gpus=4)
            """,
            line=3,
        ),
        Invalid(
            """
            import tensorflow as tf
            parallel = tf.keras.utils.multi_gpu_model(model, 2)
            """,
            line=2,
        ),
        Invalid(
            """
            try:
                from keras.utils import multi_gpu_model
            except ImportError:
                from keras.utils.training_utils import multi_gpu_model
            parallel = multi_gpu_model(model, gpus=[0, 1])
            """,
            line=5,
        ),
        # Built by a function, guarded by `except ValueError` (fewer GPUs than asked): the
        # strategy replicates onto what there is, so the fallback is the whole of the fix.
        Invalid(
            """
            import tensorflow as tf
            from tensorflow.keras.utils import multi_gpu_model
            def train(x, y):
                model = build_model()
                try:
                    parallel = multi_gpu_model(model, gpus=2)
                except ValueError:
                    parallel = model
                    print('Training on one device')
                parallel.compile(loss='mse', optimizer='adam')
                parallel.fit(x, y)
            """,
            line=6,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            def train(x, y):
                strategy = tf.distribute.MirroredStrategy()
                with strategy.scope():
                    model = build_model()
                    parallel = model
                    parallel.compile(loss='mse', optimizer='adam')
                parallel.fit(x, y)
            """,
        ),
        # The same at a script's top level, the `try` logging after the call: the log stays.
        Invalid(
            """
            import tensorflow as tf
            model = build_model()
            try:
                parallel = tf.keras.utils.multi_gpu_model(model, gpus=2)
                print('Training on 2 GPUs')
            except ValueError:
                parallel = model
            parallel.compile(loss='mse', optimizer='adam')
            parallel.fit(x, y)
            """,
            line=4,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            strategy = tf.distribute.MirroredStrategy()
            with strategy.scope():
                model = build_model()
                parallel = model
                print('Training on 2 GPUs')
                parallel.compile(loss='mse', optimizer='adam')
            parallel.fit(x, y)
            """,
        ),
        # A hand-written `make_parallel` (the keras-extras gist), called once: the same fix, and the
        # helper goes, with the imports only it read.
        Invalid(
            """
            import tensorflow as tf
            from keras.layers import Lambda, concatenate
            from keras.models import Model, Sequential
            def make_parallel(model, gpu_count):
                outputs = []
                for i in range(gpu_count):
                    with tf.device('/gpu:%d' % i):
                        piece = Lambda(lambda x: x[i::gpu_count])(model.inputs[0])
                        outputs.append(model(piece))
                return Model(inputs=model.inputs, outputs=concatenate(outputs, axis=0))
            model = Sequential(layers)
            model = make_parallel(model, 2)
            model.compile(loss='mse', optimizer='sgd')
            model.fit(x, y, batch_size=64)
            """,
            line=12,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            from keras.models import Sequential
            strategy = tf.distribute.MirroredStrategy()
            with strategy.scope():
                model = Sequential(layers)
                model.compile(loss='mse', optimizer='sgd')
            model.fit(x, y, batch_size=64)
            """,
        ),
        # The Kaggle kernels' form: the parallel model takes the template's name, and a failure
        # passes (the template stays). A bare `except` is the same fallback.
        Invalid(
            """
            import tensorflow as tf
            from keras.utils.training_utils import multi_gpu_model
            model = get_model()
            try:
                model = multi_gpu_model(model, gpus=2)
            except:
                pass
            model.compile(loss='binary_crossentropy', optimizer='adam')
            model.fit(x, y, batch_size=64)
            """,
            line=5,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            strategy = tf.distribute.MirroredStrategy()
            with strategy.scope():
                model = get_model()
                model.compile(loss='binary_crossentropy', optimizer='adam')
            model.fit(x, y, batch_size=64)
            """,
        ),
        # A trainer class keeping the template and the parallel model on `self`.
        Invalid(
            """
            import tensorflow as tf
            from keras.utils import multi_gpu_model
            class Trainer:
                def __init__(self):
                    self.template = build_model()
                    self.parallel = multi_gpu_model(self.template, gpus=2)
                    self.parallel.compile(loss='mse', optimizer='adam')
                def train(self, x, y):
                    self.parallel.fit(x, y, batch_size=64)
            """,
            line=6,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            class Trainer:
                def __init__(self):
                    strategy = tf.distribute.MirroredStrategy()
                    with strategy.scope():
                        self.template = build_model()
                        self.parallel = self.template
                        self.parallel.compile(loss='mse', optimizer='adam')
                def train(self, x, y):
                    self.parallel.fit(x, y, batch_size=64)
            """,
        ),
        # The same `try` only where several GPUs are asked for (a Kaggle k-fold kernel): each
        # guard falls back to the template, so both go; the `try`'s log line stays.
        Invalid(
            """
            import tensorflow as tf
            from keras.utils import multi_gpu_model
            model = get_model(X.shape[1])
            if args.gpus > 1:
                try:
                    model = multi_gpu_model(model, gpus=args.gpus)
                    print('Training using {} GPUs..'.format(args.gpus))
                except ValueError:
                    print('Training using single GPU or CPU..')
            model.compile(loss='mse', optimizer='adam')
            model.fit(x, y, batch_size=64)
            """,
            line=6,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            strategy = tf.distribute.MirroredStrategy()
            with strategy.scope():
                model = get_model(X.shape[1])
                print('Training using {} GPUs..'.format(args.gpus))
                model.compile(loss='mse', optimizer='adam')
            model.fit(x, y, batch_size=64)
            """,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self._calls: list[tuple[cst.Call, str | None]] = []  # (call, name it is assigned to)
        self._assigned: dict[int, str] = {}  # id(call) -> target name
        self._fit_batch: dict[str, str] = {}  # model name -> batch_size text in its fit
        self._validated: dict[str, str] = {}  # model name -> its `fit` that validates (`parallel.fit`)
        self._tf1_unsupported: dict[str, str] = {}  # model name -> a use TF1-mode Keras refuses under a strategy
        self._names: set[str] = set()  # every Name in the module (to pick a free `strategy`)
        self._imports: dict[str, list[ImportItem]] = {}  # bound name -> the imports binding it
        self._weight_files: list[cst.Call] = []  # `x.save_weights(...)` / `x.load_weights(...)` calls
        self._checkpoints: list[cst.Call] = []  # `ModelCheckpoint(..., save_weights_only=True)` (or a subclass's)
        # hand-written `make_parallel` helpers of the module, and `ParallelModel` classes
        self._helpers: dict[str, cst.FunctionDef | cst.ClassDef] = {}
        self._helper_calls: list[cst.Call] = []  # calls of a module function by name (a helper's, maybe)

    def visit_Name(self, node: cst.Name) -> None:
        self._names.add(node.value)

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            module = self.context.module.code_for_node(alias.name)
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self._imports.setdefault(alias.asname.name.value, []).append(
                    ImportItem(module, alias=alias.asname.name.value))
            else:
                self._imports.setdefault(module.split(".")[0], []).append(ImportItem(module))

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return
        module = self.context.module.code_for_node(node.module)
        for alias in node.names:
            name = self.context.module.code_for_node(alias.name)
            bound = name
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                bound = alias.asname.name.value
            self._imports.setdefault(bound, []).append(ImportItem(module, name, None if bound == name else bound))

    def _code(self, node: cst.CSTNode) -> str:
        return self.context.module.code_for_node(node).strip()

    def _is_multi_gpu_model(self, call: cst.Call) -> bool:
        return MULTI_GPU_MODEL in self.imports.resolve_all(call.func)

    def visit_Assign(self, node: cst.Assign) -> None:
        target = dotted_name(node.targets[0].target) if len(node.targets) == 1 else None
        if target is None:
            return
        if isinstance(node.value, cst.Call):
            self._assigned[id(node.value)] = target
        elif isinstance(node.value, cst.IfExp):  # `multi_gpu_model(model, gpus=n) if n > 1 else model`
            for branch in (node.value.body, node.value.orelse):
                if isinstance(branch, cst.Call):
                    self._assigned[id(branch)] = target

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if keras_parallel_helper(self.context, node):
            self._helpers[node.name.value] = node

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if keras_parallel_class(self.context, node) or self._wraps_multi_gpu_model(node):
            self._helpers[node.name.value] = node

    def _wraps_multi_gpu_model(self, cls: cst.ClassDef) -> bool:
        """`class ModelMGPU(Model)` (from a Keras issue, widely copied): its `__init__(self,
        ser_model, gpus)` makes `multi_gpu_model(ser_model, gpus)` and takes its attributes, and
        its `__getattribute__` sends `save`/`load` to the template. Made around the template, it
        is the parallel model."""
        init = init_of(cls)
        params = [p.name.value for p in init.params.params] if init is not None else []
        if len(params) < 2:
            return False
        calls = [call for call in find(init, cst.Call) if self._is_multi_gpu_model(call)]
        return len(calls) == 1 and dotted_name(argument(calls[0], PARAMS, "model") or cst.Name("_")) == params[1]

    def visit_Call(self, node: cst.Call) -> None:
        if self._is_multi_gpu_model(node):
            self._calls.append((node, self._assigned.get(id(node))))
            return
        if isinstance(node.func, cst.Name):
            self._helper_calls.append(node)
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("save_weights", "load_weights"):
            self._weight_files.append(node)
        if any(keyword_is(arg, "save_weights_only", is_true) for arg in node.args):
            self._checkpoints.append(node)
        receiver = dotted_name(func.value) if isinstance(func, cst.Attribute) else None  # `model`, `self.parallel`
        if receiver is not None and func.attr.value in FIT_METHODS:
            batch = argument(node, FIT_PARAMS[func.attr.value], "batch_size")
            if batch is not None:
                self._fit_batch.setdefault(receiver, self._code(batch))
            if any(a.keyword is not None and a.keyword.value in ("validation_data", "validation_split") for a in node.args):
                self._validated.setdefault(receiver, self._code(func))
        if receiver is not None:
            unsupported = self._unsupported_under_strategy(node, func.attr.value)
            if unsupported is not None:
                self._tf1_unsupported.setdefault(receiver, unsupported)

    def leave_Module(self, original_node: cst.Module) -> None:
        helped = [call for call in self._helper_calls if call.func.value in self._helpers]  # type: ignore[attr-defined]
        if not self._calls and not helped:
            return
        blocks = StatementBlocks()
        visit_read_only(original_node, blocks)
        inside_helpers = {id(n) for c in helped  # type: ignore[attr-defined]
                          for n in find(self._helpers[c.func.value], cst.Call)}
        for call, target in self._calls:
            if id(call) in inside_helpers:
                continue  # reported, and deleted, with the call of the helper around it
            edit, blocker = self._edit(call, target, blocks)
            message = self._message(call, target)
            if blocker:
                message += f"; no automatic fix: {blocker}"
            self.report(call, message, edit=edit)
        for call in helped:
            self._report_helper_call(call, helped, blocks)

    def _report_helper_call(self, call: cst.Call, helped: list[cst.Call], blocks: StatementBlocks) -> None:
        """`model = make_parallel(model, 2)`, a hand-written helper that does what `multi_gpu_model`
        does (TFM105 finds its slicing): the same fix, and the helper goes with its one call."""
        name = call.func.value  # type: ignore[attr-defined]
        target = self._assigned.get(id(call))
        edit, blocker = self._edit(call, target, blocks)
        if edit is not None and sum(c.func.value == name for c in helped) != 1:  # type: ignore[attr-defined]
            edit, blocker = None, f"`{name}` is called more than once: rewrite each call by hand and delete the helper"
        other = next((n for n in find(self.context.module, cst.Name) if n.value == name and n is not call.func
                      and not contains(self._helpers[name], n)), None)
        if edit is not None and other is not None:
            edit, blocker = None, (f"`{name}` is also used on line {self.position(other).start.line}: rewrite the call "
                                   "by hand and delete the helper")
        if edit is not None:
            helper, *only_its = self._helper_and_its_functions(call)
            for function in (helper, *only_its):
                edit.changes[function] = cst.RemovalSentinel.REMOVE
            edit.title += f", and delete the helper `{name}`" + "".join(f" and `{f.name.value}`" for f in only_its)
            # What only the helper imported (`Lambda`, `Concatenate`) goes with it, where nothing else reads it.
            read = {n.value for n in find(self._helpers[name], cst.Name)}
            helper_imports = [item for bound in sorted(read & set(self._imports)) for item in self._imports[bound]]
            edit.remove_imports = list(edit.remove_imports) + helper_imports
        subject = (f"`{name}(...)` is a hand-written Keras `multi_gpu_model` (Lambda slices of the batch per GPU, "
                   "outputs concatenated)")
        if self._wraps_multi_gpu_model(self._helpers[name]):
            subject = f"`{name}(...)` wraps Keras `multi_gpu_model(...)`"
        message = f"{self._message(call, target, subject)}, and delete `{name}`"
        if blocker:
            message += f"; no automatic fix: {blocker}"
        self.report(call, message, edit=edit)

    def _helper_and_its_functions(self, call: cst.Call) -> list[cst.FunctionDef | cst.ClassDef]:
        """The hand-written helper ``call`` calls, if any, then the module's functions that only
        it reads (kuza55's `slice_batch`): they go with it."""
        helper = self._helpers.get(call.func.value) if isinstance(call.func, cst.Name) else None
        if helper is None:
            return []

        def compute() -> list:
            names = find(self.context.module, cst.Name)
            in_helper = {id(n) for n in find(helper, cst.Name)}
            read = {n.value for n in find(helper, cst.Name)}
            only_its = []
            for function in self.context.module.body:
                if not isinstance(function, cst.FunctionDef) or function is helper or function.name.value not in read:
                    continue
                own = in_helper | {id(n) for n in find(function, cst.Name)}
                if not any(n.value == function.name.value and id(n) not in own for n in names):
                    only_its.append(function)
            return [helper, *only_its]

        # Asked by the edit and by the report of the same call: worked out once.
        return self.context.memo(("tfm201.helper_and_its_functions", id(call)), compute)

    # --- the fix ------------------------------------------------------------------------
    def _edit(self, call: cst.Call, target: str | None, blocks: StatementBlocks) -> tuple[Edit | None, str | None]:
        template = argument(call, PARAMS, "model")
        model = dotted_name(template) if template is not None else None
        if has_star_args(call) or model is None:
            return None, "pass the template model by name (`multi_gpu_model(model, gpus=N)`)"
        if id(call) not in blocks.of_call:
            return None, "the call is not in a statement block"
        body, index = blocks.of_call[id(call)]
        guards = fallback_guards(self.context.module, blocks, body[index], target, model)
        guard = guards[-1] if guards else None
        if guard is not None:
            body, index = blocks.where(guard)
        built = self._construction(body, index, model)
        sites: list[tuple[tuple, int, int, str]] = []  # where the callers build a template passed in
        # Built under a strategy's scope already (the fix of another call wrapping it, one stage of
        # a fine-tuning script before): compiled under the model's own strategy, as a template passed in.
        under_strategy = built is None and self._built_under_strategy(call, model)
        if built is not None:
            built = self._first_layer_call(body, built)
        elif not under_strategy:
            sites, blocker = self._passed_template_sites(body[index], model, blocks)
            if blocker is not None:
                return None, blocker
        assigned = single_assign(body[index]) if body[index] is not guard else (target, call)
        if assigned is None and _returns_call(body[index], call):  # `return template, multi_gpu_model(template)`
            assigned = (None, call)
        wrapped = call
        if assigned is not None and self._template_otherwise(assigned[1], call, model):
            wrapped = assigned[1]  # the strategy runs on one GPU too: the whole choice is the template
        if assigned is None or assigned[1] is not wrapped:
            return None, (
                f"assign the parallel model on a line of its own (`parallel = multi_gpu_model({model}, ...)`), "
                f"or build and compile `{model}` under `strategy.scope()` by hand and use it in place of the parallel model"
            )
        returned_to, returned_blocker = self._returned_to(body, index, call, {model, target} - {None})
        models = {model, target, *(site[3] for site in sites), *(n for _, names in returned_to for n in names)} - {None}
        blocker = self._training_blocker(models)
        if blocker is not None:
            return None, blocker
        devices = self._devices(call)
        if devices is False:
            return None, "`gpus` is a list that is not a literal list of GPU ids; pass `devices=[...]` to MirroredStrategy by hand"
        strategy = next((n for n in ("strategy", "mirrored_strategy") if n not in self._names), None)
        if strategy is None:
            return None, "the names `strategy` and `mirrored_strategy` are both taken"
        keras3, keras3_imports, blocker = self._keras3_changes(models)
        if blocker is not None:
            return None, blocker
        last = self._compile_index(body, index, model, target)
        if last == index:  # not compiled here: where it is returned, the callers compile it
            if returned_blocker is not None:
                return None, returned_blocker
            outside = self._compiled_outside(body, {model, target} - {None}, returned=bool(returned_to))
            if outside is not None:
                return None, outside
        lines = self._parallel_lines_replaced(call, body, index, last, guards, target, model, wrapped, blocks)
        placed = _Placed(call, body, index, last, lines, strategy, devices, blocks, keras3)
        if sites or under_strategy:
            changes, imports, blocker = self._passed_template_changes(placed, model, sites)
        else:
            changes, imports, blocker = self._built_here_changes(placed, built, models)
        if blocker is not None:
            return None, blocker
        for line, names in returned_to:
            if not names:  # the caller drops what it returns
                continue
            compiled, blocker = self._compiles_elsewhere(blocks, [line], names, keras3)
            if last == index and (blocker is not None or not compiled):
                return None, blocker or (f"the model returned to line {self.position(line).start.line} is not compiled "
                                         "in that function: build and compile it under `strategy.scope()` by hand")
            changes.update(compiled if blocker is None else {})  # compiled again by the caller: under the strategy too
        changes = self._laid_over(keras3, changes)
        title = f"build and compile `{model}` under `{strategy}.scope()` of a MirroredStrategy"
        return Edit(changes, title, add_imports=imports + keras3_imports, remove_imports=self._removed_imports(call)), None

    @staticmethod
    def _laid_over(keras3: dict, changes: dict) -> dict:
        """The module's Keras 3 changes with the edit's own laid over them: a statement both
        change (the first after the imports, spaced below the classes written there, and made the
        strategy's creation) is the edit's, with the spacing; a statement the edit moves under the
        scope is moved (its Keras 3 changes made in the copy, :func:`made_within`)."""
        merged = dict(keras3)
        for node, new in changes.items():
            spaced = keras3.get(node)
            if isinstance(spaced, cst.CSTNode) and isinstance(new, cst.FlattenSentinel) and new.nodes:
                new = cst.FlattenSentinel([new.nodes[0].with_changes(leading_lines=spaced.leading_lines),
                                           *new.nodes[1:]])
            merged[node] = new
        return merged

    def _parallel_lines_replaced(self, call, body, index, last, guards, target, model, wrapped, blocks) -> list:
        """The statements from the `multi_gpu_model` line (or its guard) to the `compile` after it,
        as they run under the scope: the parallel model is the template itself."""
        line = body[index]
        lines: list[cst.BaseStatement] = []
        if guards and line is guards[-1]:  # the fallback (`except`, `else`) is what the strategy does: the template
            if target != model:
                lines.append(cst.parse_statement(f"{target} = {model}\n").with_changes(leading_lines=line.leading_lines))
            inner = next(s for s in guards[0].body.body if blocks.guarded.get(id(s)) is guards[0])
            for each in guards:  # what the guard logged around the call (`print('Training on GPUs')`)
                lines += [s for s in each.body.body if s is not inner]
                inner = each
        elif target != model:
            lines.append(line.deep_replace(wrapped, cst.parse_expression(model)))
        return lines + list(body[index + 1:last + 1])

    def _without_helper(self, call: cst.Call, statements: list) -> list:
        """``statements`` less a hand-written helper ``call`` calls, which goes with the call
        (_report_helper_call), not under the scope."""
        dropped = {id(function) for function in self._helper_and_its_functions(call)}
        return [statement for statement in statements if id(statement) not in dropped]

    def _built_here_changes(self, placed: _Placed, built: int, models: set) -> tuple[dict, list, str | None]:
        """The template built in the block of the `multi_gpu_model` line (from statement ``built``
        on): from its first layer to the `compile`, under the scope of a strategy made in place of
        the first statement: (changes, imports, blocker)."""
        body, last, keras3 = placed.body, placed.last, placed.keras3
        elsewhere, blocker = self._compiles_elsewhere(placed.blocks, body[built:last + 1], models, keras3)
        if blocker is not None:
            return {}, [], blocker
        built = self._optimizer_made(body, built, last)
        moved = [*self._built_unwrapped(self._without_helper(placed.call, body[built:placed.index])),
                 *self._without_helper(placed.call, placed.lines)]
        moved = [made_within(statement, keras3) for statement in moved]
        changes, imports, blocker = self._under_scope(body, body[built], moved, placed.strategy, placed.devices)
        if blocker is not None:
            return {}, [], blocker
        for statement in body[built + 1:last + 1]:
            changes[statement] = cst.RemovalSentinel.REMOVE
        changes.update(elsewhere)
        return changes, imports, None

    def _passed_template_sites(self, line: cst.BaseStatement, model: str,
                               blocks: StatementBlocks) -> tuple[list[tuple[tuple, int, int, str]], str | None]:
        """Where a template the function with the `multi_gpu_model` line receives as a parameter is
        built by its callers (`def train_model(model, ...)`, called with a model the module builds):
        each place once, as (the caller's block, its first layer statement, its construction, the
        name it is passed by). ([], why not) when it cannot be told."""
        by_hand = (f"create `strategy = tf.distribute.MirroredStrategy()` where `{model}` is built, build and "
                   f"compile it under `with strategy.scope():`, and use `{model}` in place of the parallel model")
        not_here = f"`{model}` is not built in this block (a parameter, or made elsewhere): {by_hand}"
        parents = module_parents(self.context)
        function = enclosing(line, parents, cst.FunctionDef)
        if function is None or model not in {p.name.value for p in find(function.params, cst.Param)}:
            return [], not_here
        if any(single_assign(s) and single_assign(s)[0] == model for s in find(function.body, cst.SimpleStatementLine)):
            return [], not_here  # the parameter is rebound in the function
        passed, why = passed_models(self.context.module, parents, function, model)
        if why is not None:
            return [], f"`{model}` is a parameter of `{function.name.value}`, and {why}: {by_hand}"
        sites: dict[int, tuple[tuple, int, int, str]] = {}
        for caller, name in passed:
            if id(caller) not in blocks.of_call:
                return [], (f"the call of `{function.name.value}` on line {self.position(caller).start.line} is "
                            "not in a statement block")
            body, index = blocks.of_call[id(caller)]
            built = self._construction(body, index, name)
            if built is None:
                return [], (f"`{name}`, passed to `{function.name.value}` on line {self.position(caller).start.line}, "
                            f"is not built in the caller's block: {by_hand}")
            first = self._first_layer_call(body, built)
            sites.setdefault(id(body[first]), (body, first, built, name))
        return list(sites.values()), None

    def _passed_template_changes(self, placed: _Placed, model: str, sites: list) -> tuple[dict, list, str | None]:
        """A template passed in: each caller builds it under a strategy's scope (``sites``, from
        :meth:`_passed_template_sites`), and the function compiles it under the model's own
        strategy (`model.distribute_strategy.scope()`: Keras 3 makes the optimizer where `compile`
        runs): (changes, imports, blocker)."""
        body, index, last, keras3 = placed.body, placed.index, placed.last, placed.keras3
        changes: dict = {}
        imports: list[ImportItem] = []
        for caller_body, first, built, name in sites:
            elsewhere, blocker = self._compiles_elsewhere(placed.blocks, caller_body[first:built + 1], {name}, keras3)
            if blocker is not None:
                return {}, [], blocker
            moved = [made_within(statement, keras3) for statement in self._built_unwrapped(caller_body[first:built + 1])]
            made, made_imports, blocker = self._under_scope(caller_body, caller_body[first], moved, placed.strategy,
                                                             placed.devices)
            if blocker is not None:
                return {}, [], blocker
            changes.update(made)
            changes.update(elsewhere)
            imports += made_imports
            for statement in caller_body[first + 1:built + 1]:
                changes[statement] = cst.RemovalSentinel.REMOVE
        start = self._optimizer_made(body, index, last) if last > index else index
        compiled = self._without_helper(placed.call, [*body[start:index], *placed.lines])
        compiled = [made_within(statement, keras3) for statement in compiled]
        if last > index and not self._in_a_scope(body[index]):
            scope = cst.parse_expression(f"{model}.distribute_strategy.scope()")
            inner = [compiled[0].with_changes(leading_lines=()), *compiled[1:]]
            compiled = [cst.With(items=[cst.WithItem(scope)], leading_lines=body[start].leading_lines,
                                 body=cst.IndentedBlock(body=[blank_lines_unindented(s) for s in inner]))]
        changes[body[start]] = cst.FlattenSentinel(compiled) if compiled else cst.RemovalSentinel.REMOVE
        for statement in body[start + 1:last + 1]:
            changes[statement] = cst.RemovalSentinel.REMOVE
        return changes, imports, None

    def _in_a_scope(self, statement: cst.BaseStatement) -> bool:
        """Whether ``statement`` sits right in a `with ....scope():` block (a recompile after
        freezing, wrapped by an earlier pass in `with model.distribute_strategy.scope():`)."""
        parents = module_parents(self.context)
        block = parents.get(id(statement))
        owner = parents.get(id(block)) if block is not None else None
        return isinstance(owner, cst.With) and any(method_call(item.item, "scope") for item in owner.items)

    def _under_scope(self, body, first: cst.BaseStatement, moved: list, strategy: str,
                     devices: str) -> tuple[dict, list, str | None]:
        """``first`` (of ``body``) replaced by the strategy's creation and ``moved`` under its
        scope, a Keras session the builder clears cleared before: (changes, imports, blocker).
        A strategy the block made before (a GAN's discriminator's, for the combined model that
        holds the discriminator) is used again: models sharing layers need one strategy."""
        cleared, changes, blocker = self._session_cleared(moved)
        if blocker is not None:
            return {}, [], blocker
        strategy_class, imports = self.tf_ref("tensorflow.distribute.MirroredStrategy")
        made = f"{self.context.module.code_for_node(strategy_class)}({devices})"
        existing = None if cleared else self._strategy_made_before(body, first, made)
        before = [*cleared, cst.parse_statement(f"{strategy} = {made}\n")] if existing is None else []
        scope = cst.With(
            items=[cst.WithItem(cst.parse_expression(f"{existing or strategy}.scope()"))],
            body=cst.IndentedBlock(body=[blank_lines_unindented(s) for s in moved]),
        )
        made_first = [*before, scope]
        made_first[0] = made_first[0].with_changes(leading_lines=first.leading_lines)
        changes[first] = cst.FlattenSentinel(made_first)
        return changes, imports, None

    def _strategy_made_before(self, body, first: cst.BaseStatement, made: str) -> str | None:
        """The name the statements of ``body`` above ``first`` bind the same strategy to
        (`strategy = tf.distribute.MirroredStrategy()`), else None."""
        name = None
        for statement in body:
            if statement is first:
                return name
            assigned = single_assign(statement)
            if assigned is not None and self._code(assigned[1]) == made:
                name = assigned[0]
        return None

    @staticmethod
    def _template_otherwise(value: cst.BaseExpression, call: cst.Call, model: str) -> bool:
        """`multi_gpu_model(model, gpus=n) if n > 1 else model` (a Kaggle kernel's): the parallel
        model on several GPUs, the template itself on one."""
        if not isinstance(value, cst.IfExp):
            return False
        branches = [value.body, value.orelse]
        return any(b is call for b in branches) and any(dotted_name(b) == model for b in branches)

    def _session_cleared(self, moved) -> tuple[list, dict, str | None]:
        """`K.clear_session()` first in a function the statements moved under the scope call
        (keras-yolo3's `create_model`): run under the scope, it reset what the scope had entered,
        and leaving the scope failed ("IndexError: pop from empty list"). It moves before the
        strategy is made, still before the model is built: (the calls, changes, blocker)."""
        cleared, changes = [], {}
        for function in functions_called(self, moved):
            body = list(function.body.body)
            for position, statement in enumerate(body):
                expression = single_small(statement)
                if not (isinstance(expression, cst.Expr) and isinstance(expression.value, cst.Call)
                        and self.imports.resolve(expression.value.func) in CLEAR_SESSION):
                    continue
                callers = [c for c in find(self.context.module, cst.Call)
                           if isinstance(c.func, cst.Name) and c.func.value == function.name.value]
                if len(callers) > 1 or position > (1 if is_docstring(body[0]) else 0):
                    return [], {}, (f"`{function.name.value}` clears the Keras session (line "
                                    f"{self.position(statement).start.line}) after other code or for another caller "
                                    "too, and under the strategy's scope that breaks the scope: clear it before "
                                    "making the strategy by hand")
                cleared.append(statement.with_changes(leading_lines=()))
                changes[statement] = cst.RemovalSentinel.REMOVE
        return cleared, changes, None

    def _built_unwrapped(self, statements) -> list[cst.BaseStatement]:
        """``statements`` (those that build the template), each `with tf.device('/cpu:0'):`
        block among them unwrapped: the strategy places the variables."""
        moved: list[cst.BaseStatement] = []
        for position, statement in enumerate(statements):
            # The first statement's comments go above the strategy (_under_scope); the first line
            # of an unwrapped block keeps its own comments, under the block's.
            above = statement.leading_lines if position else ()
            if isinstance(statement, cst.With) and self._is_cpu_device_scope(statement):
                inner = list(cst.ensure_type(statement.body, cst.IndentedBlock).body)
                moved += [inner[0].with_changes(leading_lines=(*above, *inner[0].leading_lines)), *inner[1:]]
            else:
                moved.append(statement.with_changes(leading_lines=above) if not position else statement)
        return moved

    def _keras3_changes(self, models: set) -> tuple[dict, list[ImportItem], str | None]:
        """What the module must change to train the same on Keras 3, which the migrated program
        runs on (:mod:`tfmigrate.rewrites.keras3_leftovers`): (changes, imports, blocker)."""
        module = self.context.module
        changes, imports, blocked = optimizer_arguments(self)
        if blocked is None:
            reads, blocked = learning_rate_reads(self)
            changes.update(reads)
        if blocked is None:
            periods, blocked = self._checkpoint_periods()
            changes.update(periods)
        blocked = blocked or weighted_named_targets(module) or shared_optimizer(self)
        if blocked is None:
            backend, backend_imports, blocked = backend_calls(self, self._names)
            changes.update(backend)
            imports += backend_imports
        trained_as_compiled: list = []
        stepped = whole_batch_steps(self, models)  # train_on_batch with batch normalization: split by `fit`
        if blocked is None:
            unfrozen, trained_as_compiled, blocked = frozen_after_compile(self, models, split=bool(stepped))
            changes.update(unfrozen)
            changes.update(split_batch_steps(stepped, unfrozen))
            if stepped:
                trained_as_compiled.append(cst.parse_statement(TRAIN_SPLIT))
                imports.append(ImportItem("keras"))
        if blocked is not None:
            node, reason = blocked
            where = f"`{self._code(node.func)}(...)`: " if isinstance(node, cst.Call) else ""
            return {}, [], f"line {self.position(node).start.line}: {where}{reason}"
        compiles = self._compile_calls(module, models)
        casts, cast_imports = metric_label_casts(self, self._names, compiles)
        changes.update(casts)
        changes.update(output_metrics(compiles))
        changes.update(single_output_targets(module, compiles))
        changes.update(accuracy_log_names(module, compiles))
        changes.update(per_example_losses(module, compiles, changes))
        steps = self._whole_batch_steps(models, stepped)
        whole, whole_blocked = whole_batch_functions(module, compiles, changes, steps)
        if whole_blocked is not None:
            return {}, [], whole_blocked
        changes.update(whole)
        imports += cast_imports
        changes.update(weight_file_renames(module, self._weight_files, self._checkpoints, models))
        changes.update(callback_models_set(module))
        changes.update(categorical_dtypes(self))
        changes.update(integer_sizes(self))
        changes.update(boolean_inputs(self, models))
        changes.update(generator_methods(module, skipped=self._wrapped_elsewhere(models)))
        spellings, spelling_imports = tf2_spellings(self)
        changes.update(spellings)
        imports += spelling_imports
        optimizers, optimizer_imports = tf1_compiled_optimizers(self)
        changes.update(optimizers)
        imports += optimizer_imports
        changes.update(session_setup(self).changes)
        changes.update(model_keywords(self))
        changes.update(module_paths(module))
        changes.update(function_aliases(module))
        predicted = predictions(self, models)
        changes.update(predicted)
        fits = self._generator_calls(models)  # and evaluate_generator, predict_generator
        changes.update(generator_fits(fits, changes))
        changes.update(continuation_lines(self, changes))
        classes, class_imports = self._written_definitions(changes, bool(fits), predicted, bool(whole),
                                                           trained_as_compiled)
        changes.update(placed_after_imports(module, changes, classes))
        imports += class_imports
        return {node: made_within(new, changes) for node, new in changes.items()}, imports, None

    def _written_definitions(self, changes: dict, fits: bool, predicted: dict, whole: bool,
                             trained_as_compiled: list) -> tuple[list[cst.BaseStatement], list[ImportItem]]:
        """The classes and functions the Keras 3 changes need written into the module (Keras 2's
        optimizer steps, `BatchesInOrder`, the prediction and backend functions, `PeriodCheckpoint`,
        `on_whole_batch`), but those another call's fix of the module wrote already (a resumed
        training wraps twice): (definitions, imports)."""
        classes, imports = keras2_step_classes(self)
        written = [batches_in_order_class(self)] if fits else []
        written.append(prediction_functions(self, predicted))
        written += [on_whole_batch_function(self)] if whole else []
        written += [period_checkpoint_class(changes), backend_functions(self, changes), (trained_as_compiled, [])]
        for made, made_imports in written:
            classes += made if isinstance(made, list) else [made]
            imports += made_imports
        definitions = (cst.ClassDef, cst.FunctionDef)
        defined = {s.name.value for s in self.context.module.body if isinstance(s, definitions)}
        return [c for c in classes if not (isinstance(c, definitions) and c.name.value in defined)], imports

    def _compiles_elsewhere(self, blocks: StatementBlocks, moved, models: set, keras3: dict) -> tuple[dict, str | None]:
        """A `compile` of one of ``models`` away from the statements that move under the scope
        (in `train()`, the model built in `build_model()`; again after unfreezing layers to
        fine-tune them), with the statements before it that make what it reads (`optimizer =
        Adam(...)`), put under the model's own strategy: Keras 3 makes an optimizer's variables
        where it is made, and outside the scope a held-out trainer class failed ("Mixing
        different tf.distribute.Strategy objects"). Returns (changes, blocker)."""
        changes: dict = {}
        for call in self._compile_calls(self.context.module, models):
            if any(contains(statement, call) for statement in moved) or not self._same_model(call, moved[0]):
                continue
            if self._uses_tf1_apis() or id(call) not in blocks.of_call:
                return {}, (f"`{self._code(call.func)}(...)` (line {self.position(call).start.line}) compiles the "
                            "model away from where it is built: build and compile it under `strategy.scope()` by hand")
            body, index = blocks.of_call[id(call)]
            # In the block the model is built in (or one around it), what the scope covers is not covered twice.
            floor = next((i + 1 for i, s in enumerate(body) if contains(s, moved[-1])), 0)
            start = self._first_layer_call(body, index, floor)
            if any(statement in changes for statement in body[start:index + 1]):
                return {}, (f"`{self._code(call.func)}(...)` (line {self.position(call).start.line}) compiles the "
                            "model a second time in one block: compile it once")
            wrapped = [blank_lines_unindented(made_within(s, keras3)) for s in body[start:index + 1]]
            strategy = cst.parse_expression(f"{self._code(call.func.value)}.distribute_strategy.scope()")
            changes[body[start]] = cst.With(
                items=[cst.WithItem(strategy)], leading_lines=body[start].leading_lines,
                body=cst.IndentedBlock(body=[wrapped[0].with_changes(leading_lines=()), *wrapped[1:]]))
            for statement in body[start + 1:index + 1]:
                changes[statement] = cst.RemovalSentinel.REMOVE
        return changes, None

    def _same_model(self, call: cst.Call, built: cst.CSTNode) -> bool:
        """Whether the model ``call`` compiles is the one built at ``built``: an attribute of
        `self` in a method of the same class (`train()`, the model built in `__init__`), a plain
        name in the same function (a fine-tuning script compiling again after unfreezing)."""
        parents = module_parents(self.context)
        if self._code(call.func.value).startswith("self."):
            owner = enclosing(built, parents, cst.ClassDef)
            return owner is not None and enclosing(call, parents, cst.ClassDef) is owner
        return enclosing(call, parents, cst.FunctionDef) is enclosing(built, parents, cst.FunctionDef)

    def _returned_to(self, body, index: int, call: cst.Call, models: set) -> tuple[list, str | None]:
        """Where the callers of the function returning the parallel model (or its template) from
        ``body`` bind it, to compile it under its strategy: [(statement, names)]
        (:func:`returned_models`), [] where it is not returned; or ([], why) where a caller's
        names cannot be told."""
        def model(value: cst.BaseExpression) -> bool:
            return value is call or dotted_name(value) in models

        def positions(value: cst.BaseExpression) -> frozenset[int] | None:
            if not isinstance(value, cst.Tuple):
                return None
            return frozenset(i for i, element in enumerate(value.elements) if model(element.value))

        returned = [r for statement in body[index:] for r in find(statement, cst.Return) if r.value is not None
                    and (model(r.value) or positions(r.value))]
        if not returned:
            return [], None

        parents = module_parents(self.context)
        function = enclosing(returned[0], parents, cst.FunctionDef)
        where = {positions(r.value) for r in returned}
        bound, why = (returned_models(self.context.module, parents, function, next(iter(where)))
                      if function is not None and len(where) == 1 else ([], "it returns it in more than one way"))
        if why is not None:
            return [], (f"the model is returned (line {self.position(returned[0]).start.line}) and compiled by the "
                        f"caller, where Keras 3 would make the optimizer outside the strategy's scope, and {why}: "
                        "make the strategy in the caller and build and compile the model under its scope by hand")
        return bound, None

    def _compiled_outside(self, body, models: set, returned: bool = False) -> str | None:
        """Why a model the fix would not compile under the scope cannot train: compiled later in
        the block, or returned to a caller that compiles it (unless ``returned``: the callers
        compile it under its strategy, :meth:`_returned_to`). Keras 3 makes the optimizer's
        variables where `compile` runs, outside the strategy (a held-out VAE whose
        `build_models()` returned the parallel model failed: "Mixing different
        tf.distribute.Strategy objects")."""
        for statement in body:
            compiled = self._compile_calls(statement, models)
            if compiled:
                return (f"`{self._code(compiled[0].func)}(...)` (line {self.position(compiled[0]).start.line}) is not "
                        "right after the model is made, and Keras 3 makes the optimizer where `compile` runs: compile "
                        "the model right after `multi_gpu_model(...)`, or build and compile it under `strategy.scope()` "
                        "by hand")
            if returned:
                continue
            for node in find(statement, cst.Return):
                if node.value is not None and models & _references(node.value):
                    return (f"the model is returned (line {self.position(node).start.line}) and compiled by the "
                            "caller, outside the strategy's scope, where Keras 3 would make the optimizer: make "
                            "the strategy in the caller and build and compile the model under its scope by hand")
        return None

    def _training_blocker(self, models: set) -> str | None:
        """Why the way ``models`` train cannot run under the strategy as written, and where the
        module's Keras session set-up keeps it in TF1 mode, why; else None."""
        reason = self._training_cannot_run(models)
        stuck = session_setup(self).blocked
        if reason is not None and stuck is not None and self._uses_tf1_apis():
            node, why = stuck
            reason += f" (the Keras session set-up stays TF1, line {self.position(node).start.line}: {why})"
        return reason

    def _training_cannot_run(self, models: set) -> str | None:
        """Why the way ``models`` train cannot run under the strategy as written; else None."""
        generator_calls = self._generator_calls(models)
        if generator_calls and self._uses_tf1_apis():
            return (
                f"`{self._code(generator_calls[0].func)}(...)` feeds a Python generator, and Keras's TF1-mode training "
                "under a distribution strategy takes only `tf.data` datasets (it failed on one); feed a "
                "`tf.data.Dataset` (`tf.data.Dataset.from_generator(...)`) or run the program as TF2"
            )
        for call in generator_calls:
            fed = generator_argument(call)
            if fed is None:
                return f"`{self._code(call.func)}(...)` (line {self.position(call).start.line}): pass the generator by name"
        validated = self._validated_fit(models) if self._uses_tf1_apis() else None
        if validated is not None:
            return (
                f"`{validated}(..., validation_...)` validates in batches of the fit's batch size, and under a "
                "distribution strategy TF1-mode Keras evaluates whole batches only (`The number of samples N is not "
                "divisible by batch size B`; a run failed) where the parallel model took a partial last one: make "
                "the validation set a multiple of the batch size and build the model under `strategy.scope()` by "
                "hand, or run the program as TF2"
            )
        unsupported = next((self._tf1_unsupported[m] for m in sorted(models - {None}) if m in self._tf1_unsupported), None)
        if unsupported is not None and self._uses_tf1_apis():
            return (
                f"`{unsupported}` is not supported by TF1-mode Keras under a distribution strategy (it raises "
                "NotImplementedError), and this module runs in TF1 mode (it uses TF1 APIs): move it to TF2 "
                "APIs first, or train without it")
        if self._uses_tf1_apis():
            return (
                "this module uses TF1 APIs, so it runs in TF1 mode, where Keras under a distribution strategy trains "
                "a partial last batch differently (the replicas' unequal parts averaged as equal ones) and carries "
                "the rest of an epoch into the next, running fewer steps (checked: 101 samples in batches of 32 for "
                "3 epochs ran 10 steps for 12, with another loss from the 4th); it is exact only when every array the "
                "model trains, validates, evaluates or predicts on holds a multiple of the global batch: move the "
                "module to TF2 APIs first (`tf.random.set_seed`, no Session), or build and compile the model under "
                "`strategy.scope()` by hand and keep the data a multiple of the batch")
        return (self._batch_coupled_loss(models) or self._activity_regularized()
                or frozen_batch_norm(self) or masked_steps(self)
                or model_tensors_in_losses(self, self._compile_calls(self.context.module, models)))

    def _activity_regularized(self) -> str | None:
        """A layer with an activity regularizer (`Dense(..., activity_regularizer=l1(1e-4))`, an
        `ActivityRegularization` layer): the parallel model's template added its term once for
        each device's slice, MirroredStrategy's replicas add it as one average, so the loss
        differs from the first step (a held-out fraud-detection autoencoder: 0.7902 against 0.7895
        at step 0; without the regularizer the two agreed)."""
        for call in find(self.context.module, cst.Call):
            regularized = any(keyword_is(arg, "activity_regularizer", lambda value: not is_none(value))
                              for arg in call.args)
            if regularized or "keras.layers.ActivityRegularization" in self.imports.resolve_all(call.func):
                return (f"`{self._code(call.func)}(...)` (line {self.position(call).start.line}) regularizes its "
                        "activity: the parallel model added that term once for each device's slice of the batch, "
                        "MirroredStrategy adds it once as the replicas' average, so the loss differs from the first "
                        "step; move the regularizer into the loss by hand, or keep the model on one device")
        return None

    def _unsupported_under_strategy(self, call: cst.Call, method: str) -> str | None:
        """`model.train_on_batch(...)`, `model.fit(..., class_weight=...)`: what TF1-mode Keras
        does not run under a distribution strategy, as code to quote; else None."""
        if method in TF1_STRATEGY_UNSUPPORTED_METHODS:
            return f"{self._code(call.func)}(...)"
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value in TF1_STRATEGY_UNSUPPORTED_KEYWORDS.get(method, ()):
                return f"{self._code(call.func)}(..., {arg.keyword.value}=...)"
        return None

    def _validated_fit(self, models: set) -> str | None:
        """`parallel_model.fit(..., validation_data=...)` (or `validation_split=`): the model
        validated after each epoch (the fits were seen by visit_Call)."""
        return next((self._validated[m] for m in sorted(models - {None}) if m in self._validated), None)

    def _whole_batch_steps(self, models: set, split: list[cst.Call]) -> cst.Call | None:
        """A `train_on_batch` or `test_on_batch` call of one of ``models`` that stays one (not
        among those ``split`` by `fit`): Keras 3 runs it on the whole batch on every replica."""
        split_ids = {id(call) for call in split}
        return next((call for call in find(self.context.module, cst.Call) if isinstance(call.func, cst.Attribute)
                     and call.func.attr.value in ("train_on_batch", "test_on_batch") and id(call) not in split_ids
                     and self._code(call.func.value) in models), None)

    def _batch_coupled_loss(self, models: set) -> str | None:
        """Why a loss or metric of the module, compiled into one of ``models``, that computes one
        value for the whole batch (a Dice loss dividing whole-batch sums; an RMSE's root) cannot
        be computed on the whole batch under the strategy as the parallel model did
        (:func:`tfmigrate.rewrites.keras3_losses.whole_batch_functions`); else None."""
        compiles = self._compile_calls(self.context.module, models)
        steps = self._whole_batch_steps(models, whole_batch_steps(self, models))
        return whole_batch_functions(self.context.module, compiles, output_metrics(compiles), steps)[1]

    def _compile_calls(self, node: cst.CSTNode, models: set) -> list[cst.Call]:
        """The `compile(...)` calls under ``node`` of one of ``models`` (`parallel.compile`)."""
        return [call for call in find(node, cst.Call) if isinstance(call.func, cst.Attribute)
                and call.func.attr.value == "compile" and self._code(call.func.value) in models]

    def _wrapped_elsewhere(self, models: set) -> set[str]:
        """The models another `multi_gpu_model` call of the module wraps (its template and the
        parallel model it makes): the fix of that call trains them on a generator through
        `BatchesInOrder` (a resumed training's second wrap read ahead of the generator, renamed
        `fit` by the first call's fix: 20% apart from its first step)."""
        wrapped = set()
        for call, target in self._calls:
            template = argument(call, PARAMS, "model")
            wrapped |= {dotted_name(template) if template is not None else None, target}
        return wrapped - models - {None}

    def _generator_calls(self, models: set) -> list[cst.Call]:
        """`parallel_model.fit_generator(...)` (or `evaluate_generator`, `predict_generator`) calls:
        the model run on batches from a generator or a `keras.utils.Sequence`."""
        if not self.context.mentions("_generator"):
            return []
        return [node for node in find(self.context.module, cst.Call)
                if isinstance(node.func, cst.Attribute) and node.func.attr.value in GENERATOR_METHODS
                and self._code(node.func.value) in models]

    def _construction(self, body, index: int, model: str) -> int | None:
        """Index of the statement that builds ``model``, before ``index`` in the same block."""
        for position in range(index - 1, -1, -1):
            statement = body[position]
            assigned = single_assign(statement)
            if assigned is not None and assigned[0] == model or model in _unpacked(statement):
                return position
            if self._cpu_block_assigns(statement, {model}):  # with tf.device('/cpu:0'): ... model = Model(...)
                return position
        return None

    def _built_under_strategy(self, call: cst.Call, model: str) -> bool:
        """Whether a `with <strategy>.scope():` statement above ``call`` in its function (or at
        module level) assigns ``model``, ``<strategy>`` made by `tf.distribute.MirroredStrategy(...)`."""
        module = self.context.module
        strategies = {self._code(target.target) for assign in find(module, cst.Assign) for target in assign.targets
                      if isinstance(assign.value, cst.Call)
                      and self.imports.resolve(assign.value.func) == "tensorflow.distribute.MirroredStrategy"}
        line = self.position(call).start.line
        parents = module_parents(self.context)
        scope = enclosing(call, parents, cst.FunctionDef)  # the same function's, or the module's
        for statement in find(module, cst.With):
            if enclosing(statement, parents, cst.FunctionDef) is not scope:
                continue
            if self.position(statement).start.line < line and any(
                    method_call(item.item, "scope") and self._code(item.item.func.value) in strategies
                    for item in statement.items):
                if any((assigned := single_assign(each)) is not None and assigned[0] == model
                       for each in find(statement.body, cst.SimpleStatementLine)):
                    return True
        return False

    def _optimizer_made(self, body, built: int, last: int) -> int:
        """``built``, or the statement above it in the block that makes the optimizer the
        `compile` at ``last`` passes by name (`optimizer = RMSprop(lr=0.001)` above the model, a
        trainer class's `__init__`): Keras 3 makes an optimizer's variables where it is made, and
        one made outside the scope failed in it ("Mixing different tf.distribute.Strategy objects")."""
        compiled = next(filter(None, map(compiled_optimizer, find(body[last], cst.Call))), None)
        name = dotted_name(compiled) if compiled is not None else None
        for position in range(built - 1, -1, -1):
            assigned = single_assign(body[position])
            if (name is not None and assigned is not None and assigned[0] == name
                    and isinstance(assigned[1], cst.Call) and OPTIMIZERS & set(self.imports.resolve_all(assigned[1].func))):
                return position
        return built

    def _checkpoint_periods(self) -> tuple[dict, tuple[cst.CSTNode, str] | None]:
        """:func:`checkpoint_periods` of the module, asked by the edit and by the imports it removes:
        worked out once."""
        return self.context.memo("tfm201.checkpoint_periods", lambda: checkpoint_periods(self.context.module))

    def _uses_tf1_apis(self) -> bool:
        """Whether the module reads an API that only TF1 has (`tf.set_random_seed`, `tf.Session`,
        `tf.train.AdamOptimizer`): it can only run in TF1 mode (`tf.compat.v1`, Keras 2). What the
        fix spells in TF2 (`tf.set_random_seed`, :data:`TF2_SPELLINGS`; a Keras session's set-up,
        :mod:`tfmigrate.rewrites.keras3_session`) does not count. Asked for each call: worked out
        once per module."""

        def compute() -> bool:
            moved_to_tf2 = {id(node) for statement in session_setup(self).removed for node in find(statement, cst.Attribute)}
            moved_to_tf2 |= {id(node) for made in tf1_compiled_optimizers(self)[0] for node in find(made.func, cst.Attribute)}
            for node in find(self.context.module, cst.Attribute):
                qualified = self.imports.resolve(node) or ""
                if qualified in TF2_SPELLINGS or id(node) in moved_to_tf2:
                    continue
                if qualified.startswith("tensorflow.") and tf1_only(qualified.split(".")[1:]):
                    return True
            return False

        return self.context.memo("tfm201.uses_tf1_apis", compute)

    def _first_layer_call(self, body, built: int, floor: int = 0) -> int:
        """The first statement of the block (from ``floor`` on) that the model's construction
        reads from, through names assigned one by one (`inputs = Input(...)`, `hidden =
        Dense(16)(inputs)`): calling a layer makes its weights, which must happen under the
        strategy's scope too."""
        needed = self._names_in(body[built])
        first = built
        for position in range(built - 1, floor - 1, -1):
            assigned = single_assign(body[position])
            if assigned is not None and assigned[0] in needed and not self._plain_data(assigned[1]):
                needed |= self._names_in(assigned[1])
                first = position
            elif self._cpu_block_assigns(body[position], needed):  # with tf.device('/cpu:0'): model = ...
                needed |= self._names_in(body[position])
                first = position
        return first

    def _plain_data(self, value: cst.BaseExpression) -> bool:
        """Whether ``value`` only computes data (`len(chars)`, `np.zeros(...)`, `x.shape[1:]`): it
        makes no layer, so the scope need not reach up to it (a seq2seq script's data preparation
        stays where it is)."""
        for call in find(value, cst.Call):
            name = self.imports.resolve(call.func) or ""
            if not (name.startswith(_DATA_MODULES) or isinstance(call.func, cst.Name) and call.func.value in _DATA_BUILTINS):
                return False
        return True

    def _cpu_block_assigns(self, statement: cst.BaseStatement, names: set) -> bool:
        """Whether ``statement`` is a `with tf.device('/cpu:0'):` block assigning one of ``names``
        (`model = Sequential()` there, `self.model = model` after it)."""
        if not (isinstance(statement, cst.With) and self._is_cpu_device_scope(statement)):
            return False
        return any((single_assign(s) or ("",))[0] in names or names & _unpacked(s)
                   for s in cst.ensure_type(statement.body, cst.IndentedBlock).body)

    def _is_cpu_device_scope(self, statement: cst.With) -> bool:
        if len(statement.items) != 1 or statement.items[0].asname is not None:
            return False
        call = statement.items[0].item
        if not isinstance(call, cst.Call) or self.call_name(call) != "tensorflow.device" or len(call.args) != 1:
            return False
        device = call.args[0].value
        return isinstance(device, cst.SimpleString) and "cpu" in device.evaluated_value.lower()

    def _compile_index(self, body, index: int, model: str, target: str | None) -> int:
        """The `compile` after the multi_gpu_model line, if it comes before any use of the model."""
        names = {model, target}
        for position in range(index + 1, len(body)):
            called = _method_call(body[position])
            if called is not None and called[0] in names and called[1] == "compile":
                return position
            if not isinstance(body[position], cst.SimpleStatementLine) or (called and called[1] in USES):
                break
            if names & _references(body[position]) and called is None:
                break
        return index

    @staticmethod
    def _names_in(node: cst.CSTNode) -> set[str]:
        found: set[str] = set()

        class Names(cst.CSTVisitor):
            def visit_Name(self, name: cst.Name) -> None:
                found.add(name.value)

            def visit_Attribute(self, attribute: cst.Attribute) -> None:
                # `self.generator` too: a trainer class keeps its models on `self` (Keras-GAN)
                dotted = dotted_name(attribute)
                if dotted is not None:
                    found.add(dotted)

        visit_read_only(node, Names())
        return found

    def _devices(self, call: cst.Call) -> str | bool:
        gpus = argument(call, PARAMS, "gpus")
        if isinstance(gpus, (cst.List, cst.Tuple)):
            if not all(isinstance(e.value, cst.Integer) for e in gpus.elements):
                return False
            return "devices=[" + ", ".join(f'"/gpu:{e.value.value}"' for e in gpus.elements) + "]"
        return ""

    def _removed_imports(self, call: cst.Call) -> list[ImportItem]:
        """The imports the edit of ``call`` may leave unused: `multi_gpu_model`'s, those of the
        optimizers replaced by classes that step as Keras 2's, and TF1's names spelled in TF2
        (`from tensorflow import set_random_seed`, which TF 2 does not have); each removed if
        nothing else uses it."""
        spelled = {func.value for func in tf2_spellings(self)[0] if isinstance(func, cst.Name)}
        spelled |= {call.func.value for statement in session_setup(self).removed for call in find(statement, cst.Call)
                    if isinstance(call.func, cst.Name)}
        replaced = sorted(replaced_optimizer_names(self) | spelled)
        # Keras's backend (`K`), called by the program, may be read by nothing once its calls are
        # spelled in Keras 3 (`K.set_value(v, x)` is `v.assign(x)`).
        called = any(isinstance(c.func, cst.Attribute) and self.imports.resolve(c.func.value) == "keras.backend"
                     for c in find(self.context.module, cst.Call))
        backend = [item for items in self._imports.values() for item in items
                   if called and (item.module, item.obj_name) in (("keras", "backend"), ("keras.backend", None))]
        # Keras's `ModelCheckpoint`, once a `PeriodCheckpoint` saves in its place.
        periodic = uses_period_checkpoint(self._checkpoint_periods()[0])
        checkpoint = list(self._imports.get("ModelCheckpoint", [])) if periodic else []
        return (self._import_of(call) + [item for name in replaced for item in self._imports.get(name, [])] + backend
                + checkpoint)

    def _import_of(self, call: cst.Call) -> list[ImportItem]:
        """The imports binding the called name's head: removed if nothing else uses them."""
        head = call.func
        while isinstance(head, cst.Attribute):
            head = head.value
        if not isinstance(head, cst.Name):
            return []
        return list(self._imports.get(head.value, []))

    def _message(self, call: cst.Call, target: str | None, subject: str | None = None) -> str:
        """What the call is (``subject``, else Keras's `multi_gpu_model` and its GPUs) and what to do."""
        gpus = argument(call, PARAMS, "gpus")
        if gpus is None:
            where = "on every visible GPU"
            devices = ""
        elif isinstance(gpus, cst.Integer):
            where = f"with gpus={gpus.value}"
            devices = ""
        elif isinstance(gpus, (cst.List, cst.Tuple)) and all(
            isinstance(e.value, cst.Integer) for e in gpus.elements
        ):
            ids = [e.value.value for e in gpus.elements]  # type: ignore[attr-defined]
            where = f"with gpus=[{', '.join(ids)}]"
            devices = "devices=[" + ", ".join(f"'/gpu:{i}'" for i in ids) + "]"
        else:
            where = f"with gpus={self._code(gpus)}"
            devices = ""
        template = argument(call, PARAMS, "model")
        template_text = f"`{self._code(template)}`" if template is not None else "the template model"
        batch = self._fit_batch.get(target) if target else None
        batch_text = (
            f"the same global batch size (batch_size={batch} in `{target}.fit`)"
            if batch is not None
            else "the same global batch size"
        )
        subject = subject or f"Keras `multi_gpu_model(...)` {where} (removed in TF 2.4)"
        return (
            f"{subject}: build and compile "
            f"{template_text} under `tf.distribute.MirroredStrategy({devices}).scope()` and fit it "
            f"directly with {batch_text}"
        )
