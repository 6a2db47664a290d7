from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import describe_device, tower_group, tower_loop_at
from tfmigrate.analysis.tower_forms import module_tower_forms
from tfmigrate.rewrites import loop_forms, mirrored
from tfmigrate.rule import DEVICE_SCOPE, FixSafety, Invalid, Rule


class ManualTowerLoop(Rule):
    code = "TFM101"
    name = "manual-tower-loop"
    summary = "A loop builds one model replica ('tower') per GPU under tf.device"
    triggers = ("device",)
    requires = (DEVICE_SCOPE,)
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        A `for` loop whose body opens a `tf.device(...)` scope that depends on the loop
        variable and builds ops in it: the hand-written data parallelism of TensorFlow 1.
        Every spelling of the device counts: `'/gpu:%d' % i`, `'/gpu:{}'.format(i)`,
        f-strings, `'/device:GPU:%d'`, `'/gpu:' + str(i)`, `tf.DeviceSpec(device_type='GPU',
        device_index=i)`, a list of device names, and device functions such as
        `assign_to_device('/gpu:%d' % i, ps_device='/cpu:0')`.
        The same towers built by a `while` counter loop (`gpu = 0; while gpu < n: ...; gpu += 1`)
        or by a comprehension that calls a tower function once per device
        (`[tower(i, x_parts[i]) for i in range(n)]`) are reported too.
        A loop that only lists GPUs, or places everything on one fixed device, is not reported.
    """
    why = """
        Tower loops tie the program to TF1 graph mode, hard-code the replica count, and leave
        gradient averaging, variable sharing and input splitting to hand-written code that is
        easy to get subtly wrong. `tf.distribute.MirroredStrategy` does all of it: it mirrors
        variables on every device, runs the step function once per replica, all-reduces the
        gradients and splits each global batch across replicas.
    """
    example = """
        tower_grads = []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                with tf.name_scope('tower_%d' % i) as scope:
                    loss = tower_loss(scope, images, labels)
                    tf.get_variable_scope().reuse_variables()
                    tower_grads.append(opt.compute_gradients(loss))
        train_op = opt.apply_gradients(average_gradients(tower_grads), global_step=global_step)
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            opt = tf.compat.v1.train.GradientDescentOptimizer(lr)

            def step_fn(images, labels):
                per_example_loss = model_loss(images, labels)
                loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=batch_size)
                train_op = opt.minimize(loss, global_step=global_step)
                with tf.control_dependencies([train_op]):
                    return tf.identity(loss)

            per_replica_loss = strategy.run(step_fn, args=next_batch)
            loss = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)
    """
    fix_notes = """
        Unsafe (`--unsafe-fixes`), for the `compat` target: the loop body becomes a replica
        function that `MirroredStrategy(devices=<the loop's devices>)` runs once per device with
        `strategy.extended.call_for_each_replica`, statement for statement; the replica index
        takes the place of the loop variable (so `x_parts[i]`, `'tower_%d' % i` and per-tower
        placeholders keep working); lists it fills stay per-replica results that the code after
        the loop reads as before; names it leaves for that code are declared `nonlocal`; the
        device scopes and `reuse_variables()` go; the graph is built under `strategy.scope()` in
        place of the `/cpu:0` pin (at module level, or in a module-level `if __name__ ==
        '__main__':` block, the run of statements around the loop goes under it). Only the update
        moves into the replica: each replica applies its share (1/N) of the averaged gradients,
        or minimises the mean loss by its own weights (MirroredStrategy sums what the replicas
        give). The program's input stays as it was: placeholders are fed by the session loop,
        queues and iterators keep running; throughput stays close to the legacy program's. It
        refuses, naming the line, what would change the meaning: gradients computed after the
        loop, regularization losses collected once by the first tower (read by the tower's
        scope they are each replica's own, and stay), a global step made outside the strategy
        scope that no named update could count once after (a step made in the scope's block by a
        statement that can run first is made just before the scope, so that fetched with the
        update it reads the count after it, as TF1's did), a loop in a module-level block that
        may run more than once, towers that store into a variable themselves (`tf.assign(last, x)`: in a replica it updates that replica's
        copy; a moving average such as a hand-written batch norm's stays, and a counter the
        towers add to, made under the scope, is made with `aggregation=tf.VariableAggregation.SUM`
        so that every replica's add reaches every copy), a
        custom getter in the towers, a variable set with `Variable.load` outside the function
        the strategy is made in (inside it, each replica's copy is loaded), towers that each
        make their own copy of the variables (a variable scope named by the tower, a model
        function whose `reuse` stays at its default in every tower), an optimizer class of the
        project that overrides `apply_gradients` itself (BERT's `AdamWeightDecayOptimizer`) where
        its update would have to run in the replicas (each would update its copy from its own
        gradients; followed into the project's other modules), and a name shared with the code
        after the loop that the body reads after a step where the replicas wait for each other
        (a `tf.metrics` call, a counter's add, a moving average's merge call). Only the names
        the code after the loop reads before binding them again are shared with it. A second
        optimizer of one class over the same variables (a pretraining and a GAN Adam on one
        generator; YOLOv3's two training stages, one list built from the other) gets its own
        `name=` (`'Adam_2'`), since under the strategy both would name their slots alike. A
        moving average a tower makes of its own losses (inception's `_tower_loss`) is applied
        per replica from a merge call, each replica's average making its own variables. An averaging helper defined by the trainer class or imported
        from another module of the project is read where it is defined.
        A `while` counter loop or a comprehension is first rewritten as the `for` loop it
        means (`for gpu in range(n):`; `towers = []` and `towers.append(...)` in the loop),
        and only where the tower rewrite then takes that loop; otherwise the finding gives the
        tower rewrite's reason. Towers built by one method of a class into `self` and updated
        by a sibling method (both called in turn by a third, e.g. `__init__`) are rewritten
        where they are: the strategy is made in the calling method. Where the sibling is a
        method the class's user calls later (carpedm20 DCGAN's `train()`), the strategy is kept
        on `self` (`self.strategy`) and that method's body runs under `self.strategy.scope()`.
        A function or class that builds its towers into one graph more than once (ptb_word_lm's
        training and validation models sharing variables; a GAN's critic and generator trainers
        of one class) runs every build on the graph's one strategy (`graph_mirrored_strategy`,
        written into the module); refused where the builds pass different devices. A TF1 metric
        made after the towers (`tf.metrics.accuracy` over their joined predictions) cannot be
        made under the scope outside the replicas: the scope ends before the statement that makes
        it, with the code after (refused where that code still makes model variables).
        Towers built across several loops (in one function, reading each other's lists; in
        several methods of one class, reading each other's `self.tower_*` lists; or side by side
        over the same devices, as training and validation towers) are rewritten together by one
        fix: each loop is its own replica function, all run by one strategy (on `self`, made by
        the first method, across methods), and one of them may feed the update. Gradients
        of the towers' total taken once after the loop (`grads = opt.compute_gradients(total)`)
        and read before they are applied (clipped) are taken by each replica by its own copy of
        the weights and summed (`strategy.reduce`), the legacy weight's gradient. Gradients
        combined after the loop and applied by assignments written by hand (OpenAI's
        `adam_updates`, or a project optimizer whose `apply_gradients` assigns the weights, as
        BERT's does) stay after the loop, or in the caller the averaged gradients are returned
        to, as written: outside the replicas an assignment sets every replica's copy. Such an
        update that reads a variable it also updates, with nothing ordering the two, is refused
        (the runtimes order them differently). A trainer class whose constructor builds the
        towers and whose update is a method its user calls (`train_step()`, a lazy property)
        keeps the strategy on `self` and runs that method under its scope. Whether the towers
        train is read through the module's functions they call: a branch a parameter passed
        `False` or `None` guards (`if is_training:`) does not run, and a function a module
        function makes and returns (`model_fn = get_model_fn(...)`) runs where it is called.

        With `tower-input = "dataset"` (pyproject.toml, or `fix --tower-input dataset`), the
        textbook shape is rewritten as a step a TF2 program can take over: `strategy.run` of a
        replica step, and placeholders made before the loop, cut with `x_parts = tf.split(images,
        N)` and fed each step from `for ... in <source>` (`feed_dict={images: x, ...}`), become
        one `tf.data.Dataset.from_generator(<source>)` distributed by the strategy; any other
        feed is kept, and the message says why. It takes
        `tower_grads.append(opt.compute_gradients(loss))` in the loop, then
        `grads = helper(tower_grads)` (a helper of the module) and
        `train_op = opt.apply_gradients(grads, ...)`, inside a function; other shapes get the
        rewrite above. A generator-backed dataset runs slower in graph mode than a feed (0.3-0.6x
        the legacy throughput on the fixture programs). Check either with
        `tfmigrate verify old.py new.py`: the fixture programs match their originals step by step.

        With `--target tf2`, where the model code allows it, the `dataset` rewrite goes on to an
        eager program: no graph and no Session; the v1 optimizer becomes the Keras one with the
        same update (`GradientDescentOptimizer`/`MomentumOptimizer` -> `SGD`, `AdamOptimizer`
        -> `Adam(epsilon=1e-8)`), built on the model's variables under the scope; the replica
        function computes its loss under a `tf.GradientTape` (divided by
        `num_replicas_in_sync` inside the tape when the helper averaged) and applies the
        gradients of the model's trainable variables; `@tf.function def train_step(batch)`
        runs it with `strategy.run` and returns the reduced loss; the session loop becomes
        `for step, batch in enumerate(<distributed dataset>): loss_value = train_step(batch)`,
        keeping its logging. It needs: input the rewrite turned into a dataset, Keras models or
        layers made under the scope with an input shape (`tf.keras.Input`, `input_shape=`) or
        `tf.Variable`s made there,
        `import tensorflow as tf`, no TF1-only API anywhere in the module (`tf.get_variable`,
        `tf.layers`, `tf.losses`, collections, `global_step`, ...), and a session used only to
        initialise and run the step. Otherwise the `compat` rewrite with `tower-input = "dataset"`
        applies (the general one where that refuses) and the fix title says which of these
        blocked the tf2 one.
    """

    valid = [
        """\
        import tensorflow as tf
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()
        """,
        """\
        import tensorflow as tf
        gpus = [d for d in tf.config.list_physical_devices('GPU')]
        for gpu in gpus:
            print(gpu.name)
        """,
        """\
        import tensorflow as tf
        for i in range(3):
            with tf.device('/cpu:0'):
                x = tf.constant(i)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            for i in range(2):
                with tf.device('/gpu:%d' % i):
                    out = model(x)
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow.compat.v1 as tf
            for i, dev in enumerate(['/gpu:0', '/gpu:1']):
                with tf.device(dev):
                    out = model(x)
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow as tf
            gpu = 0
            while gpu < num_gpus:
                with tf.device('/gpu:%d' % gpu):
                    out = model(x[gpu])
                gpu += 1
            """,
            line=3,
        ),
        Invalid(
            """\
            import tensorflow as tf
            def tower(i, x):
                with tf.device('/gpu:%d' % i):
                    return model(x)
            outs = [tower(i, parts[i]) for i in range(num_gpus)]
            """,
            line=5,
        ),
    ]

    def visit_Module(self, node: cst.Module) -> None:
        self._towers: list = []

    def visit_For(self, node: cst.For) -> None:
        tower = tower_loop_at(self.context, node)
        group = tower_group(self.context, node)
        if tower is not None and group and group[0] is not tower:
            tower = None  # one finding per group of loops, at its first loop
        if tower is not None:
            self._towers.append((node, tower, group))

    def leave_Module(self, original_node: cst.Module) -> None:
        # The rewrite is planned once the walk has seen the whole module (it reads the code
        # after the loop too, with the walk's parents).
        for node, tower, group in self._towers:
            message = _message(self, tower.scopes[0].device, _where_else(self, tower, group))
            try:
                edit = mirrored.plan(self, tower)
                kept = mirrored.planned(self, tower).split_kept
                if kept:
                    message += f" (the rewrite keeps feeding the split placeholders each step: {kept})"
            except mirrored.Refused as reason:
                edit = None
                message += f" (no automatic fix: {reason})"
            self.report(node, message, edit=edit)
        for form in module_tower_forms(self.context):
            message, edit = loop_forms.plan(self, form, _message(self, form.device, _where_else(self, form, [])))
            self.report(form.statement, message, edit=edit)


def _message(rule: Rule, device: cst.CSTNode, where: str) -> str:
    return (
        f"tower loop: one model replica per device under `tf.device({describe_device(device, rule.context.module)})`"
        f"{where}; use tf.distribute.MirroredStrategy, which replicates the model, splits "
        "the batch and all-reduces the gradients"
    )


def _where_else(rule: Rule, tower, group) -> str:
    """Message text for towers opened in a tower function or built over several loops (a
    tower loop, or a tower form, which is one statement)."""
    note = ""
    if getattr(tower, "via", None):
        names = ", ".join(f"`{f.name.value}`" for f in tower.via)
        note += f" (opened in {names}, called once per device)"
    if len(group) > 1:
        lines = ", ".join(str(rule.position(t.loop).start.line) for t in group[1:])
        where = f"loop at line {lines}" if len(group) == 2 else f"loops at lines {lines}"
        note += f", continued by the {where} over the same devices (one migration for all of them)"
    return note
