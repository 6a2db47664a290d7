"""Fix safety that depends on the rest of the module."""

from __future__ import annotations

from tests.conftest import run_check

COLOCATE = """\
import tensorflow as tf
{placement}
train_op = opt.minimize(loss, colocate_gradients_with_ops=True)
"""
TOWER = "for i in range(2):\n    with tf.device('/gpu:%d' % i):\n        build(i)\n"


def _safety(code: str, **config) -> str:
    (finding,) = [f for f in run_check(code, **config) if f.code == "TFM104"]
    return finding.fix_safety.value


def test_colocate_removal_is_safe_without_manual_placement():
    assert _safety(COLOCATE.format(placement="")) == "safe"
    assert _safety(COLOCATE.format(placement="with tf.device('/cpu:0'):\n    x = f()\n")) == "safe"


def test_colocate_removal_is_unsafe_while_towers_remain_in_compat_mode():
    assert _safety(COLOCATE.format(placement=TOWER)) == "unsafe"
    assert _safety(COLOCATE.format(placement="with tf.device('/gpu:1'):\n    x = f()\n")) == "unsafe"


def test_colocate_removal_is_safe_for_the_tf2_target():
    assert _safety(COLOCATE.format(placement=TOWER), target="tf2") == "safe"


def test_queue_scaffolding_in_a_try_with_only_finally_leaves_the_body():
    """`try: ... finally: coord.request_stop()` with no `except`: once the coordinator goes the
    try has neither handler nor finally, which LibCST cannot even build (the fix crashed)."""
    from tests.conftest import FIXTURES, unsafe_fix

    text = (FIXTURES / "programs" / "fix_queue_slices.py").read_text()
    text = text.replace("    except tf.errors.OutOfRangeError:\n        pass\n", "")
    assert "try:\n        while not coord.should_stop():" in text and "except" not in text
    fixed = unsafe_fix(text)
    assert "try:" not in fixed and "finally:" not in fixed and "coord" not in fixed
    assert "    while True:\n        f, l = sess.run([feature_batch, label_batch])\n" in fixed
