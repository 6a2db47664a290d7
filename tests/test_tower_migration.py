"""Issue 5: hand-built tower programs rewritten to MirroredStrategy train like the originals.

Each legacy program under fixtures/programs/ is fixed with `fix --write --unsafe-fixes` (in a
temporary copy). The result must parse, be a fixed point of a second fix, have no tower loop
and no gradient-averaging helper left, and — with TensorFlow — train step by step like the
original under `tfmigrate verify` on 2 logical CPU devices. Both programs start from the same
weights and see the same batches, so the bar is verify's default rtol 1e-4 (measured agreement
is 6e-8 to 3e-7, float32 rounding; a wrong loss scale is off by 1e-2 or more from the first step).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT, run_verify

PROGRAMS = [
    "legacy_towers", "towers_cifar", "towers_feed_dict", "towers_assign_to_device", "towers_layers",
    "parallel_make_parallel", "towers_dataset_shard", "towers_keras", "towers_variables",
]
HELPERS = ("average_gradients(", "sum_gradients(", "make_parallel(")


def tfmigrate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfmigrate", *args], cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("migrated")
    out = {}
    for name in PROGRAMS:
        out[name] = folder / f"{name}.py"
        shutil.copy(FIXTURES / "programs" / f"{name}.py", out[name])
    # One run for all the programs (a start-up per program adds up on CI).
    result = tfmigrate("fix", "--write", "--unsafe-fixes", "--tower-input", "dataset", "--no-cache", ".", cwd=folder)
    assert result.returncode in (0, 1), result.stderr
    return out


@pytest.mark.parametrize("name", PROGRAMS)
def test_rewrite_parses_is_idempotent_and_leaves_no_towers(migrated, name):
    path = migrated[name]
    text = path.read_text()
    compile(text, str(path), "exec")
    assert "MirroredStrategy(" in text and "strategy.run(" in text
    assert not any(helper in text for helper in HELPERS)
    again = tfmigrate("fix", "--write", "--unsafe-fixes", "--tower-input", "dataset", path.name, cwd=path.parent)
    assert path.read_text() == text, again.stderr
    check = tfmigrate("check", "--format", "json", "--no-cache", path.name, cwd=path.parent)
    codes = {item["code"] for item in json.loads(check.stdout)}
    assert not codes & {"TFM101", "TFM102", "TFM103"}, codes


def test_sum_helper_keeps_the_loss_scale_and_mean_helper_divides(migrated):
    assert "loss / strategy.num_replicas_in_sync" in migrated["towers_cifar"].read_text()
    assert "compute_gradients(loss)" in migrated["towers_layers"].read_text()
    assert "opt.minimize(tf.reduce_mean(loss) / strategy.num_replicas_in_sync)" in (
        migrated["parallel_make_parallel"].read_text()
    )


@pytest.mark.tensorflow
@pytest.mark.parametrize("name", PROGRAMS)
def test_migrated_program_trains_like_the_original(migrated, name, tmp_path):
    pytest.importorskip("tensorflow")
    code, report = run_verify(FIXTURES / "programs" / f"{name}.py", migrated[name], tmp_path)
    assert code == 0, json.dumps(report, indent=1)[:3000]


@pytest.mark.tensorflow
def test_unscaled_loss_is_caught(migrated, tmp_path):
    pytest.importorskip("tensorflow")
    wrong = tmp_path / "unscaled.py"
    text = migrated["legacy_towers"].read_text()
    assert "loss / strategy.num_replicas_in_sync" in text
    wrong.write_text(text.replace("loss / strategy.num_replicas_in_sync", "loss"))
    code, _ = run_verify(FIXTURES / "programs" / "legacy_towers.py", wrong, tmp_path)
    assert code == 1


MAKE_PARALLEL = """\
import tensorflow as tf
def make_parallel(fn, num_gpus, **kwargs):
    in_splits = {k: tf.split(v, num_gpus) for k, v in kwargs.items()}
    out_split = []
    for i in range(num_gpus):
        with tf.device(tf.DeviceSpec(device_type='GPU', device_index=i)):
            out_split.append(fn(**{k: v[i] for k, v in in_splits.items()}))
    return tf.concat(out_split, axis=0)
