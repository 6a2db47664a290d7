"""A global step the tower rewrite meets in the code its strategy scope covers.

TF1 programs fetch the step with the update and steer by it; TF1's step variable, fetched so,
reads the count after the update. Made under the scope it would be a mirrored variable read
before it, and the program's schedule would run a step behind. The rewrite makes such a step
just before the scope and counts it once after the replicas' update
(tfmigrate/rewrites/global_steps.py).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import FIXTURES, run_check, run_verify, unsafe_fix

WITH_GRAPH = """
    import tensorflow as tf

    def train(data, num_gpus):
        with tf.Graph().as_default():
            x = tf.placeholder(tf.float32, [None, 4])
            global_step = tf.Variable(0, name='global_step', trainable=False)
            opt = tf.train.GradientDescentOptimizer(0.1)
            parts = tf.split(x, num_gpus)
            tower_grads = []
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i), tf.variable_scope('m', reuse=i > 0):
                    loss = tf.reduce_mean(tf.layers.dense(parts[i], 1))
                    tower_grads.append(opt.compute_gradients(loss))
            grads = [(tf.add_n([g for g, _ in gv]) / num_gpus, gv[0][1]) for gv in zip(*tower_grads)]
            train_op = opt.apply_gradients(grads, global_step=global_step)
            with tf.Session() as sess:
                sess.run(tf.global_variables_initializer())
                for _ in range(10):
                    _, step = sess.run([train_op, global_step], {x: data})
