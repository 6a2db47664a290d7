from __future__ import annotations

import libcst as cst

from tfmigrate.rule import FixSafety, Invalid, Rule

#: The parts of TF-Slim's `deployment/model_deploy.py` that replicate a model over GPUs.
_API = ("DeploymentConfig", "create_clones", "optimize_clones", "deploy")


class SlimModelDeploy(Rule):
    code = "TFM108"
    name = "slim-model-deploy"
    summary = "TF-Slim model_deploy clones (DeploymentConfig, create_clones, optimize_clones)"
    triggers = ("model_deploy",)
    fix_safety = FixSafety.NONE

    what_it_finds = """
        Use of TF-Slim's `model_deploy` module (from the TF models repository's
        `research/slim/deployment`): `model_deploy.DeploymentConfig(num_clones=...)`,
        `create_clones(config, model_fn, ...)`, `optimize_clones(clones, optimizer)` and
        `deploy(...)`, however the module was imported. One finding per module, at the first of
        these calls; the message lists the others.
    """
    why = """
        `model_deploy` builds one clone of the model per GPU (`clone_device(i)`), keeps the
        variables on the CPU, divides each clone's loss by the number of clones and sums the
        clones' gradients, so the update is the *average* of the clones' gradients.
        `tf.distribute.MirroredStrategy` does the same replication and all-reduce, but it sums
        the replicas' gradients without dividing: the migrated per-replica loss must be averaged
        over the global batch (`tf.nn.compute_average_loss`) to keep the same update.
    """
    example = """
        from deployment import model_deploy

        config = model_deploy.DeploymentConfig(num_clones=FLAGS.num_clones)
        with tf.device(config.variables_device()):
            global_step = tf.train.create_global_step()
        clones = model_deploy.create_clones(config, clone_fn, [batch_queue])
        total_loss, grads_and_vars = model_deploy.optimize_clones(clones, optimizer)
        train_op = optimizer.apply_gradients(grads_and_vars, global_step=global_step)
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)

        def step_fn(images, labels):
            per_example_loss = clone_loss(images, labels)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=batch_size)
            return optimizer.minimize(loss, global_step=global_step)

        per_replica = strategy.run(step_fn, args=next_batch)
    """
    fix_notes = """
        No automatic fix: the clone function, the batch queue it reads and the summaries
        `model_deploy` collects per clone move into a `step_fn` by hand. `num_clones` becomes
        the strategy's replica count (`MirroredStrategy(devices=[...])` to pin it).
    """

    valid = [
        """\
        import tensorflow as tf
        config = DeploymentConfig(num_clones=2)
        clones = create_clones(config, model_fn)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            from deployment import model_deploy
            config = model_deploy.DeploymentConfig(num_clones=4)
            clones = model_deploy.create_clones(config, clone_fn, [queue])
            """,
            line=3,
        ),
        Invalid(
            """\
            from nets.deployment.model_deploy import optimize_clones
            loss, grads = optimize_clones(clones, opt)
            """,
            line=2,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.calls: list[tuple[cst.Call, str]] = []

    def visit_Call(self, node: cst.Call) -> None:
        name = self.call_name(node) or ""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "model_deploy" and parts[-1] in _API:
            self.calls.append((node, parts[-1]))

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self.calls:
            return
        first, api = self.calls[0]
        others = ", ".join(f"`{n}` (line {self.position(c).start.line})" for c, n in self.calls[1:])
        seen = f", with {others}" if others else ""
        self.report(
            first,
            f"TF-Slim model_deploy clones the model per GPU (`{api}`{seen}); its clones' "
            "gradients are averaged (each clone's loss divided by num_clones, gradients summed): "
            "use tf.distribute.MirroredStrategy with the clone function as the replica step_fn "
            "and scale each replica's loss by the global batch size "
            "(tf.nn.compute_average_loss) to keep the same update",
        )