"""

# TFM105's make_parallel rewrite: shapes it leaves alone, and what its message says.
PARALLEL_REFUSALS = {
    "not_minimized": (
        MAKE_PARALLEL + "logits = make_parallel(model, 2, x=x)\npredictions = tf.argmax(logits, axis=1)\n",
        "`logits` is not minimized in the same block",
    ),
    "called_twice": (
        MAKE_PARALLEL + "a = make_parallel(model, 2, x=x)\nb = make_parallel(model, 2, x=y)\n"
        "train_op = opt.minimize(tf.reduce_mean(a))\n",
        "`make_parallel` is used 2 times in this module",
    ),
    "not_called_here": (MAKE_PARALLEL, "`make_parallel` is not called in this module"),
    "loss_not_a_mean": (
        MAKE_PARALLEL + "loss = make_parallel(model, 2, x=x)\ntrain_op = opt.minimize(tf.reduce_max(loss))\n",
        "`loss` is not minimized in the same block as `tf.reduce_mean(loss)`",
    ),
    "more_than_split_and_concat": (
        MAKE_PARALLEL.replace("    return tf.concat", "    tf.summary.histogram('out', out_split[0])\n    return tf.concat")
        + "loss = make_parallel(model, 2, x=x)\ntrain_op = opt.minimize(tf.reduce_mean(loss))\n",
        "`make_parallel` also calls `tf.summary.histogram`",
    ),
}


@pytest.mark.parametrize("name", sorted(PARALLEL_REFUSALS))
def test_make_parallel_shapes_that_are_not_rewritten_say_why(name):
    from tests.conftest import run_check

    code, reason = PARALLEL_REFUSALS[name]
    (finding,) = [f for f in run_check(code, tower_input="dataset") if f.code == "TFM105"]
    assert finding.fix_title is None
    assert "no automatic fix: " in finding.message and reason in finding.message, finding.message
    # The tower loop inside the helper is TFM101's. Where the script's code minimizes what the
    # helper returns, it rewrites the loop (each replica differentiates that loss by its own copy
    # of the weights); elsewhere it says why not.
    (loop,) = [f for f in run_check(code, tower_input="dataset") if f.code == "TFM101"]
    if name in ("loss_not_a_mean", "more_than_split_and_concat"):
        assert "(the update stays in the module's code; each replica runs its optimizer call)" in loop.fix_title
    elif name == "not_minimized":
        assert loop.fix_title is None and "which does not update the model through an optimizer" in loop.message
    else:
        assert loop.fix_title is None and "`out_split` are returned to the caller" in loop.message


def test_make_parallel_rewrite_is_offered_as_an_unsafe_fix():
    from tests.conftest import run_check

    code = MAKE_PARALLEL + "loss = make_parallel(model, 2, x=x)\ntrain_op = opt.minimize(tf.reduce_mean(loss))\n"
    (finding,) = [f for f in run_check(code, tower_input="dataset") if f.code == "TFM105"]
    assert finding.fix_safety.value == "unsafe" and "MirroredStrategy" in finding.fix_title


REFUSALS = {
    "module_level": (
        """\
        import tensorflow as tf
        def average_gradients(tower_grads):
            return [(tf.reduce_mean(tf.stack([g for g, _ in gv]), 0), gv[0][1]) for gv in zip(*tower_grads)]
        tower_grads = []
        for attempt in range(3):
            for i in range(2):
                with tf.device('/gpu:%d' % i):
                    loss = model(i)
                    tower_grads.append(opt.compute_gradients(loss))
            grads = average_gradients(tower_grads)
            train_op = opt.apply_gradients(grads)
        """,
        "line 5: the tower loop is inside a block at module level that may run more than once",
    ),
}


def test_a_module_level_script_goes_under_the_strategy_scope_from_its_first_statement():
    from tests.conftest import unsafe_fix

    out = unsafe_fix(textwrap.dedent("""\
        import tensorflow as tf
        def average_gradients(tower_grads):
            return [(tf.reduce_mean(tf.stack([g for g, _ in gv]), 0), gv[0][1]) for gv in zip(*tower_grads)]

        opt = tf.train.AdamOptimizer()
        tower_grads = []
        for i in range(2):
            with tf.device('/gpu:%d' % i):
                loss = model(i)
                tower_grads.append(opt.compute_gradients(loss))
        grads = average_gradients(tower_grads)
        train_op = opt.apply_gradients(grads)

        sess = tf.Session()
        """))
    # The run of module statements around the loop, up to the definitions above it.
    assert ("\nstrategy = tf.distribute.MirroredStrategy(devices=['/gpu:%d' % i for i in range(2)])\n"
            "with strategy.scope():\n    opt = tf.train.AdamOptimizer()\n") in out
    assert "    def tower_fn():\n        global train_op\n" in out  # `loss` is the replica's own
    assert "\n\n    sess = tf.Session()\n" in out  # the blank line above it has no trailing spaces


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_shapes_that_are_not_rewritten_say_why(name):
    from tests.conftest import run_check

    code, reason = REFUSALS[name]
    (finding,) = [f for f in run_check(code, tower_input="dataset") if f.code == "TFM101"]
    assert finding.fix_title is None
    assert "no automatic fix: " in finding.message and reason in finding.message, finding.message


def test_an_imported_averaging_helper_stays_and_each_replica_applies_its_share():
    """Whether `average_gradients` from another module averages or sums cannot be read here,
    so its call stays as written and each replica applies 1/N of what it returns."""
    from tests.conftest import unsafe_fix

    out = unsafe_fix(textwrap.dedent("""\
        import tensorflow as tf
        from mylib import average_gradients
        def train(opt):
            tower_grads = []
            for i in range(2):
                with tf.device('/gpu:%d' % i):
                    loss = model(i)
                    tower_grads.append(opt.compute_gradients(loss))
            grads = average_gradients(tower_grads)
            train_op = opt.apply_gradients(grads)
            return train_op
        """))
    assert "grads = average_gradients(tower_grads)" in out
    assert "for g, v in grads if g is not None]" in out and "return opt.apply_gradients(share)" in out


def test_tf2_target_applies_the_compat_rewrite_and_says_why():
    from tfmigrate.engine.config import Config
    from tfmigrate.engine.fixer import fix_text
    from tfmigrate.engine.runner import check_text

    source = (FIXTURES / "programs" / "legacy_towers.py").read_text()
    (finding,) = [f for f in check_text(source, Config(root=ROOT, target="tf2")) if f.code == "TFM101"]
    assert "compat target" in finding.fix_title and "`tf.get_variable`" in finding.fix_title
    compat = fix_text(source, Config(root=ROOT, tower_input="dataset"), unsafe=True)
    assert fix_text(source, Config(root=ROOT, target="tf2"), unsafe=True) == compat


@pytest.mark.tensorflow
def test_a_fetched_per_example_loss_is_read_from_every_replica(migrated, tmp_path):
    """With no scalar loss fetched, verify sums the losses the replicas passed to their
    optimizer (each replica's, not only the last one's: they share one update op)."""
    pytest.importorskip("tensorflow")
    fetch = "_, loss_value = sess.run([train_op, mean_loss], {x: xs, y: ys})"
    vector = "_, per_example = sess.run([train_op, loss], {x: xs, y: ys}); loss_value = per_example.mean()"
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    for source, target in ((FIXTURES / "programs" / "parallel_make_parallel.py", old),
                           (migrated["parallel_make_parallel"], new)):
        text = source.read_text()
        assert fetch in text
        target.write_text(text.replace(fetch, vector))
    code, report = run_verify(old, new, tmp_path)
    assert code == 0, json.dumps(report, indent=1)[:3000]
    assert any(note.startswith("NEW:") and "sum of the 2 losses" in note for note in report["notes"]), report["notes"]


def test_per_tower_shards_become_one_distributed_dataset(migrated):
    text = migrated["towers_dataset_shard"].read_text()
    assert "shard = dataset.shard(" not in text and "make_one_shot_iterator(" not in text
    assert "strategy.experimental_distribute_dataset(\n            dataset.batch(PER_GPU_BATCH * strategy.num_replicas_in_sync)))" in text
    assert "strategy.run(tower_step, args=(inputs.get_next(),))" in text
    # Initialised right after the variables, in the same session.
    assert "sess.run(tf.global_variables_initializer())\n            sess.run(inputs.initializer)\n" in text


def test_shards_the_rewrite_cannot_merge_stay_per_replica(tmp_path):
    """A shuffle after the shard: one global shuffle would not give the replicas the same
    examples, so each replica keeps reading its own shard (the program still trains the same)."""
    source = (FIXTURES / "programs" / "towers_dataset_shard.py").read_text()
    per_tower = "dataset.shard(NUM_GPUS, i).batch(PER_GPU_BATCH)"
    assert per_tower in source
    target = tmp_path / "shuffled.py"
    target.write_text(source.replace(per_tower, "dataset.shard(NUM_GPUS, i).shuffle(64, seed=1).batch(PER_GPU_BATCH)"))
    result = tfmigrate("fix", "--write", "--unsafe-fixes", "--tower-input", "dataset", target.name, cwd=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    text = target.read_text()
    compile(text, str(target), "exec")
    assert "strategy.run(tower_step)" in text and "experimental_distribute_dataset" not in text
    assert "dataset.shard(NUM_GPUS, i).shuffle(64, seed=1).batch(PER_GPU_BATCH)" in text


def test_the_iterator_is_initialised_where_a_named_initializer_runs(tmp_path):
    """`init = tf.global_variables_initializer()` ... `sess.run(init)`: the iterator's
    initializer runs right after it."""
    source = (FIXTURES / "programs" / "towers_dataset_shard.py").read_text()
    run_init = "            sess.run(tf.global_variables_initializer())\n"
    assert run_init in source
    source = source.replace(run_init, "            sess.run(init)\n").replace(
        "        with tf.Session() as sess:\n", "        init = tf.global_variables_initializer()\n        with tf.Session() as sess:\n")
    target = tmp_path / "named_init.py"
    target.write_text(source)
    result = tfmigrate("fix", "--write", "--unsafe-fixes", "--tower-input", "dataset", target.name, cwd=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    text = target.read_text()
    assert "            sess.run(init)\n            sess.run(inputs.initializer)\n" in text
    assert "experimental_distribute_dataset" in text
