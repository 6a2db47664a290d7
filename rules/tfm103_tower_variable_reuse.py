from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.devices import enclosing_tower, per_device_names
from tfmigrate.cst.traversal import names_used
from tfmigrate.cst.names import dotted_name
from tfmigrate.rule import PER_DEVICE, FixSafety, Invalid, Rule


class TowerVariableReuse(Rule):
    code = "TFM103"
    name = "tower-variable-reuse"
    summary = "Variables shared between towers with reuse_variables() / reuse=..."
    triggers = ("reuse", "make_template", "keras", "layers")
    requires = (PER_DEVICE,)  # every finding is in a tower loop or a loop over the devices
    fix_safety = FixSafety.NONE

    what_it_finds = """
        Variable sharing between the towers of a hand-written multi-GPU loop:
        `tf.get_variable_scope().reuse_variables()` (or `scope.reuse_variables()`) and any
        call with a `reuse=` argument (`tf.variable_scope(..., reuse=i > 0)`,
        `reuse=bool(i != 0)`, `reuse=tf.AUTO_REUSE`, `reuse=True`, `tf.layers.dense(...,
        reuse=...)`) inside a tower loop (TFM101) or a loop over the devices (`for i in
        range(FLAGS.num_gpus)`, `for d in devices`: a loop whose iterable mentions gpu,
        device, tower or replica), when the value always shares (`True`, `AUTO_REUSE`) or is
        computed from that loop's variable.

        Also: a Python flag passed as `reuse=reuse` and set to `True` inside the per-device
        loop (`reuse = False` before it, `reuse = True` at the end of its body); a
        `tf.make_template(...)` whose template is called in a tower loop (reported at the
        `make_template` call); and a Keras layer or model object built once outside a tower
        loop and called in it (reported at its first call in each tower loop).

        Not reported: `reuse=False` / `reuse=None`; `reuse=True` in ordinary code outside any
        per-device loop (a GAN discriminator called twice, an evaluation graph built after
        the training graph); `reuse=t > 0` in a loop over time steps (an unrolled RNN), even
        inside a tower.
    """
    why = """
        A tower loop builds the model once per GPU and must make every tower use the same
        variables, so it switches the variable scope to reuse after the first tower. Under
        `tf.distribute.MirroredStrategy` the model is built once, in `strategy.scope()`, and
        its variables are mirrored to every replica by the strategy: the reuse flags have
        nothing left to share, and left in place after a migration they make the first
        `tf.compat.v1.get_variable` call fail (`reuse=True` with no variable yet) or hide
        accidental duplicate variables (`AUTO_REUSE`).
    """
    example = """
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                with tf.variable_scope(tf.get_variable_scope(), reuse=i > 0):
                    loss = tower_loss(images[i], labels[i])
                tf.get_variable_scope().reuse_variables()
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = build_model()

        def step_fn(images, labels):
            return model_loss(model, images, labels)
    """
    fix_notes = """
        No automatic fix: the reuse goes away with the tower loop (TFM101) it belongs to.
        Remove it by hand only together with the loop; on its own, removing it would make
        each tower create its own variables.
    """

    valid = [
        """\
        import tensorflow as tf
        def discriminator(x, reuse=False):
            with tf.variable_scope('disc', reuse=reuse):
                return tf.layers.dense(x, 1)
        d_real = discriminator(real)
        d_fake = discriminator(fake, reuse=True)
        """,
        """\
        import tensorflow as tf
        for t in range(num_steps):
            with tf.variable_scope('rnn', reuse=t > 0):
                state = cell(inputs[t], state)
        """,
        """\
        import tensorflow as tf
        for i in range(num_gpus):
            with tf.device('/gpu:%d' % i):
                with tf.variable_scope('tower', reuse=False):
                    out = model(x[i])
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            for i in range(num_gpus):
                with tf.device('/gpu:%d' % i):
                    loss = tower_loss(i)
                    tf.get_variable_scope().reuse_variables()
            """,
            line=5,
        ),
        Invalid(
            """\
            import tensorflow.compat.v1 as tf
            for i in range(FLAGS.num_gpus):
                with tf.variable_scope('model', reuse=bool(i != 0)):
                    logits = model(images[i])
            """,
            line=3,
        ),
        Invalid(
            """\
            import tensorflow as tf
            for dev in ['/gpu:0', '/gpu:1']:
                with tf.device(dev), tf.variable_scope('m', reuse=tf.AUTO_REUSE):
                    out = model(x)
            """,
            line=3,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self._functions: list[int] = [0]
        # reuse=<name> in a per-device loop, and names set to True inside one, per function.
        self._flag_uses: list[tuple[cst.Call, tuple[int, str]]] = []
        self._flipped: set[tuple[int, str]] = set()
        self._templates: dict[str, cst.Call] = {}  # name -> its tf.make_template(...) call
        self._keras_objects: dict[str, str] = {}  # dotted name -> Keras class it was built from
        self._called_in_towers: list[tuple[cst.Call, str]] = []  # name(...) inside a tower loop

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._functions.append(id(node))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._functions.pop()

    def _function(self) -> int:
        return self._functions[-1]

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) != 1:
            return
        target = dotted_name(node.targets[0].target)
        if target is None:
            return
        value = node.value
        if isinstance(value, cst.Name) and value.value == "True":
            if "." not in target and self._per_device_loop_names(node) is not None:
                self._flipped.add((self._function(), target))
            return
        if not isinstance(value, cst.Call):
            return
        name = self.call_name(value) or ""
        if name == "tensorflow.make_template":
            self._templates.setdefault(target, value)
        elif _is_keras_object(name) and enclosing_tower(self.context, node) is None:
            self._keras_objects[target] = name

    def leave_Module(self, original_node: cst.Module) -> None:
        for call, (function, flag) in self._flag_uses:
            if (function, flag) in self._flipped:
                self.report(
                    call,
                    f"`reuse={flag}`, a flag set to True after the first tower, shares variables "
                    "between towers: under MirroredStrategy the model is built once in "
                    "strategy.scope() and its variables are mirrored to every replica, so this "
                    "goes with the tower loop",
                )
        reported: set[tuple[int, str]] = set()
        templates_reported: set[str] = set()
        for call, name in self._called_in_towers:
            tower = enclosing_tower(self.context, call)
            key = (id(tower), name)
            if key in reported:
                continue
            if name in self._templates:
                if name in templates_reported:
                    continue
                templates_reported.add(name)
                self.report(
                    self._templates[name],
                    f"`tf.make_template` shares the variables of `{name}` between the towers "
                    "that call it: under MirroredStrategy build the model once in "
                    "strategy.scope() (a Keras model or tf.Module) and call it in the replica "
                    "step function",
                )
            elif name in self._keras_objects:
                reported.add(key)
                kind = self._keras_objects[name].rsplit(".", 1)[-1]
                self.report(
                    call,
                    f"`{name}` (a Keras `{kind}` built once, outside the towers) is called in "
                    "every tower, which shares its variables between towers: under "
                    "MirroredStrategy build it under strategy.scope() and call it once in the "
                    "replica step function",
                )

    def visit_Call(self, node: cst.Call) -> None:
        func_name = dotted_name(node.func)
        if func_name is not None and (func_name in self._templates or func_name in self._keras_objects):
            if enclosing_tower(self.context, node) is not None:
                self._called_in_towers.append((node, func_name))
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "reuse_variables" and not node.args:
            if self._in_per_device_loop(node):
                self.report(
                    node,
                    "`reuse_variables()` shares variables between towers: under "
                    "MirroredStrategy the model is built once in strategy.scope() and its "
                    "variables are mirrored to every replica, so this goes with the tower loop",
                )
            return
        for arg in node.args:
            if arg.keyword is None or arg.keyword.value != "reuse":
                continue
            value = arg.value
            if isinstance(value, cst.Name) and value.value in ("False", "None"):
                return
            loop_names = self._per_device_loop_names(node)
            if loop_names is None:
                return
            # `reuse=t > 0` of an RNN's time loop inside a tower stays: only sharing that
            # follows the device loop, or that always shares, is the towers'.
            if not (names_used(value) & loop_names or _always_reuses(value, self)):
                if isinstance(value, cst.Name):
                    self._flag_uses.append((node, (self._function(), value.value)))  # decided once the module is read
                return
            code = self.context.module.code_for_node(value)
            self.report(
                node,
                f"`reuse={code}` shares variables between towers: under MirroredStrategy the "
                "model is built once in strategy.scope() and its variables are mirrored to "
                "every replica, so this goes with the tower loop",
            )

    def _in_per_device_loop(self, node: cst.CSTNode) -> bool:
        return self._per_device_loop_names(node) is not None

    def _per_device_loop_names(self, node: cst.CSTNode) -> frozenset[str] | None:
        """Names of the per-device loops around ``node`` (a tower loop counts), else None."""
        tower = enclosing_tower(self.context, node)
        names = per_device_names(self.context, node)
        if tower is None and not names:
            return None
        return names | (frozenset(tower.loop_names) if tower else frozenset())


def _always_reuses(value: cst.BaseExpression, rule: Rule) -> bool:
    """`reuse=True` / `reuse=tf.AUTO_REUSE`: sharing whatever the loop variable."""
    if isinstance(value, cst.Name) and value.value == "True":
        return True
    return (rule.qualified(value) or "").endswith("AUTO_REUSE")


_KERAS_OBJECT_PREFIXES = ("keras.layers.", "keras.applications.")
_KERAS_MODELS = {"keras.Sequential", "keras.Model", "keras.models.Sequential", "keras.models.Model"}


def _is_keras_object(name: str) -> bool:
    """A Keras layer, model or application class (whose instances own variables)."""
    if name in _KERAS_MODELS:
        return True
    if not name.startswith(_KERAS_OBJECT_PREFIXES):
        return False
    last = name.rsplit(".", 1)[-1]
    return last[:1].isupper() or name.startswith("keras.applications.")
