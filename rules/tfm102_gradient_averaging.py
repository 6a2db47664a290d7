from __future__ import annotations

import builtins

import libcst as cst
import libcst.matchers as m

from tfmigrate.devices import names_used
from tfmigrate.rule import FixSafety, Invalid, Rule

# How a reduction combines the towers' gradients.
_MEAN = {
    "tensorflow.reduce_mean",
    "tensorflow.math.reduce_mean",
    "numpy.mean",
    "numpy.average",
}
_SUM = {
    "tensorflow.add_n",
    "tensorflow.math.add_n",
    "tensorflow.reduce_sum",
    "tensorflow.math.reduce_sum",
    "tensorflow.accumulate_n",
    "tensorflow.math.accumulate_n",
    "numpy.sum",
}
_DIVIDE = {
    "tensorflow.divide",
    "tensorflow.div",
    "tensorflow.truediv",
    "tensorflow.realdiv",
    "tensorflow.math.divide",
    "tensorflow.math.truediv",
}
# Gathering the towers' gradients into one tensor (before a reduction, or instead of one).
_BUILTINS = set(dir(builtins))
_GATHER = {"tensorflow.stack", "tensorflow.concat", "tensorflow.math.stack"}

class GradientAveraging(Rule):
    code = "TFM102"
    name = "gradient-averaging"
    summary = "Hand-written averaging (or summing) of per-tower gradient lists"
    triggers = ("zip",)
    fix_safety = FixSafety.NONE

    what_it_finds = """
        A loop or comprehension over `zip(*tower_grads)` (one entry per variable, holding that
        variable's gradient from every tower) that combines the towers' gradients with
        `tf.reduce_mean`, `tf.add_n`, `tf.reduce_sum`, `tf.accumulate_n`, `tf.stack` or
        `tf.concat` (the `average_gradients` helper of the TF1 multi-GPU tutorials).

        When the averaging sits in a helper function — one whose parameter (or a name
        computed from nothing but its parameters) is what `zip(*...)` transposes — the
        finding is at the helper's `def`, once per helper; averaging written inline, at module
        level or inside a bigger function that builds the towers itself, is reported at its
        loop or comprehension.

        The message says whether the code averages (a mean, or a sum divided by a count) or
        sums: the loss scaling of the migrated program depends on it.
    """
    why = """
        `tf.distribute` strategies all-reduce gradients themselves: the optimizer's
        `apply_gradients` under `MirroredStrategy` *sums* the per-replica gradients. Keeping a
        hand-written average on top does nothing useful once there is one model, and getting
        the scaling wrong silently changes the effective learning rate: a legacy program that
        averaged tower gradients must scale each replica's loss by the global batch size
        (`tf.nn.compute_average_loss`), or it trains at N times the learning rate; a legacy
        program that summed them must keep each replica's loss a mean over its own batch.
    """
    example = """
        def average_gradients(tower_grads):
            average_grads = []
            for grad_and_vars in zip(*tower_grads):
                grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
                grad = tf.reduce_mean(tf.concat(grads, 0), 0)
                average_grads.append((grad, grad_and_vars[0][1]))
            return average_grads
    """
    use_instead = """
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)

        def step_fn(images, labels):
            per_example_loss = model_loss(images, labels)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=batch_size)
            return opt.minimize(loss)
    """
    fix_notes = """
        No automatic fix: the helper goes away together with the tower loop (TFM101), whose
        fix rewrites the loss scaling from what this rule finds. Delete the helper by hand once
        nothing calls it.
    """

    valid = [
        """\
        import tensorflow as tf
        losses = [tower_loss(i) for i in range(2)]
        total = tf.add_n(losses)
        """,
        """\
        import tensorflow as tf
        for name, value in zip(*columns):
            print(name, value)
        """,
        """\
        import tensorflow as tf
        for grads, variables in zip(grad_list, var_list):
            update = tf.reduce_mean(grads)
        """,
    ]
    invalid = [
        Invalid(
            """\
            import tensorflow as tf
            def average_gradients(tower_grads):
                out = []
                for grad_and_vars in zip(*tower_grads):
                    grad = tf.reduce_mean(tf.stack([g for g, _ in grad_and_vars]), 0)
                    out.append((grad, grad_and_vars[0][1]))
                return out
            """,
            line=2,
        ),
        Invalid(
            """\
            import tensorflow.compat.v1 as tf
            summed = [(tf.add_n([g for g, _ in gv]), gv[0][1]) for gv in zip(*tower_grads)]
            """,
            line=2,
        ),
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.functions: list[cst.FunctionDef] = []
        self.reported: set[int] = set()
        self.helper_names: dict[int, set[str]] = {}

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()

    def visit_For(self, node: cst.For) -> None:
        zipped = self._transposed(node.iter)
        if zipped is not None:
            self._check(node, zipped, node.body)

    # (LibCST's batched visitors find methods by their own name: no aliases.)
    def visit_ListComp(self, node: cst.ListComp) -> None:
        self._comprehension(node)

    def visit_GeneratorExp(self, node: cst.GeneratorExp) -> None:
        self._comprehension(node)

    def visit_SetComp(self, node: cst.SetComp) -> None:
        self._comprehension(node)

    def visit_DictComp(self, node: cst.DictComp) -> None:
        self._comprehension(node)

    def _comprehension(self, node: cst.BaseComp) -> None:
        comp = node.for_in
        while comp is not None:
            zipped = self._transposed(comp.iter)
            if zipped is not None:
                self._check(node, zipped, node)
                return
            comp = comp.inner_for_in

    def _transposed(self, iterable: cst.BaseExpression) -> cst.BaseExpression | None:
        """X in ``zip(*X)`` (or Python 2's ``izip(*X)``), else None."""
        if not isinstance(iterable, cst.Call) or not isinstance(iterable.func, (cst.Name, cst.Attribute)):
            return None
        qualified = self.qualified(iterable.func)
        builtin = isinstance(iterable.func, cst.Name) and iterable.func.value == "zip" and qualified is None
        if not (builtin or qualified in ("itertools.izip", "future.builtins.zip", "six.moves.zip")):
            return None
        starred = [a.value for a in iterable.args if a.star == "*"]
        return starred[0] if starred else None

    def _how(self, body: cst.CSTNode) -> tuple[str, str] | None:
        """('averages' | 'sums' | 'combines', the API that shows it), or None."""
        mean = total = gather = None
        divides = bool(m.findall(body, m.BinaryOperation(operator=m.Divide())))
        for call in m.findall(body, m.Call()):
            name = self.call_name(call)
            if name in _MEAN and mean is None:
                mean = name
            elif name in _SUM and total is None:
                total = name
            elif name in _DIVIDE:
                divides = True
            elif name in _GATHER and gather is None:
                gather = name
            elif isinstance(call.func, cst.Name) and call.func.value == "sum" and name is None:
                total = total or "sum"
        short = lambda n: n.replace("tensorflow.", "tf.").replace("numpy.", "np.")  # noqa: E731
        if mean:
            return "averages", short(mean)
        if total:
            return ("averages" if divides else "sums"), short(total)
        if gather:
            return "combines", short(gather)
        return None

    def _check(self, node: cst.CSTNode, zipped: cst.BaseExpression, body: cst.CSTNode) -> None:
        how = self._how(body)
        if how is None:
            return
        verb, api = how
        listed = self.context.module.code_for_node(zipped)
        helper = self._helper(zipped)
        if helper is not None:
            if id(helper) in self.reported:
                return
            self.reported.add(id(helper))
            where, target = f"`{helper.name.value}`", helper
        else:
            where, target = "this code", node
        self.report(target, f"{where} {verb} the per-tower gradients (`zip(*{listed})` with `{api}`): " + _ADVICE[verb])

    def _helper(self, zipped: cst.BaseExpression) -> cst.FunctionDef | None:
        """The enclosing function, when what it transposes comes from its parameters."""
        if not self.functions:
            return None
        function = self.functions[-1]
        if id(function) not in self.helper_names:
            self.helper_names[id(function)] = _parameter_data(function)
        return function if names_used(zipped) & self.helper_names[id(function)] else None


def _parameter_data(function: cst.FunctionDef) -> set[str]:
    """The parameters, plus names computed from nothing but them (`present = [gv for gv in
    tower_grads if gv]`): what a helper receives, as opposed to what a bigger function
    builds (`tower_grads = [opt.compute_gradients(...) for i in range(num_gpus)]`)."""
    data = {p.name.value for p in _all_params(function.params)}
    assignments = [
        (target.target, assign.value)
        for assign in m.findall(function.body, m.Assign())
        for target in assign.targets
    ]
    changed = True
    while changed:
        changed = False
        for target, value in assignments:
            free = _free_names(value) - _BUILTINS
            if free and free <= data and not names_used(target) <= data:
                data |= names_used(target)
                changed = True
    return data


def _free_names(expr: cst.BaseExpression) -> set[str]:
    """Names an expression reads, less those its own comprehensions bind."""
    bound: set[str] = set()
    for comp in m.findall(expr, m.CompFor()):
        bound |= names_used(comp.target)
    return names_used(expr) - bound


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    found = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            found.append(star)
    return found


_ADVICE = {
    "averages": (
        "MirroredStrategy all-reduces gradients by summing them across replicas, so drop the "
        "averaging and scale each replica's loss by the global batch size "
        "(tf.nn.compute_average_loss(..., global_batch_size=...)) to keep the same update"
    ),
    "sums": (
        "MirroredStrategy also sums gradients across replicas, so drop the summing and keep "
        "each replica's loss a mean over its own batch (not divided by the replica count) to "
        "keep the same update"
    ),
    "combines": (
        "no mean or sum was recognised, and MirroredStrategy sums gradients across replicas, "
        "so check how this code reduces them before choosing each replica's loss scaling"
    ),
}
