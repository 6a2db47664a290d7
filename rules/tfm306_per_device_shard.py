from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import enclosing_tower, per_device_names
from tfmigrate.cst.traversal import names_used
from tfmigrate.rule import PER_DEVICE, FixSafety, Invalid, Rule


def _shard_arguments(call: cst.Call) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(num_shards, index) of a ``.shard(n, i)`` call, else None."""
    if not isinstance(call.func, cst.Attribute) or call.func.attr.value != "shard":
        return None
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    num = keywords.get("num_shards", positional[0] if positional else None)
    index = keywords.get("index", positional[1] if len(positional) > 1 else None)
    if num is None or index is None:
        return None
    return num, index


class PerDeviceShard(Rule):
    code = "TFM306"
    name = "per-device-shard"
    summary = "dataset.shard(n, i) builds one input pipeline per device"
    triggers = ("shard",)
    requires = (PER_DEVICE,)  # sharded per device: in a tower loop or a loop over the devices
    fix_safety = FixSafety.NONE

    what_it_finds = """
        `dataset.shard(num_shards, index)` called inside a per-device loop — a tower loop
        (TFM101), or a `for` loop or comprehension whose iterable mentions gpu, device, tower
        or replica (`range(FLAGS.num_gpus)`) — with an index computed from the loop variable:
        one input pipeline (and usually one iterator) per GPU.
    """
    why = """
        `tf.distribute.MirroredStrategy` feeds all local replicas from one dataset:
        `strategy.experimental_distribute_dataset(dataset)` splits each global batch across
        them. Per-device shards duplicate the pipeline, each with its own shuffle buffer and
        prefetch, and fix the device count in the input code. Sharding still has a place
        between *workers* (hosts), which `distribute_datasets_from_function` expresses with
        `input_context.input_pipeline_id`.
    """
    example = """
        iterators = []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                shard = dataset.shard(num_gpus, i).batch(per_gpu_batch)
                iterators.append(shard.make_one_shot_iterator())
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        dist_dataset = strategy.experimental_distribute_dataset(dataset.batch(global_batch))
    """
    fix_notes = """
        No automatic fix: the shards' consumers are the tower loop's inputs, migrated with the
        loop (TFM101).
    """

    valid = [
        """\
        import tensorflow as tf
        dataset = dataset.shard(hvd.size(), hvd.rank())
        """,
        """\
        import tensorflow as tf
        for epoch in range(epochs):
            part = dataset.shard(4, epoch % 4)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    it = dataset.shard(num_gpus, i).make_one_shot_iterator()
                    losses.append(model(it.get_next()))
            """,
            line=4,
        ),
        Invalid(
            """\
            import tensorflow as tf
            shards = [dataset.shard(num_shards=FLAGS.num_gpus, index=g) for g in range(FLAGS.num_gpus)]
            """,
            line=2,
        ),
    ]

    def visit_Call(self, node: cst.Call) -> None:
        arguments = _shard_arguments(node)
        if arguments is None:
            return
        num, index = arguments
        names = per_device_names(self.context, node)
        tower = enclosing_tower(self.context, node)
        if tower is not None:
            names = names | frozenset(tower.loop_names)
        if not names_used(index) & names:
            return
        code = self.context.module.code_for_node
        self.report(
            node,
            f"per-device shard: `.shard({code(num)}, {code(index)})` builds one input pipeline "
            "per device; build one dataset and let strategy.experimental_distribute_dataset "
            "split each global batch across replicas",
        )
