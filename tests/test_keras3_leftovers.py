"""TFM201's fix moves a Keras 2 program onto Keras 3 (`tfmigrate.rewrites.keras3_leftovers`):
what Keras 3 refuses, or takes and trains otherwise, is rewritten or the fix is refused."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import FIXTURES, replaced, run_check, run_program, unsafe_fix

KERAS2_SCRIPT = """
    import numpy as np
    import tensorflow as tf
    import keras
    from keras.models import Model
    from keras.layers import Input
    from keras.layers.core import Dense
    from keras.utils import np_utils
    from keras.optimizers import SGD
    from keras.utils import multi_gpu_model

    tf.random.set_seed(0)
    x = np.zeros((64, 4), 'float32')
    y = np_utils.to_categorical(np.arange(64) % 2, 2)
    inputs = Input(shape=(4,))
    model = Model(input=inputs, output=Dense(2, activation='softmax')(inputs))
    parallel = multi_gpu_model(model, gpus=2)
    parallel.compile(loss='categorical_crossentropy', optimizer=OPTIMIZER)
    FIT
"""


def script(optimizer="SGD(lr=0.1)", fit="parallel.fit(x, y, batch_size=16)", extra=""):
    return textwrap.dedent(KERAS2_SCRIPT).replace("OPTIMIZER", optimizer).replace("FIT", fit) + textwrap.dedent(extra)


def refusal(source: str) -> str:
    findings = [f for f in run_check(source) if f.code == "TFM201"]
    assert len(findings) == 1 and not findings[0].fixable
    return findings[0].message


def test_keras_2_spellings_become_keras_3_ones_and_a_second_fix_changes_nothing():
    result = unsafe_fix(script())
    assert "    parallel.compile(loss='categorical_crossentropy', optimizer=SGD(learning_rate=0.1))\n" in result
    assert "from keras.layers import Dense\n" in result and "keras.layers.core" not in result
    assert "from keras import utils as np_utils\n" in result  # `np_utils.to_categorical` still reads
    assert "    model = Model(inputs=inputs, outputs=Dense(2, activation='softmax')(inputs))\n" in result
    assert unsafe_fix(result) == result


@pytest.mark.parametrize("optimizer, expected", [
    # Keras 2 trained at lr / (1 + decay * iterations); Keras 3 ignores `decay=` with a warning.
    ("SGD(lr=0.1, momentum=0.9, decay=1e-3, nesterov=True)",
     "SGD(learning_rate=tf.keras.optimizers.schedules.InverseTimeDecay(0.1, decay_steps=1, decay_rate=1e-3), "
     "momentum=0.9, nesterov=True)"),
    ("keras.optimizers.Adam(1e-4, decay=1e-6)",
     "keras.optimizers.Adam(tf.keras.optimizers.schedules.InverseTimeDecay(1e-4, decay_steps=1, "
     "decay_rate=1e-6))"),
    # A zero decay and Keras 2's `epsilon=None` ("the backend's epsilon", Keras 3's default) go.
    ("keras.optimizers.Adam(lr=1e-3, epsilon=None, decay=0.0, amsgrad=False)",
     "keras.optimizers.Adam(learning_rate=1e-3, amsgrad=False)"),
    ("keras.optimizers.Adam(lr=1e-3, decay=0.)", "keras.optimizers.Adam(learning_rate=1e-3)"),
])
def test_optimizer_arguments_keep_their_meaning(optimizer, expected):
    result = unsafe_fix(script(optimizer=optimizer))
    assert f"optimizer={expected})\n" in result


@pytest.mark.parametrize("optimizer, extra, reason", [
    ("SGD(0.1, 0.9, 0.0, True, 1)", "", "by keyword: Keras 2 and Keras 3 order them differently"),
    ("SGD(momentum=0.9, decay=1e-4)", "", "pass `learning_rate=`"),
    # Keras 3 under a strategy clips each replica's gradient before the sum; an RMSprop stepped as
    # Keras 2's cannot also clip the sum (a clipping SGD or Adam can: below).
    ("keras.optimizers.RMSprop(lr=0.1, clipnorm=1.0)", "", "clips each replica's gradient before they are summed"),
])
def test_an_optimizer_whose_meaning_keras_3_would_change_is_refused_with_its_line(optimizer, extra, reason):
    message = refusal(script(optimizer=optimizer, extra=extra))
    assert f"line 17: `{optimizer.split('(')[0]}(...)`: " in message and reason in message


def test_learning_rate_reads_are_renamed():
    """Keras 3's optimizers have no `lr` (a callback logging `self.model.optimizer.lr` failed)."""
    extra = """
        class LogRate(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                print(float(self.model.optimizer.lr), self.lr)
    """
    result = unsafe_fix(script(extra=extra))
    assert "print(float(self.model.optimizer.learning_rate), self.lr)" in result  # only the optimizer's


SEQUENCE = """
    class Batches(keras.utils.Sequence):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]
"""


def test_generator_methods_of_another_model_become_keras_3_methods_with_named_arguments():
    """Keras 3's `fit` takes a Sequence itself; the generator method's positions differ from
    `fit`'s, so they are named, and the worker arguments (which Keras 3 does not take) go. (A
    model off `multi_gpu_model` fed so is refused: below.)"""
    fit = ("parallel.fit(x, y, batch_size=16)\n"
           "encoder.fit_generator(Batches(), 4, 2, verbose=0, workers=4, use_multiprocessing=True)\n"
           "encoder.evaluate_generator(generator=Batches(), steps=4, max_queue_size=2)\n")
    result = unsafe_fix(script(fit=fit) + textwrap.dedent(SEQUENCE))
    assert "encoder.fit(Batches(), steps_per_epoch=4, epochs=2, verbose=0)\n" in result
    assert "encoder.evaluate(x=Batches(), steps=4)\n" in result


