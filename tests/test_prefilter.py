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
])
def test_every_spelling_of_a_queue_batch_still_gets_through(spelling, parsed):
    findings = check_text(spelling, Config(root=ROOT, select=["TFM303"]))
    assert [f.code for f in findings] == ["TFM303"] and parsed == [spelling]


def test_the_catalog_keeps_the_required_patterns():
    rule = next(r for r in all_rules() if r.code == "TFM303")
    info = registry.RuleInfo.from_json(next(i for i in registry.computed_catalog() if i.code == "TFM303").to_json())
    assert info.requires == rule.requires != ()
    for text, expected in ((MODERN_INPUT, False), ("tf.train.batch(x, 2)", True)):
        assert could_fire(info, text) is could_fire(rule, text) is expected
