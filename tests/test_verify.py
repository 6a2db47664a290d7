"""Tests for ``tfmigrate verify``: the comparison logic (pure Python) and end-to-end runs of the
fixture programs in fixtures/programs/ on 2 logical CPU devices (TensorFlow needed).

Each end-to-end case runs the CLI once, in a module-scoped fixture, and several tests read it.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfmigrate.verify.compare import DEFAULT_ATOL, DEFAULT_RTOL, close, compare, throughput
from tfmigrate.verify.detect import detect

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "fixtures" / "programs"


def steps(losses, examples=32, dt=0.01):
    return [{"step": i, "loss": loss, "examples": examples, "t_start": i * dt, "t_end": (i + 1) * dt}
            for i, loss in enumerate(losses)]


# --------------------------------------------------------------------------------------------
# pure Python: comparison, detection, stdout capture


def test_compare_identical_runs_match():
    result = compare(steps([1.0, 0.5, 0.25]), steps([1.0, 0.5, 0.25]))
    assert result.verdict == "match"
    assert result.steps_compared == 3
    assert result.max_rel_diff == 0.0
    assert result.final == {"step": 2, "old": 0.25, "new": 0.25, "rel_diff": 0.0, "ok": True}


def test_compare_within_and_beyond_tolerance():
    old = [1.0, 0.8, 0.6, 0.4]
    near = [1.0, 0.8 * (1 + 0.5 * DEFAULT_RTOL), 0.6, 0.4]
    far = [1.0, 0.8, 0.6 * (1 + 10 * DEFAULT_RTOL), 0.4 * 1.1]
    assert compare(steps(old), steps(near)).verdict == "match"
    result = compare(steps(old), steps(far))
    assert result.verdict == "mismatch"
    assert result.first_bad_step == 2
    assert result.worst_step == 3
    assert math.isclose(result.max_rel_diff, 0.1, rel_tol=1e-9)
    assert "2 of 4 steps differ" in result.reasons[0]
    # a looser tolerance accepts it
    assert compare(steps(old), steps(far), rtol=0.2).verdict == "match"


def test_compare_nan_missing_and_step_counts():
    assert not close(float("nan"), float("nan"), 1e-4, 1e-6)
    assert not close(None, 1.0, 1e-4, 1e-6)
    assert close(0.0, 5e-7, 0.0, DEFAULT_ATOL)
    assert compare(steps([1.0, float("nan")]), steps([1.0, float("nan")])).verdict == "mismatch"
    shorter = compare(steps([1.0, 0.5, 0.2]), steps([1.0, 0.5]))
    assert shorter.verdict == "mismatch" and shorter.steps_compared == 2
    assert "step counts differ" in shorter.reasons[0]
    assert compare([], []).verdict == "mismatch"


def test_throughput_excludes_warmup_and_gives_ratio():
    def run(dt):  # a 5 s first step (start-up), then 5 steps of dt seconds
        timed = steps([1.0] * 6, examples=32)
        timed[0].update(t_start=0.0, t_end=5.0)
        for i, s in enumerate(timed[1:], start=1):
            s.update(t_start=5.0 + (i - 1) * dt, t_end=5.0 + i * dt)
        return timed

    old, new = run(0.01), run(0.02)                       # 3200 and 1600 examples/s
    rate = throughput(old, warmup=1)
    assert rate.measured_steps == 5
    assert math.isclose(rate.examples_per_s, 3200, rel_tol=1e-9)
    assert math.isclose(rate.median_examples_per_s, 3200, rel_tol=1e-9)
    result = compare(old, new, warmup=1)
    assert math.isclose(result.throughput["ratio"], 0.5, rel_tol=1e-9)
    assert result.throughput["basis"] == "examples"
    # without batch sizes the ratio is in steps/s
    for run in (old, new):
        for s in run:
            s["examples"] = None
    assert compare(old, new, warmup=1).throughput["basis"] == "steps"
    assert throughput(old, warmup=10).examples_per_s is None


def test_detect_legacy_programs():
    legacy = detect((PROGRAMS / "legacy_towers.py").read_text())
    assert legacy.legacy and not legacy.keras
    assert "tf.placeholder" in legacy.reasons
    keras = detect((PROGRAMS / "legacy_keras_mgpu.py").read_text())
    assert keras.legacy and keras.keras
    for name in ("migrated_towers.py", "migrated_keras_strategy.py", "crash.py"):
        assert not detect((PROGRAMS / name).read_text()).legacy, name
    assert detect("import tensorflow.compat.v1 as tf\ntf.disable_v2_behavior()\nx = tf.placeholder(tf.float32)\n").legacy is False
    # Keras 2.0's own modules (Keras 3 has none of them): a program for Keras 2 on TF1.
    assert detect("from keras.layers.core import Dense\n").legacy
    assert detect("import keras.engine.topology\n").legacy
    assert not detect("from keras.layers import Dense\n").legacy


TF2_ERA = """
import tensorflow as tf
from tensorflow.keras.utils import multi_gpu_model
SEED
parallel = multi_gpu_model(model, gpus=2)
"""


@pytest.mark.parametrize("seed, tf2_era", [("tf.random.set_seed(1)", True), ("tf.set_random_seed(1)", False),
                                           ("np.random.seed(1)", False)])
def test_a_tf2_era_keras_program_runs_as_tf2_with_multi_gpu_model_restored(seed, tf2_era):
    """TF 2.0-2.3 had both `multi_gpu_model` and `tf.random.set_seed`: such a program runs as TF2
    with Keras 2 (in TF1 mode its `tf.random.set_seed` does not exist: a held-out round failed
    to verify against itself). With a TF1 API, or neither, it runs in TF1 mode as before."""
    detection = detect(TF2_ERA.replace("SEED", seed))
    assert detection.multi_gpu_tf2 is tf2_era and detection.legacy is not tf2_era
    assert detection.keras2 is tf2_era and detection.keras


def test_keras_2_3_module_paths_with_a_tf2_seed_still_run_as_tf2():
    """Standalone Keras 2.3 ran on TF 2.0-2.3 and still had `keras.layers.core` and
    `keras.utils.np_utils`: with `tf.random.set_seed` such a program is TF2-era too (it ran in TF1
    mode, where `tf.random.set_seed` does not exist)."""
    paths = "from keras.layers.core import Dense\nfrom keras.utils import np_utils\nimport keras.utils.np_utils\n"
    detection = detect(paths + TF2_ERA.replace("SEED", "tf.random.set_seed(1)"))
    assert detection.multi_gpu_tf2 and not detection.legacy
    assert detect(paths + TF2_ERA.replace("SEED", "tf.set_random_seed(1)")).legacy


@pytest.mark.parametrize("source, keras2", [
    ("import tensorflow.compat.v1 as tf\ny = tf.layers.dense(x, 2)\n", True),
    ("from tensorflow.compat import v1\ncell = v1.nn.rnn_cell.GRUCell(8)\n", True),
    ("import tensorflow as tf\ny = tf.compat.v1.layers.conv2d(x, 4, 3)\n", True),
    ("import tensorflow.compat.v1 as tf\ny = tf.nn.relu(tf.matmul(x, w))\n", False),
    ("import tensorflow as tf\ny = tf.keras.layers.Dense(2)(x)\n", False),  # Keras 3 is what it asks for
])
def test_tf1_layers_through_compat_v1_run_with_keras_2(source, keras2):
    detection = detect(source)
    assert detection.keras2 is keras2 and not detection.legacy
    assert detect("import tensorflow as tf\nopt = tf.train.AdamOptimizer(0.1)\n").legacy
    assert not detect("import tensorflow as tf\nckpt = tf.train.Checkpoint()\n").legacy


def test_loss_regex_watcher_reads_printed_losses():
    from types import SimpleNamespace

    from tfmigrate.verify import harness

    state = harness.State(SimpleNamespace(steps=2, loss_regex=r"loss[ =:]+(?P<loss>[-\d.eE+]+)",
                                          dump_weights=None, load_weights=None))
    sink = io.StringIO()
    watcher = harness.LineWatcher(sink, state)
    watcher.write("step 0, loss = 0.75 (1 ex/s)\nnoise\nstep 1, lo")
    assert [s["loss"] for s in state.regex_steps] == [0.75]
    with pytest.raises(harness.StopRun):
        watcher.write("ss: 0.5\n")
    assert [s["loss"] for s in state.regex_steps] == [0.75, 0.5]
    assert sink.getvalue().endswith("loss: 0.5\n")


def test_harness_helpers():
    from tfmigrate.verify.harness import canonical_name, rewrite_device_string

    assert canonical_name("tower_1/hidden/weights:0") == "hidden/weights"
    assert canonical_name("hidden/weights/replica_1:0") == "hidden/weights"
    assert canonical_name("dense/kernel") == "dense/kernel"
    assert rewrite_device_string("/gpu:1", 2) == "/device:CPU:1"
    assert rewrite_device_string("/job:localhost/replica:0/task:0/device:GPU:3", 2).endswith("/device:CPU:1")
    assert rewrite_device_string("/cpu:0", 2) == "/cpu:0"


def test_the_rows_keras_3_trains_on_with_a_validation_split_are_counted_as_it_splits():
    """`fit(x, y, validation_split=0.1)` on 512 rows trains on 460 (Keras 3.15 rounds down); the
    count was rounded up, and the last batch's loss, recovered from the running mean by its size,
    read 12% off on a held-out forecaster (a batch of 13 taken for 12)."""
    pytest.importorskip("keras")
    import numpy

    from keras.src.trainers.data_adapters.array_slicing import train_validation_split
    from tfmigrate.verify.harness import _trained_rows

    for total, split in ((512, 0.1), (100, 0.25), (97, 0.3)):
        (trained,), _ = train_validation_split((numpy.zeros((total, 1)),), validation_split=split)
        assert _trained_rows(total, split) == len(trained)
    assert _trained_rows(512, 0.1) == 460


def test_a_batch_loss_is_read_from_keras_3s_loss_tracker_whatever_the_batch_sizes():
    """A dataset's partial batch in mid-run (1000 rows in batches of 64, repeated, 15 steps an
    epoch: the second epoch starts with 40 rows) was read as a whole batch from the running mean,
    and every later step of the epoch 0.2% to 0.6% off: a false MISMATCH of a correct migration.
    Keras 3's loss tracker holds the epoch's summed loss and its examples: each batch's exactly."""
    from types import SimpleNamespace

    from tfmigrate.verify.harness import _make_callback

    recorded = []
    state = SimpleNamespace(weights_done=True, note=lambda text: None,
                            record=lambda loss, examples, *rest: recorded.append((loss, examples)))
    callback = _make_callback(object, "keras", state, None, SimpleNamespace())
    tracker = SimpleNamespace(total=0.0, count=0.0)
    callback.model = SimpleNamespace(_loss_tracker=tracker)
    callback.on_epoch_begin(0)
    for loss, rows in ((2.0, 40), (1.0, 64), (0.5, 64)):
        tracker.total, tracker.count = tracker.total + loss * rows, tracker.count + rows
        callback.on_train_batch_begin(0)
        callback.on_train_batch_end(0, {"loss": tracker.total / tracker.count})
    assert recorded == [(2.0, 40), (1.0, 64), (0.5, 64)]


