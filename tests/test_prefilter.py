"""The prefilter: a file no enabled rule could fire on is not parsed at all."""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import ROOT
from tfmigrate.engine import registry, source
from tfmigrate.engine.config import Config
from tfmigrate.engine.registry import all_rules, could_fire
from tfmigrate.engine.runner import check_text

MODERN_INPUT = textwrap.dedent("""\
    import tensorflow as tf


    def train_model(files, batch_size=64):
        dataset = tf.data.TFRecordDataset(files).shuffle(1000).batch(batch_size)
        return dataset.prefetch(tf.data.AUTOTUNE)
    """)


@pytest.fixture
def parsed(monkeypatch):
    """The texts LibCST was asked to parse."""
    texts = []
    real = source.parse_source

    def counting(src):
        texts.append(src.text)
        return real(src)

    monkeypatch.setattr(source, "parse_source", counting)
    return texts


def test_a_tf_data_module_is_not_parsed(parsed):
    assert check_text(MODERN_INPUT, Config(root=ROOT)) == [] and parsed == []


@pytest.mark.parametrize("spelling", [
    "import tensorflow as tf\nx = tf.train.shuffle_batch([a], 32, 100, 10)\n",
    "import tensorflow.compat.v1 as tf\nx = tf.train.batch([a], 32)\n",
    "from tensorflow.compat.v1 import train\nx = train.batch([a], 32)\n",
    "from tensorflow.compat.v1 import train as queues\nx = queues.maybe_batch([a], True, 32)\n",
    "from tensorflow.compat.v1.train import batch_join\nx = batch_join([[a]], 32)\n",
    "import tensorflow as tf\nbatching = tf.train\nx = batching.batch([a], 32)\n",
    "from tensorflow.compat.v1.train import maybe_shuffle_batch\nx = maybe_shuffle_batch([a], 32, 100, 10, True)\n",
    "from tensorflow.compat.v1.train import (\n    shuffle_batch_join,\n)\nx = shuffle_batch_join([[a]], 32, 100, 10)\n",
])
def test_every_spelling_of_a_queue_batch_still_gets_through(spelling, parsed):
    findings = check_text(spelling, Config(root=ROOT, select=["TFM303"]))
    assert [f.code for f in findings] == ["TFM303"] and parsed == [spelling]


def test_a_batch_function_of_the_modules_own_is_not_parsed(parsed):
    text = textwrap.dedent("""\
        import tensorflow as tf

        def next_batch(reader, size):
            return reader.read(size)

        opt = tf.train.AdamOptimizer(0.1)
        images = next_batch(reader, 32)
        dataset = tf.data.Dataset.range(10).batch(2)
        """)
    assert check_text(text, Config(root=ROOT)) == [] and parsed == []


def test_the_catalog_keeps_the_required_patterns():
    rule = next(r for r in all_rules() if r.code == "TFM303")
    info = registry.RuleInfo.from_json(next(i for i in registry.computed_catalog() if i.code == "TFM303").to_json())
    assert info.requires == rule.requires != ()
    for text, expected in ((MODERN_INPUT, False), ("tf.train.batch(x, 2)", True)):
        assert could_fire(info, text) is could_fire(rule, text) is expected


# The module every TF1 project has many of: a `num_gpus` flag, input pinned to the CPU, a
# tf.data pipeline, a schedule from `tf.train`. No rule can fire on it.
PROJECT_MODULE = textwrap.dedent("""\
    import tensorflow as tf

    FLAGS = tf.app.flags.FLAGS
    tf.app.flags.DEFINE_integer('num_gpus', 2, \"\"\"How many GPUs to use.\"\"\")


    def learning_rate(global_step):
        return tf.train.exponential_decay(0.1, global_step, 1000, 0.1, staircase=True)


    def input_fn(files, mode, batch_size):
        with tf.device('/cpu:0'):
            dataset = tf.data.TFRecordDataset(files)
            if mode == 'train':
                dataset = dataset.shuffle(1000)
            return dataset.batch(batch_size)
    """)


def test_a_project_module_with_a_gpu_flag_and_a_cpu_pin_is_not_parsed(parsed):
    assert check_text(PROJECT_MODULE, Config(root=ROOT)) == [] and parsed == []


@pytest.mark.parametrize("code, rule", [
    # a loop over the devices whose header is broken over lines, with no device scope
    ("import tensorflow as tf\nfor i in range(\n        FLAGS.num_gpus):\n"
     "    with tf.variable_scope('m', reuse=i > 0):\n        out = model(x[i])\n", "TFM103"),
    # `device` imported under another name
    ("from tensorflow import device as placed\nfor i in range(n):\n"
     "    with placed('/gpu:%d' % i):\n        outs.append(model(x[i]))\n", "TFM101"),
    # two fixed GPUs spelled as device specs
    ("import tensorflow as tf\nwith tf.device(tf.DeviceSpec(device_type='GPU', device_index=0)):\n    a = f(x)\n"
     "with tf.device(tf.DeviceSpec(device_type='GPU', device_index=1)):\n    b = g(a)\n", "TFM401"),
    # a batch split by a device count, with no loop in the module
    ("import numpy as np\nparts = np.split(batch, FLAGS.num_gpus)\nfeed = dict(zip(placeholders, parts))\n", None),
])
def test_what_the_device_patterns_let_through_is_still_found(code, rule):
    codes = {f.code for f in check_text(code, Config(root=ROOT))}
    assert rule is None or rule in codes, codes
    assert registry.could_fire(next(r for r in all_rules() if r.code == "TFM111"), code) or "np.split" not in code
