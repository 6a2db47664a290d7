"""Towers built by a `while` counter loop or by a comprehension (analysis/tower_forms.py,
rewrites/loop_forms.py): found as TFM101, rewritten as the `for` loop they mean only when the
tower rewrite then takes that loop, refused with the line of the file as it is otherwise.

The runnable programs are fixtures/programs/general_while_counter.py and
general_comprehension_towers.py (tests/test_general_rewrite.py verifies them step by step).
"""

from __future__ import annotations

import textwrap

from tests.conftest import run_check, unsafe_fix

WHILE_TOWERS = """
    import tensorflow as tf


    def train(opt, parts, num_gpus):
        tower_grads = []
        # one tower per GPU
        gpu = 0
        while gpu < num_gpus:
            with tf.device('/gpu:%d' % gpu):
                loss = tf.reduce_mean(model(parts[gpu]))
                tower_grads.append(opt.compute_gradients(loss))
            gpu += 1
        return opt.apply_gradients(average_gradients(tower_grads))


    def average_gradients(tower_grads):
        return [(tf.reduce_mean(tf.stack([g for g, _ in gv]), 0), gv[0][1]) for gv in zip(*tower_grads)]
"""

COMPREHENSION_TOWERS = """
    import tensorflow as tf


    def tower(i, x, opt):
        with tf.device('/gpu:%d' % i):
            loss = tf.reduce_mean(model(x))
            return loss, opt.compute_gradients(loss)


    def average_gradients(tower_grads):
        return [(tf.reduce_mean(tf.stack([g for g, _ in gv]), 0), gv[0][1]) for gv in zip(*tower_grads)]


    def train(opt, parts, num_gpus):
        losses, grads = zip(*[tower(i, parts[i], opt) for i in range(num_gpus)])
        train_op = opt.apply_gradients(average_gradients(grads))
        return train_op, tf.add_n(losses) / num_gpus
"""


def towers(code: str) -> list:
    return [f for f in run_check(code) if f.code == "TFM101"]


def snippet(code: str) -> str:
    return textwrap.dedent(code).strip("\n") + "\n"


def test_a_while_counter_loop_is_a_tower_loop_and_becomes_the_replica_function():
    (finding,) = towers(WHILE_TOWERS)
    assert finding.start.row == 8 and finding.fixable
    assert "written as `while gpu < num_gpus`" in finding.message
    assert "for gpu in range(num_gpus)" in finding.fix_title
    fixed = unsafe_fix(snippet(WHILE_TOWERS))
    assert "while" not in fixed and "gpu += 1" not in fixed and "gpu = 0" not in fixed
    assert "call_for_each_replica(tower_fn)" in fixed and "tf.device" not in fixed
    assert "gpu = int(tf.get_static_value(" in fixed
    assert "# one tower per GPU" in fixed  # the comment above the counter's start stays
    assert not towers(fixed)


def test_a_comprehension_that_calls_a_tower_function_is_rewritten_through_a_list():
    (finding,) = towers(COMPREHENSION_TOWERS)
    assert finding.start.row == 15 and finding.fixable
    assert "towers built by a comprehension" in finding.message and "opened in `tower`" in finding.message
    fixed = unsafe_fix(snippet(COMPREHENSION_TOWERS))
    assert "tower_results = []" in fixed and "tower_results.append(tower(i, parts[i], opt))" in fixed
    assert "losses, grads = zip(*tower_results)" in fixed
    assert "call_for_each_replica(tower_fn)" in fixed and "tf.device" not in fixed
    assert not towers(fixed)


def test_a_list_comprehension_assigned_to_a_name_fills_that_name():
    code = COMPREHENSION_TOWERS.replace(
        "losses, grads = zip(*[tower(i, parts[i], opt) for i in range(num_gpus)])",
        "results = [tower(i, parts[i], opt) for i in range(num_gpus)]\n        losses, grads = zip(*results)")
    fixed = unsafe_fix(snippet(code))
    assert "results = []" in fixed and "results.append(tower(i, parts[i], opt))" in fixed
    assert "tower_results" not in fixed


def test_a_counter_read_after_the_loop_is_refused_with_its_line():
    code = WHILE_TOWERS.replace("        return opt.apply_gradients(", "        print(gpu)\n        return opt.apply_gradients(")
    (finding,) = towers(code)
    assert not finding.fixable
    assert finding.refusal.startswith("line 13 reads the counter `gpu` after the loop"), finding.refusal
    assert unsafe_fix(snippet(code)) == snippet(code)


def test_a_counter_without_a_known_start_is_refused():
    code = WHILE_TOWERS.replace("        gpu = 0\n", "")
    (finding,) = towers(code)
    assert "cannot tell where the counter `gpu` starts" in finding.refusal


def test_the_tower_rewrites_refusal_names_the_lines_of_the_file_as_it_is():
    # The trial runs on the module with the `while` rewritten (two lines shorter above the
    # second loop): the line it names must be the second loop's line in the file.
    code = WHILE_TOWERS.replace("        return opt.apply_gradients(average_gradients(tower_grads))\n", """\
        train_op = opt.apply_gradients(average_gradients(tower_grads))
        losses = []
        for k in range(num_gpus):
            with tf.device('/gpu:%d' % k):
                losses.append(tf.reduce_mean(head(parts[k])))
        return train_op, opt.minimize(tf.add_n(losses))
""")
    first, second = towers(code)
    assert second.start.row == 15
    # (The `while` loop's towers start at its counter, line 7: the `for` loop it becomes is there.)
    assert "the tower loops at lines 7 and 15 each feed an update" in first.refusal, first.refusal


def test_a_while_tower_loop_and_a_validation_loop_are_rewritten_together():
    code = WHILE_TOWERS.replace("        return opt.apply_gradients(average_gradients(tower_grads))\n", """\
        train_op = opt.apply_gradients(average_gradients(tower_grads))
        for k in range(num_gpus):
            with tf.device('/gpu:%d' % k):
                tf.summary.histogram('out', model(parts[k]))
        return train_op
""")
    first, _ = towers(code)  # the `while` loop's fix takes the other loop with it
    assert first.fixable, first.refusal
    out = unsafe_fix(textwrap.dedent(code).lstrip("\n"))
    assert out.count("MirroredStrategy(") == 1 and "while" not in out
    assert "def tower_fn():" in out and "def tower_fn_2():" in out


def test_a_comprehension_variable_read_later_is_refused():
    code = COMPREHENSION_TOWERS.replace("        return train_op,", "        print(i)\n        return train_op,")
    (finding,) = towers(code)
    assert "reads `i`, which a `for` loop would leave bound" in finding.refusal


def test_a_later_comprehension_that_binds_the_same_name_is_no_read():
    code = COMPREHENSION_TOWERS.replace(
        "        return train_op,", "        names = [i.name for i in tf.trainable_variables()]\n        return train_op,")
    (finding,) = towers(code)
    assert finding.fixable


def test_while_loops_that_build_no_towers_are_not_reported():
    assert not towers("""
        import tensorflow as tf
        step = 0
        while step < 10:
            with tf.device('/cpu:0'):
                x = tf.constant(step)
            step += 1
        i = 0
        while i < num_gpus:
            print('/gpu:%d' % i)
            i += 1
    """)
