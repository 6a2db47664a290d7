"""The TF1 API tables, one home: which names exist only in TF1, and the queue-input API
(canonical name -> signature, or -> what it does and what replaces it). Read by the rules, the
rewrites and ``verify``; imports nothing."""

from __future__ import annotations

#: attributes of the top-level ``tensorflow`` module that exist only in TF1
TF1_ONLY = {
    "placeholder", "placeholder_with_default", "Session", "InteractiveSession", "get_variable",
    "variable_scope", "get_variable_scope", "global_variables_initializer",
    "local_variables_initializer", "initialize_all_variables", "trainable_variables",
    "global_variables", "ConfigProto", "GPUOptions", "RunOptions", "RunMetadata",
    "get_collection", "add_to_collection", "GraphKeys", "set_random_seed", "contrib",
    "random_normal", "random_uniform", "truncated_normal_initializer", "layers",
    "app", "flags", "logging", "gfile", "to_float", "to_int32", "log",
    "reset_default_graph", "get_default_graph", "train", "FIFOQueue", "RandomShuffleQueue",
    "PaddingFIFOQueue", "assign", "assign_add", "sparse_placeholder", "py_func",
}
#: ``tf.train.X`` names that exist only in TF1 (``tf.train.Checkpoint`` etc. are fine in TF2)
TF1_TRAIN = {
    "Optimizer", "GradientDescentOptimizer", "MomentumOptimizer", "AdamOptimizer",
    "AdagradOptimizer", "RMSPropOptimizer", "AdadeltaOptimizer", "FtrlOptimizer",
    "Saver", "Coordinator", "QueueRunner", "start_queue_runners", "batch", "shuffle_batch",
    "batch_join", "shuffle_batch_join", "string_input_producer", "slice_input_producer",
    "input_producer", "range_input_producer", "MonitoredTrainingSession", "MonitoredSession",
    "get_or_create_global_step", "get_global_step", "exponential_decay", "SyncReplicasOptimizer",
    "SessionRunHook", "StopAtStepHook", "LoggingTensorHook", "replica_device_setter",
}


def tf1_only(attributes: list[str]) -> bool:
    """Whether ``tf.<attributes>`` (``["train", "AdamOptimizer"]``) exists only in TF1."""
    if attributes[0] == "train":
        return len(attributes) > 1 and attributes[1] in TF1_TRAIN
    return attributes[0] in TF1_ONLY


# --- queue-based input ---

#: Canonical name -> the parameters in their positional order (TF 1.15 signatures).
PRODUCERS: dict[str, tuple[str, ...]] = {
    "tensorflow.train.string_input_producer": ("string_tensor", "num_epochs", "shuffle"),
    "tensorflow.train.slice_input_producer": ("tensor_list", "num_epochs", "shuffle"),
    "tensorflow.train.input_producer": ("input_tensor", "element_shape", "num_epochs", "shuffle"),
    "tensorflow.train.range_input_producer": ("limit", "num_epochs", "shuffle"),
}

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

QUEUE_CLASSES = ("FIFOQueue", "RandomShuffleQueue", "PaddingFIFOQueue", "PriorityQueue")
QUEUE_HOMES = ("tensorflow.", "tensorflow.queue.", "tensorflow.python.ops.data_flow_ops.")

#: Canonical name -> what the object is, for the message. The TF1 API exports each class as
#: `tf.X` and `tf.queue.X`, and all but FIFOQueue also as `tf.io.X` (deprecated endpoints).
QUEUES: dict[str, str] = {f"{home}{cls}": cls for home in QUEUE_HOMES for cls in QUEUE_CLASSES}
QUEUES.update({f"tensorflow.io.{cls}": cls for cls in QUEUE_CLASSES if cls != "FIFOQueue"})
PREFETCH_QUEUES = {
    "slim.prefetch_queue.prefetch_queue",  # tf.contrib.slim / tf_slim (0.x)
    "slim.data.prefetch_queue.prefetch_queue",  # tf_slim
    "slim.python.slim.data.prefetch_queue.prefetch_queue",  # tensorflow.contrib.slim.python...
}
STAGING_AREAS = {
    "tensorflow.contrib.staging.StagingArea",
    "tensorflow.python.ops.data_flow_ops.StagingArea",
}

#: Always reported: they exist only to run queue-runner threads.
QUEUE_RUNNERS = {
    "tensorflow.train.start_queue_runners": (
        "`start_queue_runners` starts the threads of a queue-based input pipeline; once the input "
        "is a tf.data pipeline (TFRecordDataset → map → shuffle → batch → prefetch) nothing needs "
        "starting: drop the call and its threads"
    ),
    "tensorflow.train.QueueRunner": (
        "`QueueRunner` runs enqueue ops on background threads; produce the data with a tf.data "
        "pipeline instead (`tf.data.Dataset.from_generator` for a Python producer), which needs "
        "no threads"
    ),
    "tensorflow.train.add_queue_runner": (
        "`add_queue_runner` registers enqueue threads for `start_queue_runners`; produce the data "
        "with a tf.data pipeline instead, which needs no threads"
    ),
    "slim.queues.QueueRunners": (
        "slim `queues.QueueRunners` starts and stops the queue-runner threads of a queue-based "
        "input pipeline; with tf.data input nothing needs starting: drop the context manager"
    ),
}
#: Reported only in a module that also uses queue input (see `what_it_finds`).
COORDINATORS = {
    "tensorflow.train.Coordinator": (
        "`tf.train.Coordinator` here stops the input queue-runner threads; with tf.data input "
        "it goes, and the end of the data is the iterator's `OutOfRangeError` (or the end of a "
        "`for` loop over the dataset)"
    ),
    "tensorflow.train.Supervisor": (
        "`tf.train.Supervisor` starts this module's input queue runners implicitly (and is "
        "deprecated); with tf.data input use `tf.compat.v1.train.MonitoredTrainingSession` or a "
        "Session with a `tf.train.CheckpointManager`"
    ),
}
QUEUE_INPUT = set(QUEUE_RUNNERS) | set(PRODUCERS) | set(BATCHERS) | set(QUEUES) | PREFETCH_QUEUES | STAGING_AREAS
