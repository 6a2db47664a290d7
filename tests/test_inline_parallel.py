"""TFM105's inline form: a split, a tower loop and a concat written in the training code itself
get the same MirroredStrategy rewrite as the `make_parallel` helper (tfmigrate.rewrites.parallel_call).

The runnable program fixtures/programs/parallel_inline_split.py is fixed with
`fix --write --unsafe-fixes` in a temporary copy: the result must parse, be a fixed point of a
second fix, have no per-GPU device loop left, and train step by step like the original under
`tfmigrate verify` on 2 logical CPU devices (measured: identical losses, max relative
difference 0). Shapes the rewrite cannot take keep the finding, which says what blocks them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT, replaced, run_check, run_verify

PROGRAM = FIXTURES / "programs" / "parallel_inline_split.py"


def tfmigrate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfmigrate", *args], cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("inline") / PROGRAM.name
    shutil.copy(PROGRAM, target)
    result = tfmigrate("fix", "--write", "--unsafe-fixes", target.name, cwd=target.parent)
    assert result.returncode in (0, 1), result.stderr
    return target


def test_program_rewrite_parses_is_idempotent_and_leaves_no_towers(migrated):
    text = migrated.read_text()
    compile(text, str(migrated), "exec")
    code = text.split('"""', 2)[2]  # after the module docstring
    assert "strategy = tf.distribute.MirroredStrategy(devices=['/gpu:%d' % k for k in range(NUM_GPUS)])" in text
    assert "tf.device(" not in code and "tower_losses" not in code and "reuse=" not in code
    assert "point_parts = tf.split(points, strategy.num_replicas_in_sync)" in text
    # The step, made first, is made before the scope (TF1's variable) and counted once after the
    # replicas' update, which goes without it: fetched with the update, it reads the count after it.
    assert ("    with tf.Graph().as_default():\n"
            "        # Made before the strategy's scope, the step stays TF1's variable: fetched with the update,\n"
            "        # it reads the count after it, as it did (a mirrored step would read the count before).\n"
            "        global_step = tf.train.get_or_create_global_step()\n"
            "        with strategy.scope():\n") in text
    assert "tf.reduce_mean(per_example) / strategy.num_replicas_in_sync)" in text
    assert "            with tf.control_dependencies([train_op]):\n                train_op = global_step.assign_add(1).op\n" in text
    assert "colocate_gradients_with_ops" not in text
    assert "loss = tf.concat(strategy.experimental_local_results(strategy.run(replica_step)), axis=0)" in text
    assert "train_op = loss.op" in text
    again = tfmigrate("fix", "--write", "--unsafe-fixes", migrated.name, cwd=migrated.parent)
    assert migrated.read_text() == text, again.stderr
    check = tfmigrate("check", "--format", "json", "--no-cache", migrated.name, cwd=migrated.parent)
    codes = {item["code"] for item in json.loads(check.stdout)}
    assert not codes & {"TFM101", "TFM103", "TFM104", "TFM105"}, codes


@pytest.mark.tensorflow
def test_migrated_program_trains_like_the_original(migrated, tmp_path):
    pytest.importorskip("tensorflow")
    code, report = run_verify(PROGRAM, migrated, tmp_path)
    assert code == 0, json.dumps(report, indent=1)[:3000]
    assert report["comparison"]["steps_compared"] == 20
    assert report["comparison"]["max_rel_diff"] <= 1e-5
    assert report["weights_matched"], report["notes"]


@pytest.mark.tensorflow
def test_an_unscaled_replica_loss_is_caught(migrated, tmp_path):
    """The division by the replica count is what keeps the learning rate: verify sees it go."""
    pytest.importorskip("tensorflow")
    scaled = "tf.reduce_mean(per_example) / strategy.num_replicas_in_sync"
    text = migrated.read_text()
    assert scaled in text
    wrong = tmp_path / "unscaled.py"
    wrong.write_text(text.replace(scaled, "tf.reduce_mean(per_example)"))
    code, _ = run_verify(PROGRAM, wrong, tmp_path)
    assert code == 1


# --- snippets ---------------------------------------------------------------------------------
BASE = """\
import tensorflow as tf
def train(x, y, opt):
    xs = tf.split(x, 2)
    ys = tf.split(y, 2)
    losses = []
    for i in range(2):
        with tf.device('/gpu:%d' % i):
            logits = model(xs[i])
            losses.append(tf.square(logits - ys[i]))
    loss = tf.concat(losses, axis=0)
    train_op = opt.minimize(tf.reduce_mean(loss))
    return train_op
"""


