from __future__ import annotations

import libcst as cst

from tfmigrate.rewrites import mirrored
from tfmigrate.analysis.devices import enclosing_tower
from tfmigrate.rule import FixSafety, Invalid, Rule

PLACEHOLDERS = {
    "tensorflow.placeholder",
    "tensorflow.placeholder_with_default",
    "tensorflow.sparse_placeholder",
}


class PerTowerFeeds(Rule):
    code = "TFM106"
    name = "per-tower-feeds"
    summary = "One tf.placeholder per device, fed together through feed_dict"
    triggers = ("placeholder",)
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        `tf.placeholder(...)` (also `placeholder_with_default`, `sparse_placeholder`) created
        inside a tower loop (TFM101), i.e. one input per device, which the program then feeds
        with a slice of each batch through one `feed_dict`. Each placeholder call in the loop
        is reported. A placeholder created once, outside the loop, and split across the towers
        is not reported here (TFM105 reports the split).
    """
    why = """
        Under `tf.distribute.MirroredStrategy` there is one model and one input: the strategy
        splits each global batch across the replicas itself. Per-device placeholders have no
        counterpart, and feeding a distributed program through placeholders (re-initialising a
        distributed iterator every step) was measured at 100x slower than reading a dataset.
    """
    example = """
        placeholders = []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                x = tf.placeholder(tf.float32, [None, 784])
                placeholders.append(x)
        with tf.Session() as sess:
            sess.run(total, feed_dict={p: batch[i] for i, p in enumerate(placeholders)})
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        dataset = tf.data.Dataset.from_generator(
            batches, output_signature=tf.TensorSpec([None, 784], tf.float32))
        dist_dataset = strategy.experimental_distribute_dataset(dataset)
    """
    fix_notes = """
        Unsafe, and the same edit as TFM101's: the tower loop is rewritten to MirroredStrategy,
        and when the session loop feeds each tower's placeholders the tower's contiguous slice
        of one batch (`xs[k * per:(k + 1) * per]`, `np.split(xs, N)[k]`) drawn from
        `for ... in <source>`, the placeholders become one
        `tf.data.Dataset.from_generator(<source>, output_signature=...)` distributed with
        `strategy.experimental_distribute_dataset` and read through an iterator initialised
        after the variables; the loop runs until `tf.errors.OutOfRangeError`. The strategy gives
        replica k the k-th contiguous part of each batch, so training is the same; check it with
        `tfmigrate verify`. Any other shape (other entries in the feed, the batch used elsewhere,
        uneven `np.array_split` pieces, ...) keeps one placeholder per replica, still filled by
        the program's `feed_dict`, and the finding says why.
    """

    valid = [
        """\
        import tensorflow as tf
        x = tf.placeholder(tf.float32, [None, 784])
        splits = tf.split(x, 2)
        """,
        """\
        import tensorflow as tf
        for i in range(3):
            x = tf.placeholder(tf.float32, name='input_%d' % i)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    x = tf.placeholder(tf.float32)
                    outputs.append(model(x))
            """,
            line=4,
        ),
        Invalid(
            """\
            from tensorflow.compat import v1
            for i, dev in enumerate(devices):
                with v1.device(dev):
                    labels = v1.placeholder(v1.int32, [None])
                    losses.append(loss_fn(labels))
            """,
            line=4,
        ),
    ]

    def visit_Call(self, node: cst.Call) -> None:
        name = self.call_name(node)
        if name not in PLACEHOLDERS or enclosing_tower(self.context, node) is None:
            return
        short = name.replace("tensorflow.", "tf.")
        message = (
            f"per-tower input: `{short}` created once per device in the tower loop and fed "
            "through feed_dict; feed the global batch once from a tf.data.Dataset (e.g. "
            "from_generator over the existing batch source) distributed with "
            "strategy.experimental_distribute_dataset, which splits it across replicas"
        )
        self._placeholders.append((node, enclosing_tower(self.context, node), message))

    def visit_Module(self, node: cst.Module) -> None:
        self._placeholders: list = []

    def leave_Module(self, original_node: cst.Module) -> None:
        # The TFM101 rewrite (which this one shares) is planned once the walk has seen the
        # whole module: it reads the session code after the loop too.
        for node, tower, message in self._placeholders:
            edit = None
            planned = mirrored.planned(self, tower)
            if planned.fed is not None and id(node) in planned.fed.placeholder_calls:
                edit = planned.edit
            elif planned.edit is not None and planned.feeds_kept:
                message += f" (the TFM101 rewrite keeps one placeholder per replica: {planned.feeds_kept})"
            self.report(node, message, edit=edit)
