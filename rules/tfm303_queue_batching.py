from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import argument, is_true
from tfmigrate.rewrites.pipelines import module_plan
from tfmigrate.rule import FixSafety, Invalid, Rule
from tfmigrate.tf_api import BATCHERS


class QueueBatching(Rule):
    code = "TFM303"
    name = "queue-batching"
    summary = "Batches are assembled by a TF1 batching queue (`tf.train.batch`, `shuffle_batch`, ...)"
    # Every spelling is a call: `tf.train.batch(`, `shuffle_batch(`, `maybe_batch(`, `batch(` after a
    # from-import; only the *_join variants do not end in "batch(".
    triggers = ("batch(", "batch_join")
    # They all live in `tf.train`, and names resolve from the text: a spelling of them is a call
    # on the module (`tf.train.shuffle_batch(`), a bare call of an imported one by its name
    # (`batch_join(`, `maybe_shuffle_batch(`), or goes through an alias of the module (`batching
    # = tf.train`, `from tensorflow.compat.v1 import train as queues`). tf.data's
    # `dataset.batch(` in a TF1 module, which names `tf.train` for its optimizers and
    # schedules, is none of these, nor is a function of the module's own (`next_batch(`).
    # (Each branch starts with a literal, and the lookbehinds after it say what precedes it:
    # a pattern starting with `\b` is tried at every character of every file, see rule.py.)
    requires = (r"(?m)train(?<!\wtrain)\s*\.\s*\w*batch"
                r"|batch(?:(?<![.\w]batch)|(?<=(?<![.\w])shuffle_batch)|(?<=(?<![.\w])maybe_batch)"
                r"|(?<=(?<![.\w])maybe_shuffle_batch))(?:_join)?\s*\("
                r"|train(?<!\wtrain)\s*$|import(?<!\wimport)\s[^\n]*\btrain\b",)
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        Calls of the TF1 queue-based batching functions `tf.train.batch`,
        `tf.train.shuffle_batch`, `tf.train.batch_join`, `tf.train.shuffle_batch_join` and
        their `maybe_` variants (`maybe_batch`, `maybe_shuffle_batch`, `maybe_batch_join`,
        `maybe_shuffle_batch_join`), in any spelling (`tf.compat.v1.train.batch`,
        `v1.train.batch`, `from tensorflow.compat.v1.train import shuffle_batch`, ...).
        `Dataset.batch(...)`, and functions of your own that are called `batch`, are not reported.
    """
    why = """
        Each of these builds a queue plus a `QueueRunner` whose `num_threads` threads run the
        whole preprocessing graph to fill it. That needs `tf.train.start_queue_runners` (gone in
        TF2) and a `Coordinator` to stop, and it feeds multi-GPU towers through one shared queue.
        In `tf.data` the same thing is `.shuffle(min_after_dequeue)` (shuffle variants),
        `.filter(keep_input)` (`maybe_` variants), `.interleave(...)` (`_join` variants),
        `.batch(batch_size, drop_remainder=True)` (`.padded_batch` for `dynamic_pad=True`;
        no `drop_remainder` for `allow_smaller_final_batch=True`), then `.prefetch`;
        the parallelism of `num_threads` goes to `map(..., num_parallel_calls=tf.data.AUTOTUNE)`.
        Under `MirroredStrategy` the batch size is the *global* batch: with towers that each
        dequeued their own batch, it is `batch_size * num_gpus`.
    """
    example = """
        image, label = read_and_decode(filename_queue)
        images, labels = tf.train.shuffle_batch(
            [image, label], batch_size=128, capacity=2000, min_after_dequeue=1000, num_threads=16)
    """
    use_instead = """
        dataset = (
            tf.data.TFRecordDataset(filenames)
            .map(decode, num_parallel_calls=tf.data.AUTOTUNE)
            .shuffle(1000)
            .batch(128, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE)
        )
    """
    fix_notes = """
        Unsafe. The batching call, the producer and reader that feed it (TFM302) and, once
        no queue is left in the module, the queue-runner scaffolding (TFM301) are rewritten
        together, by one edit that all three rules offer (see `tfmigrate/pipelines.py`).
        Recognised in one function (or module) body:
        `q = string_input_producer(files, num_epochs=E, shuffle=S)` read by
        `tf.TFRecordReader()` / `TextLineReader()` / `FixedLengthRecordReader(record_bytes=R)`
        (`_, value = reader.read(q)`), `x, y = slice_input_producer([xs, ys], ...)`, or
        `queue = slice_input_producer([xs, ys])` read by position (`queue[0]`; the map
        function then takes the slices as one tuple, `def _parse(*queue)`), or an index or row
        queue the program dequeues (`idx = range_input_producer(n).dequeue()`, `row =
        input_producer(rows).dequeue()`, `Dataset.range` / `from_tensor_slices`); the
        statements after it that use what was read become a nested `def _parse(value): ...
        return <tensors>` for `.map`; `tf.train.batch` / `shuffle_batch` over those tensors,
        assigned (to names or attributes) or returned. `shapes=[...]` becomes a
        `tf.ensure_shape` of each returned tensor (the queue checked them and gave the batch
        those static shapes). `enqueue_many=True` adds `.unbatch()` before `.batch`; over
        `tf.constant`s made in the same block (no producer), whose rows the queue runner
        enqueued again and again, the source is `Dataset.from_tensor_slices((x, y)).repeat()`.
        The result is
        `dataset = (tf.data.TFRecordDataset(files).repeat(E).map(_parse, num_parallel_calls=T)
        .shuffle(M).batch(B, drop_remainder=True).prefetch(tf.data.AUTOTUNE))` and
        `tensors = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()`.
        `num_epochs` becomes `.repeat(E)` (`.repeat()` when None), so the iterator raises the
        same `OutOfRangeError` at the end of the data as the queue did; `num_threads` becomes
        `num_parallel_calls` (the order of elements is kept); `min_after_dequeue` the
        shuffle buffer; `allow_smaller_final_batch=True` drops `drop_remainder=True`.
        A producer that shuffles (the default) gets its file names (or slices) reshuffled
        every epoch, as before:
        `Dataset.from_tensor_slices(files).shuffle(tf.size(files, out_type=tf.int64))
        .repeat(E).flat_map(tf.data.TFRecordDataset)`. `capacity` has no equivalent and goes.

        Name, variable and device scopes (`with tf.name_scope('input'):`) are transparent:
        the producer may be outside one and the read inside. Pipelines split across
        functions of the module as public code splits them are rewritten as a whole, each
        function once for all its callers (or not at all, with the reason): a reader function
        given the queue (`read_and_decode(filename_queue)`, cifar10's `read_cifar10`, whose
        record size is written out for the dataset) decodes the record it is given; a batching
        helper given the examples (cifar10's `_generate_image_and_label_batch`, batching with
        `shuffle_batch` or `batch`) is given their dataset; a function that makes its own queue
        and returns its examples returns their dataset; a reader function that batches too is
        given the dataset of the queue's records. `if`/`with`/`try` statements and loops on what was
        read move into the map function whole (not where they return, or fill a list made
        outside them); batching calls in the branches of an `if` (or after a
        guard `if shuffle: return shuffle_batch(...)`) batch one dataset made before it (every
        branch must batch or raise). A `WholeFileReader`'s files
        are read by the dataset (`.map(tf.io.read_file)`, the file name kept where it is used).
        Refused where the dataset would read a variable or a placeholder: a one-shot iterator
        cannot hold one.

        No fix, and the message says why, for `batch_join`, `shuffle_batch_join` and the
        `maybe_` variants, `enqueue_many=True` over tensors that are not constants (each
        enqueue may see other values) or with `shapes=`, `dynamic_pad=True`, `shared_name=`,
        readers other than the three above or with `options=`, a reader whose arguments the
        function computes from its own inputs, a function of the pipeline also used where no
        pipeline is rewritten, or a tensor of the pipeline used after the batching call.
        Check the result with `tfmigrate verify`.
    """

    valid = [
        """
        import tensorflow as tf
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1000).batch(32)
        """,
        """
        import tensorflow as tf
        def batch(items, n):
            return [items[i:i + n] for i in range(0, len(items), n)]
        chunks = batch(list(range(10)), 3)
        """,
    ]
    invalid = [
        Invalid(
            """
            import tensorflow as tf
            images, labels = tf.train.batch([image, label], batch_size=32, num_threads=4)
            """,
            line=2,
        ),
        Invalid(
            """
            from tensorflow.compat import v1
            images, labels = v1.train.shuffle_batch(
                [image, label], 64, capacity=5000, min_after_dequeue=1000)
            """,
            line=2,
        ),
        Invalid(
            """
            from tensorflow.compat.v1.train import maybe_batch
            images = maybe_batch([image], keep_input=ok, batch_size=8)
            """,
            line=2,
        ),
    ]

    def _code(self, node: cst.CSTNode) -> str:
        text = self.context.module.code_for_node(node).strip()
        return text if len(text) <= 30 else "..."

    def visit_Call(self, node: cst.Call) -> None:
        qualified = self.call_name(node)
        if qualified in BATCHERS:
            message = self._message(node, qualified)
            plan = module_plan(self)
            pipeline = plan.pipeline_of(node)
            if pipeline is not None and pipeline.blocker is None:
                self.report(node, message, edit=plan.edit)
            else:
                blocker = pipeline.blocker if pipeline is not None else "not recognised as a pipeline"
                self.report(node, f"{message}; no automatic fix: {blocker}")

    def _code_of(self, call: cst.Call, params: tuple[str, ...], name: str) -> str:
        value = argument(call, params, name)
        return name if value is None else self._code(value)

    def _message(self, call: cst.Call, qualified: str) -> str:
        params = BATCHERS[qualified]
        short = qualified.rsplit(".", 1)[1]
        chain = ""
        if short.endswith("_join"):
            chain += ".interleave(...)"
        if is_true(argument(call, params, "enqueue_many")):
            chain += ".unbatch()"
        if short.startswith("maybe_"):
            chain += f".filter({self._code_of(call, params, 'keep_input')})"
        if "shuffle" in short:
            chain += f".shuffle({self._code_of(call, params, 'min_after_dequeue')})"
        batch_size = self._code_of(call, params, "batch_size")
        method = "padded_batch" if is_true(argument(call, params, "dynamic_pad")) else "batch"
        drop = "" if is_true(argument(call, params, "allow_smaller_final_batch")) else ", drop_remainder=True"
        chain += f".{method}({batch_size}{drop}).prefetch(tf.data.AUTOTUNE)"
        threads = argument(call, params, "num_threads")
        parallel = ""
        if threads is not None:
            parallel = f", with the {self._code(threads)} threads' work in `map(..., num_parallel_calls=tf.data.AUTOTUNE)`"
        return f"`tf.train.{short}` batches through a queue filled by queue-runner threads; in tf.data it is `dataset{chain}`{parallel}"
