from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.rewrites import parallel_call
from tfmigrate.analysis.batch_splits import JOINS, KERAS_LAMBDAS, SPLIT, UNSTACKS, along_batch_axis, join_after
from tfmigrate.cst.callargs import is_legacy_split
from tfmigrate.analysis.devices import TowerLoop, enclosing_tower, tower_loop_at
from tfmigrate.cst.traversal import find, names_used
from tfmigrate.rule import DEVICE_WORDS, FixSafety, Invalid, Rule

SPLITS = {SPLIT} | UNSTACKS


def bound_names(target: cst.CSTNode) -> set[str]:
    """The names an assignment target binds or fills: `x`, `a, b`, `splits[k]` -> splits."""
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Subscript, cst.Attribute)):
        return bound_names(target.value)
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(bound_names(e.value) for e in target.elements))
    if isinstance(target, cst.StarredElement):
        return bound_names(target.value)
    return set()


@dataclass
class _Scope:
    """What one function (or the module) holds, outside nested functions."""

    node: cst.CSTNode
    splits: list[tuple[cst.Call, set[str]]] = field(default_factory=list)  # call, names it fills
    towers: list[TowerLoop] = field(default_factory=list)
    returns: list[cst.Return] = field(default_factory=list)
    joined: set[str] = field(default_factory=set)  # names assigned from a join
    keras: bool = False  # the pieces are Keras Lambda slices


@dataclass
class _Found:
    """A split / towers / join found in one scope, reported once the walk is over."""

    scope: _Scope
    tower: TowerLoop
    feeding: list[cst.Call]
    join: cst.Call


