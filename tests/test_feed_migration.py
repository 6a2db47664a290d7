"""Per-tower placeholder feeds become one generator-backed distributed tf.data pipeline
(TFM101/TFM106 unsafe fix, tfmigrate/rewrites/tower_feeds.py).

fixtures/programs/towers_feed_dict.py makes two placeholders per tower, collects them in lists
and feeds each tower its contiguous slice of every numpy batch. The fix reads the program's own
batch source through `tf.data.Dataset.from_generator`, distributed by the strategy (which gives
replica k the k-th contiguous part of each batch: the slice tower k was fed), through an
iterator initialised once; the session loop runs until `OutOfRangeError`. With TensorFlow, the
result must train step by step like the original under `tfmigrate verify`.

Variants of that program check the other feed spellings handled, and near misses: each check
the rewrite makes has a case that leaves today's rewrite (one placeholder per replica, still
fed by the program's feed_dict) and says why in the TFM106 finding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest

from tests.conftest import FIXTURES, ROOT, replaced, run_verify, unsafe_fix
from tfmigrate.engine.config import Config
from tfmigrate.engine.runner import check_text


def fixed(text: str) -> str:
    """The rewrite this file tests: fed batches become a distributed tf.data pipeline."""
    return unsafe_fix(text, tower_input="dataset")


PROGRAM = FIXTURES / "programs" / "towers_feed_dict.py"
SOURCE = PROGRAM.read_text()
FEED = """\
                feed = {}
                for k in range(NUM_GPUS):
                    feed[x_holders[k]] = xs[k * per_tower:(k + 1) * per_tower]
                    feed[y_holders[k]] = ys[k * per_tower:(k + 1) * per_tower]
                _, loss_value = sess.run([train_op, loss], feed_dict=feed)
"""
RUN = "                _, loss_value = sess.run([train_op, loss], feed_dict=feed)\n"
LOG = "                if step % 10 == 0:\n"
PER = "            per_tower = BATCH_SIZE // NUM_GPUS\n"


def variant(*replacements: tuple[str, str]) -> str:
    return replaced(SOURCE, *replacements)


def code_of(text: str) -> str:
    """The program without its module docstring (which talks about feeds)."""
    docstring = cst.parse_module(text).body[0]
    assert "feed_dict" in cst.Module([docstring]).code
    return text.split(cst.Module([docstring]).code, 1)[1]


def feed_findings(text: str) -> list:
    return [f for f in check_text(text, Config(root=ROOT, tower_input="dataset")) if f.code == "TFM106"]


# --- the program ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("feeds")
    target = folder / PROGRAM.name
    target.write_text(SOURCE)
    result = subprocess.run(
        [sys.executable, "-m", "tfmigrate", "fix", "--write", "--unsafe-fixes", "--tower-input", "dataset", target.name],
        cwd=folder, capture_output=True, text=True,
    )
    assert result.returncode in (0, 1), result.stderr
    return target


def test_feeds_become_a_generator_backed_distributed_dataset(migrated):
    text = migrated.read_text()
    assert "feed_dict" not in code_of(text) and "tf.placeholder" not in text
    assert "x_holders" not in text and "y_holders" not in text and "per_tower" not in text
    assert (
        "        dataset = tf.data.Dataset.from_generator(batches, output_signature=(\n"
        "            tf.TensorSpec([None, 6], tf.float32),\n"
        "            tf.TensorSpec([None, 1], tf.float32),\n"
        "        ))\n"
        "        inputs = tf.compat.v1.data.make_initializable_iterator(\n"
        "            strategy.experimental_distribute_dataset(dataset))\n"
    ) in text
    # The replica's part of the batch gets the placeholders' names, where they were made.
    assert "        def tower_step(batch):\n" in text
    assert "            with tf.variable_scope('model', reuse=i > 0):\n                x, y = batch\n" in text
    assert "strategy.run(tower_step, args=(inputs.get_next(),))" in text
    # Initialised once, after the variables; the loop keeps its counter and logging.
    assert (
        "            sess.run(tf.global_variables_initializer())\n"
        "            sess.run(inputs.initializer)\n"
        "            for step in itertools.count():\n"
        "                try:\n"
        "                    _, loss_value = sess.run([train_op, loss])\n"
        "                except tf.errors.OutOfRangeError:\n"
        "                    break\n"
        "                if step % 10 == 0:\n"
        "                    print('step %d loss %.5f' % (step, loss_value))\n"
    ) in text
    assert "import itertools\n" in text and "import numpy as np\n" in text  # numpy: still used by batches()


def test_the_placeholders_finding_carries_the_rewrite():
    findings = feed_findings(SOURCE)
    rows = [n for n, line in enumerate(SOURCE.splitlines(), start=1) if "tf.placeholder(" in line]
    assert [f.start.row for f in findings] == rows and len(rows) == 2
    for finding in findings:
        assert finding.fix_safety.value == "unsafe"
        assert "MirroredStrategy" in finding.fix_title and "from_generator" in finding.fix_title


def test_the_golden_pair_is_discovered():
    from tests.test_fix_fixtures import PAIRS

    before = FIXTURES / "TFM106" / "per_tower_feeds_dataset.before.py"
    assert before in PAIRS and before.with_name("per_tower_feeds_dataset.after.py").exists()


# --- other spellings of the same shape ----------------------------------------------------

HANDLED = {
    "comprehensions_in_the_call": [(FEED, """\
                _, loss_value = sess.run([train_op, loss], feed_dict={
                    **{x_holders[k]: xs[k * per_tower:(k + 1) * per_tower] for k in range(NUM_GPUS)},
                    **{h: ys[per_tower * k:per_tower * (k + 1)] for k, h in enumerate(y_holders)},
                })
