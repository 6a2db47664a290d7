"""Issue 5, `--target tf2`: towers whose model code is Keras become an eager program whose
training step is a tf.function running a GradientTape step per replica under MirroredStrategy.

The program fixtures (fixtures/programs/towers_keras.py: a Keras model; towers_variables.py:
`tf.Variable`s read by a function) are fixed with `--target tf2`; the result
must parse, be a fixed point, have no Session, placeholder, tower loop or averaging helper left,
and train step by step like the original under `tfmigrate verify` on 2 logical CPU devices
(both start from the same weights and see the same batches: verify's default rtol 1e-4; the
measured agreement is ~1e-7, float32 rounding). Programs the tf2 target cannot take get the
compat rewrite, and the fix title says why.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import FIXTURES, ROOT, replaced, run_verify
from tfmigrate.engine.config import Config
from tfmigrate.engine.fixer import fix_text
from tfmigrate.engine.runner import check_text

GOLDEN = FIXTURES / "TFM101" / "keras_towers_tf2.before.py"
# The program fixtures the tf2 target takes, and what their rewrite must say: a Keras model,
# and plain `tf.Variable`s read by a function.
PROGRAMS = {
    "towers_keras": ("opt.build(trainable)", "trainable = model.trainable_variables",
                     "tf.keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)",
                     "duration = time.time() - start"),
    "towers_variables": ("trainable = [weights, bias]", "tf.keras.optimizers.SGD(learning_rate=0.2)"),
}


def tfmigrate(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfmigrate", *args], cwd=cwd, capture_output=True, text=True)


def program(name: str):
    return FIXTURES / "programs" / f"{name}.py"


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("tf2")
    out = {}
    for name in PROGRAMS:
        out[name] = folder / f"{name}.py"
        shutil.copy(program(name), out[name])
    # One run for all the programs (a start-up per program adds up on CI).
    result = tfmigrate("fix", "--write", "--unsafe-fixes", "--target", "tf2", "--no-cache", ".", cwd=folder)
    assert result.returncode in (0, 1), result.stderr
    return out


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_tf2_rewrite_is_eager_code_with_a_tape_step(migrated, name):
    text = migrated[name].read_text()
    compile(text, name, "exec")
    for expected in ("@tf.function", "with tf.GradientTape() as tape:", "strategy.run(tower_step",
                     "scaled_loss = loss / strategy.num_replicas_in_sync", "opt.build(trainable)",
                     "for step, batch in enumerate(inputs):", "loss_value = train_step(batch)", *PROGRAMS[name]):
        assert expected in text, expected
    code = text.split('"""', 2)[2]  # after the module docstring, which tells the story
    for gone in ("Session", "placeholder", "average_gradients(", "tf.device(", "itertools", "tf.Graph()",
                 "compute_gradients", "make_initializable_iterator", "Optimizer("):
        assert gone not in code, gone
    assert "print('step %d" in code  # the logging stays


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_tf2_rewrite_is_a_fixed_point_and_leaves_no_finding(migrated, name):
    path = migrated[name]
    text = path.read_text()
    again = tfmigrate("fix", "--write", "--unsafe-fixes", "--target", "tf2", path.name, cwd=path.parent)
    assert path.read_text() == text, again.stderr
    check = tfmigrate("check", "--format", "json", "--no-cache", "--target", "tf2", path.name, cwd=path.parent)
    assert json.loads(check.stdout) == []


@pytest.mark.tensorflow
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_tf2_program_trains_like_the_original(migrated, name, tmp_path):
    pytest.importorskip("tensorflow")
    code, report = run_verify(program(name), migrated[name], tmp_path, steps=30)
    assert code == 0, json.dumps(report, indent=1)[:3000]
    new = report["new"]
    assert new["loss_source"] == "tf.function"
    assert new["weights"]["loaded"] == new["weights"]["variables"] > 0


@pytest.mark.tensorflow
def test_the_tf2_program_with_its_loss_left_unscaled_disagrees(migrated, tmp_path):
    pytest.importorskip("tensorflow")
    wrong = tmp_path / "unscaled.py"
    wrong.write_text(replaced(migrated["towers_keras"].read_text(),
                              ("scaled_loss = loss / strategy.num_replicas_in_sync", "scaled_loss = loss")))
    code, _ = run_verify(program("towers_keras"), wrong, tmp_path, steps=10)
    assert code == 1


