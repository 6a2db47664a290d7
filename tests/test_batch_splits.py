"""Batch splits in every spelling (issue 17): TFM105 and TFM111 find the cut, say where it is and
which loop reads it, and stay quiet on splits of channels or heads and on modern code.

The per-shape cases are fixtures (fixtures/TFM111/breadth_split_spellings.py,
fixtures/TFM105/breadth_split_concat_spellings.py, fixtures/negative/modern_split_heads_and_batches.py),
checked by tests/test_fixtures.py; here what a fixture cannot say.
"""

from __future__ import annotations

import sys

import libcst as cst
import pytest

from tests.conftest import ROOT, run_check
from tfmigrate.cst.callargs import is_legacy_split, split_arguments


def _call(code: str) -> cst.Call:
    return cst.parse_expression(code)


@pytest.mark.parametrize(
    "code, value, count, axis, legacy",
    [
        ("tf.split(x, n)", "x", "n", None, False),
        ("tf.split(x, n, 0)", "x", "n", "0", False),
        ("tf.split(x, num_or_size_splits=n, axis=1)", "x", "n", "1", False),
        ("tf.split(axis=0, num_or_size_splits=n, value=x)", "x", "n", "0", False),
        ("tf.split(value=x, axis=0, num_or_size_splits=n)", "x", "n", "0", False),
        ("tf.split(0, n, x)", "x", "n", "0", True),
        ("tf.split(split_dim=0, num_split=n, value=x)", "x", "n", "0", True),
    ],
)
def test_split_arguments_in_every_order(code, value, count, axis, legacy):
    call = _call(code)
    got = [None if node is None else cst.Module([]).code_for_node(node) for node in split_arguments(call)]
    assert got == [value, count, axis]
    assert is_legacy_split(call) is legacy


def _only(code: str, rule: str):
    findings = [f for f in run_check(code) if f.code == rule]
    assert len(findings) == 1, [(f.start.row, f.code, f.message) for f in run_check(code)]
    return findings[0]


def test_tfm111_names_the_split_and_the_loop_that_reads_it():
    finding = _only(
        """\
        import tensorflow as tf
        def towers(images, opt):
            images_splits = tf.split(axis=0, num_or_size_splits=FLAGS.num_gpus, value=images)
            grads = []
            for i in range(FLAGS.num_gpus):
                with tf.device('/gpu:%d' % i):
                    grads.append(opt.compute_gradients(loss(images_splits[i])))
            return grads
        """,
        "TFM111",
    )
    assert finding.start.row == 3 and finding.fix_title is None
    assert "with `tf.split(axis=0, num_or_size_splits=" in finding.message
    assert "read by the tower loop at line 5" in finding.message
    assert "no automatic fix for the cut itself" in finding.message


def test_tfm111_tf0_order_and_fixed_gpu_halves_say_so():
    legacy = _only(
        """\
        import tensorflow as tf
        parts = tf.split(0, num_gpus, batch)
        for g in range(num_gpus):
            with tf.device('/gpu:%d' % g):
                grads.append(opt.compute_gradients(loss(parts[g])))
        """,
        "TFM111",
    )
    assert "TF 0.x's argument order" in legacy.message
    halves = _only(
        """\
        import tensorflow as tf
        a, b = tf.split(images, 2)
        with tf.device('/gpu:0'):
            la = loss(a)
        with tf.device('/gpu:1'):
            lb = loss(b)
        """,
        "TFM111",
    )
    assert "one piece under each fixed GPU scope (lines 3, 5)" in halves.message
    assert "no automatic fix: there is no tower loop" in halves.message


def test_tfm111_py_func_reported_once_not_again_at_its_numpy_split():
    findings = [
        f for f in run_check(
            """\
            import numpy as np
            import tensorflow as tf
            parts = tf.py_func(lambda b: np.array_split(b, num_gpus), [batch], [tf.float32] * num_gpus)
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    grads.append(opt.compute_gradients(loss(parts[i])))
            """
        )
        if f.code == "TFM111"
    ]
    assert len(findings) == 1 and "a Python function run through `tf.py_func(" in findings[0].message


@pytest.mark.parametrize(
    "split",
    ["tf.split(images, 3, axis=3)", "tf.split(images, num_gpus, axis=-1)", "tf.unstack(images, axis=1)"],
)
def test_splits_along_another_axis_are_not_batch_splits(split):
    code = f"""\
        import tensorflow as tf
        parts = {split}
        outs = []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                outs.append(model(parts[i]))
        merged = tf.concat(outs, axis=0)
        """
    assert not [f for f in run_check(code) if f.code in ("TFM105", "TFM111")]


def test_tfm105_names_the_split_the_loop_and_the_join_and_refuses_tf0_order():
    finding = _only(
        """\
        import tensorflow as tf
        def parallel_predict(batch, labels, n_gpus):
            pieces = tf.split(0, n_gpus, batch)
            label_pieces = tf.split(0, n_gpus, labels)
            outs = []
            for g in range(n_gpus):
                with tf.device('/gpu:' + str(g)):
                    outs.append(predict(pieces[g], label_pieces[g]))
            return tf.concat(0, outs)
        """,
        "TFM105",
    )
    assert "split at lines 3, 4, read by the tower loop at line 6, joined at line 9" in finding.message
    assert "no automatic fix: `tf.split(0, n, x)` is TF 0.x's argument order" in finding.message
    assert not [f for f in run_check("import tensorflow as tf\n" + "x = 1\n") if f.code == "TFM111"]


def test_keras_backend_spellings_are_the_keras_form():
    finding = _only(
        """\
        import keras.backend as K
        from keras.layers.core import Lambda
        from keras.models import Model
        def to_multi_gpu(model, x, n_gpus=2):
            towers = []
            for g in range(n_gpus):
                with K.tf.device('/gpu:' + str(g)):
                    piece = Lambda(slice_batch, arguments={'n_gpus': n_gpus, 'part': g})(x)
                    towers.append(model(piece))
            return Model(inputs=[x], outputs=K.concatenate(towers, axis=0))
        """,
        "TFM105",
    )
    assert finding.start.row == 4 and finding.fix_title is None
    assert "sliced at line 8, read by the tower loop at line 6, joined at line 10" in finding.message


def test_recall_of_batch_splits_on_the_annotated_fixtures(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_split_recall
    finally:
        sys.path.pop(0)
    assert bench_split_recall.main([]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "(recall 100%)" in out and "false positives: 0" in out