""")],
    "split_pieces_and_update": [(FEED, """\
                feed = {h: p for h, p in zip(x_holders, np.split(xs, len(x_holders)))}
                for k in range(len(y_holders)):
                    feed.update({y_holders[k]: ys[k * per_tower:k * per_tower + per_tower]})
                _, loss_value = sess.run([train_op, loss], feed)
""")],
    "no_step_counter": [
        ("for step, (xs, ys) in enumerate(batches()):", "for xs, ys in batches():"),
        ("if step % 10 == 0:", "if loss_value > 0:"), ("% (step, loss_value)", "% (0, loss_value)"),
    ],
    "counter_start": [("enumerate(batches())", "enumerate(batches(), start=1)")],
    "fixed_batch_dimension": [("[None, 6]", "[BATCH_SIZE // NUM_GPUS, 6]")],
    "timed_step": [
        ("import numpy as np\n", "import time\n\nimport numpy as np\n"),
        ("                feed = {}\n", "                start = time.time()\n                feed = {}\n"),
        ("% (step, loss_value))", "% (step, loss_value), BATCH_SIZE / (time.time() - start))"),
    ],
    "compat_v1_alias": [("import tensorflow as tf\n", "import tensorflow.compat.v1 as tf\n")],
}
EXPECTED = {
    "comprehensions_in_the_call": "sess.run([train_op, loss])\n",
    "split_pieces_and_update": "sess.run([train_op, loss])\n",
    "no_step_counter": "            while True:\n                try:\n",
    "counter_start": "for step in itertools.count(1):\n",
    "fixed_batch_dimension": "tf.TensorSpec([(BATCH_SIZE // NUM_GPUS) * strategy.num_replicas_in_sync, 6], tf.float32)",
    "timed_step": "                start = time.time()\n                try:\n",
    "compat_v1_alias": "inputs = tf.data.make_initializable_iterator(",
}


@pytest.mark.parametrize("name", sorted(HANDLED))
def test_other_feed_spellings_are_rewritten(name):
    text = fixed(variant(*HANDLED[name]))
    assert "feed_dict" not in code_of(text) and "placeholder(" not in text and "_holders" not in text
    assert "from_generator(" in text and "sess.run(inputs.initializer)" in text
    assert EXPECTED[name] in text


def test_a_batch_source_that_is_not_a_local_tuple_generator_is_repacked():
    """from_generator reads a yielded list as one tensor: a source it cannot see yield tuples
    is repacked into tuples, as the loop's own unpacking did."""
    text = fixed(variant(("enumerate(batches())", "enumerate(zip(*next(iter([list(zip(*batches()))]))))")))
    assert "lambda: ((xs, ys) for xs, ys in zip(*next(iter([list(zip(*batches()))]))))" in text