class SplitConcatParallel(Rule):
    code = "TFM105"
    name = "split-concat-parallel"
    summary = "A batch split with tf.split across devices and joined with tf.concat"
    triggers = ("split", "Lambda")
    requires = (DEVICE_WORDS,)  # a make_parallel places its pieces on devices
    fix_safety = FixSafety.UNSAFE

    what_it_finds = """
        Data parallelism by hand in one function or module: a batch cut with `tf.split` (or
        `tf.unstack`), one piece per device, processed in a tower loop (TFM101), and the
        towers' outputs joined with `tf.concat` (or `tf.stack`) after the loop — the
        `make_parallel(fn, num_gpus, **kwargs)` helper and its inline form.

        The Keras form counts too: each tower's inputs cut with a `Lambda` layer that takes
        the tower index (`Lambda(get_slice, arguments={'idx': i, 'parts': gpu_count})`) and the
        outputs merged with `concatenate` / `Concatenate` / `merge(mode='concat')` (reported at
        the helper's `def`, or at the first `Lambda` outside a function). It is reported only:
        the fix notes say how to migrate it by hand.

        Every spelling of the split counts: `tf.split(x, n)`, keywords in any order
        (`tf.split(axis=0, num_or_size_splits=n, value=x)`), TF 0.x's `tf.split(0, n, x)`, and
        the Keras slices imported from `keras.layers.core` or spelled with the backend (`K.shape`,
        `K.tf.device`), joined with `concatenate`, `Concatenate`, Keras 1's
        `merge(..., mode='concat')` or `K.concatenate`. A split along another axis than the
        batch's (channel groups joined back along the channels) is not a batch split.

        The finding is at the helper's `def` when the function returns the joined result
        and does not train on it (it is a `make_parallel`), otherwise at the first `tf.split`
        that feeds the towers (the inline form); its message gives the lines of the split, of
        the tower loop that reads it and of the join.
        A `tf.split` without a tower loop, or a tower loop whose outputs are not joined with
        `tf.concat` (the towers' gradients are averaged instead: TFM102), is not reported here:
        such a batch split is TFM111's.
    """
    why = """
        `tf.distribute.MirroredStrategy` splits each global batch across the replicas and
        gathers per-replica results itself (`strategy.run`, then `strategy.gather` or
        `strategy.reduce`). A hand-written split fails when the batch does not divide by the
        number of devices, hard-codes the device count, and keeps the program in TF1 graph
        mode.
    """
    example = """
        def make_parallel(fn, num_gpus, **kwargs):
            in_splits = {k: tf.split(v, num_gpus) for k, v in kwargs.items()}
            out_split = []
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    out_split.append(fn(**{k: v[i] for k, v in in_splits.items()}))
            return tf.concat(out_split, axis=0)
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        per_replica = strategy.run(fn, args=(x, y))
        result = strategy.gather(per_replica, axis=0)
    """
    fix_notes = """
        Unsafe (`--unsafe-fixes`), for the `compat` target (the Session program stays), for two
        shapes. The `make_parallel(fn, num_gpus, **kwargs)` helper: a module-level function that
        only cuts each keyword input with `tf.split(value, num_gpus)`, calls `fn(**<slice i>)`
        once per device in a `for i in range(num_gpus)` tower loop and ends with
        `return tf.concat(outputs, axis=0)`, called once in the module as
        `loss = make_parallel(fn, n, x=x, ...)`. The inline form, in one function or at module
        level: `x_parts = tf.split(x, n)` statements, `outputs = []`, a
        `for i in range(n)` (or `for i, d in enumerate(devices)`) tower loop whose body ends
        with `outputs.append(tower_output)`, and `loss = tf.concat(outputs, axis=0)` (or
        `tf.stack(outputs)`), all in one block. Either must be followed in the same block by
        `train_op = opt.minimize(tf.reduce_mean(loss), ...)` (or `reduce_sum`, or through a
        `mean_loss = tf.reduce_mean(loss)` line).

        The towers become a replica function that
        `MirroredStrategy(devices=<the loop's devices>)` runs with `strategy.run`: the helper's
        replica calls `fn` on its slice `tf.split(x, strategy.num_replicas_in_sync)[i]`; the
        inline form keeps its split statements (now cut into `strategy.num_replicas_in_sync`
        pieces, once) and its tower code, which reads `x_parts[i]` with `i` the replica id,
        without the device scopes and the `reuse=i > 0` variable-scope wrapper. Each replica
        runs the `minimize` step itself (a v1 optimizer cannot minimize in the cross-replica
        context); MirroredStrategy sums the replicas' gradients, so a `reduce_mean` loss is
        divided by `strategy.num_replicas_in_sync` (equal slices: the global mean is the sum of
        the replica means / N) and a `reduce_sum` loss is not. An optimizer built inline is
        built once before the replica function; `colocate_gradients_with_ops` goes. `loss`
        stays the replicas' outputs joined in order and `train_op` its op, so the
        `Session.run` code is unchanged; the graph is built under `strategy.scope()` (as for
        TFM101); the helper (or the output list and the loop) goes.

        Anything else gets no fix and the message says what blocks it: a helper imported from
        or called in another module, called more than once, doing more than split / call /
        concat; a batch cut with `tf.unstack`, into unequal sizes, along another axis, into
        another count than the towers, or inside the loop; a loop body that carries a value
        from one tower to the next, breaks, or defines names used after it; outputs joined
        other than `loss = tf.concat(outputs, axis=0)`; a result not minimized in the same
        block, or a name the `minimize` reads set between the join and it; a split in TF 0.x's
        argument order (`tf.split(0, n, x)`).

        The Keras form (`Lambda` slices and a `concatenate`, building a new `Model` around a
        template) gets no fix: the template is built, compiled and fit elsewhere, and it is that
        code that must change. Migrate it by hand: build and compile the template model under
        `tf.distribute.MirroredStrategy().scope()`, call `fit` on it with the same global batch
        size, and delete the helper (as TFM201 does for `multi_gpu_model`).
        Check the result with `tfmigrate verify old.py new.py`.
    """

    valid = [
        """\
        import tensorflow as tf
        q, k, v = tf.split(qkv, 3, axis=-1)
        heads = tf.concat([attend(q, k, v)], axis=-1)
        """,
        """\
        import tensorflow as tf
        images = tf.split(batch, num_gpus)
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                tower_grads.append(opt.compute_gradients(model(images[i])))
        """,
        """\
        import tensorflow as tf
        xs = tf.split(images, num_gpus)
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                grads = opt.compute_gradients(loss_fn(xs[i]))
                tower_grads.append(grads)
        # Gradients stacked to be averaged: TFM102's, not the towers' outputs joined.
        avg = [(tf.reduce_mean(tf.stack([g for g, _ in gv]), 0), gv[0][1]) for gv in zip(*tower_grads)]
        """,
        """\
        import tensorflow as tf
        xs = tf.split(images, num_gpus)
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                tower_losses.append(loss_fn(xs[i]))
        # The towers' losses stacked to be averaged: nothing is joined per example (TFM111's split).
        loss = tf.reduce_mean(tf.stack(tower_losses))
        """,
        """\
        import tensorflow as tf
        groups = tf.split(features, num_gpus, axis=3)
        outs = []
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                outs.append(conv_block(groups[i]))
        merged = tf.concat(outs, axis=3)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            def make_parallel(fn, num_gpus, x):
                parts = tf.split(x, num_gpus)
                outs = []
                for i in range(num_gpus):
                    with tf.device('/gpu:%d' % i):
                        outs.append(fn(parts[i]))
                return tf.concat(outs, axis=0)
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow as tf
            split_a = tf.split(a, 2)
            split_c = []
            for i in range(2):
                with tf.device(tf.DeviceSpec(device_type='GPU', device_index=i)):
                    split_c.append(split_a[i] * 2)
            c = tf.concat(split_c, axis=0)
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow as tf
            def parallel_predict(batch, n_gpus):
                pieces = tf.split(0, n_gpus, batch)
                outs = []
                for g in range(n_gpus):
                    with tf.device('/gpu:' + str(g)):
                        outs.append(predict(pieces[g]))
                return tf.concat(0, outs)
            """,
            line=2,
        ),
        Invalid(
            """\
            import keras.backend as K
            from keras.layers import merge
            from keras.layers.core import Lambda
            def make_parallel(model, gpu_count, x):
                outputs = []
                for i in range(gpu_count):
                    with K.tf.device('/gpu:%d' % i):
                        piece = Lambda(get_slice, arguments={'idx': i, 'parts': gpu_count})(x)
                        outputs.append(model(piece))
                return merge(outputs, mode='concat', concat_axis=0)
            """,
            line=4,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.scopes: list[_Scope] = []
        self.filled: dict[int, set[str]] = {}  # id(split call) -> the names its result fills
        self.found: list[_Found] = []

    # --- collect, per function ----------------------------------------------------------
    def visit_Module(self, node: cst.Module) -> None:
        self.scopes.append(_Scope(node))

    def leave_Module(self, original_node: cst.Module) -> None:
        self._judge(self.scopes.pop())
        # Reported once the walk is over: the messages give the lines of the split and the loop.
        for found in self.found:
            self._report(found)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes.append(_Scope(node))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._judge(self.scopes.pop())

    def visit_For(self, node: cst.For) -> None:
        tower = tower_loop_at(self.context, node)
        if tower is not None:
            self.scopes[-1].towers.append(tower)

    def visit_Assign(self, node: cst.Assign) -> None:
        targets = set().union(*(bound_names(t.target) for t in node.targets))
        for call in find(node.value, cst.Call):
            name = self.call_name(call)
            if name in SPLITS:
                self.filled[id(call)] = targets
            elif name in JOINS:
                self.scopes[-1].joined |= targets

    def visit_Call(self, node: cst.Call) -> None:
        name = self.call_name(node)
        if name in SPLITS:
            self.scopes[-1].splits.append((node, self.filled.get(id(node), set())))
        elif name in KERAS_LAMBDAS:
            # `Lambda(get_slice, arguments={'idx': i, 'parts': n})(x)` in a tower loop.
            tower = enclosing_tower(self.context, node)
            if tower is not None and names_used(node) & tower.loop_names:
                self.scopes[-1].splits.append((node, set()))
                self.scopes[-1].keras = True

    def visit_Return(self, node: cst.Return) -> None:
        self.scopes[-1].returns.append(node)

    # --- judge ----------------------------------------------------------------------------
    def _judge(self, scope: _Scope) -> None:
        for tower in scope.towers:
            body_names = names_used(tower.loop)  # the iterable too: `enumerate(pieces)`
            feeding = [
                call
                for call, filled in scope.splits
                if filled & body_names or enclosing_tower(self.context, call) is tower
            ]
            # A split along another axis (channels, heads) is no batch split; Keras slices are.
            if not any(self._cuts_batch(call) for call in feeding):
                continue
            join = join_after(self.context, tower)
            if join is not None:
                self.found.append(_Found(scope, tower, feeding, join))
                return

    def _cuts_batch(self, call: cst.Call) -> bool:
        name = self.call_name(call)
        return name in KERAS_LAMBDAS or along_batch_axis(call, name)

    def _report(self, found: _Found) -> None:
        scope, tower, feeding, concat = found.scope, found.tower, found.feeding, found.join
        split = feeding[0]
        advice = (
            "MirroredStrategy splits each global batch across replicas and gathers their "
            "results (strategy.run, then strategy.gather or strategy.reduce)"
        )
        lines = self._lines(tower, feeding, concat)
        if scope.keras:
            where = scope.node if isinstance(scope.node, cst.FunctionDef) else split
            subject = f"`{scope.node.name.value}`" if isinstance(scope.node, cst.FunctionDef) else "this code"
            self.report(
                where,
                f"{subject} slices each batch per GPU with Keras `Lambda` layers and concatenates "
                f"the towers' outputs ({lines}; a `make_parallel` / `ParallelModel` helper): build and "
                "compile the template model under tf.distribute.MirroredStrategy().scope() and "
                "fit it directly, and delete the helper; the batch size passed to fit stays the global batch "
                "(no automatic fix here: the Keras form wraps a template model that is built, compiled and fit "
                "elsewhere, and it is that code, not the slicing, that must move under the strategy scope; "
                "TFM201 rewrites a call of the helper where the template is built, and deletes the helper)",
            )
            return
        legacy = next((c for c in feeding if self.call_name(c) == SPLIT and is_legacy_split(c)), None)
        helper = isinstance(scope.node, cst.FunctionDef) and self._is_helper(scope, concat)
        if helper:
            message = (
                f"`{scope.node.name.value}` splits a batch across devices with tf.split and "
                f"joins the towers' outputs with tf.concat ({lines}): {advice}"
            )
        else:
            message = (
                "batch split across devices with tf.split and joined with tf.concat after the "
                f"tower loop ({lines}): {advice}"
            )
        try:
            if legacy is not None:
                raise parallel_call.Refused(
                    f"`{self.context.module.code_for_node(legacy.func)}(0, n, x)` is TF 0.x's argument order "
                    "(axis, count, value); only `tf.split(x, n)` is rewritten"
                )
            edit = (
                parallel_call.plan_helper(self, scope.node) if helper
                else parallel_call.plan_inline(self, tower, feeding, concat)
            )
        except parallel_call.Refused as reason:
            edit = None
            message += f" (no automatic fix: {reason})"
        self.report(scope.node if helper else split, message, edit=edit)

    def _lines(self, tower: TowerLoop, feeding: list[cst.Call], join: cst.Call) -> str:
        """Where the splits, the tower loop that reads them and the join are."""
        what = "sliced" if self.call_name(feeding[0]) in KERAS_LAMBDAS else "split"
        at = sorted({self.position(call).start.line for call in feeding})
        where = f"line {at[0]}" if len(at) == 1 else "lines " + ", ".join(map(str, at))
        return (
            f"{what} at {where}, read by the tower loop at line {self.position(tower.loop).start.line}, "
            f"joined at line {self.position(join).start.line}"
        )

    def _is_helper(self, scope: _Scope, concat: cst.Call) -> bool:
        """A `make_parallel`: a function that returns the joined result and does not train on it
        (one that also calls `minimize` is the inline form, whatever it returns)."""
        minimizes = any(
            isinstance(call.func, cst.Attribute) and call.func.attr.value == "minimize"
            for call in find(scope.node.body, cst.Call)
        )
        return not minimizes and self._returns_join(scope, concat)

    def _returns_join(self, scope: _Scope, concat: cst.Call) -> bool:
        for ret in scope.returns:
            if ret.value is None:
                continue
            if any(c is concat for c in find(ret.value, cst.Call)) or names_used(ret.value) & scope.joined:
                return True
        return False
