"""Unit tests for the shared device analysis (tfmigrate/analysis/devices.py)."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from tfmigrate.analysis.devices import (
    enclosing_tower, fixed_gpu, looks_per_device, mentions_only_cpu, module_tower_loops, per_device_names,
    tower_group, tower_loop_at,
)
from tfmigrate.cst.names import ImportTable
from tfmigrate.rule import RuleContext


def context_for(code: str) -> RuleContext:
    module = cst.parse_module(textwrap.dedent(code))
    return RuleContext(path="<test>", module=module, imports=ImportTable.from_module(module))


def expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


TF = ImportTable.from_module(cst.parse_module("import tensorflow as tf\n"))


@pytest.mark.parametrize(
    "device, expected",
    [
        ("'/gpu:1'", "/gpu:1"),
        ("'/device:GPU:1'", "/gpu:1"),
        ("'GPU:0'", "/gpu:0"),
        ("'/job:worker/task:0/gpu:2'", "/job:worker/task:0/gpu:2"),
        ("tf.DeviceSpec(device_type='GPU', device_index=3)", "/gpu:3"),
        ("'/gpu:%d' % i", None),
        ("f'/gpu:{i}'", None),
        ("'/cpu:0'", None),
        ("tf.DeviceSpec(device_type='CPU', device_index=0)", None),
        ("name", None),
    ],
)
def test_fixed_gpu(device, expected):
    assert fixed_gpu(expr(device), TF) == expected


def test_ps_device_of_a_device_function_is_not_where_ops_go():
    assert not mentions_only_cpu(expr("assign_to_device(dev, ps_device='/cpu:0')"), TF)
    assert mentions_only_cpu(expr("assign_to_device('/cpu:0', ps_device='/cpu:0')"), TF)
    assert mentions_only_cpu(expr("tf.DeviceSpec(device_type='CPU', device_index=i)"), TF)


@pytest.mark.parametrize(
    "iterable, expected",
    [
        ("range(FLAGS.num_gpus)", True),
        ("enumerate(devices)", True),
        ("range(len(gpu_list))", True),
        ("range(num_towers)", True),
        ("range(num_steps)", False),
        ("dataset", False),
    ],
)
def test_looks_per_device(iterable, expected):
    assert looks_per_device(expr(iterable)) == expected


def test_tower_loops_membership_and_nesting():
    context = context_for(
        """
        import tensorflow as tf
        for host in range(2):
            for g in range(4):
                with tf.device('/task:%d/gpu:%d' % (host, g)):
                    out = f(g)
        for step in range(10):
            run(step)
        """
    )
    towers = module_tower_loops(context)
    assert len(towers) == 1
    outer = context.module.body[1]
    assert tower_loop_at(context, outer) is towers[0]
    inner = outer.body.body[0]
    assert tower_loop_at(context, inner) is None  # nested: reported at the outer loop
    assert enclosing_tower(context, inner) is towers[0]
    assert enclosing_tower(context, context.module.body[2]) is None


def test_device_listing_loop_is_not_a_tower_loop():
    context = context_for(
        """
        import tensorflow as tf
        gpus = tf.config.list_logical_devices('GPU')
        for gpu in gpus:
            with tf.device(gpu.name):
                out.append(model(x))
        """
    )
    assert module_tower_loops(context) == []


def test_per_device_names_cover_loops_and_comprehensions():
    context = context_for(
        """
        for i in range(num_gpus):
            shard = ds.shard(num_gpus, i)
        shards = [ds.shard(n, g) for g in range(FLAGS.num_gpus)]
        for t in range(num_steps):
            step(t)
        """
    )
    first, second, third = context.module.body
    call = first.body.body[0].body[0].value
    assert {"i", "shard"} <= per_device_names(context, call)
    assert "g" in per_device_names(context, second.body[0].value.elt)
    assert per_device_names(context, third.body.body[0]) == frozenset()


# --- issue 7: device functions, tower functions, groups of loops ---------------------------


@pytest.mark.parametrize(
    "device, only_cpu",
    [
        ("assign_to_device(dev, '/cpu:0')", False),  # second positional: the variables' device
        ("tf.train.replica_device_setter(ps_tasks=1, ps_device='/cpu:0', worker_device=gpu)", False),
        ("local_device_setter(ps_device_type='cpu', worker_device=worker)", False),
        ("local_device_setter(worker_device='/cpu:0')", True),
        ("'/cpu:{}'.format(i)", True),
        ("'/gpu:{}'.format(i)", False),
    ],
)
def test_device_functions_are_read_for_where_the_ops_go(device, only_cpu):
    assert mentions_only_cpu(expr(device), TF) == only_cpu


def test_a_loop_calling_a_tower_function_is_a_tower_loop():
    context = context_for(
        """
        import tensorflow as tf
        def build_tower(i, x):
            with tf.device('/gpu:%d' % i):
                ph = tf.placeholder(tf.float32)
                return net(x[i], ph)
        for k in range(num_gpus):
            outs.append(build_tower(k, x))
        for name in names:
            print(name)
        """
    )
    (tower,) = module_tower_loops(context)
    function, loop = context.module.body[1], context.module.body[2]
    assert tower.loop is loop and tower.via == [function]
    assert tower.scopes and tower.scopes[0].with_node is function.body.body[0]
    assert {"k", "i"} <= tower.loop_names
    placeholder = function.body.body[0].body.body[0]
    assert enclosing_tower(context, placeholder) is tower  # the function's body is the tower's


def test_colocating_with_a_variable_is_not_a_tower():
    context = context_for(
        """
        import tensorflow as tf
        for j, var in enumerate(variables):
            with tf.device(var.device):
                averaged.append(tf.add_n(grads[j]))
        """
    )
    assert module_tower_loops(context) == []


def test_loops_over_the_same_devices_that_feed_each_other_are_one_group():
    context = context_for(
        """
        import tensorflow as tf
        def build(num_gpus):
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    logits.append(net(x[i]))
            for i in range(0, num_gpus):
                with tf.device('/gpu:%d' % i):
                    losses.append(loss(logits[i]))
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    other.append(net(y[i]))
        """
    )
    first, second, third = context.module.body[1].body.body
    group = tower_group(context, first)
    assert [t.loop for t in group] == [first, second]
    assert tower_group(context, second) is group
    assert [t.loop for t in tower_group(context, third)] == [third]
    assert tower_group(context, context.module.body[0]) == []


def test_per_device_names_from_the_walks_parents_equal_the_whole_module_pass():
    """The rules' walk records each node's parent; the names found going up from a node are
    those the one-pass computation over the module gives."""
    from tfmigrate.analysis.devices import _per_device_names

    compared = 0
    for path, module, walked in _walked_fixtures():
        whole = _per_device_names(RuleContext(path=str(path), module=module, imports=walked.imports))
        for node in (n for n in _all_nodes(module)):
            assert per_device_names(walked, node) == whole.get(id(node), frozenset()), (path, type(node).__name__)
            compared += bool(whole.get(id(node)))
    assert compared > 1000  # nodes inside per-device loops


def _walked_fixtures():
    """(path, module, context after the rules' walk with no rule) for every parsable fixture."""
    from tests.conftest import FIXTURES
    from tfmigrate.engine.runner import _walk_rules

    for path in sorted(FIXTURES.rglob("*.py")):
        try:
            module = cst.parse_module(path.read_text(encoding="utf-8"))
        except (cst.ParserSyntaxError, UnicodeDecodeError):
            continue
        context = RuleContext(path=str(path), module=module, imports=ImportTable.from_module(module))
        _walk_rules(module, [], {}, {}, set(), context)
        yield path, module, context


def _all_nodes(module: cst.Module) -> list[cst.CSTNode]:
    from tfmigrate.cst.traversal import walk

    return list(walk(module))


@pytest.mark.parametrize("binding", [
    "from tensorflow.config import list_logical_devices as lld\ngpus = lld('GPU')\n",
    "lld = tf.config.experimental.list_physical_devices\ngpus = lld('GPU')\n",
    "gpus = tf.config.list_logical_devices('GPU')\n",
])
def test_a_device_listing_is_seen_in_every_spelling_when_the_source_is_known(binding):
    """The runner gives the analysis the source, which spares looking for device listings in a
    module that does not name one; every spelling names one."""
    from tests.conftest import run_check

    code = "import tensorflow as tf\n" + binding + (
        "for gpu in gpus:\n    with tf.device(gpu.name):\n        y = tf.matmul(x, w)\n"
    )
    assert [f.code for f in run_check(code) if f.code == "TFM101"] == []


def test_the_walks_parents_are_those_of_the_analyses():
    """Once the rules' walk is complete, the rewrites use its parents instead of computing
    them: for every node the analyses walk, the same parent."""
    from tfmigrate.cst.traversal import parents_of, walk
    from tfmigrate.cst.walker import trivia_types

    compared = 0
    for _, module, context in _walked_fixtures():
        assert context.walk_complete
        skipped = trivia_types()  # operators and the like: the walk skips them; no rewrite asks
        nodes = {id(node): node for node in walk(module)}
        for key, parent in parents_of(module).items():
            if type(nodes[key]) not in skipped:
                assert context.parents[key] is parent
                compared += 1
    assert compared > 10000


def test_a_device_function_defined_in_the_loop_over_its_device_makes_a_tower_loop():
    """chqiwang/transformer: `balanced_device_setter`, defined in the loop body, places the ops on
    the loop's `device`; the scope reads the function, not the device, and the loop went unseen."""
    context = context_for(
        """
        import tensorflow as tf
        for i, (x, device) in enumerate(zip(parts, devices)):
            def balanced_device_setter(op):
                if op.type in ('Variable', 'VariableV2'):
                    return '/cpu:0'
                return device
            device_setter = balanced_device_setter
            with tf.device(device_setter):
                losses.append(model(x, reuse=i > 0))
        """
    )
    (tower,) = module_tower_loops(context)
    assert isinstance(tower.loop, cst.For)


ROUND_ROBIN = """
    import tensorflow as tf

    class Model(object):
        def _next_device(self):
            dev = '/gpu:%d' % self._cur_gpu
            self._cur_gpu = (self._cur_gpu + 1) % self._num_gpus
            return dev

        def build(self, x, opt):
            for layer in range(self.layers):  # one layer per GPU: no replica
                with tf.device(self._next_device()):
                    x = tf.layers.dense(x, 8)
            for i in range(self.towers):
                with tf.device(self._next_device()), tf.name_scope('tower_%d' % i):
                    self.grads.append(opt.compute_gradients(self.loss(x[i])))
"""


def test_towers_placed_by_a_round_robin_device_allocator_are_a_tower_loop():
    """`tf.device(self._next_device())` names no loop variable: a call of the module's own
    allocator that names a GPU and moves its counter gives each call the next device. Only the
    loop that computes gradients is replicas; textsum's layers placed one per GPU are not."""
    context = context_for(ROUND_ROBIN)
    loops = module_tower_loops(context)
    assert [cst.Module([]).code_for_node(t.loop.iter) for t in loops] == ["range(self.towers)"]
    fixed = context_for(ROUND_ROBIN.replace("self._cur_gpu = (self._cur_gpu + 1) % self._num_gpus", "pass"))
    assert module_tower_loops(fixed) == []  # always the same device: no towers