MODEL = """\
        inputs = tf.keras.Input(shape=(28, 28))
        hidden = tf.keras.layers.Dense(128, activation='relu')(tf.keras.layers.Flatten()(inputs))
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(10)(hidden))
"""
# Programs the tf2 target leaves to the compat rewrite: the edit to the golden "before" file,
# and what the fix title says.
REFUSALS = {
    "tf1_layers": (("logits = model(x_parts[i])", "logits = tf.layers.dense(x_parts[i], 10)"),
                   "the program uses `tf.layers.dense`"),
    "tf1_in_the_graph_block": (("        opt = tf.train.AdamOptimizer(1e-3)",
                                "        scale = tf.get_variable('scale', [])\n        opt = tf.train.AdamOptimizer(1e-3)"),
                               "the program uses `tf.get_variable`"),
    "global_step": (("train_op = opt.apply_gradients(average_gradients(tower_grads))",
                     "step = tf.Variable(0, trainable=False)\n"
                     "        train_op = opt.apply_gradients(average_gradients(tower_grads), global_step=step)"),
                    "apply_gradients is given more than the gradients"),
    # (`MomentumOptimizer(..., use_nesterov=True)` has one: Keras's SGD(nesterov=True), checked
    # equal to the bit over three steps; the tf2 target takes it.)
    "compat_import": (("import tensorflow as tf", "import tensorflow.compat.v1 as tf"),
                      "imports tensorflow.compat.v1"),
    "model_from_outside": (("def train(images, labels, batch_size=256):", "def train(images, labels, model, batch_size=256):"),
                           (MODEL, ""), "the tower trains no Keras model or layer, nor tf.Variable, made under the strategy scope"),
    "lazily_built": ((MODEL, "        model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])\n"),
                     "the Keras model is built on its first call"),
    "session_kept": (("        sess.close()", "        weights = sess.run(model.weights)\n        sess.close()"),
                     "the session `sess` is used for more than the training loop"),
    "optimizer_from_outside": (("def train(images, labels, batch_size=256):", "def train(images, labels, opt, batch_size=256):"),
                               ("        opt = tf.train.AdamOptimizer(1e-3)  # v1 Adam: epsilon 1e-8\n", ""),
                               "the optimizer `opt` is not made under the strategy scope"),
    "not_keras": ((MODEL, "        model = make_model()\n"),
                  "the tower reads `model`, made by `make_model`, which is not a Keras model or layer, nor a tf.Variable"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_programs_the_tf2_target_cannot_take_get_the_compat_rewrite_and_say_why(name):
    *edits, reason = REFUSALS[name]
    source = replaced(GOLDEN.read_text(), *edits)
    tf2, compat = Config(root=ROOT, select=["TFM101"], target="tf2"), Config(
        root=ROOT, select=["TFM101"], tower_input="dataset",
    )
    (finding,) = [f for f in check_text(source, tf2) if f.code == "TFM101"]
    assert finding.fix_title is not None and "(compat target: " in finding.fix_title, finding.fix_title
    assert reason in finding.fix_title, finding.fix_title
    assert fix_text(source, tf2, unsafe=True) == fix_text(source, compat, unsafe=True)


def test_the_golden_program_is_taken_by_the_tf2_target():
    # The base of the refusal table is itself rewritten (else every refusal would pass vacuously).
    (finding,) = [f for f in check_text(GOLDEN.read_text(), Config(root=ROOT, target="tf2")) if f.code == "TFM101"]
    assert "compat target" not in finding.fix_title and "tf.GradientTape" in finding.fix_title


def test_tf2_check_does_not_import_tensorflow(tmp_path):
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tfmigrate.engine.config import Config\n"
        "from tfmigrate.engine.fixer import fix_text\n"
        f"fix_text(Path({str(GOLDEN)!r}).read_text(), Config(root=Path({str(ROOT)!r}), target='tf2'), unsafe=True)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'tf_keras')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