def _variant(*pairs: tuple[str, str]) -> str:
    return replaced(BASE, *pairs)


def _finding(code: str):
    (finding,) = [f for f in run_check(code) if f.code == "TFM105"]
    return finding


def _fixed(code: str) -> str:
    from tfmigrate.engine.config import Config
    from tfmigrate.engine.fixer import fix_text

    return fix_text(textwrap.dedent(code), Config(root=ROOT, select=["TFM105"]), unsafe=True)


def test_inline_rewrite_is_offered_as_an_unsafe_fix():
    finding = _finding(BASE)
    assert finding.start.row == 3  # at the first split
    assert finding.fix_safety.value == "unsafe" and "MirroredStrategy" in finding.fix_title
    text = _fixed(BASE)
    assert "        losses = tf.square(logits - ys[i])\n" not in text
    assert "        loss = tf.square(logits - ys[i])\n" in text
    assert "opt.minimize(tf.reduce_mean(loss) / strategy.num_replicas_in_sync)" in text
    assert "xs = tf.split(x, strategy.num_replicas_in_sync)" in text
    assert "losses" not in text and "tf.device" not in text
    assert _fixed(text) == text


def test_a_summed_loss_is_not_divided_and_a_stack_stays_a_stack():
    text = _fixed(_variant(("tf.reduce_mean(loss)", "tf.reduce_sum(loss)"),
                           ("tf.concat(losses, axis=0)", "tf.stack(losses)")))
    assert "train_op = opt.minimize(tf.reduce_sum(loss))\n" in text
    assert "loss = tf.stack(strategy.experimental_local_results(strategy.run(replica_step)), axis=0)" in text


def test_a_named_tower_output_is_returned_by_the_replica():
    text = _fixed(_variant(("losses.append(tf.square(logits - ys[i]))",
                            "tower_loss = tf.square(logits - ys[i])\n            losses.append(tower_loss)")))
    assert "opt.minimize(tf.reduce_mean(tower_loss) / strategy.num_replicas_in_sync)" in text
    assert "return tf.identity(tower_loss)" in text


def test_at_module_level_the_strategy_is_created_before_the_split():
    code = textwrap.dedent("""\
        import tensorflow as tf
        x = tf.placeholder(tf.float32, [8, 3])
        xs = tf.split(x, 2)
        outs = []
        for i in range(2):
            with tf.device('/gpu:%d' % i):
                outs.append(model(xs[i]))
        loss = tf.concat(outs, axis=0)
        train_op = tf.train.AdamOptimizer(0.1).minimize(tf.reduce_mean(loss))
        """)
    text = _fixed(code)
    compile(text, "module_level.py", "exec")
    assert text.index("strategy = tf.distribute.MirroredStrategy(") < text.index("xs = tf.split(x, strategy.")
    assert "opt = tf.train.AdamOptimizer(0.1)\n" in text and _fixed(text) == text
    with_step = code.replace("(tf.reduce_mean(loss))", "(tf.reduce_mean(loss), global_step=step)")
    assert "the global step is created outside a strategy scope at module level" in _finding(with_step).message


def test_a_function_that_returns_the_join_and_trains_on_it_is_the_inline_form():
    code = BASE.replace("return train_op", "return train_op, loss")
    finding = _finding(code)
    assert finding.start.row == 3 and finding.fix_title is not None