def test_a_batch_loss_is_recovered_from_keras_3s_running_mean_by_examples():
    """Keras 3 reports the epoch's running mean of the loss, each batch weighed by its examples:
    a partial last batch (16 of 432 after `validation_split=0.1` of 480, in batches of 32) counts
    half a batch (a held-out text classifier's last batch had been read 20% off)."""
    from tfmigrate.verify.harness import _batch_loss

    losses, sizes = [1.0, 3.0, 0.5], [32, 32, 16]
    total, seen, previous, recovered = 0.0, 0, 0.0, []
    for batch, (loss, size) in enumerate(zip(losses, sizes)):
        total += loss * size
        mean = total / (seen + size)  # what Keras 3 logs after this batch
        recovered.append(_batch_loss(mean, previous, seen, size, batch))
        seen, previous = seen + size, mean
    assert recovered == pytest.approx(losses)
    assert _batch_loss(2.0, 1.0, 0, None, 1) == pytest.approx(3.0)  # sizes unknown: batches of one size


def test_preload_servers_are_kept_per_import_setting_and_a_few_at_most(monkeypatch):
    """A variable no import reads (pytest's PYTEST_CURRENT_TEST, new for every test) reaches the
    run but keeps its server; a setting of the import's variables past MAX_SERVERS ends the least
    recently used server (each holds ~200 MB: a server per test once filled a 23 GiB machine)."""
    from tfmigrate.verify import preload

    made = []

    class FakeServer:
        def __init__(self, env):
            self.closed = False
            made.append(self)

        def alive(self):
            return not self.closed

        def close(self):
            self.closed = True

        def fork(self, argv, log, env, *where):
            return self, env

    monkeypatch.setattr(preload, "Server", FakeServer)
    monkeypatch.setattr(preload, "MAX_SERVERS", 2)
    monkeypatch.setattr(preload, "_SERVERS", {})
    base = {"PATH": "/bin", "TF_CPP_MIN_LOG_LEVEL": "2"}
    first, _ = preload.start([], "log", dict(base, PYTEST_CURRENT_TEST="a"))
    again, env = preload.start([], "log", dict(base, PYTEST_CURRENT_TEST="b"))
    assert again is first and env["PYTEST_CURRENT_TEST"] == "b"
    legacy, _ = preload.start([], "log", dict(base, TF_USE_LEGACY_KERAS="1"))
    first_again, _ = preload.start([], "log", base)
    assert first_again is first  # used again: now the most recent
    third, _ = preload.start([], "log", dict(base, TF_ENABLE_ONEDNN_OPTS="0"))
    assert len(made) == 3 and legacy.closed and not first.closed and not third.closed


