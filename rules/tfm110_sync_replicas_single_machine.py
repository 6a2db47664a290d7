from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import argument
from tfmigrate.rule import FixSafety, Invalid, Rule

SYNC_REPLICAS = {
    "tensorflow.train.SyncReplicasOptimizer",
    "tensorflow.python.training.sync_replicas_optimizer.SyncReplicasOptimizer",
}
#: A module that sets up a cluster is multi-machine training: not this rule's business.
CLUSTER_APIS = {
    "tensorflow.train.ClusterSpec",
    "tensorflow.train.Server",
    "tensorflow.distribute.Server",
    "tensorflow.distribute.cluster_resolver.TFConfigClusterResolver",
}
_CLUSTER_WORDS = ("job_name", "task_index", "ps_hosts", "worker_hosts", "TF_CONFIG", "cluster_spec")


class SyncReplicasSingleMachine(Rule):
    code = "TFM110"
    name = "sync-replicas-single-machine"
    summary = "SyncReplicasOptimizer used on one machine to average the towers' gradients"
    triggers = ("SyncReplicasOptimizer",)
    fix_safety = FixSafety.NONE

    what_it_finds = """
        `tf.train.SyncReplicasOptimizer(opt, replicas_to_aggregate=N, ...)` in a module that
        sets up no cluster (no `tf.train.ClusterSpec`, `tf.train.Server`, `job_name`,
        `task_index`, `ps_hosts`/`worker_hosts` or `TF_CONFIG`): synchronous data parallelism
        on one machine, through the parameter-server machinery. A module that builds a cluster
        is multi-worker training and is not reported.
    """
    why = """
        `SyncReplicasOptimizer` collects `replicas_to_aggregate` gradients in accumulators and
        applies their *average*; on one machine that is what `tf.distribute.MirroredStrategy`
        does with an all-reduce, without the token queue, the chief's queue runner and the
        `make_session_run_hook` it needs. The strategy sums the replicas' gradients, so each
        replica's loss must be averaged over the global batch (`tf.nn.compute_average_loss`)
        to keep the averaged update. `SyncReplicasOptimizer` does not exist in TF2.
    """
    example = """
        opt = tf.train.SyncReplicasOptimizer(
            tf.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=num_gpus,
            total_num_replicas=num_gpus)
        train_op = opt.minimize(loss, global_step=global_step)
        sync_hook = opt.make_session_run_hook(is_chief=True)
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)

        def step_fn(images, labels):
            per_example_loss = model_loss(images, labels)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=batch_size)
            return opt.minimize(loss, global_step=global_step)
    """
    fix_notes = """
        No automatic fix: the optimizer's session hook and the replicas' input change with it.
        Replace the wrapper by the optimizer it wraps, built under `strategy.scope()`, and run
        the step under `strategy.run`.
    """

    valid = [
        """\
        import tensorflow as tf
        cluster = tf.train.ClusterSpec({'ps': ps_hosts, 'worker': worker_hosts})
        server = tf.train.Server(cluster, job_name=FLAGS.job_name, task_index=FLAGS.task_index)
        opt = tf.train.SyncReplicasOptimizer(base, replicas_to_aggregate=len(worker_hosts))
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            opt = tf.train.SyncReplicasOptimizer(base, replicas_to_aggregate=2, total_num_replicas=2)
            """,
            line=2,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.calls: list[cst.Call] = []
        self.cluster = False

    def visit_Call(self, node: cst.Call) -> None:
        name = self.call_name(node)
        if name in SYNC_REPLICAS:
            self.calls.append(node)
        elif name in CLUSTER_APIS:
            self.cluster = True

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in _CLUSTER_WORDS:
            self.cluster = True

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if any(word in node.value for word in _CLUSTER_WORDS):
            self.cluster = True

    def leave_Module(self, original_node: cst.Module) -> None:
        if self.cluster:
            return
        for call in self.calls:
            count = argument(call, ("opt", "replicas_to_aggregate"), "replicas_to_aggregate")
            replicas = f" of {self.context.module.code_for_node(count)} replicas" if count is not None else ""
            self.report(
                call,
                f"`SyncReplicasOptimizer` averages the gradients{replicas} on one machine (no cluster "
                "in this module): use tf.distribute.MirroredStrategy with the wrapped optimizer, and "
                "scale each replica's loss by the global batch size (tf.nn.compute_average_loss) "
                "because the strategy sums gradients across replicas",
            )