# TFM105's inline rewrite: shapes it leaves alone, and what its message says.
INLINE_REFUSALS = {
    "tower_function": (
        textwrap.dedent("""\
            import tensorflow as tf
            def tower(i, piece):
                with tf.device('/gpu:%d' % i):
                    return model(piece)
            def train(x, opt):
                xs = tf.split(x, 2)
                outs = []
                for i in range(2):
                    outs.append(tower(i, xs[i]))
                loss = tf.concat(outs, axis=0)
                train_op = opt.minimize(tf.reduce_mean(loss))
            """),
        "the towers are built by `tower`, called in the loop",
    ),
    "several_loops": (
        _variant(("    losses = []\n    for i in range(2):\n        with tf.device('/gpu:%d' % i):\n"
                  "            logits = model(xs[i])\n            losses.append(tf.square(logits - ys[i]))\n",
                  "    logits = []\n    for i in range(2):\n        with tf.device('/gpu:%d' % i):\n"
                  "            logits.append(model(xs[i]))\n"
                  "    losses = []\n    for i in range(2):\n        with tf.device('/gpu:%d' % i):\n"
                  "            losses.append(tf.square(logits[i] - ys[i]))\n")),
        "the towers are built across several loops; merge them into one loop first",
    ),
    "join_not_assigned": (
        _variant(("    loss = tf.concat(losses, axis=0)\n    train_op = opt.minimize(tf.reduce_mean(loss))",
                  "    train_op = opt.minimize(tf.reduce_mean(tf.concat(losses, axis=0)))")),
        "the towers' outputs are not joined as `result = tf.concat(outputs, axis=0)`",
    ),
    "join_along_features": (
        _variant(("tf.concat(losses, axis=0)", "tf.concat(losses, axis=1)")),
        "the towers' outputs are not joined as `result = tf.concat(outputs, axis=0)`",
    ),
    "join_in_another_block": (
        _variant(("    loss = tf.concat(losses, axis=0)\n    train_op = opt.minimize(tf.reduce_mean(loss))",
                  "    if True:\n        loss = tf.concat(losses, axis=0)\n"
                  "        train_op = opt.minimize(tf.reduce_mean(loss))")),
        "is not in the same block as the tower loop",
    ),
    "list_not_empty": (
        _variant(("losses = []", "losses = list(extra)")),
        "`losses` is not created as an empty list (`losses = []`) before the tower loop",
    ),
    "list_read_elsewhere": (
        _variant(("    loss = tf.concat(", "    tf.summary.histogram('first', losses[0])\n    loss = tf.concat(")),
        "`losses` is used other than to collect the towers' outputs and join them once",
    ),
    "no_append": (
        _variant(("losses = []", "losses = [None, None]"), ("losses.append(", "losses[i] = (")),
        "the tower loop does not collect one output per tower with `losses.append(output)`",
    ),
    "statements_after_append": (
        _variant(("            losses.append(tf.square(logits - ys[i]))\n",
                  "            losses.append(tf.square(logits - ys[i]))\n            tf.summary.histogram('l', logits)\n")),
        "statements follow `losses.append(...)` in the tower loop's body",
    ),
    "no_index": (
        _variant(("for i in range(2):", "for device in ['/gpu:0', '/gpu:1']:"), ("'/gpu:%d' % i", "device"),
                 ("xs[i]", "xs[0]"), ("ys[i]", "ys[0]")),
        "has no index to pick each replica's slice",
    ),
    "loop_over_zip": (
        _variant(("for i in range(2):", "for i, device in zip(range(2), DEVICES):"), ("'/gpu:%d' % i", "device")),
        "the tower loop runs over `zip(range(2), DEVICES)`, not `range(n)` or `enumerate(devices)`",
    ),
    "break": (
        _variant(("            logits = model(xs[i])\n",
                  "            logits = model(xs[i])\n            if logits is None:\n                break\n")),
        "the tower loop's body has a `break`",
    ),
    "carried_sum": (
        _variant(("            logits = model(xs[i])\n", "            logits = model(xs[i])\n            total += logits\n")),
        "`total += ...` in the tower loop carries a value from one tower to the next",
    ),
    "carried_flag": (
        _variant(("    losses = []\n", "    losses = []\n    reuse = False\n"),
                 ("            logits = model(xs[i])\n",
                  "            logits = model(xs[i], reuse=reuse)\n            reuse = True\n")),
        "the tower loop sets `reuse`, also set before it",
    ),
    "leaking_name": (
        _variant(("    return train_op", "    return train_op, logits")),
        "the tower loop defines `logits`, used after the loop",
    ),
    "set_before_the_join": (
        _variant(("    loss = tf.concat(", "    xs = None\n    loss = tf.concat(")),
        "`xs` is set between the tower loop and the `tf.concat`",
    ),
    "split_in_the_loop": (
        _variant(("    xs = tf.split(x, 2)\n", ""), ("model(xs[i])", "model(tf.split(x, 2)[i])")),
        "the batch is cut in the tower loop itself",
    ),
    "loop_over_pieces": (
        _variant(("for i in range(2):", "for i, piece in enumerate(xs):"), ("model(xs[i])", "model(piece)")),
        "the tower loop runs over the pieces of `xs` itself",
    ),
    "unstack": (
        _variant(("xs = tf.split(x, 2)", "xs = tf.unstack(tf.reshape(x, [2, -1, 3]))")),
        "the batch is cut with `tf.unstack`",
    ),
    "split_unpacked": (
        _variant(("xs = tf.split(x, 2)", "x0, x1 = tf.split(x, 2)"), ("model(xs[i])", "model([x0, x1][i])")),
        "`tf.split(x, 2)` is not assigned to one name the towers index",
    ),
    "unequal_sizes": (
        _variant(("tf.split(x, 2)", "tf.split(x, [3, 5])")),
        "cuts the batch into unequal sizes",
    ),
    "count_differs": (
        _variant(("tf.split(x, 2)", "tf.split(x, 4)")),
        "`tf.split(x, 4)` cuts the batch into `4` pieces, the tower loop builds `2` towers",
    ),
    "split_along_features": (
        _variant(("tf.split(y, 2)", "tf.split(y, 2, axis=1)")),
        "`tf.split(y, 2, axis=1)` cuts along axis 1, not the batch axis",
    ),
    "split_in_another_block": (
        _variant(("    ys = tf.split(y, 2)\n", "    if y is not None:\n        ys = tf.split(y, 2)\n")),
        "the batch is not cut in the same block as the tower loop, before it",
    ),
    "device_variable_read": (
        _variant(("for i in range(2):", "for i, device in enumerate(DEVICES):"), ("'/gpu:%d' % i", "device"),
                 ("tf.split(x, 2)", "tf.split(x, len(DEVICES))"), ("tf.split(y, 2)", "tf.split(y, len(DEVICES))"),
                 ("model(xs[i])", "model(xs[i], name=device)")),
        "the tower code uses the loop's device variable `device`",
    ),
    "not_minimized": (
        _variant(("    train_op = opt.minimize(tf.reduce_mean(loss))\n", "    predictions = tf.argmax(loss)\n")),
        "`loss` is not minimized in the same block",
    ),
    "optimizer_made_after_the_join": (
        _variant(("    train_op = opt.minimize", "    opt = make_optimizer()\n    train_op = opt.minimize")),
        "`opt` is set between the `tf.concat` and `minimize`",
    ),
}


