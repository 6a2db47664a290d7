"""Placeholders made before the tower loop and cut with `tf.split`, fed a numpy batch each step,
become one generator-backed distributed tf.data pipeline (TFM101 unsafe fix,
tfmigrate/rewrites/tower_feeds.py `_plan_split`).

fixtures/programs/legacy_towers.py is the textbook shape: `images`/`targets` placeholders,
`x_parts = tf.split(images, NUM_GPUS)`, tower i reading `x_parts[i]`, and a session loop
`sess.run([train_op, loss], feed_dict={images: x, targets: y})` over `make_batches()`. The fix
reads `make_batches` through `tf.data.Dataset.from_generator`, distributed by the strategy
(which cuts each global batch into equal contiguous parts along axis 0, replica k getting part
k: the piece `tf.split` cut for tower k), and binds the replica's part to the placeholders'
names. With TensorFlow, the result must train step by step like the original under
`tfmigrate verify`.

Each check the rewrite makes has a near miss below: the fix then leaves today's rewrite (the
replicas read `x_parts[i]` of the placeholders, still fed each step) and the TFM101 finding
says why.
"""

from __future__ import annotations

import json
import shutil
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


PROGRAM = FIXTURES / "programs" / "legacy_towers.py"
SOURCE = PROGRAM.read_text()
RUN = "            _, loss_value = sess.run([train_op, loss], feed_dict={images: x, targets: y})\n"
SPLIT_X = "        x_parts = tf.split(images, NUM_GPUS)\n"
SPLIT_Y = "        y_parts = tf.split(targets, NUM_GPUS)\n"
TOWER_LOSS = "                        loss = tf.reduce_mean(tf.square(prediction - y_parts[i]))\n"
INIT = "        init = tf.global_variables_initializer()\n"
NOTE = "the rewrite keeps feeding the split placeholders each step: "


def variant(*replacements: tuple[str, str]) -> str:
    return replaced(SOURCE, *replacements)


def code_of(text: str) -> str:
    """The program without its module docstring (which names `tf.placeholder`)."""
    docstring = cst.Module([cst.parse_module(text).body[0]]).code
    assert text.startswith(docstring) and '"""' in docstring
    return text[len(docstring):]


def tower_findings(text: str) -> list:
    return [f for f in check_text(text, Config(root=ROOT, tower_input="dataset")) if f.code == "TFM101"]


def tfmigrate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfmigrate", *args], cwd=cwd, capture_output=True, text=True)


# --- the program ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("split_feeds")
    target = folder / PROGRAM.name
    shutil.copy(PROGRAM, target)
    result = tfmigrate("fix", "--write", "--unsafe-fixes", "--tower-input", "dataset", target.name, cwd=folder)
    assert result.returncode in (0, 1), result.stderr
    return target


def test_split_placeholders_become_a_generator_backed_distributed_dataset(migrated):
    text = migrated.read_text()
    cst.parse_module(text)
    compile(text, str(migrated), "exec")
    code = code_of(text)
    assert "feed_dict" not in code and "tf.placeholder" not in code and "tf.split(" not in code
    assert "x_parts" not in text and "y_parts" not in text
    assert (
        "        opt = tf.train.GradientDescentOptimizer(LEARNING_RATE)\n"
        "\n"
        "        # The session loop's batches: the strategy gives each replica its contiguous part,\n"
        "        # the piece `tf.split` cut for its tower.\n"
        "        dataset = tf.data.Dataset.from_generator(make_batches, output_signature=(\n"
        "            tf.TensorSpec([None, FEATURES], tf.float32),\n"
        "            tf.TensorSpec([None, 1], tf.float32),\n"
        "        ))\n"
        "        inputs = tf.compat.v1.data.make_initializable_iterator(\n"
        "            strategy.experimental_distribute_dataset(dataset))\n"
    ) in text
    # The replica's part of the batch takes the placeholders' names; the tower reads it where
    # it read its piece.
    assert (
        "        def tower_step(batch):\n"
        "            # MirroredStrategy runs this once per replica; the replica index replaces the loop variable.\n"
        "            i = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))\n"
        "            images, targets = batch\n"
        "            with tf.name_scope(\"tower_%d\" % i):\n"
        "                prediction = tower_model(images)\n"
        "                loss = tf.reduce_mean(tf.square(prediction - targets))\n"
    ) in text
    assert "strategy.run(tower_step, args=(inputs.get_next(),))" in text
    # Initialised once, after the variables; the loop keeps its counter, timing and logging.
    assert (
        "        sess.run(init)\n"
        "        sess.run(inputs.initializer)\n"
        "        for step in itertools.count():\n"
        "            start = time.time()\n"
        "            try:\n"
        "                _, loss_value = sess.run([train_op, loss])\n"
        "            except tf.errors.OutOfRangeError:\n"
        "                break\n"
        "            duration = time.time() - start\n"
    ) in text
    assert "import itertools\n" in text and "import numpy as np\n" in text  # numpy: still used by make_batches()


