from __future__ import annotations

import builtins

import libcst as cst

from tfmigrate.analysis.devices import (
    derived_names, device_scope_arg, enclosing_tower, module_tower_loops, tower_collections,
)
from tfmigrate.analysis.tower_forms import module_tower_forms
from tfmigrate.cst.traversal import find, free_names, names_used
from tfmigrate.cst.names import dotted_name
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
_INDEXED_SLICES = {"tensorflow.IndexedSlices", "tensorflow.python.framework.ops.IndexedSlices"}
# NCCL all-reduce across the towers' devices: a sum.
_NCCL_SUMS = {
    "tensorflow.contrib.nccl.all_sum",
    "tensorflow.contrib.nccl.python.ops.nccl_ops.all_sum",
    "tensorflow.python.ops.nccl_ops.all_sum",
}
# Differentiating a loss.
_GRADIENT_METHODS = ("compute_gradients", "minimize")
_GRADIENT_FUNCTIONS = {"tensorflow.gradients"}

class GradientAveraging(Rule):
    code = "TFM102"
    name = "gradient-averaging"
    summary = "Hand-written averaging (or summing) of per-tower gradient lists"
    triggers = ("zip", "grad", "all_sum", "minimize")
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

        Other shapes of the same combination are found too:

        - per variable, on the variable's device: `with tf.device(var.device):` around
          `tf.add_n(grads) * (1.0 / num_gpus)` (or a mean) of the towers' gradients;
        - a dict from each variable to the list of its towers' gradients (filled with
          `grads.setdefault(v, []).append(g)` in a loop over `(g, v)` pairs, `None` gradients
          skipped), then reduced per entry;
        - sparse gradients: the towers' `IndexedSlices` concatenated (`values`, `indices`) into
          one `tf.IndexedSlices`, divided by the tower count (averaged) or not (summed);
        - summing in place: `grads[0][j] += grads[i][j]` (averaging when the module then
          divides the same list);
        - averaging (or summing) the towers' *losses* collected in a tower loop and then
          differentiating once (`opt.compute_gradients(tf.reduce_mean(tower_losses))`,
          `opt.minimize`, `tf.gradients`): reported at the reduction;
        - NCCL all-reduce: `tf.contrib.nccl.all_sum(...)` / `nccl_ops.all_sum(...)`, summed,
          or averaged when its result is then divided: reported at the call.

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
        No automatic fix of its own: the helper goes away together with the tower loop
        (TFM101), whose fix scales the loss from what the helper does (divided by the replica
        count when it averaged, unchanged when it summed) and deletes the helper once nothing
        else calls it.
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
        # Migrated by `tfmigrate fix`: the towers are replicas, and the average kept for a clip
        # is applied by each replica as its share (nothing left to migrate).
        """\
        import tensorflow as tf
        def average_gradients(tower_grads):
            return [(tf.reduce_mean(tf.stack([g for g, _ in gv]), 0), gv[0][1]) for gv in zip(*tower_grads)]
        def train(strategy, opt, parts):
            tower_grads = []
            def tower_fn():
                i = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
                tower_grads.append(opt.compute_gradients(model(parts[i])))
            strategy.extended.call_for_each_replica(tower_fn)
            grads = [(tf.clip_by_value(g, -1.0, 1.0), v) for g, v in average_gradients(tower_grads)]
            def apply_share():
                return opt.apply_gradients([(g / strategy.num_replicas_in_sync, v) for g, v in grads])
            return strategy.extended.call_for_each_replica(apply_share)
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
        self.loops: list[list[cst.For]] = [[]]  # enclosing loops, per function
        self.statements: list[cst.SimpleStatementLine] = []
        self.grad_dicts: dict[str, set[str]] = {}  # dict -> names its filling loops read
        self.assigned: dict[int, set[str]] = {}  # id(value) -> names it is assigned to
        # Reductions of the towers' collected losses, and the losses differentiated later:
        # (order, function, call, api) and (order, function, names read, calls inside).
        self.loss_reductions: list[tuple[int, int, cst.Call, str]] = []
        self.differentiations: list[tuple[int, int, set[str], set[int]]] = []
        self.order = 0

    def report(self, node: cst.CSTNode, message: str, **kwargs) -> None:
        # A module already migrated (its towers are a replica function, no tower loop is left)
        # keeps an average only where the rewrite applies it per replica: nothing to report,
        # and `check` after `fix` is clean.
        migrated = self.context.memo("tfm102.migrated", lambda: (
            "call_for_each_replica" in self.context.text and not module_tower_loops(self.context)
            and not module_tower_forms(self.context)))
        if not migrated:
            super().report(node, message, **kwargs)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)
        self.loops.append([])

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()
        self.loops.pop()

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.statements.append(node)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.statements.pop()

    def visit_For(self, node: cst.For) -> None:
        self.loops[-1].append(node)
        zipped = self._transposed(node.iter)
        if zipped is not None:
            self._check(node, zipped, node.body)
            return
        grad_dict = self._grad_dict_items(node.iter)
        if grad_dict is not None:
            self._check(node, grad_dict, node.body, listed=f"`{self._code(node.iter)}`")

    def leave_For(self, original_node: cst.For) -> None:
        self.loops[-1].pop()

    def _code(self, node: cst.CSTNode) -> str:
        return self.context.module.code_for_node(node).strip()

    # --- other shapes of the same combination ----------------------------------------------
    def visit_Assign(self, node: cst.Assign) -> None:
        targets = set().union(*(names_used(t.target) for t in node.targets))
        self.assigned[id(node.value)] = targets
        # `total[j] = total[j] + grads[i][j]`
        if (
            len(node.targets) == 1
            and _double_subscript_base(node.targets[0].target) is not None
            and any(
                isinstance(op.operator, cst.Add)
                and _double_subscript_base(op.left) is not None
                and _double_subscript_base(op.right) is not None
                for op in find(node.value, cst.BinaryOperation)
            )
        ):
            self._in_place_sum(node, _double_subscript_base(node.targets[0].target))

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        # `grads[0][j] += grads[i][j]`
        if isinstance(node.operator, cst.AddAssign):
            target = _double_subscript_base(node.target)
            if target is not None and _double_subscript_base(node.value) is not None:
                self._in_place_sum(node, target)

    def _in_place_sum(self, node: cst.CSTNode, base: str) -> None:
        loops = self.loops[-1]
        if not loops:
            return
        scope = self.functions[-1] if self.functions else self.context.module
        divided = any(
            isinstance(aug.operator, (cst.DivideAssign, cst.MultiplyAssign)) and base in names_used(aug.target)
            for aug in find(scope, cst.AugAssign)
        ) or any(
            isinstance(op.operator, cst.Divide) and base in names_used(op.left)
            for op in find(scope, cst.BinaryOperation)
        )
        verb = "averages" if divided else "sums"
        code = self._code(node)
        self._report_at(loops[0], names_used(node), verb, f"`{code}`")

    def visit_With(self, node: cst.With) -> None:
        # `with tf.device(var.device): ... tf.add_n(grads) * (1.0 / num_gpus)`
        for item in node.items:
            device = device_scope_arg(item.item, self.imports)
            if isinstance(device, cst.Attribute) and device.attr.value == "device":
                if not any("grad" in name.lower() for name in names_used(node.body)):
                    return
                how = self._how(node.body, sums_only=True)
                if how is None:
                    return
                verb, api = how
                where = self.loops[-1][0] if self.loops[-1] else node
                self._report_at(where, names_used(node.body), verb, f"`{api}` under `tf.device({self._code(device)})`")
                return

    def _grad_dict_items(self, iterable: cst.BaseExpression) -> cst.BaseExpression | None:
        """D in `D.items()` / `D.values()` / `six.iteritems(D)` when D maps variables to
        their towers' gradient lists."""
        if not isinstance(iterable, cst.Call):
            return None
        func = iterable.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("items", "values", "iteritems", "itervalues"):
            holder = func.value
        elif (self.qualified(func) or "").startswith("six.iter") and iterable.args:
            holder = iterable.args[0].value
        else:
            return None
        return holder if isinstance(holder, cst.Name) and holder.value in self.grad_dicts else None

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        # `D.setdefault(v, []).append(g)` / `D[v].append(g)` in a loop over (g, v) pairs.
        if isinstance(func, cst.Attribute) and func.attr.value == "append" and self.loops[-1]:
            holder = func.value
            name = None
            if isinstance(holder, cst.Call) and isinstance(holder.func, cst.Attribute) and holder.func.attr.value == "setdefault":
                name = dotted_name(holder.func.value)
            elif isinstance(holder, cst.Subscript):
                name = dotted_name(holder.value)
            if name and any(_is_pair_target(loop.target) for loop in self.loops[-1]):
                read = set().union(*(names_used(loop.iter) for loop in self.loops[-1]))
                words = read | names_used(node) | {name}
                if any("grad" in word.lower() or "tower" in word.lower() for word in words):
                    self.grad_dicts.setdefault(name, set()).update(read)
        qualified = self.call_name(node)
        if qualified in _NCCL_SUMS:
            self._nccl(node, qualified)
        elif qualified in _MEAN | _SUM and enclosing_tower(self.context, node) is None:
            collected = tower_collections(self.context)
            if names_used(node) & collected:
                api = qualified.replace("tensorflow.", "tf.").replace("numpy.", "np.")
                self.order += 1
                self.loss_reductions.append((self.order, self._function_id(), node, api))
        if (isinstance(func, cst.Attribute) and func.attr.value in _GRADIENT_METHODS) or qualified in _GRADIENT_FUNCTIONS:
            if node.args and enclosing_tower(self.context, node) is None:
                first = node.args[0].value
                self.order += 1
                self.differentiations.append(
                    (self.order, self._function_id(), names_used(first), {id(c) for c in find(first, cst.Call)})
                )

    def _nccl(self, node: cst.Call, qualified: str) -> None:
        scope = self.functions[-1] if self.functions else self.context.module
        statement = self.statements[-1] if self.statements else node
        results = set().union(*(self.assigned.get(id(v), set()) for v in [node]))
        for assign in find(statement, cst.Assign):
            if any(c is node for c in find(assign.value, cst.Call)):
                results |= set().union(*(names_used(t.target) for t in assign.targets))
        if results:
            results = derived_names(scope, results)
        # Divided in the same statement, or in a statement that reads the result
        # (`return [s / num_gpus for s in summed]`).
        divided = _divides(statement) or any(
            _divides(line) and names_used(line) & results
            for line in find(scope, cst.SimpleStatementLine)
        )
        verb = "averages" if divided else "sums"
        api = qualified.rsplit(".", 2)[-2] + ".all_sum"
        self._report_at(node, set(), verb, f"NCCL `{api}`", helper=False)

    def leave_Module(self, original_node: cst.Module) -> None:
        for order, function, call, api in self.loss_reductions:
            targets = self._targets_of(call)
            if any(
                id(call) in calls or (later > order and where == function and targets & names)
                for later, where, names, calls in self.differentiations
            ):
                verb = "averages" if (api in ("tf.reduce_mean", "tf.math.reduce_mean", "np.mean") or self._divided(call)) else "sums"
                listed = self._code(call)
                if len(listed) > 50:
                    listed = listed[:47] + "..."
                self.report(
                    call,
                    f"this code {verb} the towers' losses (`{listed}`) and differentiates the result "
                    "once, which " + ("averages" if verb == "averages" else "sums")
                    + " the per-tower gradients: " + _ADVICE[verb],
                )

    def _function_id(self) -> int:
        return id(self.functions[-1]) if self.functions else 0

    def _targets_of(self, call: cst.Call) -> set[str]:
        statement = self._statement_of(call)
        found: set[str] = set()
        if statement is None:
            return found
        for assign in find(statement, cst.Assign):
            if any(c is call for c in find(assign.value, cst.Call)):
                found |= set().union(*(names_used(t.target) for t in assign.targets))
        return found

    def _statement_of(self, call: cst.Call) -> cst.CSTNode | None:
        if not hasattr(self, "_statement_index"):
            index: dict[int, cst.CSTNode] = {}
            for statement in find(self.context.module, cst.SimpleStatementLine):
                for inner in find(statement, cst.Call):
                    index[id(inner)] = statement
            self._statement_index = index
        return self._statement_index.get(id(call))

    def _divided(self, call: cst.Call) -> bool:
        statement = self._statement_of(call)
        return statement is not None and _divides(statement)

    def _report_at(self, where: cst.CSTNode, data: set[str], verb: str, what: str, helper: bool = True) -> None:
        function = self._helper_of(data) if helper else None
        target = function if function is not None else where
        if id(target) in self.reported:
            return
        self.reported.add(id(target))
        subject = f"`{function.name.value}`" if function is not None else "this code"
        self.report(target, f"{subject} {verb} the per-tower gradients ({what}): " + _ADVICE[verb])

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
            grad_dict = self._grad_dict_items(comp.iter)
            if grad_dict is not None:
                self._check(node, grad_dict, node, listed=f"`{self._code(comp.iter)}`")
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

    def _how(self, body: cst.CSTNode, sums_only: bool = False) -> tuple[str, str] | None:
        """('averages' | 'sums' | 'combines', the API that shows it), or None."""
        mean = total = gather = sparse = None
        divides = any(isinstance(b.operator, cst.Divide) for b in find(body, cst.BinaryOperation))
        for call in find(body, cst.Call):
            name = self.call_name(call)
            if name in _INDEXED_SLICES and sparse is None:
                sparse = name
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
        if sparse:
            return ("averages" if divides else "sums"), "tf.IndexedSlices"
        if gather and not sums_only:
            return "combines", short(gather)
        return None

    def _check(self, node: cst.CSTNode, zipped: cst.BaseExpression, body: cst.CSTNode, listed: str | None = None) -> None:
        how = self._how(body)
        if how is None:
            return
        verb, api = how
        if listed is not None:
            data = names_used(zipped) | self.grad_dicts.get(getattr(zipped, "value", ""), set())
            self._report_at(node, data, verb, f"{listed} with `{api}`")
            return
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
        return self._helper_of(names_used(zipped))

    def _helper_of(self, data: set[str]) -> cst.FunctionDef | None:
        """The enclosing function, when ``data`` (names the combination reads) comes from its
        parameters."""
        if not self.functions:
            return None
        function = self.functions[-1]
        if id(function) not in self.helper_names:
            self.helper_names[id(function)] = _parameter_data(function)
        return function if data & self.helper_names[id(function)] else None