@pytest.mark.parametrize("name", sorted(INLINE_REFUSALS))
def test_inline_shapes_that_are_not_rewritten_say_why(name):
    code, reason = INLINE_REFUSALS[name]
    finding = _finding(code)
    assert finding.fix_title is None
    assert "no automatic fix: " in finding.message and reason in finding.message, finding.message


def test_keras_lambda_form_says_why_and_what_to_do_by_hand():
    from tfmigrate.engine.registry import all_rules

    code = (FIXTURES / "TFM105" / "breadth_keras_make_parallel.py").read_text()
    findings = [f for f in run_check(code) if f.code == "TFM105"]
    assert len(findings) == 2
    for finding in findings:
        assert finding.fix_title is None
        assert "no automatic fix here: the Keras form wraps a template model" in finding.message
        assert "under tf.distribute.MirroredStrategy().scope()" in finding.message and "delete the helper" in finding.message
    (rule,) = [r for r in all_rules() if r.code == "TFM105"]
    assert "Lambda" in rule.what_it_finds and "Keras" in rule.fix_notes and "by hand" in rule.fix_notes
    assert "inline" in rule.fix_notes


@pytest.mark.tensorflow
def test_a_global_step_fetched_with_the_update_reads_the_count_after_it(tmp_path):
    """`make_parallel`'s gist with a step passed to `minimize` and fetched with the update: made
    under the scope it was mirrored, read before the update (0 after the first step, where TF1
    read 1): a program steering by it ran one step behind. Made before the scope and counted once
    after the replicas' update, it prints the steps TF1 printed."""
    pytest.importorskip("tensorflow")
    from tests.conftest import unsafe_fix

    source = replaced(
        (FIXTURES / "programs" / "parallel_make_parallel.py").read_text(),
        ("        loss = make_parallel(", "        global_step = tf.Variable(0, trainable=False, name='global_step')\n"
                                        "        loss = make_parallel("),
        ("minimize(mean_loss, colocate_gradients_with_ops=True)",
         "minimize(mean_loss, global_step=global_step, colocate_gradients_with_ops=True)"),
        ("_, loss_value = sess.run([train_op, mean_loss], {x: xs, y: ys})\n                if step % 10 == 0:\n"
         "                    print('step %d loss %.5f' % (step, loss_value))",
         "_, loss_value, fetched = sess.run([train_op, mean_loss, global_step], {x: xs, y: ys})\n"
         "                print('step %d loss %.5f' % (fetched, loss_value))"))
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(source)
    new.write_text(unsafe_fix(source))
    assert "train_op = global_step.assign_add(1).op\n" in new.read_text()
    code, report = run_verify(old, new, tmp_path, loss_regex=r"step (\d+) loss")
    assert code == 0, json.dumps(report, indent=1)[:3000]
    assert [s["loss"] for s in report["old"]["steps"]][:3] == [1.0, 2.0, 3.0]
