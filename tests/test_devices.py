"""Unit tests for the shared device analysis (tfmigrate/devices.py)."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from tfmigrate.devices import (
    enclosing_tower,
    fixed_gpu,
    looks_per_device,
    mentions_only_cpu,
    module_tower_loops,
    per_device_names,
    tower_loop_at,
)
from tfmigrate.names import ImportTable
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