def test_continuation_lines_aligned_under_a_renamed_call_move_with_its_parenthesis():
    """PEP 8's visual indent (arguments under the opening parenthesis) is kept when the callee's
    name shrinks or grows; a line inside two renamed calls moves by both, a hanging indent and a
    line left of the parenthesis stay."""
    fit = ("parallel.fit(x, y, batch_size=16)\n"
           "encoder.fit_generator(Batches(),\n"
           "                      steps_per_epoch=4,  # per epoch\n"
           "                      epochs=2)\n"
           "encoder.evaluate_generator(\n"
           "    Batches(), steps=4)\n")
    extra = """
        def loss(y_true, y_pred):
            return K.mean(K.square(y_pred -
                                   y_true),
                          axis=-1) + K.sum(y_pred,
                axis=-1)
    """
    source = script(fit=fit, extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n")
    result = unsafe_fix(source + textwrap.dedent(SEQUENCE))
    assert ("encoder.fit(Batches(),\n"
            "            steps_per_epoch=4,  # per epoch\n"
            "            epochs=2)\n") in result
    assert "encoder.evaluate(\n    Batches(), steps=4)\n" in result
    assert ("    return ops.mean(ops.square(y_pred -\n"
            "                               y_true),\n"
            "                    axis=-1) + ops.sum(y_pred,\n"
            "        axis=-1)\n") in result
    assert unsafe_fix(result) == result


def test_a_parallel_model_fed_an_image_data_generator_is_refused():
    """Keras 3 has no `ImageDataGenerator` (3.15's `keras.preprocessing.image` keeps its file
    functions only)."""
    fit = ("datagen = keras.preprocessing.image.ImageDataGenerator()\n"
           "parallel.fit_generator(datagen.flow(x, y, batch_size=16), steps_per_epoch=4)")
    message = refusal(script(fit=fit) + textwrap.dedent(SEQUENCE))
    assert "`keras.preprocessing.image.ImageDataGenerator` is gone from Keras 3" in message


def test_a_parallel_model_evaluated_or_predicting_on_a_generator_reads_the_batches_keras_2_read():
    """Fed a generator, Keras 3 under a strategy reads ahead of it and drops what it read, so it
    would evaluate or predict on other batches (these were refused). `BatchesInOrder.evaluate`
    and `.predict` read the batches Keras 2 read (a Sequence's from its first, a generator's
    next ones) and evaluate them as arrays: a held-out APTOS kernel's `predict_generator` and a
    Kaggle CNN's `evaluate_generator` on a Sequence, MATCH (tests/test_fix_runs.py runs one)."""
    fit = ("parallel.fit(x, y, batch_size=16)\n"
           "score = parallel.evaluate_generator(batches(16), steps=4, workers=2)\n"
           "predicted = parallel.predict_generator(generator=Batches())\n")
    result = unsafe_fix(script(fit=fit) + textwrap.dedent(SEQUENCE))
    assert "score = BatchesInOrder.evaluate(parallel, batches(16), steps=4)\n" in result
    assert "predicted = BatchesInOrder.predict(parallel, Batches())\n" in result
    assert "    def evaluate(cls, model, generator, steps=None, **arguments):\n" in result


def test_a_parallel_model_fit_on_a_sequence_reads_it_as_keras_2_did():
    """A `keras.utils.Sequence` goes through `BatchesInOrder` too, which reads it pass after pass
    as Keras 2's `fit_generator` did (Keras 3's own reading under a strategy split its batches
    otherwise from the second epoch in 2 of 5 runs, the loss halved); `shuffle=` reaches it."""
    result = unsafe_fix(script(fit="parallel.fit_generator(Batches(), 4, epochs=2, shuffle=False)")
                        + textwrap.dedent(SEQUENCE))
    assert "\nBatchesInOrder.fit(parallel, Batches(), steps_per_epoch=4, epochs=2, shuffle=False)\n" in result
    assert "            sequence.on_epoch_end()\n" in result and "\nimport random\n" in result


def test_a_template_wrapped_again_to_resume_on_the_same_generator_trains_through_batches_in_order_too():
    """A resumed training (Chollet's Jena forecaster, saved, rebuilt, `initial_epoch=2`): the
    module wraps a second template and fits it on the same generator. The first call's fix
    renamed the second's `fit_generator` to a plain `fit`, which under a strategy read ahead of
    the generator and dropped what it read (a held-out program 20% apart from the resumed
    epoch's first step); both go through one `BatchesInOrder` class now."""
    fit = "parallel.fit_generator(gen, 4, epochs=2)\n"
    extra = """
        model2 = Model(inputs, Dense(2, activation='softmax')(inputs))
        parallel2 = multi_gpu_model(model2, gpus=2)
        parallel2.compile(loss='categorical_crossentropy', optimizer='sgd')
        parallel2.fit_generator(gen, 4, epochs=4, initial_epoch=2)
    """
    source = script(fit=fit, extra=extra).replace("tf.random.set_seed(0)\n", "tf.random.set_seed(0)\n"
                                                  "gen = (batch for batch in [(np.zeros((8, 4)), np.zeros((8, 2)))] * 99)\n")
    result = unsafe_fix(source)
    assert "\nBatchesInOrder.fit(parallel, gen, steps_per_epoch=4, epochs=2)\n" in result
    assert "\nBatchesInOrder.fit(parallel2, gen, steps_per_epoch=4, epochs=4, initial_epoch=2)\n" in result
    assert result.count("class BatchesInOrder(keras.callbacks.Callback):") == 1


def test_a_parallel_model_fit_on_a_python_generator_trains_through_batches_in_order():
    """Keras 3's `fit` under a strategy drops the batches it read ahead to build the model, so the
    generator's batches go through the `BatchesInOrder` class the fix writes (once), its
    validation generator too; the arguments after the generator are named, the worker ones go."""
    fit = ("parallel.fit_generator(batches(16), 4, epochs=2, validation_data=batches(8),\n"
           "                       validation_steps=2, workers=4)\n")
    extra = """
        def batches(size):
            while True:
                for start in range(0, 64, size):
                    yield x[start:start + size], y[start:start + size]
    """
    result = unsafe_fix(script(fit=fit, extra=extra))
    assert ("\nBatchesInOrder.fit(parallel, batches(16), steps_per_epoch=4, epochs=2, validation_data=batches(8),\n"
            "                   validation_steps=2)\n") in result  # the continuation line moved with the parenthesis
    assert result.count("class BatchesInOrder(keras.callbacks.Callback):") == 1
    assert "\nimport threading\n" in result and "        self.dataset = tf.data.Dataset.from_generator(" in result
    assert unsafe_fix(result) == result


def test_tf1_s_seed_call_is_spelled_in_tf2_so_the_program_leaves_tf1_mode():
    """The Keras FAQ's `tf.set_random_seed(1)` was all that kept held-out Keras 2 programs in TF1
    mode, where their fit is refused; spelled `tf.random.set_seed(1)` the program runs as TF2."""
    source = script(fit="parallel.fit(x, y, batch_size=16, validation_data=(x, y))").replace(
        "tf.random.set_seed(0)", "tf.set_random_seed(0)")
    result = unsafe_fix(source)
    assert "\ntf.random.set_seed(0)\n" in result and "set_random_seed" not in result
    source = source.replace("tf.set_random_seed(0)", "tf.set_random_seed(0)\nsess = tf.Session()")
    assert "validates in batches of the fit's batch size" in refusal(source)  # another TF1 API: still TF1 mode


def test_backend_math_moves_to_keras_ops_inside_out():
    """Keras 3's `keras.backend` keeps only its settings (`K.epsilon()`); a held-out regression
    script's R^2 metric (`K.sum(K.square(...))`) failed there. Nested calls are each moved;
    `K.variable` (a held-out weighted loss's class weights) is a `keras.Variable`."""
    extra = """
        def r2(y_true, y_pred):
            res = K.sum(K.square(y_true - y_pred))
            return 1 - res / (K.sum(K.square(y_true - K.mean(y_true))) + K.epsilon())

        def weighted(weights):
            weights = K.variable(weights)
            kept = K.variable(weights, 'float64', name='kept')
            return weights, kept

        def dice(y_true, y_pred):
            flat = K.flatten(y_true)
            K.set_value(parallel.optimizer.lr, 0.5 * K.get_value(parallel.optimizer.lr))
            return K.argmax(y_pred), K.pow(flat, 2)
    """
    result = unsafe_fix(script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n"))
    assert "from keras import ops, backend as K\n" in result
    assert "    res = ops.sum(ops.square(y_true - y_pred))\n" in result
    assert "    return 1 - res / (ops.sum(ops.square(y_true - ops.mean(y_true))) + K.epsilon())\n" in result
    assert "    flat = ops.reshape(y_true, (-1,))\n" in result
    assert ("    parallel.optimizer.learning_rate.assign(0.5 * ops.convert_to_numpy(parallel.optimizer.learning_rate))\n"
            in result)
    assert "    return ops.argmax(y_pred, axis=-1), ops.power(flat, 2)\n" in result  # Keras 2's axis was the last
    # Keras 2 made a variable in floatx() unless told; Keras 3 keeps a NumPy value's float64
    assert "    weights = keras.Variable(weights, dtype=keras.config.floatx())\n" in result
    assert "    kept = keras.Variable(weights, dtype='float64', name='kept')\n" in result
    assert unsafe_fix(result) == result


def test_backend_functions_without_an_equivalent_and_gone_modules_are_refused():
    message = refusal(script(extra="z = K.random_normal_variable((2, 2), 0, 1)\n").replace(
        "import keras\n", "import keras\nimport keras.backend as K\n"))
    assert "`K.random_normal_variable` is gone from Keras 3's backend" in message
    message = refusal(script().replace("import keras\n", "import keras\nfrom keras.preprocessing.text import Tokenizer\n"))
    assert "line 4: `keras.preprocessing.text` is gone from Keras 3" in message


@pytest.mark.parametrize("optimizer", ["keras.optimizers.Nadam()", "'nadam'"])
def test_optimizers_keras_3_computes_otherwise_are_refused(optimizer):
    """A Nadam-trained Kaggle kernel drifted 8e-2 from its Keras 2 run in 30 steps."""
    assert "Keras 3's Nadam steps otherwise" in refusal(script(optimizer=optimizer))


@pytest.mark.parametrize("optimizer, made, extra", [
    ("keras.optimizers.RMSprop(lr=1e-4)", "Keras2RMSprop(learning_rate=1e-4)", ""),
    ("'rmsprop'", "Keras2RMSprop()", ""),
    ("keras.optimizers.RMSprop(lr=1e-3, rho=0.9, epsilon=None, decay=0.0)", "Keras2RMSprop(learning_rate=1e-3, rho=0.9)",
     "embedding = keras.layers.Embedding(100, 8)\n"),
])
def test_rmsprop_becomes_a_subclass_that_steps_as_keras_2_s(optimizer, made, extra):
    """Keras 2's RMSprop stepped by g / (sqrt(v) + eps), Keras 3's by g / sqrt(v + eps): a held-out
    `cifar10_cnn` (RMSprop(lr=0.0001, decay=1e-6)) drifted 7e-3 from its Keras 2 run in 30 steps.
    The fix writes one `Keras2RMSprop` class (it also adds an `Embedding`'s rows up, as
    `DenseGradientAdam` does; tests/test_fix_runs.py trains it against Keras 2's)."""
    result = unsafe_fix(script(optimizer=optimizer, extra=extra))
    assert f"optimizer={made})" in result
    assert result.count("class Keras2RMSprop(keras.optimizers.RMSprop):\n") == 1
    assert "        self.assign_sub(variable, rate * gradient / (keras.ops.sqrt(denominator) + self.epsilon))\n" in result
    assert "DenseGradient" not in result


@pytest.mark.parametrize("optimizer, made", [
    ("keras.optimizers.Adadelta()", "keras.optimizers.Adadelta(learning_rate=1.0)"),
    ("'adadelta'", "keras.optimizers.Adadelta(learning_rate=1.0)"),
    ("keras.optimizers.Adadelta(0.5, rho=0.9)", "keras.optimizers.Adadelta(0.5, rho=0.9)"),
    ("keras.optimizers.Adamax(decay=0.1)",
     "keras.optimizers.Adamax(learning_rate=tf.keras.optimizers.schedules.InverseTimeDecay(0.002, decay_steps=1, "
     "decay_rate=0.1))"),
    ("'adamax'", "keras.optimizers.Adamax(learning_rate=0.002)"),
    ("keras.optimizers.Adagrad()", "Keras2Adagrad()"),
    ("'adagrad'", "Keras2Adagrad()"),
    ("keras.optimizers.Adagrad(lr=0.1)", "Keras2Adagrad(learning_rate=0.1)"),
    # Keras 2's lower-case aliases (Keras's cifar10_cnn example), which Keras 3 has not
    ("keras.optimizers.adam(lr=0.01)", "keras.optimizers.Adam(learning_rate=0.01)"),
    ("keras.optimizers.adadelta()", "keras.optimizers.Adadelta(learning_rate=1.0)"),
])
def test_keras_2_s_default_rates_and_adagrad_s_step_are_kept(optimizer, made):
    """Keras 2 trained `Adadelta()` at 1.0 (Keras's mnist_cnn example), `Adamax()` at 0.002,
    Keras 3 at 0.001; Keras 2's Adagrad started its accumulators at zero and divided by sqrt(a)
    + epsilon, Keras 3's start at 0.1 and divide by sqrt(a + epsilon) (5% apart at the first step
    of a held-out-style program with the same rate, which matches through `Keras2Adagrad`)."""
    result = unsafe_fix(script(optimizer=optimizer))
    assert f"optimizer={made})" in result
    assert ("class Keras2Adagrad(keras.optimizers.Adagrad):\n" in result) == made.startswith("Keras2Adagrad")
    if made.startswith("Keras2Adagrad"):
        assert "    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.0, **kwargs):\n" in result
        assert "        self.assign_sub(variable, rate * gradient / (keras.ops.sqrt(accumulator) + self.epsilon))\n" in result
    assert unsafe_fix(result) == result


@pytest.mark.parametrize("optimizer, made", [
    ("keras.optimizers.Adam(lr=1e-3)", "DenseGradientAdam(learning_rate=1e-3)"),
    ("'adadelta'", "DenseGradientAdadelta(learning_rate=1.0)"),
    ("SGD(lr=0.1, momentum=0.9)", None),
])
def test_an_adaptive_optimizer_of_a_model_with_an_embedding_adds_up_each_row_s_gradients(optimizer, made):
    """Keras 3's Adam squares each occurrence's gradient of an embedding row seen more than once
    in a batch, Keras 2 squared their sum (one step on a row seen 3 times: -0.030 against 0.0; a
    held-out Kaggle text kernel differed from its second step, and matched with the subclass the
    fix writes). SGD's step is linear in the gradient: both agree, and it stays."""
    source = script(optimizer=optimizer, extra="embedding = keras.layers.Embedding(100, 8)\n")
    result = unsafe_fix(source)
    if made is None:
        assert "SGD(learning_rate=0.1, momentum=0.9)" in result and "DenseGradient" not in result
        return
    name = made.split("(")[0][len("DenseGradient"):]
    assert f"optimizer={made})" in result
    assert f"from keras.optimizers import SGD\n\n\nclass DenseGradient{name}(keras.optimizers.{name}):\n" in result
    assert "        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]\n" in result
    assert "\n\n\ntf.random.set_seed(0)\n" in result  # two blank lines after the class
    assert unsafe_fix(result) == result


@pytest.mark.tensorflow
def test_every_spelling_the_fix_leaves_is_one_keras_3_takes(tmp_path):
    """The fixed script, run on Keras 3 up to its training (a subprocess): everything constructs."""
    pytest.importorskip("tensorflow")
    result = unsafe_fix(script(optimizer="SGD(lr=0.1, momentum=0.9, decay=1e-3, nesterov=True)"))
    program = tmp_path / "fixed.py"
    program.write_text(result.replace("parallel.fit(x, y, batch_size=16)", "print(type(parallel.optimizer).__name__)"))
    run = run_program(program, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "SGD"


PARALLEL_CLASS = """
    import tensorflow as tf
    from tensorflow.keras.layers import Concatenate, Lambda
    from tensorflow.keras.models import Model

    class ParallelModel(Model):
        def __init__(self, template, gpus):
            outputs = []
            for i in range(gpus):
                with tf.device('/gpu:%d' % i):
                    outputs.append(template(Lambda(lambda t, k=i: tf.split(t, gpus)[k])(template.input)))
            super(ParallelModel, self).__init__(inputs=template.input, outputs=Concatenate(axis=0)(outputs))

    template = build()
    model = ParallelModel(template, 2)
    model.compile(optimizer='sgd', loss='mse')
    model.fit(x, y, batch_size=8)
"""


def test_a_parallel_model_class_used_elsewhere_is_refused_with_the_line():
    """The class goes with its one construction; anything else reading it would break."""
    assert "class ParallelModel" not in unsafe_fix(textwrap.dedent(PARALLEL_CLASS))
    source = textwrap.dedent(PARALLEL_CLASS) + "assert isinstance(model, ParallelModel)\n"
    message = refusal(source)
    assert "`ParallelModel` is also used on line 17" in message


RETURNED = """
    import tensorflow as tf
    from keras.utils import multi_gpu_model
    from keras.optimizers import Adam
    def build_models(gpus):
        if gpus > 1:
            with tf.device('/cpu:0'):
                model = build()
            RETURN
        return model, model
    def main():
        model, parallel = build_models(2)
        optimizer = Adam(lr=0.001)
        COMPILE
"""


@pytest.mark.parametrize("returned", ["return model, multi_gpu_model(model, gpus=gpus)",
                                      "parallel = multi_gpu_model(model, gpus=gpus)\n        return model, parallel"])
def test_a_model_returned_to_a_caller_that_compiles_it_is_compiled_under_its_strategy(returned):
    """Keras 3 makes the optimizer where `compile` runs: a held-out VAE's `build_models()`
    returned the parallel model to a caller that compiled it outside the strategy's scope, and
    the fixed program failed ("Mixing different tf.distribute.Strategy objects"). The function
    builds the template under the scope and returns it in the parallel model's place; the
    caller compiles it (and makes the optimizer it reads) under the model's own strategy."""
    source = textwrap.dedent(RETURNED).replace("RETURN", returned).replace(
        "COMPILE", "parallel.compile(optimizer=optimizer, loss='mse')")
    result = unsafe_fix(source)
    assert "        strategy = tf.distribute.MirroredStrategy()\n        with strategy.scope():\n" in result
    assert "multi_gpu_model" not in result and ("return model, model\n" in result or "parallel = model\n" in result)
    assert ("    with parallel.distribute_strategy.scope():\n        optimizer = Adam(learning_rate=0.001)\n"
            "        parallel.compile(optimizer=optimizer, loss='mse')\n") in result
    assert unsafe_fix(result) == result


def test_a_model_a_method_returns_to_a_caller_dropping_it_is_fixed_where_the_class_compiles_it():
    """`self.build()` in `__init__` drops what `build()` returns (the models stay on `self`, the
    MaskRCNN trainer layout); `compile()` compiles `self.parallel` under its strategy."""
    source = textwrap.dedent("""
        import tensorflow as tf
        from keras.utils import multi_gpu_model
        class Trainer:
            def __init__(self):
                self.build()
            def build(self):
                with tf.device('/cpu:0'):
                    self.template = make_template()
                self.parallel = multi_gpu_model(self.template, gpus=2)
                return self.parallel
            def compile(self):
                self.parallel.compile(optimizer='adam', loss='mse')
    """)
    result = unsafe_fix(source)
    assert "            self.parallel = self.template\n        return self.parallel\n" in result
    assert ("        with self.parallel.distribute_strategy.scope():\n"
            "            self.parallel.compile(optimizer='adam', loss='mse')\n") in result


@pytest.mark.parametrize("compile_call, reason", [
    ("build_models(2)[1].compile(optimizer=optimizer, loss='mse')",
     "a call of `build_models` does not assign what it returns to names"),
    ("train(parallel, optimizer)", "the model returned to line 11 is not compiled in that function"),
])
def test_a_returned_model_whose_caller_compile_cannot_be_found_is_refused(compile_call, reason):
    """Where the caller does not bind the returned model to a name, or compiles it somewhere else,
    the fix cannot put that `compile` under the model's strategy: it says so."""
    source = textwrap.dedent(RETURNED).replace("RETURN", "return model, multi_gpu_model(model, gpus=gpus)").replace(
        "COMPILE", compile_call)
    message = refusal(source)
    assert "the model is returned" in message or "is not compiled" in message
    assert reason in message


def test_metric_functions_cast_the_labels_as_keras_2_did():
    """Keras 2 cast the labels to the predictions' type before a metric saw them; Keras 3 does not
    (float64 NumPy labels: `y_true * y_pred` failed in a held-out IMDB script's precision)."""
    extra = '''
        def precision(y_true, y_pred):
            """Batch-wise precision."""
            return K.sum(K.round(y_true * y_pred)) / (K.sum(K.round(y_pred)) + K.epsilon())
    '''
    source = script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n").replace(
        "optimizer=SGD(lr=0.1))", "optimizer=SGD(lr=0.1), metrics=['accuracy', precision])")
    result = unsafe_fix(source)
    assert ('    """Batch-wise precision."""\n    y_true = ops.cast(y_true, y_pred.dtype)\n'
            '    return ops.sum(ops.round(y_true * y_pred)) / (ops.sum(ops.round(y_pred)) + K.epsilon())\n') in result
    assert unsafe_fix(result) == result


def test_an_optimizer_decay_read_is_refused():
    extra = """
        class ShowRate(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                print(K.get_value(self.model.optimizer.decay))
    """
    message = refusal(script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n"))
    assert "`self.model.optimizer.decay` is read, and Keras 3's optimizers have no decay" in message


def test_a_checkpoint_period_of_one_epoch_goes():
    """Keras 3's ModelCheckpoint has no `period=` (its construction fails); every epoch is its default."""
    extra = "ckpt = keras.callbacks.ModelCheckpoint('best.h5', monitor='val_loss', period=1)\n"
    assert "ckpt = keras.callbacks.ModelCheckpoint('best.h5', monitor='val_loss')\n" in unsafe_fix(script(extra=extra))


def test_a_checkpoint_saving_every_few_epochs_saves_through_a_class_that_counts_them():
    """`period=5`: Keras 3 counts its `save_freq` in batches; a `PeriodCheckpoint` written into the
    module saves every 5 epochs as Keras 2 did, in place of Keras's class where it is made and as
    the base of the module's subclass (keras-yolo3's `period=3`, a VAE's template checkpoint)."""
    extra = """
        class TemplateCheckpoint(ModelCheckpoint):
            def __init__(self, filepath, template, **kwargs):
                super().__init__(filepath, **kwargs)
                self.template = template

        ckpt = ModelCheckpoint('best.h5', monitor='val_loss', period=5)
        mine = TemplateCheckpoint('w.h5', model, save_weights_only=True, period=2)
    """
    source = script(extra=extra).replace("import keras\n", "import keras\nfrom keras.callbacks import ModelCheckpoint\n")
    result = unsafe_fix(source)
    assert "class PeriodCheckpoint(keras.callbacks.ModelCheckpoint):" in result
    assert "ckpt = PeriodCheckpoint('best.h5', monitor='val_loss', period=5)\n" in result
    assert "class TemplateCheckpoint(PeriodCheckpoint):" in result and "ModelCheckpoint\n" not in result


@pytest.mark.parametrize("init", ["super(TemplateCheckpoint, self).__init__", "ModelCheckpoint.__init__(self, "])
def test_a_checkpoint_subclass_forwarding_its_own_period_to_keras_derives_from_the_period_class(init):
    """keras-team/keras#8463's template checkpoint takes `period=1` itself and hands it to
    `ModelCheckpoint.__init__`: Keras 3 failed there ("unexpected keyword argument 'period'", a
    held-out autoencoder); the subclass derives from `PeriodCheckpoint`, which takes it."""
    call = f"{init}(filepath, period=period)" if init.endswith("__init__") else f"{init}filepath, period=period)"
    extra = f"""
        class TemplateCheckpoint(ModelCheckpoint):
            def __init__(self, filepath, template, period=1):
                {call}
                self.template = template

        mine = TemplateCheckpoint('w.h5', model)
    """
    source = script(extra=extra).replace("import keras\n", "import keras\nfrom keras.callbacks import ModelCheckpoint\n")
    result = unsafe_fix(source)
    assert "class TemplateCheckpoint(PeriodCheckpoint):" in result and "class PeriodCheckpoint(" in result
    assert "ModelCheckpoint.__init__" not in result  # an explicit base call goes through the period class too


def test_the_period_checkpoint_saves_every_nth_epoch():
    """The class written into the module saves on epochs 2 and 4 of 5 with `period=2`, as Keras 2
    did (Keras 3's `_save_model`, where `save_best_only` compares, runs on those epochs only)."""
    pytest.importorskip("keras")
    import keras

    from tfmigrate.rewrites.keras3_leftovers import _PERIOD_CHECKPOINT_CLASS

    namespace = {"keras": keras}
    exec(_PERIOD_CHECKPOINT_CLASS, namespace)
    saved = []

    class Recorded(namespace["PeriodCheckpoint"]):
        def _save_model(self, epoch, batch, logs):
            saved.append((epoch, logs["loss"]))

    checkpoint = Recorded("w.weights.h5", save_weights_only=True, period=2)
    for epoch, loss in enumerate([5.0, 4.0, 3.0, 2.0, 1.0]):
        checkpoint.on_epoch_end(epoch, {"loss": loss})
    assert saved == [(1, 4.0), (3, 2.0)]


@pytest.mark.parametrize("loss, metrics", [
    ("{'main': 'binary_crossentropy', 'aux': 'mse'}", "{'main': ['accuracy', f1], 'aux': ['accuracy', f1]}"),
    ("['binary_crossentropy', 'mse']", "[['accuracy', f1], ['accuracy', f1]]"),
    ("'binary_crossentropy'", "['accuracy', f1]"),  # one output, or one loss for all: Keras 3 takes the list
])
def test_a_flat_metric_list_is_given_to_each_output_of_a_model_with_several(loss, metrics):
    """Keras 2 computed a flat metric list on every output; Keras 3 takes one only for a model of
    one output (a held-out two-headed functional model failed: "tuple arity mismatch")."""
    source = script(optimizer="'sgd'").replace(
        "parallel.compile(loss='categorical_crossentropy', optimizer='sgd')",
        f"parallel.compile(loss={loss}, optimizer='sgd', metrics=['accuracy', f1])")
    result = unsafe_fix(source)
    assert f"    parallel.compile(loss={loss}, optimizer='sgd', metrics={metrics})\n" in result
    assert unsafe_fix(result) == result


@pytest.mark.parametrize("weights, loss, metrics", [
    ("[1.0, 0.5]", "['mse', 'mse']", "[['accuracy'], ['accuracy']]"),
    ("{'main': 1.0, 'aux': 0.2}", "{'main': 'mse', 'aux': 'mse'}", "{'main': ['accuracy'], 'aux': ['accuracy']}"),
    ("[1.0]", "'mse'", "['accuracy']"),  # one weight: one output, as Keras 3 takes it
])
def test_one_loss_weighted_per_output_is_given_to_each_output(weights, loss, metrics):
    """One loss for every output, weighed by `loss_weights` (a held-out captcha model of four
    softmax heads): Keras 3 weighs only a loss per weight ("`loss_weights` must match the number
    of losses") and fails on the flat metric list too; the outputs are counted from the weights."""
    source = script(optimizer="'sgd'").replace(
        "parallel.compile(loss='categorical_crossentropy', optimizer='sgd')",
        f"parallel.compile(loss='mse', loss_weights={weights}, optimizer='sgd', metrics=['accuracy'])")
    result = unsafe_fix(source)
    assert f"    parallel.compile(loss={loss}, loss_weights={weights}, optimizer='sgd', metrics={metrics})\n" in result


def test_a_checkpoint_of_weights_named_hdf5_through_a_variable_saves_a_keras_3_weights_file():
    """Keras 3 takes only `.weights.h5` for a weights-only checkpoint (its construction fails);
    Keras 2 code named HDF5 files `.hdf5` as often as `.h5`, and through a variable (a held-out
    Kaggle kernel's `file_path = os.path.join(TMP, 'best.hdf5')`)."""
    extra = """
        import os
        file_path = os.path.join('tmp', 'best_model_weights.hdf5')
        check_point = keras.callbacks.ModelCheckpoint(file_path, monitor='val_loss', save_weights_only=True)
        model.save_weights('final.hdf5')
        model.load_weights(file_path)
    """
    result = unsafe_fix(script(extra=extra))
    assert "file_path = os.path.join('tmp', 'best_model_weights.weights.h5')\n" in result
    assert "model.save_weights('final.weights.h5')\n" in result
    assert unsafe_fix(result) == result


def test_a_template_unpacked_from_a_builder_s_results_is_built_under_the_scope():
    """CTC and YOLO code build the training and the prediction model together (`model, test_func =
    build_crnn()`, a held-out CRNN trainer's, in a cpu block): the builder runs under the scope,
    as a plain `model = ...` does (a program of that shape matched over 24 steps)."""
    source = replaced(script(), ("model = Model(input=inputs, output=Dense(2, activation='softmax')(inputs))\n",
                                 "def build(inputs):\n"
                                 "    hidden = Dense(2, activation='softmax')(inputs)\n"
                                 "    return Model(inputs, hidden), Model(inputs, inputs)\n"
                                 "with tf.device('/cpu:0'):\n"
                                 "    model, features = build(inputs)\n"))
    result = unsafe_fix(source)
    assert "with strategy.scope():\n    inputs = Input(shape=(4,))\n" in result
    assert "\n    model, features = build(inputs)\n    parallel = model\n    parallel.compile(" in result
    assert "multi_gpu_model" not in result


def test_a_callback_saving_the_template_it_was_given_gets_a_keras_3_weights_file():
    """The template checkpoint copied from keras issue #8463: a `Callback` given the template and
    a file, which it keeps on `self` and saves to (a held-out Planet kernel's fixed program failed
    at its first epoch: "The filename must end in `.weights.h5`")."""
    extra = """
        class TemplateCheckpoint(keras.callbacks.Callback):
            def __init__(self, template, filepath):
                super(TemplateCheckpoint, self).__init__()
                self.template = template
                self.filepath = filepath

            def on_epoch_end(self, epoch, logs=None):
                self.template.save_weights(self.filepath, overwrite=True)


        best = 'best.h5'
        checkpoints = [TemplateCheckpoint(model, 'weights.best.hdf5'), TemplateCheckpoint(model, filepath=best)]
    """
    result = unsafe_fix(script(extra=extra))
    assert "[TemplateCheckpoint(model, 'weights.best.weights.h5'), TemplateCheckpoint(model, filepath=best)]" in result
    assert "best = 'best.weights.h5'\n" in result
    assert unsafe_fix(result) == result


TRAINER = """
    import numpy as np
    import tensorflow as tf
    from keras.models import Sequential
    from keras.layers import Dense
    from keras.optimizers import Adam
    from keras.utils import multi_gpu_model


    class Trainer(object):
        def __init__(self, lr):
            self.lr = lr
            self.build_model()

        def build_model(self):
            with tf.device('/cpu:0'):
                model = Sequential()
                model.add(Dense(2, input_shape=(4,), activation='softmax'))
            self.model = model
            self.parallel_model = multi_gpu_model(self.model, gpus=2)

        def train(self, x, y):
            optimizer = Adam(lr=self.lr)
            self.parallel_model.compile(loss='categorical_crossentropy', optimizer=optimizer,
                                        metrics=['accuracy'])
            return self.parallel_model.fit(x, y, batch_size=16, epochs=2)
"""


def test_a_model_built_in_one_method_and_compiled_in_another_is_compiled_under_its_strategy():
    """The template is built under the strategy's scope with the `with tf.device('/cpu:0'):`
    block it was built in (it came before `self.model = model`), and the `compile` in `train()`
    runs under the model's own strategy with the optimizer it makes: Keras 3 makes an
    optimizer's variables where it is made (a held-out trainer class failed, "Mixing different
    tf.distribute.Strategy objects", then trained another model: the template outside the scope)."""
    result = unsafe_fix(textwrap.dedent(TRAINER))
    assert textwrap.indent(textwrap.dedent("""
        def build_model(self):
            strategy = tf.distribute.MirroredStrategy()
            with strategy.scope():
                model = Sequential()
                model.add(Dense(2, input_shape=(4,), activation='softmax'))
                self.model = model
                self.parallel_model = self.model

        def train(self, x, y):
            with self.parallel_model.distribute_strategy.scope():
                optimizer = Adam(learning_rate=self.lr)
                self.parallel_model.compile(loss='categorical_crossentropy', optimizer=optimizer,
                                            metrics=['accuracy'])
            return self.parallel_model.fit(x, y, batch_size=16, epochs=2)
    """), "    ") in result
    assert unsafe_fix(result) == result


FINE_TUNING = """
    import numpy as np
    import tensorflow as tf
    from keras.layers import Dense, Input
    from keras.models import Model
    from keras.optimizers import SGD
    from keras.utils import multi_gpu_model

    x, y = np.zeros((64, 4), 'float32'), np.zeros((64, 2), 'float32')
    with tf.device('/cpu:0'):
        inputs = Input(shape=(4,))
        base = Dense(8, name='base')(inputs)
        model = Model(inputs, Dense(2, activation='softmax')(base))
    for layer in model.layers[:2]:
        layer.trainable = False
    parallel = multi_gpu_model(model, gpus=2)
    parallel.compile(optimizer=SGD(lr=0.01), loss='categorical_crossentropy')
    parallel.fit(x, y, batch_size=16)
    for layer in model.layers:
        layer.trainable = True
    parallel.compile(optimizer=SGD(lr=0.0001, momentum=0.9),
                     loss='categorical_crossentropy')
    parallel.fit(x, y, batch_size=16)
"""


def test_a_fine_tuning_script_compiling_again_after_unfreezing_compiles_under_the_model_s_strategy():
    """The template built last in a `with tf.device('/cpu:0'):` block is built under the scope
    with the whole block; the second `compile` (after unfreezing, the keras.io fine-tuning recipe)
    makes its optimizer under the model's strategy: outside it Keras 3 fails (a held-out
    transfer-learning script, verified over both fits)."""
    result = unsafe_fix(textwrap.dedent(FINE_TUNING))
    assert "with strategy.scope():\n    inputs = Input(shape=(4,))\n" in result
    assert ("with parallel.distribute_strategy.scope():\n"
            "    parallel.compile(optimizer=SGD(learning_rate=0.0001, momentum=0.9),\n"
            "                     loss='categorical_crossentropy')\n"
            "parallel.fit(x, y, batch_size=16)\n") in result
    assert unsafe_fix(result) == result


def test_a_helper_defined_between_the_layers_it_needs_and_the_model_goes_not_under_the_scope():
    """The scope reaches up to the layers the model reads (`hidden = Dense(4)`), over the helper's
    definition: the helper goes with its one call there too (a held-out kuza55-style script kept
    it, indented under the scope), and so does the function only it reads (`slice_batch`)."""
    source = textwrap.dedent("""
        import tensorflow as tf
        from keras.layers import Dense, Input, Lambda, concatenate
        from keras.models import Model

        hidden = Dense(4, activation='relu')


        def slice_batch(t, n, k):
            return tf.split(t, n)[k]


        def make_parallel(model, gpu_count):
            outputs = []
            for g in range(gpu_count):
                with tf.device('/gpu:%d' % g):
                    piece = Lambda(slice_batch, arguments={'n': gpu_count, 'k': g})(model.inputs[0])
                    outputs.append(model(piece))
            return Model(inputs=model.inputs, outputs=concatenate(outputs, axis=0))


        inputs = Input(shape=(6,))
        template = Model(inputs, Dense(1)(hidden(inputs)))
        model = make_parallel(template, 2)
        model.compile(optimizer='sgd', loss='mse')
    """)
    result = unsafe_fix(source)
    assert "make_parallel" not in result and "slice_batch" not in result
    assert "with strategy.scope():\n    hidden = Dense(4, activation='relu')\n" in result
    assert unsafe_fix(result) == result


def test_boolean_arrays_fed_to_the_model_are_cast_to_floats_as_keras_2_did():
    """Keras 2 cast boolean inputs and labels (the one-hot text of Keras's lstm_text_generation
    example) to the model's floats; Keras 3 under MirroredStrategy fails on them ("Value for attr
    'T' of bool is not in the list of allowed values", checked on 2 logical CPUs; without a
    strategy it trains). An array also made otherwise somewhere is left alone."""
    fit = ("hot = np.zeros((64, 4), dtype=np.bool)\n"
           "labels = np.zeros((64, 2), dtype='bool')\n"
           "mixed = np.zeros((64, 4), dtype=bool)\n"
           "mixed = np.zeros((64, 4))\n"
           "parallel.fit(hot, labels, batch_size=16, validation_data=(hot, labels))\n"
           "parallel.predict(mixed)\n")
    result = unsafe_fix(script(fit=fit))
    assert ("parallel.fit(hot.astype('float32'), labels.astype('float32'), batch_size=16, "
            "validation_data=(hot.astype('float32'), labels.astype('float32')))\n") in result
    assert "parallel.predict(mixed)\n" in result
    assert unsafe_fix(result) == result


@pytest.mark.parametrize("layer, refused", [
    ("keras.layers.Dense(4, activity_regularizer=keras.regularizers.l1(1e-4))", True),
    ("keras.layers.ActivityRegularization(l1=1e-4)", True),
    ("keras.layers.Dense(4, activity_regularizer=None)", False),
])
def test_an_activity_regularizer_is_refused(layer, refused):
    """The parallel model's template added its activity term once for each device's slice,
    MirroredStrategy's replicas once as their average: a held-out autoencoder's loss differed from
    step 0 (0.7902 against 0.7895), and agreed with the regularizer left out of both."""
    source = script(extra=f"extra_layer = {layer}\n")
    if refused:
        assert "regularizes its activity" in refusal(source)
    else:
        assert "MirroredStrategy()" in unsafe_fix(source)


def test_a_hanging_indent_call_s_inner_continuation_lines_stay():
    """`fit_generator(` with its first argument on the next line aligns nothing under its
    parenthesis: a line aligned under an inner call's parenthesis stays where it is."""
    fit = ("parallel.fit_generator(\n"
           "    batches(16), steps_per_epoch=4,\n"
           "    validation_data=batches(8,\n"
           "                            4), validation_steps=2)\n")
    extra = """
        def batches(size, more=0):
            while True:
                yield x[:size], y[:size]
    """
    result = unsafe_fix(script(fit=fit, extra=extra))
    assert ("BatchesInOrder.fit(\n"
            "    parallel, batches(16), steps_per_epoch=4,\n"
            "    validation_data=batches(8,\n"
            "                            4), validation_steps=2)\n") in result


BUILDER_CLEARS_SESSION = """
    def create_model(size):
        '''keras-yolo3's create_model: a fresh session for every model it makes.'''
        K.clear_session()  # get a new session
        inputs = Input(shape=(size,))
        return Model(inputs, Dense(2, activation='softmax')(inputs))
"""


@pytest.mark.parametrize("second_caller", [False, True])
def test_a_keras_session_cleared_by_the_builder_is_cleared_before_the_strategy(second_caller):
    """Under the strategy's scope `K.clear_session()` reset what the scope had entered, and leaving
    it failed ("IndexError: pop from empty list", a held-out keras-yolo3 program): the call moves
    before the strategy is made. A builder other code calls too keeps it: refused."""
    source = script().replace("import keras\n", "import keras\nfrom keras import backend as K\n").replace(
        "model = Model(input=inputs, output=Dense(2, activation='softmax')(inputs))", "model = create_model(4)")
    source = source.replace("inputs = Input(shape=(4,))\n", "")
    source = source.replace("x = np.zeros", textwrap.dedent(BUILDER_CLEARS_SESSION) + "\n\nx = np.zeros")
    if second_caller:
        message = refusal(source + "other = create_model(8)\n")
        assert "`create_model` clears the Keras session (line 16)" in message
        return
    result = unsafe_fix(source)
    assert ("K.clear_session()  # get a new session\n"
            "strategy = tf.distribute.MirroredStrategy()\n"
            "with strategy.scope():\n"
            "    model = create_model(4)\n") in result
    assert "    '''keras-yolo3's create_model: a fresh session for every model it makes.'''\n    inputs = " in result


SESSION_SETUP = """
    from keras.backend.tensorflow_backend import set_session
    config = tf.ConfigProto(allow_soft_placement=True, intra_op_parallelism_threads=1)
    config.gpu_options.allow_growth = True
    config.log_device_placement = False
    sess = tf.Session(config=config)
    set_session(sess)
"""


def test_a_keras_session_set_up_becomes_tf2_s_settings_so_the_program_leaves_tf1_mode():
    """The Keras FAQ's and keras-yolo3's block (`tf.ConfigProto`, `tf.Session`, `set_session`) kept
    the program in TF1 mode, where its fit was refused; each option has a `tf.config` setting."""
    source = script(fit="parallel.fit(x, y, batch_size=16, validation_data=(x, y))").replace(
        "tf.random.set_seed(0)\n", "tf.random.set_seed(0)\n" + textwrap.dedent(SESSION_SETUP))
    result = unsafe_fix(source)
    assert ("tf.random.set_seed(0)\n"
            "tf.config.set_soft_device_placement(True)\n"
            "tf.config.threading.set_intra_op_parallelism_threads(1)\n"
            "for gpu in tf.config.list_physical_devices('GPU'):\n"
            "    tf.config.experimental.set_memory_growth(gpu, True)\n"
            "tf.debugging.set_log_device_placement(False)\n"
            "x = np.zeros") in result
    assert "Session" not in result and "ConfigProto" not in result and "set_session" not in result
    assert "with strategy.scope():" in result


@pytest.mark.parametrize("old, new, reason", [
    ("config.gpu_options.allow_growth = True", "config.gpu_options.force_gpu_compatible = True",
     "`gpu_options.force_gpu_compatible` has no TF2 setting of the same meaning"),
    ("set_session(sess)", "set_session(sess)\nprint(sess.run(tf.constant(1)))", "`sess` is read outside the session set-up"),
])
def test_a_session_set_up_without_a_tf2_equivalent_keeps_the_module_in_tf1_mode(old, new, reason):
    """An option without a TF2 setting, and a session read elsewhere (TF1 code): the module stays in
    TF1 mode, and the refusal says which line keeps it there."""
    source = script(fit="parallel.fit(x, y, batch_size=16, validation_data=(x, y))").replace(
        "tf.random.set_seed(0)\n", "tf.random.set_seed(0)\n" + textwrap.dedent(SESSION_SETUP).replace(old, new) + "\n")
    message = refusal(source)
    assert "evaluates whole batches only" in message and "(the Keras session set-up stays TF1, line " in message
    assert reason in message


def test_a_session_made_by_a_function_of_the_module_becomes_tf2_s_settings_and_the_function_goes():
    """keras-retinanet's `set_session(get_session())`: the function builds the config and returns
    the session; it goes with the call, whose place takes the settings."""
    extra = '''
        def get_session():
            """ Construct a modified tf session."""
            config = tf.ConfigProto()
            config.gpu_options.allow_growth = True
            return tf.Session(config=config)
    '''
    source = script().replace("tf.random.set_seed(0)\n", "tf.random.set_seed(0)\nkeras.backend.tensorflow_backend."
                                                           "set_session(get_session())\n") + textwrap.dedent(extra)
    result = unsafe_fix(source)
    assert ("tf.random.set_seed(0)\n"
            "for gpu in tf.config.list_physical_devices('GPU'):\n"
            "    tf.config.experimental.set_memory_growth(gpu, True)\n") in result
    assert "get_session" not in result and "with strategy.scope():" in result
    assert "runs in TF1 mode" in refusal(source + "sess = get_session()\n")  # made for another use too


def test_the_template_chosen_when_one_gpu_and_a_kaggle_session_line_are_rewritten():
    """`model = multi_gpu_model(model, gpus=n) if n > 1 else model` is the template either way under
    the strategy; `K.set_session(tf.Session(config=config))` at the top becomes `tf.config`."""
    source = script().replace("parallel = multi_gpu_model(model, gpus=2)", "parallel = multi_gpu_model(model, gpus=n) if n > 1 else model")
    source = source.replace("import keras\n", "import keras\nfrom keras import backend as K\n").replace(
        "tf.random.set_seed(0)\n", "tf.random.set_seed(0)\nn = 2\nconfig = tf.ConfigProto()\n"
        "config.gpu_options.allow_growth = True\nK.set_session(tf.Session(config=config))\n")
    result = unsafe_fix(source)
    assert "    parallel = model\n    parallel.compile(" in result and "multi_gpu_model" not in result
    assert "n = 2\nfor gpu in tf.config.list_physical_devices('GPU'):\n" in result and "Session" not in result


def test_a_checkpoint_s_own_set_model_sets_the_template_through_super():
    """`def set_model(self, model): self.model = self.template` becomes `super().set_model(...)`: as
    `self.set_model(...)` it called itself forever (a held-out speech kernel)."""
    extra = """
        class TemplateCheckpoint(keras.callbacks.ModelCheckpoint):
            def __init__(self, template, *args, **kwargs):
                super(TemplateCheckpoint, self).__init__(*args, **kwargs)
                self.template = template

            def set_model(self, model):
                self.model = self.template
    """
    result = unsafe_fix(script(extra=extra))
    assert "    def set_model(self, model):\n        super().set_model(self.template)\n" in result


def test_k_l2_normalize_becomes_ops_normalize_with_tf_s_epsilon():
    """`K.l2_normalize` divides by sqrt(max(sum(x^2), 1e-12)) over all axes unless given one;
    `ops.normalize` by max(norm, epsilon) over the last: the same with `epsilon=1e-6` (checked
    equal on TF 2.21, a near-zero row included)."""
    extra = """
        def embed(t):
            return K.l2_normalize(t, axis=1) + K.l2_normalize(t)
    """
    result = unsafe_fix(script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n"))
    assert ("return ops.normalize(t, axis=1, epsilon=1e-6) + ops.normalize(t, axis=None, epsilon=1e-6)\n") in result


def test_k_reverse_becomes_ops_flip_on_the_same_axes():
    """`K.reverse(x, axes)` is gone from Keras 3's backend (keras's addition_rnn reverses its input
    in a `Lambda`, a held-out copy of it was refused); `ops.flip(x, axis)` takes one axis or
    several, as `axes` did (the held-out program matched over 20 steps so)."""
    extra = """
        def backwards(t):
            return K.reverse(t, axes=1) + K.reverse(t, [0, 1]) + K.reverse(t, 2)
    """
    result = unsafe_fix(script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n"))
    assert "return ops.flip(t, axis=1) + ops.flip(t, [0, 1]) + ops.flip(t, 2)\n" in result


def test_k_batch_flatten_becomes_a_reshape_by_the_batch_size():
    """`K.batch_flatten(x)` is gone from Keras 3's backend (keras-yolo3's loss flattens each
    image's terms with it; a held-out copy was refused): each example's values in a row, as Keras 2
    did (the held-out program matched over 20 steps so)."""
    extra = """
        def per_image(t):
            return K.sum(K.batch_flatten(t), axis=-1, keepdims=True)
    """
    result = unsafe_fix(script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n"))
    assert "return ops.sum(ops.reshape(t, (ops.shape(t)[0], -1)), axis=-1, keepdims=True)\n" in result


def test_keras_2_short_names_of_losses_and_metrics_are_given_in_full():
    """Keras 3 dropped `mse`, `mae`, `logcosh`, ... (a held-out VAE failed on `from keras.losses
    import mse`): imported under the short name, or called through the module, by the full one."""
    extra = """
        from keras.losses import mse, binary_crossentropy
        from keras.metrics import mae as MAE
        def combined(a, b):
            return mse(a, b) + keras.losses.logcosh(a, b) + MAE(a, b)
    """
    result = unsafe_fix(script(extra=extra))
    assert "from keras.losses import mean_squared_error as mse, binary_crossentropy\n" in result
    assert "from keras.metrics import mean_absolute_error as MAE\n" in result
    assert "return mse(a, b) + keras.losses.log_cosh(a, b) + MAE(a, b)\n" in result


@pytest.mark.parametrize("term, loss, reason", [
    ("def vae_loss(y_true, y_pred):\n    return K.mean(K.square(y_pred - y_true), axis=-1) + K.mean(K.square(z_mean), axis=-1)\n",
     "vae_loss", "the loss or metric `vae_loss` reads `z_mean`, a tensor of the model"),
    ("model.add_loss(K.mean(K.square(z_mean)))\n",
     "None", "`model.add_loss(...)` adds a loss to a functional model, which Keras 3 does not do"),
])
def test_a_loss_made_of_the_model_s_own_tensors_is_refused(term, loss, reason):
    """Keras 2's VAE example adds its KL term with `vae.add_loss(...)` or reads `z_mean` in a loss
    closure; Keras 3 raises NotImplementedError for the first and cannot use a KerasTensor outside a
    layer for the second (two held-out VAEs crashed so)."""
    source = replaced(script(), ("import keras\n", "import keras\nfrom keras import backend as K\n"),
                      ("parallel = multi_gpu_model(", "z_mean = Dense(2)(inputs)\n" + term + "parallel = multi_gpu_model("),
                      ("parallel.compile(loss='categorical_crossentropy'", f"parallel.compile(loss={loss}"))
    assert reason in refusal(source)


def test_a_loss_factory_slicing_its_own_names_out_of_the_prediction_is_not_refused():
    """A loss factory whose inner loss binds `x_decoded` by slicing `y_pred` (a held-out VAE packs
    its outputs in one tensor) reads no tensor of the model, though the model builder has one of
    that name: fixed, as before (it matched over 20 steps)."""
    source = replaced(script(), ("import keras\n", "import keras\nfrom keras import backend as K\n"),
                      ("parallel = multi_gpu_model(", "x_decoded = Dense(2)(inputs)\n"
                       "def make_loss(scale):\n"
                       "    def loss(y_true, y_pred):\n"
                       "        x_decoded = y_pred[:, :1]\n"
                       "        return scale * K.mean(K.square(x_decoded - y_true[:, :1]), axis=-1)\n"
                       "    return loss\n"
                       "parallel = multi_gpu_model("),
                      ("parallel.compile(loss='categorical_crossentropy'", "parallel.compile(loss=make_loss(2.0)"))
    (finding,) = [f for f in run_check(source) if f.code == "TFM201"]
    assert finding.fixable, finding.message


def test_gpu_options_given_to_the_config_become_their_settings():
    source = script().replace("tf.random.set_seed(0)\n", "tf.random.set_seed(0)\n"
                              "gpu_options = tf.GPUOptions(allow_growth=True)\n"
                              "keras.backend.set_session(tf.Session(config=tf.ConfigProto(gpu_options=gpu_options)))\n")
    result = unsafe_fix(source)
    assert "tf.random.set_seed(0)\nfor gpu in tf.config.list_physical_devices('GPU'):\n" in result
    assert "GPUOptions" not in result and "Session" not in result


@pytest.mark.parametrize("init, made", [
    ("def __init__(self, template, filepath, **kwargs):\n                super().__init__(filepath, **kwargs)",
     "TemplateCheckpoint(model, 'w.h5', save_weights_only=True)"),
    ("def __init__(self, template, *args, **kwargs):\n                super().__init__(*args, **kwargs)",
     "TemplateCheckpoint(model, 'w.h5', save_weights_only=True)"),
])
def test_a_checkpoint_subclass_s_file_is_found_by_its_own_parameters(init, made):
    """A subclass taking the template first (`(self, template_model, filepath, **kwargs)`, a held-out
    DeepLab trainer's) had its template renamed, not its file; Keras 3 then refused the `.h5`."""
    extra = f"""
        class TemplateCheckpoint(keras.callbacks.ModelCheckpoint):
            {init}

        checkpoint = {made}
    """
    result = unsafe_fix(script(extra=extra))
    assert "checkpoint = TemplateCheckpoint(model, 'w.weights.h5', save_weights_only=True)\n" in result


def test_keras_2_s_acc_log_names_become_keras_3_s_where_the_model_compiles_accuracy():
    """Keras 2.2 logged `metrics=['accuracy']` as `acc`/`val_acc`, Keras 3 as `accuracy`: a
    checkpoint monitoring `val_acc` failed in Keras 3 (a held-out DenseNet trainer), and a
    history read by the old name would fail after training."""
    fit = ("parallel.compile(loss='categorical_crossentropy', optimizer='sgd', metrics=['accuracy'])\n"
           "stop = keras.callbacks.EarlyStopping(monitor='val_acc', patience=2)\n"
           "history = parallel.fit(x, y, batch_size=16, validation_data=(x, y), callbacks=[stop])\n"
           "print(history.history['acc'][-1], history.history.get('val_acc'), history.history['loss'])\n")
    result = unsafe_fix(script(fit=fit))
    assert "EarlyStopping(monitor='val_accuracy', patience=2)" in result
    assert "print(history.history['accuracy'][-1], history.history.get('val_accuracy'), history.history['loss'])" in result
    unchanged = unsafe_fix(script(fit=fit.replace("metrics=['accuracy']", "metrics=['acc']")))
    assert "monitor='val_acc'" in unchanged  # Keras 3 logs `acc` under the name it was given


@pytest.mark.parametrize("layer, rewritten", [("keras.layers.LSTM(4)", True), ("Dense(4)", False)])
def test_predictions_of_a_recurrent_model_go_through_predict_rows(layer, rewritten):
    """Keras 3 under a strategy fails to predict fewer rows than replicas with a recurrent layer
    (a held-out addition_rnn crashed after training; tests/test_fix_runs.py shows it)."""
    source = script(fit="parallel.fit(x, y, batch_size=16)\nprint(model.predict(x[:1], verbose=0))").replace(
        "model = Model(input=inputs, output=Dense(2, activation='softmax')(inputs))",
        f"model = Model(input=inputs, output=Dense(2, activation='softmax')({layer}(keras.layers.Reshape((4, 1))(inputs))))")
    result = unsafe_fix(source)
    assert ("print(predict_rows(model, x[:1], verbose=0))" in result) is rewritten
    assert ("\ndef predict_rows(model, x, **arguments):\n" in result) is rewritten


def test_predict_classes_and_predict_proba_which_keras_3_dropped_become_keras_2_s_meaning():
    """Keras 2's `Sequential.predict_classes` took the argmax of the predictions, or thresholded
    one sigmoid output at 0.5; `predict_proba` was `predict`. Keras 3 has neither (AttributeError
    after training). The function the fix writes is run here on predictions of both kinds."""
    fit = ("parallel.fit(x, y, batch_size=16)\n"
           "print(model.predict_classes(x, verbose=0), parallel.predict_proba(x), other.predict_proba(x))\n")
    result = unsafe_fix(script(fit=fit))
    assert "print(predict_classes(model, x, verbose=0), parallel.predict(x), other.predict_proba(x))\n" in result
    start = result.index("def predict_classes")
    namespace: dict = {}
    exec(result[start:result.index("\n\n\n", start)], namespace)

    class Predicts:
        def __init__(self, rows):
            self.rows = rows

        def predict(self, x, **arguments):
            return self.rows

    import numpy as np
    softmax = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]])
    sigmoid = np.array([[0.2], [0.9], [0.5]])
    assert namespace["predict_classes"](Predicts(softmax), None).tolist() == [1, 0]
    assert namespace["predict_classes"](Predicts(sigmoid), None).tolist() == [[0], [1], [0]]


@pytest.mark.parametrize("optimizer", ["SGD(lr=0.1, clipnorm=1.0)", "keras.optimizers.Adam(clipvalue=0.5)"])
def test_an_optimizer_that_clips_becomes_one_that_clips_the_replicas_sum(optimizer):
    """Keras 3 under a strategy clips each replica's gradient before the sum; the parallel model
    clipped the sum. `SummedClip<Name>` sums first (tests/test_fix_runs.py trains it)."""
    result = unsafe_fix(script(optimizer=optimizer))
    name = "SGD" if optimizer.startswith("SGD") else "Adam"
    assert f"class SummedClip{name}(keras.optimizers.{name}):" in result
    assert f"optimizer=SummedClip{name}(" in result and "summed = context.all_reduce(\"sum\", summed)" in result


def test_a_clipping_adam_beside_an_embedding_clips_the_sum_of_dense_gradients():
    """A Kaggle text kernel's `Adam(lr, clipnorm=1.0)` in a module with an Embedding was refused:
    an Adam stepped as Keras 2's (dense rows) could not also clip the replicas' sum.
    `SummedClipAdam` makes every gradient dense to sum it, which adds up an Embedding's rows as
    Keras 2 did (tests/test_fix_runs.py trains the class; a held-out GRU kernel: MATCH)."""
    extra = """
        from keras.layers import Embedding
        vocabulary = Embedding(100, 8)
    """
    result = unsafe_fix(script(optimizer="keras.optimizers.Adam(lr=1e-3, clipnorm=1.0)", extra=extra))
    assert "optimizer=SummedClipAdam(learning_rate=1e-3, clipnorm=1.0)" in result
    assert "class DenseGradientAdam" not in result and "summed = [tf.convert_to_tensor(grads[i]) for i in present]" in result


def test_visible_gpus_and_a_memory_fraction_become_tf2_settings():
    """`visible_device_list` is `tf.config.set_visible_devices` (where there are GPUs: TF1 ignored
    the list without them); a memory fraction, which TF2 caps in megabytes only, becomes memory
    growth, with a comment saying so, and growth asked twice is set once."""
    setup = textwrap.dedent(SESSION_SETUP).replace(
        "config.log_device_placement = False\n",
        "config.gpu_options.per_process_gpu_memory_fraction = 0.4\nconfig.gpu_options.visible_device_list = '0,1'\n")
    result = unsafe_fix(script().replace("tf.random.set_seed(0)\n", "tf.random.set_seed(0)\n" + setup))
    assert ("# per_process_gpu_memory_fraction=0.4: TF2 caps GPU memory in MB only (memory_limit); it grows as needed\n"
            "for gpu in tf.config.list_physical_devices('GPU'):\n"
            "    tf.config.experimental.set_memory_growth(gpu, True)\n"
            "gpus = tf.config.list_physical_devices('GPU')\n"
            "if gpus:\n"
            "    tf.config.set_visible_devices([gpus[int(i)] for i in str('0,1').split(',')], 'GPU')\n") in result
    assert result.count("set_memory_growth") == 1


@pytest.mark.parametrize("line, expected", [
    ("from keras.engine.topology import Layer, InputSpec", "from keras.layers import Layer, InputSpec"),
    ("from keras.engine import Layer", "from keras.layers import Layer"),
    ("from keras.engine.training import Model as Trainable", "from keras.models import Model as Trainable"),
    ("from keras.engine.topology import Layer, Network", "from keras.engine.topology import Layer, Network"),
])
def test_keras_2_engine_imports_move_to_where_keras_3_keeps_the_names(line, expected):
    """A custom layer's `from keras.engine.topology import Layer` failed on Keras 3 (no
    `keras.engine`; a held-out DeepFM program). A name with no Keras 3 home keeps the line."""
    result = unsafe_fix(script().replace("from keras.utils import multi_gpu_model\n",
                                         f"from keras.utils import multi_gpu_model\n{line}\n"))
    assert f"\n{expected}\n" in result


PASSED_TEMPLATE = """
    import numpy as np
    import tensorflow as tf
    from keras import backend as K
    from keras.layers import Dense, Input
    from keras.models import Model
    from keras.optimizers import SGD
    from keras.utils import multi_gpu_model


    def train(model, x, y, lr=0.1):
        parallel = multi_gpu_model(model, gpus=2)
        parallel.compile(loss='mse', optimizer=SGD(lr=lr))
        K.set_value(parallel.optimizer.lr, lr * 0.1)
        return parallel.fit(x, y, batch_size=16)


    x = np.zeros((64, 4), 'float32')
    with tf.device('/cpu:0'):
        # the template, built once
        inputs = Input(shape=(4,))
        template = Model(inputs, Dense(1)(inputs))
    train(template, x, x[:, :1])
    CALLED_AGAIN
"""


def test_a_template_passed_to_the_function_that_wraps_it_is_built_under_the_scope_by_its_caller():
    """`def train(model, ...)` wrapping the model it receives (Keras's mnist_transfer_cnn with GPUs
    added): the caller builds the template under the strategy's scope, once for both calls, and
    the function compiles it under the model's own strategy (Keras 3 makes the optimizer where
    `compile` runs). Keras's backend import, read by nothing after `K.set_value` is `assign`, goes."""
    source = textwrap.dedent(PASSED_TEMPLATE).replace("CALLED_AGAIN", "train(template, x, x[:, 1:2])")
    result = unsafe_fix(source)
    assert ("def train(model, x, y, lr=0.1):\n"
            "    with model.distribute_strategy.scope():\n"
            "        parallel = model\n"
            "        parallel.compile(loss='mse', optimizer=SGD(learning_rate=lr))\n"
            "    parallel.optimizer.learning_rate.assign(lr * 0.1)\n") in result
    assert ("strategy = tf.distribute.MirroredStrategy()\n"
            "with strategy.scope():\n"
            "    # the template, built once\n"
            "    inputs = Input(shape=(4,))\n") in result
    assert result.count("MirroredStrategy()") == 1 and "backend" not in result and "multi_gpu_model" not in result


@pytest.mark.parametrize("called, reason", [
    ("callbacks = [train]", "`train` is passed around, not only called"),
    ("train(template.layers[0], x, x)", "a call of `train` does not pass the model by name"),
    ("train(other, x, x)", "`other`, passed to `train` on line 23, is not built in the caller's block"),
])
def test_a_template_parameter_whose_callers_cannot_be_followed_is_refused_with_the_reason(called, reason):
    source = textwrap.dedent(PASSED_TEMPLATE).replace("CALLED_AGAIN", called)
    message = refusal(source)
    assert reason in message and "use `model` in place of the parallel model" in message


def test_a_model_mgpu_wrapper_class_is_the_parallel_model_and_goes_with_its_one_call():
    """`class ModelMGPU(Model)` (from a Keras issue, widely copied) makes `multi_gpu_model` in its
    `__init__` and sends save/load to the template: one finding, on its call, and the class goes."""
    program = (FIXTURES / "programs" / "fix_keras_template_passed_to_train.py").read_text()
    start = program.index("class ModelMGPU(Model):")
    wrapper = program[start:program.index("\n\n\n", start)] + "\n\n\n"
    source = script().replace("inputs = Input", wrapper + "inputs = Input").replace(
        "multi_gpu_model(model, gpus=2)", "ModelMGPU(model, 2)")
    findings = [f for f in run_check(source) if f.code == "TFM201"]
    assert len(findings) == 1 and findings[0].fixable and "`ModelMGPU(...)` wraps Keras `multi_gpu_model(...)`" in findings[0].message
    result = unsafe_fix(source)
    assert "ModelMGPU" not in result and "    parallel = model\n" in result


def test_train_on_batch_of_a_batch_normalized_model_is_split_by_fit():
    """Keras 3 under a strategy runs `train_on_batch` on the whole batch on every replica (checked:
    the weights of one device, to the bit): batch statistics over the whole batch, where the
    parallel model normalized each GPU's slice by its own (this was refused). `fit` splits it:
    `train_split(model, ...)` fits the one batch (tests/test_fix_runs.py trains it). Without
    normalization `train_on_batch` stays."""
    fit = "loss = parallel.train_on_batch(x, y)"
    normalized = unsafe_fix(script(fit=fit).replace("(inputs))", "(BatchNormalization()(inputs)))").replace(
        "from keras.layers import Input\n", "from keras.layers import Input, BatchNormalization\n"))
    assert "loss = train_split(parallel, x, y)\n" in normalized
    assert "\ndef train_split(model, x, y=None, sample_weight=None, class_weight=None, reset_metrics=True):\n" in normalized
    assert "    history = model.fit(x, y, sample_weight=sample_weight, class_weight=class_weight, batch_size=rows" in normalized
    assert "loss = parallel.train_on_batch(x, y)" in unsafe_fix(script(fit=fit))


def test_per_example_weights_with_targets_by_output_name_are_refused():
    """Keras 3.15 fails on `sample_weight` when the targets are a dict by output name ("KeyError:
    0"), whatever form the weights take (checked: a dict, a list, one array)."""
    fit = "parallel.fit(x, {'out': y}, sample_weight={'out': np.ones(64)}, batch_size=16)"
    assert "targets are a dict by output name" in refusal(script(fit=fit))


@pytest.mark.parametrize("saved", ["self.template.save_weights(self.path.format(epoch=epoch + 1))",
                                   "path = self.path.format(epoch=epoch + 1)\n        self.template.save_weights(path)"])
def test_a_weights_file_pattern_a_callback_formats_and_a_file_read_back_are_renamed_together(saved):
    """A callback saving the template to `self.path.format(epoch=...)`, or to a name bound to it
    (AltModelCheckpoint's `path = ...`; the pattern passed where the callback is made), and the
    final file read back into a rebuilt model: all `.weights.h5`."""
    callback = textwrap.dedent("""
        class TemplateCheckpoint(keras.callbacks.Callback):
            def __init__(self, template, path):
                super().__init__()
                self.template = template
                self.path = path

            def on_epoch_end(self, epoch, logs=None):
                SAVED

    """).replace("SAVED", saved)
    fit = ("parallel.fit(x, y, batch_size=16, callbacks=[TemplateCheckpoint(model, 'w{epoch:02d}.h5')])\n"
           "model.save_weights('final.h5')\n"
           "again = Model(inputs, Dense(2)(inputs))\n"
           "again.load_weights('final.h5')")
    result = unsafe_fix(script(fit=fit).replace("inputs = Input", callback + "inputs = Input"))
    assert "TemplateCheckpoint(model, 'w{epoch:02d}.weights.h5')" in result
    assert result.count("'final.weights.h5'") == 2


def test_a_compile_after_the_branch_choosing_the_parallel_model_starts_its_scope_at_the_optimizer():
    """`if gpus > 1:` building the template on the CPU and wrapping it, `else:` building it alone,
    then the optimizer and `compile` after the `if` (age-gender-estimation's train.py): the
    compile's scope starts at the optimizer, not above the branch (which it had wrapped again on
    each fix, the call never rewritten); the comment over the template's line stays."""
    source = textwrap.dedent("""
        import tensorflow as tf
        from keras.layers import Dense, Input
        from keras.models import Model
        from keras.optimizers import SGD
        from keras.utils import multi_gpu_model


        def build():
            inputs = Input(shape=(4,))
            return Model(inputs, Dense(1)(inputs))


        def main(gpus, lr):
            settings = dict(lr=lr)
            if gpus > 1:
                with tf.device('/cpu:0'):
                    # built on the CPU
                    single = build()
                model = multi_gpu_model(single, gpus=gpus)
            else:
                single = model = build()
            sgd = SGD(lr=settings['lr'])
            model.compile(optimizer=sgd, loss='mse')
    """)
    result = unsafe_fix(source)
    assert ("        with strategy.scope():\n"
            "            # built on the CPU\n"
            "            single = build()\n"
            "            model = single\n"
            "    else:\n") in result
    assert ("    with model.distribute_strategy.scope():\n"
            "        sgd = SGD(learning_rate=settings['lr'])\n") in result


def test_keras_2_backend_functions_keras_3_lacks_are_written_into_the_module():
    """`K.ctc_batch_cost` and `K.function` (Keras's image_ocr example) are gone from Keras 3's
    backend: each call goes to a function of the same meaning written after the imports
    (tests/test_fix_runs.py runs both); a module that already has the name is refused."""
    extra = """
        def ctc_lambda_func(args):
            y_pred, labels, input_length, label_length = args
            return K.ctc_batch_cost(labels, y_pred, input_length, label_length)

        read = K.function([inputs], [model.output])
    """
    source = script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n")
    result = unsafe_fix(source)
    assert "\ndef ctc_batch_cost(y_true, y_pred, input_length, label_length):\n" in result
    assert "    return ctc_batch_cost(labels, y_pred, input_length, label_length)\n" in result
    assert "read = backend_function([inputs], [model.output])\n" in result and "backend as K" not in result
    taken = source.replace("read = K.function", "backend_function = None\nread = K.function")
    assert "`backend_function`, the function the fix would write for `K.function`, is a name of the module" in refusal(taken)


def test_optimizer_arguments_passed_by_position_are_named_by_keras_2s_order():
    """`Adam(0.0002, 0.5)` (Keras-GAN's): Keras 2 took `beta_1` second, as Keras 3 does, but the
    orders part after `epsilon` (Keras 2's `decay`, Keras 3's `amsgrad`): each is named by Keras
    2's order. More than Keras 2 took is refused."""
    result = unsafe_fix(script(optimizer="keras.optimizers.Adam(0.0002, 0.5, 0.999, None, 0.0)"))
    assert "optimizer=keras.optimizers.Adam(0.0002, beta_1=0.5, beta_2=0.999))" in result
    assert "pass its arguments after the learning rate by keyword" in refusal(script(optimizer="SGD(0.1, 0.9, 0.0, True, 1)"))


def test_layer_sizes_computed_by_numpy_are_made_python_integers():
    """Keras 3 refuses a NumPy integer as `Dense` units or an `Embedding` size ("Received an
    invalid value for `units`"), which Keras 2 took: Keras-GAN's `Dense(np.prod(img_shape))`, a
    Kaggle kernel's `vocab = np.max(x) + 1`."""
    extra = """
        vocab = np.max(x).astype('int32') + 1
        layers = [Dense(np.prod((2, 3))), keras.layers.Embedding(vocab, 8), Dense(int(np.prod((2, 2))))]
    """
    result = unsafe_fix(script(extra=extra))
    assert "layers = [Dense(int(np.prod((2, 3)))), keras.layers.Embedding(int(vocab), 8), Dense(int(np.prod((2, 2))))]" in result


GAN = """
    import numpy as np
    import tensorflow as tf
    from keras.layers import Dense, Input
    from keras.models import Model, Sequential
    from keras.optimizers import Adam
    from keras.utils import multi_gpu_model


    class GAN:
        def __init__(self):
            optimizer = Adam(0.0002, 0.5)
            with tf.device('/cpu:0'):
                self.discriminator = Sequential([Dense(1, activation='sigmoid', input_shape=(4,))])
            self.parallel_discriminator = multi_gpu_model(self.discriminator, gpus=2)
            self.parallel_discriminator.compile(loss='binary_crossentropy', optimizer=optimizer)
            with tf.device('/cpu:0'):
                self.generator = Sequential([Dense(4, input_shape=(2,))])
                z = Input(shape=(2,))
                self.discriminator.trainable = False
                self.combined = Model(z, self.discriminator(self.generator(z)))
            self.parallel_combined = multi_gpu_model(self.combined, gpus=2)
            self.parallel_combined.compile(loss='binary_crossentropy', optimizer=Adam(0.0002, 0.5))

        def train(self, images, noise, valid, fake):
            self.parallel_discriminator.train_on_batch(images, valid)
            self.parallel_discriminator.train_on_batch(self.generator.predict(noise), fake)
            return self.parallel_combined.train_on_batch(noise, valid)
"""


def test_a_gan_discriminator_frozen_after_compile_trains_as_keras_2_trained_it_under_one_strategy():
    """Keras-GAN's layout: the discriminator compiled, frozen (`trainable = False`), then the
    combined model compiled around it. Keras 2 kept training the discriminator through its own
    `train_on_batch` (the weights fixed when it was compiled); Keras 3 reads the flag when it
    trains and trained none (checked): its steps go through `train_as_compiled`, written into
    the module. The combined model, which holds the discriminator, is built under the same
    strategy (a held-out GAN migrated with the steps as they were differed from step 3; with
    them it matched 30 of 30, its models' initial weights set alike)."""
    result = unsafe_fix(textwrap.dedent(GAN))
    assert "\ndef train_as_compiled(model, *args, **kwargs):\n" in result
    assert "        train_as_compiled(self.parallel_discriminator, images, valid)\n" in result
    assert "        return self.parallel_combined.train_on_batch(noise, valid)\n" in result
    assert result.count("MirroredStrategy()") == 1 and result.count("with strategy.scope():") == 2


def test_a_model_frozen_before_it_is_compiled_keeps_its_steps_and_one_fitted_after_is_refused():
    """Frozen before its compile, Keras 2 trained none of it either: its steps stay. Fitted
    after being frozen, it is refused (the same flag, read when `fit` trains)."""
    frozen_first = script(fit="parallel.train_on_batch(x, y)").replace(
        "parallel = multi_gpu_model", "model.trainable = False\nparallel = multi_gpu_model")
    result = unsafe_fix(frozen_first)
    assert "train_as_compiled" not in result and "parallel.train_on_batch(x, y)" in result
    fitted = textwrap.dedent(GAN).replace("self.parallel_discriminator.train_on_batch(images, valid)",
                                          "self.parallel_discriminator.fit(images, valid)")
    findings = [f for f in run_check(fitted) if f.code == "TFM201" and not f.fixable]
    assert any("the model is frozen after it is compiled" in f.message for f in findings)


@pytest.mark.parametrize("extra, refused", [
    # an application built with batch normalization, all its layers frozen to train a new head
    ("base = keras.applications.MobileNet(weights=None, include_top=False)\n"
     "for layer in base.layers:\n    layer.trainable = False\n", True),
    # VGG16 has none
    ("base = keras.applications.VGG16(weights=None, include_top=False)\n"
     "for layer in base.layers:\n    layer.trainable = False\n", False),
    # the module's own model: layers picked by position, which may not be the normalization
    ("for i in range(3):\n    model.layers[i].trainable = False\nnorm = keras.layers.BatchNormalization()\n", False),
    # a discriminator whose builder normalizes, frozen in the combined model; and one that does not
    ("def build_discriminator():\n    return keras.Sequential([keras.layers.BatchNormalization()])\n"
     "discriminator = build_discriminator()\ndiscriminator.trainable = False\n", True),
    ("def build_discriminator():\n    return keras.Sequential([keras.layers.Dense(1)])\n"
     "def build_generator():\n    return keras.Sequential([keras.layers.BatchNormalization()])\n"
     "discriminator = build_discriminator()\ndiscriminator.trainable = False\n", False),
    # PyImageSearch's fine-tuning: every layer frozen but the batch normalization ones
    ("base = keras.applications.MobileNet(weights=None, include_top=False)\n"
     "for layer in base.layers:\n    if isinstance(layer, keras.layers.BatchNormalization):\n        continue\n"
     "    layer.trainable = False\n", False),
])
def test_freezing_batch_normalization_is_refused_where_it_surely_is(extra, refused):
    """Keras 3 runs a frozen `BatchNormalization` in inference mode (its moving statistics); Keras
    2 still normalized by the batch's while training (a held-out MobileNet fine-tuning differed
    from step 0: 1.48 against 1.39). Refused only where the frozen layers surely hold some."""
    findings = [f for f in run_check(script(extra=extra)) if f.code == "TFM201"]
    assert any("freezes batch normalization" in f.message for f in findings) == refused


def test_a_decay_with_a_rate_callback_decays_the_rate_the_callback_sets():
    """A schedule cannot be set by `ReduceLROnPlateau`: with one in the module, `decay=` makes a
    `Decayed<Name>` class (tests/test_fix_runs.py steps it against Keras 2's), over the class an
    `Embedding` already needs where there is one."""
    extra = "cb = keras.callbacks.ReduceLROnPlateau(patience=2)\n"
    result = unsafe_fix(script(optimizer="SGD(lr=0.1, decay=1e-4)", extra=extra))
    assert "class DecayedSGD(keras.optimizers.SGD):" in result and "optimizer=DecayedSGD(learning_rate=0.1, decay=1e-4))" in result
    embedded = script(optimizer="keras.optimizers.Adam(lr=0.1, decay=1e-4)", extra=extra + "emb = keras.layers.Embedding(10, 2)\n")
    result = unsafe_fix(embedded)
    assert "class DenseGradientAdam(keras.optimizers.Adam):" in result
    assert "class DecayedDenseGradientAdam(DenseGradientAdam):" in result
    assert result.index("class DenseGradientAdam(") < result.index("class DecayedDenseGradientAdam(")


@pytest.mark.parametrize("sets", [
    "K.set_value(self.model.optimizer.lr, 0.5 * K.get_value(self.model.optimizer.lr))",
    "K.set_value(self.model.optimizer.learning_rate, 0.05)",
])
def test_a_decay_with_a_callback_setting_the_rate_by_hand_decays_the_rate_it_sets(sets):
    """keras's cifar10_cnn style: `rmsprop(lr=..., decay=1e-6)` and a hand-written callback
    halving the rate with `K.set_value(self.model.optimizer.lr, ...)`. The schedule `decay=` made
    has no `assign` (a held-out program crashed: "'EagerTensor' object has no attribute 'assign'");
    a `Decayed<Name>` keeps a rate to set, as for `ReduceLROnPlateau` (the program matched so)."""
    extra = f"""
        from keras import backend as K
        class StepDecay(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                {sets}
    """
    result = unsafe_fix(script(optimizer="SGD(lr=0.1, decay=1e-4)", extra=extra))
    assert "optimizer=DecayedSGD(learning_rate=0.1, decay=1e-4))" in result
    assert "self.model.optimizer.learning_rate.assign(" in result


def test_one_optimizer_compiled_into_two_models_is_refused():
    """Keras-GAN's `optimizer` compiled into the discriminator and the combined model: Keras 3
    builds an optimizer for one model's variables and fails on the other's ("Unknown variable",
    a held-out GAN), and Keras 2 shared one step count (Adam's bias correction read it)."""
    shared = textwrap.dedent(GAN).replace("optimizer=Adam(0.0002, 0.5))", "optimizer=optimizer)")
    messages = [f.message for f in run_check(shared) if f.code == "TFM201"]
    assert any("`optimizer` is compiled into `self.parallel_discriminator` and `self.parallel_combined`" in m
               for m in messages)


@pytest.mark.parametrize("head, refused", [
    ("keras.layers.TimeDistributed(Dense(2))(hidden)", True),
    ("Dense(2)(hidden)", True),
    ("Dense(2)(keras.layers.LSTM(8)(hidden))", False),
])
def test_masked_time_steps_reaching_the_loss_are_refused(head, refused):
    """`Embedding(mask_zero=True)` masking a per-step output: the parallel model averaged the loss
    over the whole batch's unmasked steps, Keras 3 over each replica's and then the replicas (a
    held-out BiLSTM tagger drifted 1.5e-4 at step 1). A last LSTM returning one vector consumes
    the mask, and that model is fixed."""
    model = ("embedded = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)\n"
             "hidden = keras.layers.LSTM(8, return_sequences=True)(embedded)\n"
             f"model = Model(input=inputs, output={head})")
    source = script().replace("model = Model(input=inputs, output=Dense(2, activation='softmax')(inputs))", model)
    if refused:
        assert "`keras.layers.Embedding(...)` (line 15) masks time steps" in refusal(source)
    else:
        assert "multi_gpu_model" not in unsafe_fix(source)


@pytest.mark.parametrize("optimizer, made", [
    ("tf.train.AdamOptimizer(0.001)", "tf.keras.optimizers.Adam(learning_rate=0.001, epsilon=1e-8)"),
    ("tf.train.AdamOptimizer(learning_rate=0.01, beta1=0.5, epsilon=1e-4)",
     "tf.keras.optimizers.Adam(learning_rate=0.01, beta_1=0.5, epsilon=1e-4)"),
    ("tf.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True, use_locking=False)",
     "tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=True)"),
    ("tf.train.GradientDescentOptimizer(0.5)", "tf.keras.optimizers.SGD(learning_rate=0.5)"),
])
def test_a_tf1_optimizer_compiled_into_the_model_becomes_keras_s_and_the_program_leaves_tf1_mode(optimizer, made):
    """TF 1.x's Keras guide compiled with `tf.train.AdamOptimizer(0.001)`, a TF1 API that kept a
    held-out tf.data program in TF1 mode, where its validation was refused; Keras's Adam of TF1's
    epsilon (1e-8) steps the same (the held-out program matched, whole batches)."""
    result = unsafe_fix(script(optimizer=optimizer))
    assert f"parallel.compile(loss='categorical_crossentropy', optimizer={made})\n" in result
    assert "tf.train" not in result and unsafe_fix(result) == result


def test_a_tf1_optimizer_bound_to_a_name_is_converted_where_it_is_made_unless_read_elsewhere():
    source = script(optimizer="opt").replace("parallel = multi_gpu_model", "opt = tf.train.AdamOptimizer(0.01)\nparallel = multi_gpu_model")
    assert "    opt = tf.keras.optimizers.Adam(learning_rate=0.01, epsilon=1e-8)\n" in unsafe_fix(source)
    read = source + "print(opt.get_name())\n"  # read by more than compile: the TF1 optimizer stays, so does TF1 mode
    assert "tf.train.AdamOptimizer(0.01)" in unsafe_fix(read)


BATCH_DOT_CHECK = '''
import json
import numpy as np
import keras
import tf_keras

WRITTEN

rng = np.random.RandomState(0)
cases = [((4, 5), (4, 5), 1), ((4, 3, 6), (4, 7, 6), [2, 2]), ((4, 3, 7), (4, 7, 6), [2, 1]),
         ((4, 3, 7), (4, 7, 6), None), ((4, 5), (4, 5, 2), (1, 1)), ((4, 3, 6), (4, 6), -1), ((4, 2, 3, 5), (4, 5, 6), [3, 1])]
apart = []
for x_shape, y_shape, axes in cases:
    x, y = rng.rand(*x_shape).astype("float32"), rng.rand(*y_shape).astype("float32")
    ours = keras.ops.convert_to_numpy(batch_dot(x, y, axes))
    theirs = tf_keras.backend.eval(tf_keras.backend.batch_dot(x, y, axes))
    apart.append([list(ours.shape), list(theirs.shape), float(np.abs(ours - theirs).max()) if ours.shape == theirs.shape else None])
print(json.dumps(apart))
'''


@pytest.mark.tensorflow
def test_the_written_batch_dot_is_keras_2s(tmp_path):
    """`K.batch_dot` is gone from Keras 3; the fix writes a `batch_dot` (an attention layer of a
    held-out NMT script: MATCH). Compared with tf_keras's (verify's Keras 2) on matrices, 3-D
    tensors by each pair of axes, the default axes, mixed ranks and a negative axis."""
    pytest.importorskip("tensorflow")
    from tfmigrate.rewrites.keras3_leftovers import _BACKEND_FUNCTIONS

    program = tmp_path / "batch_dot.py"
    program.write_text(BATCH_DOT_CHECK.replace("WRITTEN", _BACKEND_FUNCTIONS["batch_dot"]))
    run = run_program(program, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for ours, theirs, apart in json.loads(run.stdout.strip().splitlines()[-1]):
        assert ours == theirs and apart < 1e-5, (ours, theirs, apart)


def test_batch_dot_is_written_into_the_module_for_keras_3():
    extra = """
        def attend(query, keys):
            return K.batch_dot(query, keys, axes=[2, 2])
    """
    result = unsafe_fix(script(extra=extra).replace("import keras\n", "import keras\nfrom keras import backend as K\n", 1))
    assert "    return batch_dot(query, keys, axes=[2, 2])\n" in result and "\ndef batch_dot(x, y, axes=None):\n" in result


def test_a_frozen_discriminator_with_batch_normalization_is_trained_as_compiled_and_split():
    """A GAN's discriminator with batch normalization, frozen after it is compiled: its
    `train_on_batch` becomes `train_as_compiled(model, ...)`, which trains through `train_split`
    (the batch split over the replicas by `fit`)."""
    fit = "parallel.trainable = False\nloss = parallel.train_on_batch(x, y)"
    source = script(fit=fit).replace("(inputs))", "(BatchNormalization()(inputs)))").replace(
        "from keras.layers import Input\n", "from keras.layers import Input, BatchNormalization\n")
    result = unsafe_fix(source)
    assert "loss = train_as_compiled(parallel, x, y)\n" in result
    assert "        return train_split(model, *args, **kwargs)\n" in result and "\ndef train_split(" in result


def test_one_output_s_targets_given_by_name_are_given_as_they_are():
    """Keras 3.15 fails on a one-output model's targets given as a dict by output name ("Expected
    float32, but got labels of type 'str'", a held-out two-input text classifier): the array."""
    out = unsafe_fix(script(fit="parallel.fit(x, {'dense': y}, validation_data=(x, {'dense': y}), batch_size=16)"))
    assert "parallel.fit(x, y, validation_data=(x, y), batch_size=16)" in out


def test_targets_by_name_of_a_model_compiled_with_a_loss_per_output_stay():
    source = script(fit="parallel.fit(x, {'a': y}, batch_size=16)").replace(
        "loss='categorical_crossentropy'", "loss={'a': 'mse', 'b': 'mse'}")
    assert "parallel.fit(x, {'a': y}, batch_size=16)" in unsafe_fix(source)


def test_cast_to_floatx_is_keras_2_s_own_numpy_cast():
    """`keras.backend.cast_to_floatx` is gone from Keras 3 (keras-retinanet's focal loss normalizer
    used it): Keras 2's own `numpy.asarray(x, dtype=floatx())`, `floatx` kept by Keras 3."""
    out = unsafe_fix(script(extra="""
        from keras import backend as K
        floor = K.maximum(K.cast_to_floatx(1.0), 0.5)
    """))
    assert "floor = ops.maximum(numpy.asarray(1.0, dtype=K.floatx()), 0.5)" in out and "import numpy\n" in out


def test_a_backend_call_inside_a_rewritten_one_is_rewritten_too():
    """`K.batch_flatten(K.square(x))`: the replacement held a copy of the argument's code, and
    the inner `K.square` stayed Keras 2's (gone from Keras 3's backend)."""
    out = unsafe_fix(script(extra="""
        from keras import backend as K
        flat = K.batch_flatten(K.square(inputs))
        floor = K.cast_to_floatx(K.get_value(inputs))
    """))
    assert "flat = ops.reshape(ops.square(inputs), (ops.shape(ops.square(inputs))[0], -1))" in out
    assert "floor = numpy.asarray(ops.convert_to_numpy(inputs), dtype=K.floatx())" in out
