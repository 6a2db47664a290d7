from __future__ import annotations

import libcst as cst

from tfmigrate.rewrites.pipelines import module_plan
from tfmigrate.rewrites.queue_syntax import COORDINATOR, START_QUEUE_RUNNERS
from tfmigrate.rule import FixSafety, Invalid, Rule
from tfmigrate.tf_api import COORDINATORS, QUEUE_INPUT, QUEUE_RUNNERS



class QueueRunners(Rule):
    code = "TFM301"
    name = "queue-runners"
    summary = "Queue-runner threads (`start_queue_runners`, `QueueRunner`, input `Coordinator`) drive the input"
    triggers = ("queue_runner", "QueueRunner", "Coordinator", "Supervisor")
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        The thread scaffolding of TF1 queue-based input: `tf.train.start_queue_runners`,
        `tf.train.QueueRunner`, `tf.train.add_queue_runner` (also under
        `tf.train.queue_runner.*` and `tf.compat.v1`), and slim's `queues.QueueRunners(sess)`.

        `tf.train.Coordinator()` and `tf.train.Supervisor(...)` are reported only in a module that
        also uses queue input (anything above, an input producer (TFM302), a batching queue
        (TFM303) or an explicit queue (TFM304)). A `Coordinator` is a general helper for stopping
        Python threads, still part of TF2 as `tf.train.Coordinator`, and is used for threads
        that have nothing to do with input; a `Supervisor` also does checkpoints and summaries.
        In a queue-input module, though, they exist to start and stop the queue runners and go
        away with them. Input built in another module (`cifar10_input.distorted_inputs()`) is
        still caught through the `start_queue_runners` call that starts it.
    """
    why = """
        Queue runners are Python threads that run enqueue ops in a TF1 `Session`: they do not
        exist in TF2 and do not work in eager mode, they need a `Coordinator` to stop cleanly,
        and the end of input shows up as an `OutOfRangeError` from `sess.run`. With `tf.data`
        the pipeline runs inside the TensorFlow runtime, needs no thread management, and can
        be handed to `MirroredStrategy.experimental_distribute_dataset` for multi-GPU training.
    """
    example = """
        images, labels = tf.train.shuffle_batch([image, label], 128, 2000, 1000)
        with tf.Session() as sess:
            coord = tf.train.Coordinator()
            threads = tf.train.start_queue_runners(sess=sess, coord=coord)
            try:
                while not coord.should_stop():
                    sess.run(train_op)
            except tf.errors.OutOfRangeError:
                pass
            finally:
                coord.request_stop()
            coord.join(threads)
    """
    use_instead = """
        dataset = make_dataset(filenames).shuffle(1000).batch(128, drop_remainder=True)
        iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
        images, labels = iterator.get_next()
        with tf.compat.v1.Session() as sess:
            sess.run(iterator.initializer)
            try:
                while True:
                    sess.run(train_op)
            except tf.errors.OutOfRangeError:
                pass
    """
    fix_notes = """
        Unsafe. `start_queue_runners(...)` and `Coordinator()` go, with `coord.request_stop()`,
        `coord.join(threads)`, an emptied `finally:`, `if coord.should_stop(): break`, and the
        `not coord.should_stop()` of a `while` test (`while not coord.should_stop() and step <
        n:` becomes `while step < n:`); `coord.request_stop(e)` in `except ... as e:` becomes
        `raise`, as `coord.join` re-raised it. The `except tf.errors.OutOfRangeError:` end of
        data stays: the tf.data iterator raises it at the end of `num_epochs` like the queue.
        This is offered only when no queue input is left in the module once the pipelines are
        rewritten (TFM302/TFM303 share this edit), or when the module already reads a tf.data
        pipeline. No fix while a queue remains, when the queues are built in another module
        (`cifar10.distorted_inputs()`: migrate that one first), for `QueueRunner` /
        `add_queue_runner` / slim `QueueRunners` / `Supervisor`, or when the coordinator or
        the thread list is used for anything else. Check the result with `tfmigrate verify`.
    """

    valid = [
        """
        import threading
        import tensorflow as tf
        coord = tf.train.Coordinator()
        workers = [threading.Thread(target=work, args=(coord,)) for _ in range(4)]
        for w in workers:
            w.start()
        coord.join(workers)
        """,
        """
        import tensorflow as tf
        class Coordinator:
            def should_stop(self):
                return False
        coord = Coordinator()
        dataset = tf.data.Dataset.range(10).batch(2)
        """,
    ]
    invalid = [
        Invalid(
            """
            import tensorflow as tf
            sess = tf.Session()
            threads = tf.train.start_queue_runners(sess=sess)
            """,
            line=3,
        ),
        Invalid(
            """
            import tensorflow.compat.v1 as tf
            q = tf.FIFOQueue(32, [tf.float32])
            qr = tf.train.QueueRunner(q, [q.enqueue(x)] * 4)
            tf.train.add_queue_runner(qr)
            coord = tf.train.Coordinator()
            """,
            line=5,
        ),
        Invalid(
            """
            import tensorflow as tf
            images = tf.train.batch([image], 32)
            sv = tf.train.Supervisor(logdir="/tmp/train")
            """,
            line=3,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self._queue_input = False
        self._deferred: list[tuple[cst.Call, str]] = []

    def visit_Call(self, node: cst.Call) -> None:
        qualified = self.call_name(node)
        if qualified is None:
            return
        if qualified in QUEUE_INPUT:
            self._queue_input = True
        if qualified in QUEUE_RUNNERS:
            self._report(node, qualified, QUEUE_RUNNERS[qualified])
        elif qualified in COORDINATORS:
            self._deferred.append((node, qualified))

    def leave_Module(self, original_node: cst.Module) -> None:
        if self._queue_input:
            for node, qualified in self._deferred:
                self._report(node, qualified, COORDINATORS[qualified])

    def _report(self, node: cst.Call, qualified: str, message: str) -> None:
        plan = module_plan(self)
        if qualified not in (START_QUEUE_RUNNERS, COORDINATOR):
            # The runner of a queue built by hand goes with the queue's rewrite (TFM304); Supervisor, slim: no fix.
            pipeline = plan.pipeline_of(node)
            self.report(node, message, edit=plan.edit if pipeline is not None and pipeline.blocker is None else None)
            return
        if plan.edit is not None and plan.scaffolding_included:
            self.report(node, message, edit=plan.edit)
        else:
            self.report(node, f"{message}; no automatic fix: {plan.scaffolding_blocker or 'see TFM303'}")
