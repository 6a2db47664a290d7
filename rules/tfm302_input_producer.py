from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import argument, is_false
from tfmigrate.rewrites.pipelines import module_plan
from tfmigrate.rule import FixSafety, Invalid, Rule
from tfmigrate.tf_api import PRODUCERS

#: TF1 readers that consume a file-name queue -> how tf.data reads the same files.
READERS: dict[str, str] = {
    "tensorflow.TFRecordReader": "`.interleave(tf.data.TFRecordDataset)`",
    "tensorflow.FixedLengthRecordReader": "`.interleave(lambda f: tf.data.FixedLengthRecordDataset(f, record_bytes))`",
    "tensorflow.TextLineReader": "`.interleave(tf.data.TextLineDataset)`",
    "tensorflow.WholeFileReader": "`.map(tf.io.read_file)`",
}


class InputProducer(Rule):
    code = "TFM302"
    name = "input-producer"
    summary = "A queue-based input producer (`tf.train.*_input_producer`) feeds the input pipeline"
    triggers = ("input_producer",)
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        Calls of the TF1 queue producers `tf.train.string_input_producer`,
        `tf.train.slice_input_producer`, `tf.train.input_producer` and
        `tf.train.range_input_producer`, in any spelling (`tf.compat.v1.train...`,
        `from tensorflow.compat.v1.train import string_input_producer`, ...).
        Each one creates a queue plus a `QueueRunner` that fills it from a background thread.
    """
    why = """
        Producers only work with queue runners, which TF2 removed (and which never worked in
        eager mode). They are also the slowest part of many legacy multi-GPU programs: one
        Python-started thread per queue, and a `Coordinator` to stop them. `tf.data` replaces the
        whole chain: `tf.data.Dataset.from_tensor_slices(filenames)` (or `tf.data.TFRecordDataset`
        directly) → `map` → `shuffle` → `batch` → `prefetch`, and `MirroredStrategy` can
        distribute the dataset to the replicas. Note that every producer *shuffles by default*
        (`shuffle=True`) and repeats forever unless `num_epochs` is given: the dataset needs
        `.shuffle(...)` and `.repeat(num_epochs)` to behave the same.
    """
    example = """
        filename_queue = tf.train.string_input_producer(filenames, num_epochs=10)
        reader = tf.TFRecordReader()
        _, serialized = reader.read(filename_queue)
        image, label = decode(serialized)
    """
    use_instead = """
        dataset = (
            tf.data.Dataset.from_tensor_slices(filenames)
            .shuffle(len(filenames))
            .repeat(10)
            .interleave(tf.data.TFRecordDataset)
            .map(decode, num_parallel_calls=tf.data.AUTOTUNE)
        )
    """
    fix_notes = """
        Unsafe. The producer is rewritten together with its reader, the parsing, the
        batching call (TFM303) and the queue-runner scaffolding (TFM301), by the one edit the
        three rules share; TFM303's page lists the shapes. `num_epochs` becomes `.repeat(E)`
        (`.repeat()` for None) and the default `shuffle=True` a per-epoch shuffle of the file
        names or slices (`shuffle=False` keeps their order). An index queue read right away,
        `i = range_input_producer(n).dequeue()` (the PTB tutorial's reader, which slices one
        window of the data per step with `i`), or named and dequeued once later in the same
        block, becomes a range dataset mapped back to int32 and read by a one-shot iterator;
        `row = input_producer(rows).dequeue()` likewise becomes the rows' dataset (its
        `element_shape` a `tf.ensure_shape`), and what is dequeued, worked on and batched in the
        block becomes one dataset. A `slice_input_producer` list kept under one name and read
        by position (`input_queue[0]`) is the map function's tuple of slices. No fix for
        those producers used otherwise, or where the tensors are not batched in the same
        function; the message says what blocks it. Compare the runs with `tfmigrate verify`.
    """

    valid = [
        """
        import tensorflow as tf
        dataset = tf.data.TFRecordDataset(filenames).map(decode).shuffle(1000).batch(32)
        """,
        """
        import tensorflow as tf
        def string_input_producer(names):
            return list(names)
        queue = string_input_producer(["a", "b"])
        """,
    ]
    invalid = [
        Invalid(
            """
            import tensorflow.compat.v1 as tf
            queue = tf.train.string_input_producer(["a.tfrecord", "b.tfrecord"])
            """,
            line=2,
        ),
        Invalid(
            """
            from tensorflow.compat.v1.train import slice_input_producer
            image, label = slice_input_producer([images, labels], shuffle=False)
            """,
            line=2,
        ),
        # An index queue read right away (the PTB tutorial's reader): a range dataset, its
        # positions int32 as the queue's were.
        Invalid(
            """
            import tensorflow as tf
            index = tf.train.range_input_producer(100, num_epochs=1).dequeue()
            """,
            line=2,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            positions = (
                tf.data.Dataset.range(100)
                .shuffle(100)
                .repeat(1)
                .map(lambda i: tf.cast(i, tf.int32))
            )
            index = tf.compat.v1.data.make_one_shot_iterator(positions).get_next()
            """,
        ),
        # An "image list": the slices read by position, the decoded image's static shape
        # given to the batch. The map function takes the slices as one tuple; the shapes the
        # queue checked become `tf.ensure_shape`.
        Invalid(
            """
            import tensorflow as tf
            input_queue = tf.train.slice_input_producer([paths, labels], shuffle=False)
            image = tf.image.decode_png(tf.read_file(input_queue[0]), channels=3)
            images, labels = tf.train.batch([image, input_queue[1]], batch_size=32, shapes=[[28, 28, 3], []])
            """,
            line=2,
            unsafe=True,
            fixed="""
            import tensorflow as tf

            def _parse(*input_queue):
                image = tf.image.decode_png(tf.read_file(input_queue[0]), channels=3)
                return tf.ensure_shape(image, [28, 28, 3]), tf.ensure_shape(input_queue[1], [])

            dataset = (
                tf.data.Dataset.from_tensor_slices((paths, labels))
                .repeat()
                .map(_parse)
                .batch(32, drop_remainder=True)
                .prefetch(tf.data.AUTOTUNE)
            )
            images, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
            """,
        ),
        # A queue of a tensor's rows, named and dequeued once: the rows as a dataset.
        Invalid(
            """
            import tensorflow as tf
            rows = tf.constant(table)
            row_queue = tf.train.input_producer(rows, shuffle=False)
            row = row_queue.dequeue()
            """,
            line=3,
            unsafe=True,
            fixed="""
            import tensorflow as tf
            rows = tf.constant(table)
            elements = (
                tf.data.Dataset.from_tensor_slices(rows)
                .repeat()
            )
            row = tf.compat.v1.data.make_one_shot_iterator(elements).get_next()
            """,
        ),
    ]

    def _code(self, node: cst.CSTNode) -> str:
        text = self.context.module.code_for_node(node).strip()
        return text if len(text) <= 40 else "..."

    def __init__(self, context) -> None:
        super().__init__(context)
        self._found: list[tuple[cst.Call, str]] = []
        self._readers: set[str] = set()

    def visit_Call(self, node: cst.Call) -> None:
        qualified = self.call_name(node)
        if qualified in PRODUCERS:
            self._found.append((node, qualified))
        elif qualified in READERS:
            self._readers.add(qualified)

    def leave_Module(self, original_node: cst.Module) -> None:
        # Reported at the end, once the module's reader (which names the tf.data source) is known.
        plan = module_plan(self) if self._found else None
        for node, qualified in self._found:
            message = self._message(node, qualified)
            pipeline = plan.pipeline_of(node)
            if pipeline is not None and pipeline.blocker is None:
                self.report(node, message, edit=plan.edit)
            else:
                blocker = (
                    pipeline.blocker if pipeline is not None
                    else "its tensors are not batched by `tf.train.batch`/`shuffle_batch` in the same function"
                )
                self.report(node, f"{message}; no automatic fix: {blocker}")

    def _message(self, call: cst.Call, qualified: str) -> str:
        params = PRODUCERS[qualified]
        short = qualified.rsplit(".", 1)[1]
        source = argument(call, params, params[0])
        source_text = self._code(source) if source is not None else params[0]
        if short == "range_input_producer":
            dataset = f"tf.data.Dataset.range({source_text})"
        elif short == "slice_input_producer" and isinstance(source, (cst.List, cst.Tuple)):
            dataset = f"tf.data.Dataset.from_tensor_slices(({', '.join(self._code(e.value) for e in source.elements)}))"
        else:
            dataset = f"tf.data.Dataset.from_tensor_slices({source_text})"
        if not is_false(argument(call, params, "shuffle")):
            dataset += ".shuffle(...)"
        epochs = argument(call, params, "num_epochs")
        if epochs is None or (isinstance(epochs, cst.Name) and epochs.value == "None"):
            dataset += ".repeat()"
        else:
            dataset += f".repeat({self._code(epochs)})"
        if short == "string_input_producer":
            if len(self._readers) == 1:
                reader = next(iter(self._readers))
                rest = f", read with {READERS[reader]} (it replaces the `{reader.rsplit('.', 1)[1]}`)"
            else:
                rest = (
                    ", read with `.interleave(tf.data.TFRecordDataset)` (or FixedLengthRecordDataset / "
                    "TextLineDataset, as the reader was)"
                )
            rest += " → map(decode) → shuffle → batch → prefetch"
        else:
            rest = " → map → shuffle → batch → prefetch"
        return f"`{short}` feeds the input through a queue and a queue-runner thread; build it with tf.data: `{dataset}`{rest}"