"""


def fixed(source: str) -> str:
    return unsafe_fix(textwrap.dedent(source).lstrip("\n"))


def test_a_step_made_in_the_graph_block_is_made_before_the_scope_and_counted_once():
    out = fixed(WITH_GRAPH)
    assert ("    with tf.Graph().as_default():\n"
            "        # Made before the strategy's scope, the step stays TF1's variable: fetched with the update,\n"
            "        # it reads the count after it, as it did (a mirrored step would read the count before).\n"
            "        global_step = tf.Variable(0, name='global_step', trainable=False)\n"
            "        with strategy.scope():\n"
            "            x = tf.placeholder(tf.float32, [None, 4])\n"
            "            opt = tf.train.GradientDescentOptimizer(0.1)\n") in out, out
    assert "train_op = opt.apply_gradients(grads_share)\n" in out
    assert ("            with tf.control_dependencies([train_op]):\n"
            "                train_op = global_step.assign_add(1).op\n") in out
    assert out.count("global_step = tf.Variable(") == 1 and "global_step=" not in out
    assert "get_collection_ref" not in out


@pytest.mark.parametrize("collection", ["'train_op'", "tf.GraphKeys.TRAIN_OP"])
def test_a_program_reading_the_train_op_collection_reads_the_counted_update(collection):
    """TF1's optimizer puts its update, which counted the step, first in the `train_op`
    collection; a program that reads it back (`tf.get_collection('train_op')[0]`) ran the
    replicas' update alone, and its step never moved (a fixture's staircase rate parted at
    step 11)."""
    source = WITH_GRAPH.replace("_, step = sess.run([train_op, global_step], {x: data})",
                                f"_, step = sess.run([tf.get_collection({collection})[0], global_step], {{x: data}})")
    out = fixed(source)
    assert ("                train_op = global_step.assign_add(1).op\n"
            "            # The program reads the `train_op` collection, where TF1's optimizer put its\n"
            "            # counting update first: the counted update takes the replicas' place there.\n"
            "            tf.get_collection_ref(tf.GraphKeys.TRAIN_OP)[:] = [train_op]\n") in out, out


def test_a_step_made_in_a_function_body_is_made_between_the_strategy_and_its_scope():
    source = WITH_GRAPH.replace("        with tf.Graph().as_default():\n", "").replace("\n            ", "\n        ")
    out = fixed(source)
    assert ("    strategy = tf.distribute.MirroredStrategy(devices=['/gpu:%d' % i for i in range(num_gpus)])\n"
            "    # Made before the strategy's scope, the step stays TF1's variable: fetched with the update,\n"
            "    # it reads the count after it, as it did (a mirrored step would read the count before).\n"
            "    global_step = tf.Variable(0, name='global_step', trainable=False)\n"
            "    with strategy.scope():\n"
            "        x = tf.placeholder(tf.float32, [None, 4])\n") in out, out
    assert "train_op = global_step.assign_add(1).op\n" in out


def test_a_step_made_at_module_level_is_made_between_the_strategy_and_its_scope():
    """A script at module level (the make_parallel gist's, a held-out copy stepping its data and
    its rate by the fetched step): the step was made under the scope, mirrored, and read one
    behind, so the script fed the first batch twice (MISMATCH from step 1); now made before the
    scope and counted once (the copy matched over 20 steps)."""
    body = WITH_GRAPH.split("with tf.Graph().as_default():\n", 1)[1]
    source = ("import tensorflow as tf\nnum_gpus = 2\ndata = None\n"
              + textwrap.dedent(body).replace("for _ in range(10):", "for _ in range(3):"))
    out = unsafe_fix(source)
    assert ("strategy = tf.distribute.MirroredStrategy(devices=['/gpu:%d' % i for i in range(num_gpus)])\n"
            "# Made before the strategy's scope, the step stays TF1's variable: fetched with the update,\n"
            "# it reads the count after it, as it did (a mirrored step would read the count before).\n"
            "global_step = tf.Variable(0, name='global_step', trainable=False)\n"
            "with strategy.scope():\n") in out, out
    assert "    with tf.control_dependencies([train_op]):\n        train_op = global_step.assign_add(1).op\n" in out


def test_a_step_in_a_block_that_only_pinned_the_cpu_is_made_before_the_scope_that_replaces_it():
    source = WITH_GRAPH.replace("with tf.Graph().as_default():", "with tf.device('/cpu:0'):")
    out = fixed(source)
    assert ("    strategy = tf.distribute.MirroredStrategy(devices=['/gpu:%d' % i for i in range(num_gpus)])\n"
            "    # Made before the strategy's scope, the step stays TF1's variable: fetched with the update,\n"
            "    # it reads the count after it, as it did (a mirrored step would read the count before).\n"
            "    global_step = tf.Variable(0, name='global_step', trainable=False)\n"
            "    with strategy.scope():\n") in out, out
    assert "/cpu:0" not in out


@pytest.mark.parametrize("change", [
    # The step reads a value bound above it in the block: it cannot run first.
    ("global_step = tf.Variable(0,", "start = 0\n            global_step = tf.Variable(start,"),
    # The program assigns the step itself: the replicas' update and its own must agree.
    ("            with tf.Session() as sess:\n", "            reset = global_step.assign(0)\n"
                                                  "            with tf.Session() as sess:\n"),
    # The update is not bound to a name the count could be ordered after.
    ("train_op = opt.apply_gradients(grads, global_step=global_step)",
     "train_ops = [opt.apply_gradients(grads, global_step=global_step)]"),
], ids=["reads-above", "assigned", "unnamed-update"])
def test_a_step_that_cannot_be_made_first_and_counted_once_stays_mirrored(change):
    source = WITH_GRAPH.replace(*change)
    assert source != WITH_GRAPH
    out = fixed(source)
    assert "with tf.Graph().as_default(), strategy.scope():\n" in out, out
    assert "Made before the strategy's scope" not in out and ".assign_add(1).op" not in out


def test_a_tower_counting_the_step_itself_keeps_it_mirrored():
    """Each tower's own `minimize(loss, global_step=...)`: the replicas run it, so the step must
    be a variable they can update."""
    source = WITH_GRAPH.replace(
        "                    tower_grads.append(opt.compute_gradients(loss))\n",
        "                    tower_grads.append(opt.compute_gradients(loss))\n"
        "                    tower_op = opt.minimize(loss, global_step=global_step)\n")
    (finding,) = [f for f in run_check(textwrap.dedent(source).lstrip("\n")) if f.code == "TFM101"]
    assert finding.fixable
    out = fixed(source)
    assert "with tf.Graph().as_default(), strategy.scope():\n" in out, out
    assert "Made before the strategy's scope" not in out


@pytest.mark.tensorflow
@pytest.mark.slow
def test_the_step_fetched_with_the_update_reads_as_it_did(tmp_path):
    """The fixture halves its rate every 3 steps and scores the dev set every 5, counted from the
    step each run fetched with the update: the steps it prints are OLD's, 1 to 20 (made under the
    scope, the rewrite's step read 0 to 19, and the losses parted at step 2)."""
    pytest.importorskip("tensorflow")
    original = FIXTURES / "programs" / "general_step_fetched_schedule.py"
    new = tmp_path / original.name
    new.write_text(unsafe_fix(original.read_text()))
    status, report = run_verify(original, new, tmp_path, loss_regex=r"^step (\d+),")
    assert status == 0 and report["verdict"] == "match", report.get("reasons")
    steps = [step["loss"] for step in report["new"]["steps"]]
    assert steps == list(range(1, 21)), steps