def test_the_rewrite_is_a_fixed_point(migrated):
    text = migrated.read_text()
    again = tfmigrate("fix", "--write", "--unsafe-fixes", "--tower-input", "dataset", migrated.name, cwd=migrated.parent)
    assert again.returncode in (0, 1), again.stderr
    assert migrated.read_text() == text
    check = tfmigrate("check", "--format", "json", "--no-cache", migrated.name, cwd=migrated.parent)
    assert not {item["code"] for item in json.loads(check.stdout)} & {"TFM101", "TFM102", "TFM103", "TFM105"}


def test_the_tower_loop_finding_carries_the_rewrite():
    (finding,) = tower_findings(SOURCE)
    assert finding.fix_safety.value == "unsafe"
    assert "from_generator" in finding.fix_title and "split placeholders" in finding.fix_title
    assert NOTE not in finding.message


def test_the_golden_pair_is_discovered():
    from tests.test_fix_fixtures import PAIRS

    before = FIXTURES / "TFM101" / "split_placeholders_dataset.before.py"
    assert before in PAIRS and before.with_name("split_placeholders_dataset.after.py").exists()


def test_splits_of_tensors_the_program_does_not_feed_are_left_alone():
    """The textbook golden splits function arguments: no feed to replace, and nothing to say."""
    source = (FIXTURES / "TFM101" / "textbook_rewrite.before.py").read_text()
    (finding,) = tower_findings(source)
    assert finding.fix_title is not None and "from_generator" not in finding.fix_title
    assert NOTE not in finding.message
    assert "logits = model(image_parts[i])" in fixed(source)


def test_both_splits_in_one_statement():
    """`x_parts, y_parts = tf.split(x_all, N), tf.split(y_all, N)` goes whole."""
    source = (FIXTURES / "programs" / "towers_assign_to_device.py").read_text()
    text = fixed(source)
    assert "tf.split(" not in text and "tf.placeholder" not in text and "feed_dict" not in text
    assert "            x_all, y_all = batch\n            hidden = tf.layers.dense(x_all, 32," in text


def test_a_positional_feed_and_a_fixed_batch_dimension():
    source = (FIXTURES / "programs" / "towers_layers.py").read_text()
    assert "sess.run([train_op, loss], {features: x, targets: y})" in source
    text = fixed(source)
    assert "sess.run([train_op, loss])\n" in text and "tf.split(" not in text
    # The placeholders held the global batch already: their shape is the dataset's as it is.
    assert "tf.TensorSpec([BATCH_SIZE, 3], tf.float32)" in text


# --- near misses: the replicas keep reading the fed placeholders' pieces ----------------

