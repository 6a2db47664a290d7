from __future__ import annotations

import libcst as cst

from tfmigrate.rule import FixSafety, Invalid, Rule

#: Canonical name -> the parameters in their positional order (TF 1.15 signatures).
BATCHERS: dict[str, tuple[str, ...]] = {
    "tensorflow.train.batch": ("tensors", "batch_size", "num_threads", "capacity", "enqueue_many", "shapes", "dynamic_pad", "allow_smaller_final_batch"),
    "tensorflow.train.shuffle_batch": ("tensors", "batch_size", "capacity", "min_after_dequeue", "num_threads", "seed", "enqueue_many", "shapes", "allow_smaller_final_batch"),
    "tensorflow.train.batch_join": ("tensors_list", "batch_size", "capacity", "enqueue_many", "shapes", "dynamic_pad", "allow_smaller_final_batch"),
    "tensorflow.train.shuffle_batch_join": ("tensors_list", "batch_size", "capacity", "min_after_dequeue", "seed", "enqueue_many", "shapes", "allow_smaller_final_batch"),
    "tensorflow.train.maybe_batch": ("tensors", "keep_input", "batch_size", "num_threads", "capacity", "enqueue_many", "shapes", "dynamic_pad", "allow_smaller_final_batch"),
    "tensorflow.train.maybe_shuffle_batch": ("tensors", "batch_size", "capacity", "min_after_dequeue", "keep_input", "num_threads", "seed", "enqueue_many", "shapes", "allow_smaller_final_batch"),
    "tensorflow.train.maybe_batch_join": ("tensors_list", "keep_input", "batch_size", "capacity", "enqueue_many", "shapes", "dynamic_pad", "allow_smaller_final_batch"),
    "tensorflow.train.maybe_shuffle_batch_join": ("tensors_list", "batch_size", "capacity", "min_after_dequeue", "keep_input", "seed", "enqueue_many", "shapes", "allow_smaller_final_batch"),
}


def argument(call: cst.Call, params: tuple[str, ...], keyword: str) -> cst.BaseExpression | None:
    """The expression passed for ``keyword`` (by keyword or by position), else None."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    if keyword not in params:
        return None
    positional = [a for a in call.args if a.keyword is None and not a.star]
    index = params.index(keyword)
    return positional[index].value if len(positional) > index else None


def is_true(node: cst.BaseExpression | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


class QueueBatching(Rule):
    code = "TFM303"
    name = "queue-batching"
    summary = "Batches are assembled by a TF1 batching queue (`tf.train.batch`, `shuffle_batch`, ...)"
    triggers = ("batch",)
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
        No automatic fix yet (it will be unsafe): the batching call, the producer or reader
        feeding it (TFM302) and the queue-runner scaffolding (TFM301) become one `tf.data`
        pipeline together. Keep the static batch dimension (`drop_remainder=True`) that TF1 model
        code often relies on, and check the result with `tfmigrate verify`.
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
            self.report(node, self._message(node, qualified))

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
