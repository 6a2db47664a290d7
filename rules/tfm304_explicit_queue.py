from __future__ import annotations

import libcst as cst

from tfmigrate.rewrites.pipelines import module_plan
from tfmigrate.rule import FixSafety, Invalid, Rule
from tfmigrate.tf_api import PREFETCH_QUEUES, QUEUES, STAGING_AREAS

_INSTEAD = {
    "FIFOQueue": "a `tf.data.Dataset` (`from_generator` for a Python producer) with `.prefetch(tf.data.AUTOTUNE)` for the buffering",
    "RandomShuffleQueue": "a `tf.data.Dataset` with `.shuffle(buffer_size)` (the queue's min_after_dequeue) and `.prefetch`",
    "PaddingFIFOQueue": "a `tf.data.Dataset` with `.padded_batch(batch_size)` and `.prefetch`",
    "PriorityQueue": "a `tf.data.Dataset` ordered before batching (or `tf.data.Dataset.sample_from_datasets`) with `.prefetch`",
}


class ExplicitQueue(Rule):
    code = "TFM304"
    name = "explicit-queue"
    summary = "Input flows through an explicit TF1 queue (`FIFOQueue`, `RandomShuffleQueue`, `prefetch_queue`, ...)"
    triggers = ("Queue", "prefetch_queue", "StagingArea")
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        Construction of TensorFlow queues: `FIFOQueue`, `RandomShuffleQueue`, `PaddingFIFOQueue`
        and `PriorityQueue`, as `tf.X`, `tf.queue.X`, `tf.io.X` (all but FIFOQueue),
        `tf.compat.v1.X` or `data_flow_ops.X`;
        slim's `prefetch_queue.prefetch_queue(...)` (`tf.contrib.slim.prefetch_queue`,
        `slim.prefetch_queue`, `tf_slim`), which multi-GPU programs use to hand each tower its
        own `dequeue()`d batch; and `tf.contrib.staging.StagingArea`, which stages batches onto a
        GPU. Python's own queues (`queue.Queue`, `multiprocessing.Queue`) are not reported.
    """
    why = """
        A TensorFlow queue is filled by `enqueue` ops run from `QueueRunner` threads (or from
        Python threads calling `sess.run(enqueue_op, feed_dict=...)`) and emptied by `dequeue`;
        it needs queue runners and a `Coordinator`, which TF2 removed. `tf.data` does the same
        buffering with `prefetch`, the shuffling with `shuffle`, the padding with `padded_batch`,
        and `tf.distribute.MirroredStrategy.experimental_distribute_dataset` gives each replica
        its own slice of the global batch, replacing the per-tower `dequeue()` of a
        `prefetch_queue` and the GPU staging of a `StagingArea`.
        The queue classes still exist in TF2 as `tf.queue.*`; if one is used for something other
        than feeding input, suppress the finding with `# tfmigrate: ignore[TFM304]`.
    """
    example = """
        images, labels = cifar10_input.distorted_inputs(data_dir, batch_size)
        batch_queue = tf.contrib.slim.prefetch_queue.prefetch_queue(
            [images, labels], capacity=2 * num_gpus)
        image_batch, label_batch = batch_queue.dequeue()
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        dataset = make_dataset(data_dir).batch(batch_size * strategy.num_replicas_in_sync)
        dist_dataset = strategy.experimental_distribute_dataset(dataset.prefetch(tf.data.AUTOTUNE))
    """
    fix_notes = """
        Unsafe, for a queue filled by a QueueRunner and dequeued in batches, in one block (a
        function body or the module):

            example_queue = tf.FIFOQueue(3 * batch_size, dtypes=[tf.float32, tf.int32], shapes=shapes)
            example_enqueue_op = example_queue.enqueue([image, label])
            tf.train.add_queue_runner(tf.train.QueueRunner(example_queue, [example_enqueue_op] * num_threads))
            images, labels = example_queue.dequeue_many(batch_size)

        That is what `tf.train.batch([image, label], batch_size, num_threads=num_threads,
        shapes=shapes)` builds inside, and the fix rewrites it as TFM303 rewrites that batch: a
        `RandomShuffleQueue` shuffles with its `min_after_dequeue` and `seed`, a
        `PaddingFIFOQueue` pads (`padded_batch`), `enqueue_many` unbatches (over `tf.constant`s
        the dataset is their rows, repeated), `dequeue_up_to` keeps the smaller last batch. The
        queue, its enqueue op, its runner (inline or named, then registered) and a
        `sess.run(queue.close(...))` go. An `if`/`else` that chooses the queue (resnet's
        `cifar_input`: `RandomShuffleQueue` to train, `FIFOQueue` to evaluate) becomes the same
        `if` choosing the dataset's shuffle; the preprocessing in its branches moves into the map
        function, and a thread count set there for the runner goes.

        No fix, with the reason in the message, where the queue is fed otherwise (a Python thread
        running `sess.run(enqueue_op, feed_dict=...)`: make a `tf.data.Dataset.from_generator`
        over what it feeds), its runner's threads are started by `create_threads`, the queue is
        used otherwise (`queue.size()` in a summary), has `names=`, or what it holds is neither read
        from files by a producer and reader in the block nor constants. A slim `prefetch_queue`
        and a `StagingArea` have no fix: under MirroredStrategy the per-tower dequeues become the
        distributed dataset's per-replica batches. Check the result with `tfmigrate verify`.
    """

    valid = [
        """
        import queue
        import tensorflow as tf
        work = queue.Queue(maxsize=8)
        results = queue.PriorityQueue()
        """,
        """
        import tensorflow as tf
        dataset = tf.data.Dataset.from_generator(gen, output_types=tf.float32).prefetch(2)
        """,
    ]
    invalid = [
        Invalid(
            """
            import tensorflow as tf
            q = tf.FIFOQueue(capacity=64, dtypes=[tf.float32, tf.int32])
            """,
            line=2,
        ),
        Invalid(
            """
            import tensorflow as tf
            q = tf.queue.RandomShuffleQueue(1000, 100, [tf.float32])
            """,
            line=2,
        ),
        Invalid(
            """
            import tensorflow as tf
            slim = tf.contrib.slim
            batch_queue = slim.prefetch_queue.prefetch_queue([images, labels], capacity=4)
            """,
            line=3,
        ),
    ]

    def visit_Call(self, node: cst.Call) -> None:
        qualified = self.call_name(node)
        if qualified is None:
            return
        if qualified in QUEUES:
            cls = QUEUES[qualified]
            message = (f"`{cls}` carries input through a TF1 queue and its enqueue threads; "
                       f"replace it, its enqueue ops and its `dequeue` with {_INSTEAD[cls]}")
            plan = module_plan(self)
            pipeline = plan.pipeline_of(node)
            if pipeline is not None and pipeline.blocker is None:
                self.report(node, message, edit=plan.edit)
            elif pipeline is not None:  # dequeued in batches, but not in a shape the rewrite reads
                self.report(node, f"{message}; no automatic fix: {pipeline.blocker}")
            else:
                self.report(node, message)
        elif qualified in PREFETCH_QUEUES:
            self.report(
                node,
                "slim `prefetch_queue` buffers batches that each tower `dequeue()`s; use "
                "`dataset.prefetch(tf.data.AUTOTUNE)` and "
                "`MirroredStrategy.experimental_distribute_dataset(dataset)`, which gives each "
                "replica its own part of the global batch",
            )
        elif qualified in STAGING_AREAS:
            self.report(
                node,
                "`StagingArea` stages input batches onto a GPU by hand; use "
                "`dataset.prefetch(tf.data.AUTOTUNE)` with "
                "`MirroredStrategy.experimental_distribute_dataset(dataset)`, which prefetches "
                "each replica's batch to its device",
            )