def _parameter_data(function: cst.FunctionDef) -> set[str]:
    """The parameters, plus names computed from nothing but them (`present = [gv for gv in
    tower_grads if gv]`): what a helper receives, as opposed to what a bigger function
    builds (`tower_grads = [opt.compute_gradients(...) for i in range(num_gpus)]`)."""
    data = {p.name.value for p in _all_params(function.params)}
    assignments = [
        (target.target, assign.value)
        for assign in find(function.body, cst.Assign)
        for target in assign.targets
    ]
    changed = True
    while changed:
        changed = False
        for target, value in assignments:
            free = free_names(value) - _BUILTINS
            if free and free <= data and not names_used(target) <= data:
                data |= names_used(target)
                changed = True
    return data


def _double_subscript_base(node: cst.CSTNode) -> str | None:
    """X in `X[a][b]` (an element of a per-tower list of per-variable gradients)."""
    if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Subscript):
        return dotted_name(node.value.value)
    return None


def _is_pair_target(target: cst.BaseExpression) -> bool:
    """`for g, v in ...` / `for (g, v) in ...`: a loop over (gradient, variable) pairs."""
    return isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 2


def _divides(node: cst.CSTNode) -> bool:
    """Whether ``node`` divides (`x / n`, `x * (1.0 / n)`, `x /= n`)."""
    if isinstance(node, cst.AugAssign):
        return isinstance(node.operator, cst.DivideAssign)
    return any(isinstance(op.operator, cst.Divide) for op in find(node, cst.BinaryOperation)) or any(
        isinstance(aug.operator, cst.DivideAssign) for aug in find(node, cst.AugAssign)
    )


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