def test_the_split_import_goes_when_nothing_else_uses_it():
    source = (FIXTURES / "TFM106" / "per_tower_feeds_dataset.before.py").read_text()
    assert "import numpy as np\n" in source
    assert "import numpy" not in fixed(source)


# --- near misses: the replicas keep their placeholders ----------------------------------

REFUSED = {
    # Each key names the check; the text is part of the reason TFM106 then gives.
    "another_feed_entry": (
        [(RUN, "                feed[lr] = 0.05\n" + RUN),
         ("opt = tf.train.MomentumOptimizer(0.05, 0.9)", "lr = tf.placeholder(tf.float32, [])\n        opt = tf.train.MomentumOptimizer(lr, 0.9)")],
        "the session loop runs `feed[lr] = 0.05` before the training step",
    ),
    "another_key_in_the_tower_loop": (
        [("                    feed[y_holders[k]] = ys", "                    feed[x_holders[k] + 0] = 1.0\n                    feed[y_holders[k]] = ys")],
        "the feed's key `x_holders[k] + 0` is not tower k's placeholder",
    ),
    "batch_used_elsewhere": ([(LOG, "                seen = len(xs)\n" + LOG)], "`xs` is used other than to feed the towers"),
    "fed_from_one_array_twice": ([("feed[y_holders[k]] = ys[", "feed[y_holders[k]] = xs[")], "not from each array of the batch"),
    "partial_batch_handled": (
        [("                feed = {}\n", "                if len(xs) < BATCH_SIZE:\n                    continue\n                feed = {}\n")],
        "the session loop runs `if len(xs) < BATCH_SIZE:",
    ),
    "uneven_array_split": (
        [(FEED, "                parts = np.array_split(xs, NUM_GPUS)\n" + FEED.replace("xs[k * per_tower:(k + 1) * per_tower]", "parts[k]"))],
        "np.array_split",
    ),
    "strided_slices": ([("xs[k * per_tower:(k + 1) * per_tower]", "xs[k::NUM_GPUS]")], "not its contiguous part"),
    "slice_size_not_a_division": ([(PER, "            per_tower = 12\n")], "is not `<batch> // <number of towers>`"),
    "batch_does_not_divide": ([("BATCH_SIZE = 24", "BATCH_SIZE = 25")], "the batch of 25 does not divide into 2 towers"),
    "feed_loop_not_over_the_towers": ([("for k in range(NUM_GPUS):", "for k in range(2):")], "not over the towers"),
    "epoch_loop": (
        [("            for step, (xs, ys) in enumerate(batches()):\n",
          "            for epoch in range(2):\n              for step, (xs, ys) in enumerate(batches()):\n")],
        "the loop over the batches is inside another loop",
    ),
    "list_used_elsewhere": ([(PER, PER + "            print(len(x_holders))\n")], "used outside a `for` loop over the batches"),
    "list_read_in_the_session_loop": ([(LOG, "                print(len(x_holders))\n" + LOG)], "reads `x_holders` other than to build"),
    "placeholder_not_collected": ([("                    x_holders.append(x)\n", "")], "`x` is not collected with"),
    "conditional_placeholder": (
        [("                    y = tf.placeholder(tf.float32, [None, 1])\n",
          "                    if i >= 0:\n                        y = tf.placeholder(tf.float32, [None, 1])\n")],
        "in code that always runs",
    ),
    "placeholder_without_shape": ([("tf.placeholder(tf.float32, [None, 1])", "tf.placeholder(tf.float32)")], "no literal shape"),
    "two_fed_runs": ([(LOG, "                sess.run(loss, feed_dict=feed)\n" + LOG)], "runs 2 `run(..., feed_dict=...)` calls"),
    "source_set_after_the_towers": (
        [(PER, PER + "            seed = 3\n"), ("enumerate(batches())", "enumerate(batches(seed))")],
        "the batch source reads `seed`, which is set after the tower loop",
    ),
    "loop_else": (
        [("                    print('step %d loss %.5f' % (step, loss_value))\n",
          "                    print('step %d loss %.5f' % (step, loss_value))\n            else:\n                print('done')\n")],
        "the session loop has an `else`",
    ),
    "work_before_the_step": ([("                feed = {}\n", "                print('batch', step)\n                feed = {}\n")], "runs `print('batch', step)` before"),
    "counter_read_after_the_loop": ([("\n\nif __name__", "            print('steps', step)\n\n\nif __name__")], "`step` is read after the session loop"),
    "session_outside_the_graph_block": (
        [("    with tf.Graph().as_default():\n", "    with tf.Graph().as_default() as graph:\n"),
         ("        with tf.Session(config=tf.ConfigProto(allow_soft_placement=True)) as sess:\n",
          "    with tf.Session(graph=graph) as sess:\n        if True:\n")],
        "the session loop is not inside the graph's `with` block",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_near_misses_keep_per_replica_placeholders_and_say_why(name):
    replacements, reason = REFUSED[name]
    source = variant(*replacements)
    text = fixed(source)
    # Today's rewrite: the towers become a replica function that still makes and is fed its own placeholders.
    assert "strategy.run(tower_step)" in text and "from_generator" not in text
    assert "x = tf.placeholder(" in text.split("def tower_step():", 1)[1]
    assert "feed_dict" in code_of(text)
    messages = [f.message for f in feed_findings(source)]
    assert messages and all("keeps one placeholder per replica" in m and reason in m for m in messages), messages
    assert all(f.fix_title is None for f in feed_findings(source))


# --- training ------------------------------------------------------------------------------


@pytest.mark.tensorflow
def test_the_migrated_program_trains_like_the_original(migrated, tmp_path):
    pytest.importorskip("tensorflow")
    code, report = run_verify(PROGRAM, migrated, tmp_path)
    assert code == 0, json.dumps(report, indent=1)[:3000]
    assert report["comparison"]["max_rel_diff"] < 1e-6
    # Examples per second count the global batch on both sides (24 per step).
    assert {s["examples"] for s in report["old"]["steps"]} == {s["examples"] for s in report["new"]["steps"]} == {24}
    assert report["throughput"]["ratio"] > 0


@pytest.mark.tensorflow
def test_other_spellings_train_like_the_original(tmp_path):
    pytest.importorskip("tensorflow")
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(variant(*HANDLED["split_pieces_and_update"], *HANDLED["fixed_batch_dimension"], *HANDLED["no_step_counter"]))
    new.write_text(fixed(old.read_text()))
    assert "while True:" in new.read_text() and "np.split" not in new.read_text()
    code, report = run_verify(old, new, tmp_path)
    assert code == 0, json.dumps(report, indent=1)[:3000]


@pytest.mark.tensorflow
def test_a_near_miss_still_trains_like_the_original(tmp_path):
    """The fallback is today's rewrite: per-replica placeholders, fed as before."""
    pytest.importorskip("tensorflow")
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(variant(*REFUSED["batch_used_elsewhere"][0]))
    new.write_text(fixed(old.read_text()))
    assert "feed_dict=feed" in new.read_text()
    code, report = run_verify(old, new, tmp_path)
    assert code == 0, json.dumps(report, indent=1)[:3000]


@pytest.mark.tensorflow
def test_an_unscaled_loss_is_still_caught(migrated, tmp_path):
    pytest.importorskip("tensorflow")
    wrong = tmp_path / "unscaled.py"
    text = migrated.read_text()
    assert "loss / strategy.num_replicas_in_sync" in text
    wrong.write_text(text.replace("loss / strategy.num_replicas_in_sync", "loss"))
    code, _ = run_verify(PROGRAM, wrong, tmp_path)
    assert code == 1