@pytest.mark.tensorflow
def test_a_plain_script_forked_from_a_preload_server_runs_as_python_would(tmp_path):
    """The suite runs fixture programs forked from a server that imported TensorFlow: each sees
    its arguments, folder and environment, its stdout and stderr apart, and its exit status (an
    uncaught exception is status 1 with the traceback on stderr)."""
    from tests.conftest import run_program

    script = tmp_path / "probe.py"
    script.write_text("import os, sys\n"
                      "print(sys.argv[1:], os.getcwd() == os.environ['WANTED'], __name__)\n"
                      "print('to stderr', file=sys.stderr)\n"
                      "if sys.argv[1] == 'raise':\n    raise ValueError('bad')\n"
                      "sys.exit(int(sys.argv[1]))\n")
    env = dict(os.environ, WANTED=str(tmp_path))
    done = run_program(script, ("3", "x"), env, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (3, "['3', 'x'] True __main__\n", "to stderr\n")
    failed = run_program(script, ("raise",), env, cwd=tmp_path)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: bad")


@pytest.mark.parametrize("given, used", [(None, "0"), ("1", "1")])
def test_both_runs_use_tensorflow_s_own_cpu_kernels_unless_the_environment_says(given, used, monkeypatch,
                                                                                tmp_path):
    """oneDNN's fused batch normalization is 1e-5 off the exact gradient, which Keras 3's unfused
    one computes: a correct migration of a batch-normalized model trained with Adadelta was
    2e-4 apart at step 1 with it and matched with it off. A user's own setting stays."""
    from tfmigrate.verify import runner

    seen = {}

    def start(command, log, handle, env, legacy_keras):
        seen.update(env)
        raise RuntimeError("not run")

    monkeypatch.setattr(runner, "_start", start)
    if given is None:
        monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    else:
        monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", given)
    spec = runner.RunSpec(label="OLD", program=tmp_path / "p.py", legacy=False, keras=False, steps=1,
                          devices=2, seed=0, timeout=10, workdir=tmp_path)
    with pytest.raises(RuntimeError):
        runner.run_program(spec)
    assert seen["TF_ENABLE_ONEDNN_OPTS"] == used


def test_cli_import_stays_free_of_tensorflow():
    code = ("import sys, tfmigrate.cli.main, tfmigrate.verify.cli\n"
            "heavy = [m for m in ('tensorflow', 'numpy', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert 'verify' in [c.name or c.callback.__name__ for c in tfmigrate.cli.main.app.registered_commands]\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_missing_file_is_a_clear_error(tmp_path):
    result = run_verify(str(tmp_path / "absent.py"), str(PROGRAMS / "migrated_towers.py"))
    assert result.returncode == 2
    assert "absent.py: no such file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# end to end (TensorFlow)


def run_verify(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tfmigrate", "verify", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def tf_available():
    pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def towers(tf_available, tmp_path_factory):
    out = tmp_path_factory.mktemp("towers")
    result = run_verify(str(PROGRAMS / "legacy_towers.py"), str(PROGRAMS / "migrated_towers.py"),
                        "--steps", "8", "--warmup", "2", "--devices", "2",
                        "--json", str(out / "report.json"), "--plot", str(out / "report.png"))
    return result, out


@pytest.mark.tensorflow
def test_towers_migration_matches(towers):
    result, _ = towers
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MATCH" in result.stdout
    assert "weights: 4 of 4" in result.stdout


@pytest.mark.tensorflow
def test_json_report_contents(towers):
    result, out = towers
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "match" and report["exit_code"] == 0
    assert report["devices"]["kind"] in ("logical_cpu", "gpu") and report["devices"]["count"] == 2
    assert report["versions"]["tensorflow"].startswith("2.")
    assert report["settings"]["steps"] == 8 and report["settings"]["rtol"] == DEFAULT_RTOL
    weights = report["weights_matched"]
    assert weights["matched"] and weights["variables_matched"] == 4 and weights["matched_by"] == "name"
    assert report["old"]["legacy"] is True and report["new"]["legacy"] is False
    for side in ("old", "new"):
        assert len(report[side]["steps"]) == 8
        assert all(s["examples"] == 32 and s["loss"] > 0 for s in report[side]["steps"])
    old_losses = [s["loss"] for s in report["old"]["steps"]]
    new_losses = [s["loss"] for s in report["new"]["steps"]]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(old_losses, new_losses))
    assert old_losses[-1] < old_losses[0]                # it trains
    comparison = report["comparison"]
    assert comparison["steps_compared"] == 8 and comparison["max_rel_diff"] < 1e-6
    assert report["final_loss"]["old"] == old_losses[-1]
    tp = report["throughput"]
    assert tp["basis"] == "examples" and tp["old"]["measured_steps"] == 6
    assert tp["old"]["examples_per_s"] > 0 and tp["new"]["examples_per_s"] > 0
    assert math.isclose(tp["ratio"], tp["new"]["examples_per_s"] / tp["old"]["examples_per_s"])
    assert any("tower losses" in note for note in report["notes"])


@pytest.mark.tensorflow
def test_png_plot_written(towers):
    _, out = towers
    png = out / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    image = mpimg.imread(png)
    height, width = image.shape[:2]
    assert 300 <= height <= 1000 and 600 <= width <= 2000
    assert image.std() > 0.01                            # not a blank canvas


@pytest.mark.tensorflow
@pytest.mark.parametrize("new_program, first_bad", [
    ("migrated_towers_wrong_lr.py", 1),     # step 0 is evaluated before the first update
    ("migrated_towers_sum_loss.py", 0),     # the reported loss is already N times too large
])
def test_wrong_migrations_mismatch(tf_available, tmp_path, new_program, first_bad):
    report = tmp_path / "r.json"
    result = run_verify(str(PROGRAMS / "legacy_towers.py"), str(PROGRAMS / new_program),
                        "--steps", "3", "--warmup", "1", "--json", str(report))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH" in result.stdout
    data = json.loads(report.read_text())
    assert data["verdict"] == "mismatch" and data["comparison"]["first_bad_step"] == first_bad


@pytest.mark.tensorflow
def test_keras_multi_gpu_model_migration_matches(tf_available, tmp_path):
    report = tmp_path / "keras.json"
    # 10 steps cross the epoch boundary (8 batches per epoch)
    result = run_verify(str(PROGRAMS / "legacy_keras_mgpu.py"), str(PROGRAMS / "migrated_keras_strategy.py"),
                        "--steps", "10", "--warmup", "2", "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(report.read_text())
    assert data["old"]["loss_source"] == "keras" and data["new"]["loss_source"] == "keras"
    assert data["weights_matched"]["variables_matched"] == 4
    assert any("multi_gpu_model(model, gpus=2)" in note and "on each device's slice" in note for note in data["notes"])
    assert all(s["examples"] == 32 for s in data["new"]["steps"])


@pytest.mark.tensorflow
def test_crashing_program_exit_2(tf_available):
    result = run_verify(str(PROGRAMS / "crash.py"), str(PROGRAMS / "migrated_towers.py"), "--steps", "3")
    assert result.returncode == 2
    assert "OLD crash.py failed: RuntimeError: fixture crash" in result.stderr
    assert "last lines of OLD crash.py" in result.stderr
    assert 'crash.py", line' in result.stderr                 # the program's traceback
    assert "harness.py" not in result.stderr


@pytest.mark.tensorflow
def test_hanging_program_times_out_exit_2(tf_available, tmp_path):
    report = tmp_path / "hang.json"
    result = run_verify(str(PROGRAMS / "hang.py"), str(PROGRAMS / "migrated_towers.py"),
                        "--timeout", "20", "--json", str(report), timeout=120)
    assert result.returncode == 2
    # 20 s: the harness imports TensorFlow before the program prints (6 s was too short on a loaded 2-core CI).
    assert "did not finish within --timeout 20s" in result.stderr
    assert "never filled" in result.stderr                    # the tail of its output
    data = json.loads(report.read_text())
    assert data["verdict"] == "error" and data["exit_code"] == 2


def _run_towers(workdir: Path, label: str):
    from tfmigrate.verify.runner import RunSpec, run_program

    workdir.mkdir()
    spec = RunSpec(label=label, program=PROGRAMS / "legacy_towers.py", legacy=True, keras=False, steps=6,
                   devices=2, seed=0, timeout=120, workdir=workdir)
    outcome = run_program(spec)
    assert outcome.ok, outcome.tail()
    return [step["loss"] for step in outcome.result["steps"]]


@pytest.mark.tensorflow
def test_a_run_forked_from_the_preload_server_measures_what_a_fresh_process_does(tf_available, tmp_path,
                                                                                monkeypatch):
    from tfmigrate.verify import preload

    monkeypatch.setattr(preload, "_SERVERS", {})
    forked = _run_towers(tmp_path / "forked", "OLD")
    (server,) = preload._SERVERS.values()
    # a variable no import reads (pytest sets PYTEST_CURRENT_TEST anew for every test) keeps the server
    monkeypatch.setenv("TFMIGRATE_TEST_UNRELATED", "1")
    again = _run_towers(tmp_path / "again", "NEW")
    assert preload._SERVERS == {next(iter(preload._SERVERS)): server}, "the second run started another server"
    monkeypatch.setenv(preload.ENABLE_VARIABLE, "0")
    fresh = _run_towers(tmp_path / "fresh", "OLD")
    assert len(forked) == 6 and forked == again == fresh


@pytest.mark.tensorflow
def test_a_dead_preload_server_is_replaced(tf_available, tmp_path, monkeypatch):
    from tfmigrate.verify import preload

    monkeypatch.setattr(preload, "_SERVERS", {})
    first = _run_towers(tmp_path / "first", "OLD")
    (server,) = preload._SERVERS.values()
    server.process.kill()
    server.process.wait()
    assert _run_towers(tmp_path / "second", "NEW") == first
    (replacement,) = preload._SERVERS.values()
    assert replacement is not server and replacement.alive()


@pytest.mark.tensorflow
def test_a_preload_server_that_cannot_start_leaves_the_run_to_a_fresh_process(tf_available, tmp_path,
                                                                              monkeypatch):
    import subprocess as sp

    from tfmigrate.verify import preload

    def broken_server(self, env):
        self.process = sp.Popen([sys.executable, "-c", "raise SystemExit(3)"], stdin=sp.PIPE, stdout=sp.PIPE)

    monkeypatch.setattr(preload, "_SERVERS", {})
    monkeypatch.setattr(preload.Server, "__init__", broken_server)
    assert len(_run_towers(tmp_path / "run", "OLD")) == 6


@pytest.mark.tensorflow
def test_tf_contrib_is_named(tf_available, tmp_path):
    program = tmp_path / "contrib.py"
    program.write_text("import tensorflow as tf\nx = tf.placeholder(tf.float32)\n"
                       "q = tf.contrib.slim.prefetch_queue.prefetch_queue([x])\n")
    result = run_verify(str(program), str(PROGRAMS / "migrated_towers.py"), "--steps", "2")
    assert result.returncode == 2
    assert "tf.contrib.slim.prefetch_queue.prefetch_queue is not available" in result.stderr


MULTI_GPU_MODEL_SPELLINGS = '''\
import numpy as np
import tensorflow as tf
from tensorflow.keras.utils import multi_gpu_model


def main():
    x = np.random.RandomState(0).normal(size=(64, 4)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True).astype(np.float32)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(4,))])
    parallel = multi_gpu_model(model, gpus=2)
    also = tf.keras.utils.multi_gpu_model(model, gpus=2)
    parallel.compile(optimizer='sgd', loss='mse')
    parallel.fit(x, y, batch_size=16, epochs=2, verbose=0)


main()
'''


@pytest.mark.tensorflow
def test_multi_gpu_model_runs_from_tensorflow_keras_imports_too(tf_available, tmp_path):
    # Issue 14: `from tensorflow.keras.utils import multi_gpu_model` and the attribute
    # `tf.keras.utils.multi_gpu_model` failed (ImportError, AttributeError: exit 2).
    from tests.conftest import run_verify

    program = tmp_path / "mgm_spellings.py"
    program.write_text(MULTI_GPU_MODEL_SPELLINGS)
    status, report = run_verify(program, program, tmp_path, steps=4)
    assert status == 0 and report["verdict"] == "match", report.get("reasons")


KERAS_2_0_PATHS = '''\
import numpy as np
from keras.engine.topology import Layer
from keras.layers import Input
from keras.layers.core import Dense, Lambda
from keras.layers.merge import concatenate
from keras.models import Model
from keras.utils import np_utils
from keras.utils.np_utils import to_categorical


class Scale(Layer):
    def call(self, inputs):
        return inputs * 0.5


inputs = Input(shape=(4,))
halves = [Lambda(lambda t, i=i: t[:, 2 * i:2 * i + 2])(inputs) for i in range(2)]
outputs = Dense(3, activation='softmax', kernel_initializer='glorot_uniform')(Scale()(concatenate(halves)))
model = Model(inputs, outputs)
model.compile(optimizer='sgd', loss='categorical_crossentropy')
x = np.random.RandomState(0).normal(size=(64, 4)).astype(np.float32)
model.fit(x, to_categorical(np.arange(64) % 3, 3), batch_size=16, epochs=2, shuffle=False, verbose=0)
assert np_utils.to_categorical([1], 2).tolist() == [[0.0, 1.0]]
'''


@pytest.mark.tensorflow
def test_keras_2_0_module_paths_import(tf_available, tmp_path):
    """`keras.layers.core`, `keras.layers.merge`, `keras.engine.topology`, `keras.utils.np_utils`
    (also imported as `from keras.utils import np_utils`; Keras 2.0-2.2, the `make_parallel` gists): tf_keras has none of them; each is the package
    above it (a ModuleNotFoundError stopped the run)."""
    from tests.conftest import run_verify

    program = tmp_path / "keras_2_0.py"
    program.write_text(KERAS_2_0_PATHS)
    status, report = run_verify(program, program, tmp_path, steps=4)
    assert status == 0 and report["verdict"] == "match", report.get("reasons")


V1_LAYERS = """\
import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()
x = tf.placeholder(tf.float32, [8, 4])
y = tf.placeholder(tf.float32, [8, 1])
hidden = tf.layers.dense(x, 6, activation=tf.nn.tanh, kernel_initializer=tf.glorot_uniform_initializer(seed=1))
out = tf.layers.dense(hidden, 1, kernel_initializer=tf.glorot_uniform_initializer(seed=2))
loss = tf.reduce_mean(tf.square(out - y))
train_op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
data = np.random.RandomState(0).randn(8, 4).astype(np.float32)
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for step in range(12):
        _, value = sess.run([train_op, loss], {x: data, y: data[:, :1] * 0.5})
        print('step %d loss %.6f' % (step, value))
"""


@pytest.mark.tensorflow
@pytest.mark.slow
def test_a_program_with_tf1_layers_through_compat_v1_runs_with_keras_2(tmp_path):
    # With Keras 3 (TensorFlow 2.16+'s default) `tf.compat.v1.layers.dense` raises
    # "`dense` is not available with Keras 3": the run failed before it trained.
    report = _verified_against_itself(V1_LAYERS, tmp_path, steps=10)
    assert report["old"]["mode"] == "as written (TF2), Keras 2 for its tf.compat.v1 layers"


KERAS_OPTIMIZERS_IMPORTED = """\
import numpy as np
import keras
from keras import optimizers
from keras.layers import Dense
from keras.models import Sequential
from keras.utils import multi_gpu_model

rng = np.random.RandomState(0)
x = rng.randn(64, 4).astype('float32')
y = (x[:, :1] > 0).astype('float32')
model = Sequential([Dense(1, activation='sigmoid', input_shape=(4,),
                          kernel_initializer=keras.initializers.glorot_uniform(seed=1))])
parallel = multi_gpu_model(model, gpus=2)
parallel.compile(loss='binary_crossentropy', optimizer=optimizers.Adagrad(lr=0.05))
parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
"""


@pytest.mark.tensorflow
@pytest.mark.slow
def test_keras_optimizers_imported_from_keras_are_the_graph_mode_ones(tmp_path):
    # `from keras import optimizers` imported the real tf_keras, whose optimizers fail in graph
    # mode (NotImplementedError: numpy() is only available when eager execution is enabled).
    _verified_against_itself(KERAS_OPTIMIZERS_IMPORTED, tmp_path, steps=6)


KERAS2_DEFAULTS_PROBE = """
import json
import tf_keras
from tf_keras.src import optimizers as registry
from tfmigrate.verify.harness import make_keras2_modules

keras, _ = make_keras2_modules(tf_keras)
made = {"Adadelta()": keras.optimizers.Adadelta(), "Adadelta(lr=0.5)": keras.optimizers.Adadelta(lr=0.5),
        "Adagrad()": keras.optimizers.Adagrad(), "Adagrad(0.1)": keras.optimizers.Adagrad(0.1),
        "Adamax()": keras.optimizers.Adamax(), "Adam()": keras.optimizers.Adam(),
        "'adadelta'": registry.get("adadelta"), "'adagrad'": registry.get("adagrad"),
        "rmsprop(lr=0.5)": keras.optimizers.rmsprop(lr=0.5), "adadelta()": keras.optimizers.adadelta()}
print(json.dumps({name: [float(optimizer.get_config()["learning_rate"]),
                         optimizer.get_config().get("initial_accumulator_value")] for name, optimizer in made.items()}))
"""


@pytest.mark.tensorflow
def test_keras_2_s_default_rates_are_those_of_the_optimizers_a_keras_2_program_is_given():
    """Keras 2.0-2.3 trained `Adadelta()` at 1.0 (Keras's mnist_cnn example), `Adagrad()` at 0.01
    from zero accumulators, `Adamax()` at 0.002; tf_keras's legacy optimizers changed them (0.001,
    accumulators at 0.1): OLD gets Keras 2's, by class, by name and by Keras 2's lower-case
    aliases (`keras.optimizers.rmsprop`), as a rate given is kept."""
    pytest.importorskip("tf_keras")
    env = {**__import__("os").environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", KERAS2_DEFAULTS_PROBE], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    made = json.loads(result.stdout.strip().splitlines()[-1])
    assert made == {"Adadelta()": [1.0, None], "Adadelta(lr=0.5)": [0.5, None], "Adagrad()": [0.01, 0.0],
                    "Adagrad(0.1)": [0.1, 0.0], "Adamax()": [0.002, None], "Adam()": [0.001, None],
                    "'adadelta'": [1.0, None], "'adagrad'": [0.01, 0.0], "rmsprop(lr=0.5)": [0.5, None],
                    "adadelta()": [1.0, None]}, made


def _verified_against_itself(source: str, tmp_path, steps: int) -> dict:
    """`verify` of a program against itself: it must run and match; the JSON report."""
    pytest.importorskip("tensorflow")
    from tests.conftest import run_verify as verify_report

    program = tmp_path / "program.py"
    program.write_text(source)
    status, report = verify_report(program, program, tmp_path, steps=steps)
    assert status == 0 and report["verdict"] == "match", report.get("reasons")
    return report


STEP_COUNTED = '''
import numpy as np
import tensorflow as tf

x = tf.placeholder(tf.float32, [8, 3])
y = tf.placeholder(tf.float32, [8, 1])
w = tf.get_variable("w", [3, 1], initializer=tf.zeros_initializer())
# nematus names its global step 'time' and get_variable makes it a float
step = tf.get_variable("time", [], initializer=tf.zeros_initializer(), trainable=False)
loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
report = tf.identity(loss, name="report")  # what the program prints: not the tensor the optimizer saw
train_op = tf.train.GradientDescentOptimizer(LR).apply_gradients(
    tf.train.GradientDescentOptimizer(LR).compute_gradients(loss), global_step=step)
rng = np.random.RandomState(0)
xs, ys = rng.randn(8, 3).astype(np.float32), rng.randn(8, 1).astype(np.float32)
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for i in range(12):
        t, _, value = sess.run([step, train_op, report], {x: xs, y: ys})
        print("step %d loss %f" % (i, value))
'''


@pytest.mark.tensorflow
def test_a_fetched_float_global_step_is_not_taken_for_the_loss(tf_available, tmp_path):
    """A float step count fetched before the loss rises alike in any two programs: compared
    as the loss, it made a wrong learning rate MATCH."""
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(STEP_COUNTED.replace("LR", "0.1"))
    new.write_text(STEP_COUNTED.replace("LR", "0.05"))
    result = run_verify(str(old), str(new), "--steps", "8", "--warmup", "2")
    assert result.returncode == 1 and "MISMATCH" in result.stdout, result.stdout + result.stderr
    assert "fetched scalar report:0" in result.stdout, result.stdout



def test_the_recorder_s_nested_run_flag_is_per_thread():
    """A feeder thread's `sess.run(enqueue_op, ...)` (tacotron's DataFeeder, KittiSeg) runs beside
    the training loop's: with one flag for every thread, a training step that began while the
    feeder's run was being looked at went unrecorded, and a program compared with itself
    mismatched under load (2 of 3 runs here)."""
    import threading

    from tfmigrate.verify.harness import Recorder

    recorder = Recorder(None, None)
    recorder.in_run = True
    seen = []
    thread = threading.Thread(target=lambda: seen.append(recorder.in_run))
    thread.start()
    thread.join()
    assert seen == [False] and recorder.in_run


SHUFFLED_QUEUE = '''\
import numpy as np
import tensorflow as tf

rows = np.random.RandomState(0).normal(size=(64, 4)).astype(np.float32)
targets = rows.sum(axis=1, keepdims=True)
INPUT
w = tf.get_variable("w", [4, 1], initializer=tf.zeros_initializer())
loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
train_op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    coord = tf.train.Coordinator()
    threads = tf.train.start_queue_runners(sess=sess, coord=coord)
    for step in range(10):
        print("step %d loss %f" % (step, sess.run([train_op, loss])[1]))
    coord.request_stop()
    coord.join(threads)
'''
QUEUE_INPUT = '''\
row, target = tf.train.slice_input_producer([rows, targets], shuffle=True, seed=1)
x, y = tf.train.shuffle_batch([row, target], batch_size=8, capacity=40, min_after_dequeue=32, seed=2)
'''
DATASET_INPUT = '''\
dataset = tf.data.Dataset.from_tensor_slices((rows, targets)).shuffle(64, seed=1).repeat()
x, y = tf.data.make_one_shot_iterator(dataset.shuffle(32, seed=2).batch(8)).get_next()
'''


@pytest.mark.tensorflow
def test_shuffled_input_is_read_in_order_in_both_runs(tf_available, tmp_path):
    """A queue's shuffle and tf.data's draw from different random streams: a correct rewrite of a
    shuffled pipeline trains on the same examples in another order. Read in order in both runs,
    it matches step by step; the report says what was turned off in each."""
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(SHUFFLED_QUEUE.replace("INPUT\n", QUEUE_INPUT))
    new.write_text(SHUFFLED_QUEUE.replace("INPUT\n", DATASET_INPUT))
    result = run_verify(str(old), str(new), "--steps", "8", "--warmup", "2")
    assert result.returncode == 0 and "MATCH" in result.stdout, result.stdout + result.stderr
    note = " ".join(result.stdout.split())
    assert ("shuffling turned off in OLD slice_input_producer(shuffle=True), shuffle_batch(min_after_dequeue=32); "
            "in NEW Dataset.shuffle(buffer_size=64), Dataset.shuffle(buffer_size=32)") in note
    kept = run_verify(str(old), str(new), "--steps", "8", "--warmup", "2", "--keep-shuffles")
    assert kept.returncode == 1 and "MISMATCH" in kept.stdout, kept.stdout + kept.stderr


@pytest.mark.tensorflow
def test_a_rewrite_that_drops_the_shuffle_mismatches(tf_available, tmp_path):
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(SHUFFLED_QUEUE.replace("INPUT\n", QUEUE_INPUT))
    new.write_text(SHUFFLED_QUEUE.replace("INPUT\n", DATASET_INPUT.replace(".shuffle(64, seed=1)", "").replace(
        "dataset.shuffle(32, seed=2)", "dataset")))
    result = run_verify(str(old), str(new), "--steps", "8", "--warmup", "2", "-q")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "OLD shuffles its input and NEW does not" in result.stdout


BATCH_NORM_KERAS = '''
import numpy as np
import tensorflow as tf
from keras.layers import BatchNormalization, Dense
from keras.models import Sequential
from keras.utils import multi_gpu_model

tf.random.set_seed(0)
x = np.random.RandomState(0).normal(size=(64, 4)).astype('float32')
y = (x[:, :1] > 0).astype('float32')
model = Sequential([Dense(8, input_shape=(4,)), BatchNormalization(), Dense(1, activation='sigmoid')])
SWAP
model.compile(optimizer='sgd', loss='binary_crossentropy')
model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
'''


@pytest.mark.tensorflow
def test_the_restored_multi_gpu_model_normalizes_each_devices_slice(tf_available, tmp_path):
    """Keras 2's `multi_gpu_model` ran the template on each GPU's slice: a BatchNormalization
    layer saw half the batch, as each replica's does under MirroredStrategy. verify's stand-in
    did the same (it ran the template on the whole batch, and the first step of a held-out
    BatchNormalization kernel differed)."""
    from tests.conftest import run_verify as run_pair

    legacy = tmp_path / "legacy.py"
    legacy.write_text(BATCH_NORM_KERAS.replace("SWAP", "model = multi_gpu_model(model, gpus=2)"))
    migrated = tmp_path / "migrated.py"
    migrated.write_text(BATCH_NORM_KERAS.replace("model = Sequential(", "strategy = tf.distribute.MirroredStrategy()\n"
                                                 "with strategy.scope():\n    model = Sequential(").replace(
        "SWAP\nmodel.compile(", "    model.compile(").replace("from keras.utils import multi_gpu_model\n", ""))
    status, report = run_pair(legacy, migrated, tmp_path, steps=8)
    assert status == 0 and report["verdict"] == "match", report.get("reasons")


@pytest.mark.tensorflow
def test_keras_dropout_is_off_in_both_runs_and_a_dropped_layer_is_caught(tf_available, tmp_path):
    """A parallel model's slices and MirroredStrategy's replicas draw their dropout masks from
    different random streams, so both runs turn Keras's dropout off (and say so); a migration
    that lost a dropout layer still differs."""
    old = tmp_path / "old_dropout.py"
    old.write_text((PROGRAMS / "legacy_keras_mgpu.py").read_text()
                   .replace("from keras.layers import Dense", "from keras.layers import Dense, Dropout")
                   .replace('Dense(16, activation="relu", input_shape=(8,)), ', 'Dense(16, activation="relu", input_shape=(8,)), Dropout(0.5), '))
    new = tmp_path / "new_dropout.py"
    new.write_text((PROGRAMS / "migrated_keras_strategy.py").read_text().replace(
        'tf.keras.layers.Dense(16, activation="relu"),\n', 'tf.keras.layers.Dense(16, activation="relu"),\n            tf.keras.layers.Dropout(0.5),\n'))
    assert "Dropout(0.5)" in old.read_text() and "Dropout(0.5)" in new.read_text()
    report = tmp_path / "dropout.json"
    result = run_verify(str(old), str(new), "--steps", "10", "--warmup", "2", "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    notes = json.loads(report.read_text())["notes"]
    assert any("Keras dropout off in both runs" in n and "in OLD Dropout(rate=0.5); in NEW Dropout(rate=0.5)" in n
               for n in notes), notes
    lost = run_verify(str(old), str(PROGRAMS / "migrated_keras_strategy.py"), "--steps", "10", "--warmup", "2",
                      "--json", str(report))
    assert lost.returncode == 1
    assert "OLD has 1 dropout layers and NEW 0" in json.loads(report.read_text())["reasons"]


RECURRENT_DROPOUT_PROBE = """
import json, sys
from tfmigrate.verify import no_dropout
legacy = sys.argv[1] == "legacy"
no_dropout.install(legacy)
import importlib
layers = importlib.import_module("tf_keras.layers" if legacy else "keras.layers")
made = [layers.LSTM(4, dropout=0.2, recurrent_dropout=0.3), layers.GRU(4, dropout=0.1), layers.SimpleRNN(4)]
print(json.dumps({"rates": [[float(l.cell.dropout), float(l.cell.recurrent_dropout)] for l in made],
                  "off": no_dropout.TURNED_OFF}))
"""


@pytest.mark.tensorflow
@pytest.mark.parametrize("keras", ["legacy", "keras3"])
def test_recurrent_dropout_is_off_too_and_said(keras):
    """`LSTM(32, dropout=0.2, recurrent_dropout=0.2)` (Keras's imdb_lstm example) draws masks from
    each Keras's own random stream: a held-out program differed from step 0, and matches with the
    cells made without them in both runs, which the report names."""
    pytest.importorskip("tensorflow")
    env = {**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT),
           **({"TF_USE_LEGACY_KERAS": "1"} if keras == "legacy" else {})}
    result = subprocess.run([sys.executable, "-c", RECURRENT_DROPOUT_PROBE, keras], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["rates"] == [[0.0, 0.0]] * 3, seen
    assert [entry.split("(")[1] for entry in seen["off"]] == ["dropout=0.2, recurrent_dropout=0.3)", "dropout=0.1)"], seen


@pytest.mark.tensorflow
def test_keras_fit_shuffles_are_off_in_both_runs(tf_available, tmp_path):
    """Keras 2 and Keras 3 shuffle `fit`'s arrays each epoch from different random streams (a
    held-out Kaggle kernel's correct migration agreed for one epoch, then drifted 20%): both runs
    read them in order, as they read queues and datasets, and say so."""
    old = tmp_path / "old_shuffled.py"
    old.write_text((PROGRAMS / "legacy_keras_mgpu.py").read_text().replace("shuffle=False, ", ""))
    new = tmp_path / "new_shuffled.py"
    new.write_text((PROGRAMS / "migrated_keras_strategy.py").read_text().replace("shuffle=False, ", ""))
    assert "shuffle=False" not in old.read_text() + new.read_text()
    report = tmp_path / "shuffled.json"
    result = run_verify(str(old), str(new), "--steps", "16", "--warmup", "2", "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    notes = json.loads(report.read_text())["notes"]
    assert any("in OLD fit(shuffle=True); in NEW fit(shuffle=True)" in n for n in notes), notes


def test_normal_samples_the_program_draws_through_keras_sit_at_their_mean(tf_available):
    """verify's dropout-off mode: `keras.random.normal` called from the program's own code (a
    VAE's reparameterised sample) draws with no spread in both runs; Keras's own calls (an
    initializer's) still draw."""
    import keras

    from tfmigrate.verify import no_dropout

    original = keras.random.normal
    try:
        no_dropout.install(legacy_keras=False, from_program=lambda globals_: globals_ is globals())
        sampled = keras.ops.convert_to_numpy(keras.random.normal((64,), mean=2.0, stddev=1.0, seed=1))
        initialized = keras.ops.convert_to_numpy(keras.initializers.RandomNormal(stddev=1.0, seed=1)((64,)))
    finally:
        keras.random.normal = original
    assert (sampled == 2.0).all() and initialized.std() > 0.5
    assert "normal sampling(stddev=1.0)" in no_dropout.TURNED_OFF