REFUSED = {
    # Each key names the check; the text is the reason TFM101 then gives.
    "split_arguments_unreadable": (
        [(SPLIT_X, "        x_parts = tf.split(images, NUM_GPUS, num=NUM_GPUS)\n")],
        "cannot read the arguments of `x_parts = tf.split(images, NUM_GPUS, num=NUM_GPUS)`",
    ),
    "split_of_an_expression": (
        [(SPLIT_Y, "        y_parts = tf.split(targets * 2.0, NUM_GPUS)\n")],
        "`y_parts` cuts `targets * 2.0`, not a placeholder the session loop feeds",
    ),
    "split_along_another_axis": (
        [(SPLIT_X, "        x_parts = tf.split(images, NUM_GPUS, axis=1)\n")],
        "`x_parts` cuts `images` along axis `1`, not the batch axis 0",
    ),
    "split_into_sizes": (
        [(SPLIT_X, "        x_parts = tf.split(images, [8, 24])\n")],
        "`x_parts` cuts `images` into the sizes `[8, 24]`, not into equal parts",
    ),
    "split_count_not_the_towers": (
        [(SPLIT_X, "        x_parts = tf.split(images, 4)\n")],
        "`x_parts` cuts `images` into `4` pieces, not one per tower (`NUM_GPUS`)",
    ),
    "split_assigned_twice": (
        [(SPLIT_X, SPLIT_X + SPLIT_X)],
        "`x_parts` is assigned more than once",
    ),
    "pieces_used_outside_the_towers": (
        [(INIT, "        tf.summary.histogram('first_piece', x_parts[0])\n" + INIT)],
        "`x_parts` is used outside the tower loop",
    ),
    "tower_reads_another_piece": (
        [(TOWER_LOSS, TOWER_LOSS.replace("y_parts[i]", "y_parts[NUM_GPUS - 1 - i]"))],
        "the tower reads `y_parts` other than as its own piece `y_parts[i]`",
    ),
    "placeholder_split_twice": (
        [(SPLIT_Y, "        y_parts = tf.split(images, NUM_GPUS)\n")],
        "`images` is cut by more than one `tf.split`",
    ),
    "placeholder_made_elsewhere": (
        [('        targets = tf.placeholder(tf.float32, [None, 1], name="y")\n',
          '        if True:\n            targets = tf.placeholder(tf.float32, [None, 1], name="y")\n')],
        "the placeholder `targets` is not made before the tower loop, in its block",
    ),
    "tower_rebinds_the_index": (
        [("                        prediction = tower_model(x_parts[i])\n",
          "                        i = int(i)\n                        prediction = tower_model(x_parts[i])\n")],
        "the tower assigns the loop variable `i`",
    ),
    "tower_uses_the_placeholder_name": (
        [(TOWER_LOSS, TOWER_LOSS + "                        tf.summary.histogram('inputs', images)\n")],
        "the tower uses the name `images` besides its pieces",
    ),
    "split_statement_makes_more": (
        [(SPLIT_X, "        x_parts, scale = tf.split(images, NUM_GPUS), tf.constant(1.0)\n")],
        "also makes `scale`, which the towers do not read as their pieces",
    ),
    "feed_not_a_dict_literal": (
        [(RUN, RUN.replace("{images: x, targets: y}", "dict([(images, x), (targets, y)])"))],
        "the feed `dict([(images, x), (targets, y)])` is not a dict literal of the split placeholders",
    ),
    "another_feed_entry": (
        [(RUN, RUN.replace("targets: y}", "targets: y, learning_rate: 0.1}")),
         ("        opt = tf.train.GradientDescentOptimizer(LEARNING_RATE)\n",
          "        learning_rate = tf.placeholder(tf.float32, [])\n"
          "        opt = tf.train.GradientDescentOptimizer(learning_rate)\n")],
        "the feed's key `learning_rate` is not a placeholder the towers read through `tf.split`",
    ),
    "transformed_array_fed": (
        [(RUN, RUN.replace("{images: x,", "{images: x / 2.0,"))],
        "`images` is fed `x / 2.0`, not an array of the batch",
    ),
    "feed_built_in_a_loop": (
        [(RUN, "            feed = {}\n"
               "            for holder, array in ((images, x), (targets, y)):\n"
               "                feed[holder] = array\n"
               + RUN.replace("{images: x, targets: y}", "feed"))],
        "the feed of the split placeholders is built in a loop",
    ),
    # Checks shared with per-tower placeholders, with the reasons this shape gets from them.
    "evaluation_feed_after_the_loop": (
        [("\n\nif __name__", "\n        print(sess.run(loss, feed_dict={images: x, targets: y}))\n\n\nif __name__")],
        "the split placeholders are used outside a `for` loop over the batches",
    ),
    "second_fed_run_in_the_loop": (
        [(RUN, RUN + "            sess.run(loss, feed_dict={images: x, targets: y})\n")],
        "the session loop runs 2 `run(..., feed_dict=...)` calls, not one",
    ),
    "placeholder_used_before_the_loop": (
        [(SPLIT_Y, SPLIT_Y + "        tf.summary.histogram('targets', targets)\n")],
        "`targets` is used other than by its `tf.split` and the feed",
    ),
    "batch_source_used_elsewhere": (
        [("        global_step = tf.get_variable(", "        batches = list(make_batches())\n        global_step = tf.get_variable("),
         ("enumerate(make_batches())", "enumerate(batches)"),
         ("\n\nif __name__", "\n        print(len(batches))\n\n\nif __name__")],
        "the batch source `batches` is used elsewhere",
    ),
    "session_outside_the_graph_block": (
        [('    with tf.Graph().as_default(), tf.device("/cpu:0"):\n',
          '    with tf.Graph().as_default() as graph, tf.device("/cpu:0"):\n'),
         ("        sess = tf.Session(config=tf.ConfigProto(allow_soft_placement=True))\n",
          "    with tf.Session(graph=graph) as sess:\n")],
        "the session loop is not inside the graph's `with` block",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_near_misses_keep_the_fed_pieces_and_say_why(name):
    replacements, reason = REFUSED[name]
    source = variant(*replacements)
    text = fixed(source)
    # Today's rewrite: the replicas read their piece of the placeholders, fed as before.
    assert "strategy.run(tower_step)" in text and "from_generator" not in text
    assert "tf.split(" in text and "feed_dict=" in code_of(text)
    (finding,) = tower_findings(source)
    assert finding.fix_title is not None  # the tower rewrite itself is still offered
    assert NOTE in finding.message and reason in finding.message.split(NOTE, 1)[1], finding.message


# --- training ------------------------------------------------------------------------------


@pytest.mark.tensorflow
def test_the_migrated_program_trains_like_the_original(migrated, tmp_path):
    pytest.importorskip("tensorflow")
    code, report = run_verify(PROGRAM, migrated, tmp_path)
    assert code == 0, json.dumps(report, indent=1)[:3000]
    # Same weights, same batches, same split: step-by-step agreement (float32 rounding).
    assert report["comparison"]["max_rel_diff"] < 1e-6
    # Examples per second count the global batch on both sides (32 per step).
    assert {s["examples"] for s in report["old"]["steps"]} == {s["examples"] for s in report["new"]["steps"]} == {32}
    assert report["throughput"]["ratio"] > 0
