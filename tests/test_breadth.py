"""Detection breadth (issue 7): the shapes of legacy multi-GPU code beyond the textbook loop.

The per-shape cases are fixtures (fixtures/TFM1xx/breadth_*.py, fixtures/TFM201 and TFM30x
breadth_*.py, fixtures/negative/modern_*.py), checked by tests/test_fixtures.py. Here: what a
fixture cannot say (a whole run over a Python 2 file, the rule pages of the new codes, cases
that need a module of their own).
"""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import FIXTURES, run_check
from tfmigrate.cli.main import app
from tfmigrate.engine.registry import all_rules

NEW_CODES = ("TFM107", "TFM108", "TFM109", "TFM110", "TFM111")


def run_cli(args: list[str], cwd: Path):
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(app, args, catch_exceptions=False)
    finally:
        os.chdir(old)


def test_python2_file_is_reported_and_the_run_goes_on(tmp_path):
    shutil.copy(FIXTURES / "python2" / "cifar_towers_py2.py", tmp_path / "old_train.py")
    shutil.copy(FIXTURES / "TFM101" / "breadth_tower_functions.py", tmp_path / "towers.py")
    result = run_cli(["check", "."], tmp_path)
    assert result.exit_code == 2
    output = result.stdout + (result.stderr if result.stderr_bytes is not None else "")
    assert "old_train.py" in output and "Python 2 syntax" in output
    assert "towers.py:13:5: TFM101" in result.stdout  # the other file is still checked


@pytest.mark.parametrize("code", NEW_CODES)
def test_explain_documents_the_hand_migration(code):
    result = CliRunner().invoke(app, ["explain", code], catch_exceptions=False)
    assert result.exit_code == 0
    rule = next(r for r in all_rules() if r.code == code)
    assert "## Use instead" in result.stdout
    assert "MirroredStrategy" in result.stdout
    assert rule.fix_safety.value == "none"


def test_new_codes_have_breadth_fixtures():
    for code in NEW_CODES:
        assert list((FIXTURES / code).glob("breadth_*.py")), code


def test_sync_replicas_in_a_cluster_is_not_single_machine():
    code = """
        import tensorflow as tf
        flags = tf.app.flags
        flags.DEFINE_string('job_name', '', 'ps or worker')
        FLAGS = flags.FLAGS

        def main(ps_hosts, worker_hosts, loss):
            cluster = tf.train.ClusterSpec({'ps': ps_hosts, 'worker': worker_hosts})
            server = tf.train.Server(cluster, job_name=FLAGS.job_name, task_index=0)
            opt = tf.train.SyncReplicasOptimizer(tf.train.AdamOptimizer(), replicas_to_aggregate=2)
            return server, opt.minimize(loss)
        """
    assert [f.code for f in run_check(code)] == []


def _messages(code: str, rule: str) -> list[str]:
    return [f.message for f in run_check(code) if f.code == rule]


def test_split_tower_loops_are_one_finding_naming_the_other_lines():
    code = """
        import tensorflow as tf
        logits, losses = [], []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                logits.append(net(images[i]))
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                losses.append(loss_fn(logits[i], labels[i]))
        """
    findings = [f for f in run_check(code) if f.code == "TFM101"]
    assert [f.start.row for f in findings] == [3]
    assert "line 6" in findings[0].message


def test_tower_function_is_named_at_the_loop():
    code = """
        import tensorflow as tf
        def build_tower(i):
            with tf.device('/gpu:%d' % i):
                return net(images[i])
        towers = []
        for i in range(num_gpus):
            towers.append(build_tower(i))
        """
    findings = [f for f in run_check(code) if f.code == "TFM101"]
    assert [f.start.row for f in findings] == [6]
    assert "`build_tower`" in findings[0].message


@pytest.mark.parametrize(
    "code, verb",
    [
        ("summed = nccl.all_sum(grads)\n", "sums"),
        ("summed = nccl.all_sum(grads)\naveraged = [g / n for g in summed]\n", "averages"),
    ],
)
def test_nccl_message_says_summed_or_averaged(code, verb):
    source = "from tensorflow.contrib import nccl\n" + code
    messages = _messages(source, "TFM102")
    assert len(messages) == 1 and messages[0].startswith(f"this code {verb}")


def test_loss_averaging_before_gradients_is_found_only_when_differentiated():
    towers = textwrap.dedent(
        """\
        import tensorflow as tf
        losses = []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                losses.append(net_loss(i))
        """
    )
    assert _messages(towers + "total = tf.reduce_mean(losses)\n", "TFM102") == []
    messages = _messages(towers + "total = tf.reduce_mean(losses)\ntrain_op = opt.minimize(total)\n", "TFM102")
    assert len(messages) == 1 and "averages" in messages[0]


def test_modern_corpus_has_no_finding_at_all():
    for path in sorted((FIXTURES / "negative").glob("modern_*.py")):
        findings = run_check(path.read_text(encoding="utf-8"))
        assert findings == [], (path.name, [(f.start.row, f.code) for f in findings])
