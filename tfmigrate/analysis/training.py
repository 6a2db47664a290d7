"""What trains, what updates a variable, what a tower's code hands on: the questions the tower
rewrite asks of the code around a loop, answered without changing it.

`training_call` finds the first call under a node that trains (an optimizer step, gradients,
the names projects give their own training helpers), following the module's own functions
it calls, and, in a function called with a list, skipping a branch taken only for a non-list
(OpenAI's `adam_updates(params, grads)`: `if type(cost_or_grads) is not list: tf.gradients(...)`).
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import method_call
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import find, name_reads, own_nodes


#: What makes a TF1 variable.
VARIABLE_MAKERS = {"tensorflow.Variable", "tensorflow.get_variable"}

#: What makes the global step: a variable too, which the update counts.
GLOBAL_STEP_MAKERS = {"tensorflow.train.get_or_create_global_step", "tensorflow.train.create_global_step"}


def variable_update(rule, call: cst.Call) -> tuple[str, cst.BaseExpression | None, cst.BaseExpression | None] | None:
    """(The update, the variable, the value) of `tf.assign_add(v, n)` or `v.assign_add(n)` (any
    of :data:`VARIABLE_UPDATES`), else None."""
    resolved = rule.imports.resolve(call.func) or ""
    if resolved.startswith("tensorflow"):
        name = resolved.rsplit(".", 1)[-1]
        target, value = (call.args[0].value if call.args else None), (call.args[1].value if len(call.args) > 1 else None)
    elif isinstance(call.func, cst.Attribute):
        name = call.func.attr.value
        target, value = call.func.value, (call.args[0].value if call.args else None)
    else:
        return None
    return (name, target, value) if name in VARIABLE_UPDATES else None


VARIABLE_UPDATES = ("assign", "assign_add", "assign_sub", "scatter_update", "scatter_add", "scatter_sub",
                    "scatter_nd_update", "scatter_nd_add", "count_up_to")


# What computes gradients: after the loop, outside the replicas, it would see one replica's weights.
_GRADIENT_COMPUTATIONS = {"tensorflow.gradients", "tensorflow.GradientTape", "tensorflow.contrib.layers.optimize_loss"}


def optimizer_step(call: cst.CSTNode) -> bool:
    return method_call(call, "apply_gradients") or method_call(call, "minimize")


# Libraries whose functions are known not to train a model behind the rewrite's back.
KNOWN_LIBRARIES = ("tensorflow", "numpy", "keras", "tf_keras", "math", "os", "sys", "logging", "time", "json")


def tensors_read(value: cst.BaseExpression) -> set[str]:
    """The names whose values ``value`` hands on: none when it is text made from them (a tower
    result logged, `log('decoder out: {}'.format(out))`, Tacotron-2), or when it reads only what
    they are made of (`out.shape`, `out.dtype`): text and shapes carry no tensor to train on."""
    strings = (cst.SimpleString, cst.ConcatenatedString)
    if isinstance(value, cst.FormattedString) or (
            isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)
            and isinstance(value.func.value, strings) and value.func.attr.value == "format") or (
            isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Modulo)
            and isinstance(value.left, strings)):
        return set()
    return {name.value for name in name_reads(value, skipped_attributes=METADATA)}


# What a tensor is made of, not its value: reading it hands on no tensor.
METADATA = ("shape", "get_shape", "dtype", "name")


def training_call(rule, node: cst.CSTNode, test=None, seen: frozenset = frozenset(),
                   lists: frozenset = frozenset(), off: frozenset = frozenset(),
                   made_elsewhere: bool = False) -> cst.Call | None:
    """The first call under ``node`` that trains (or passes another ``test``), looking into the
    module's functions it calls (`single_core_graph(...)` returning `tf.gradients` of its loss).
    In a function called with a list for a parameter (``lists``: OpenAI's `adam_updates(params,
    grads[0])`), a branch taken only for a non-list (`if type(cost_or_grads) is not list:
    grads = tf.gradients(...)`) does not run; nor, for a parameter passed `False` or `None`
    (``off``: `is_training=False`), the branch `if is_training:`. A function a module function
    makes and returns (transformer-xl's `model_fn = get_model_fn(...)`) runs where it is called,
    with what that call passes, not where it is made (``made_elsewhere``: when the caller calls
    it only so, where :func:`_made_function` follows it)."""
    test = test or trains
    functions = module_functions(rule)
    factories = _factories(rule)
    made = factories.get(node.name.value, []) if made_elsewhere and isinstance(node, cst.FunctionDef) else []
    for call in _live_calls(node, lists, off, frozenset(id(f) for f in made)):
        if test(rule, call):
            return call
        for name in called_functions(rule, call):
            if name in seen:
                continue
            known = _list_parameters(rule, functions[name], call)
            turned_off = _parameters_off(functions[name], call, off)
            followed = name in factories and _result_only_called(node, call)
            if rule.context.memo(("training.function_trains", name, test, known, turned_off, followed),
                                 lambda: training_call(rule, functions[name], test, seen | {name}, known,
                                                       turned_off, followed) is not None):
                return call
        made_here = _made_function(rule, node, call) if factories else None
        if made_here is not None and id(made_here) not in seen:
            turned_off = _parameters_off(made_here, call, off)
            if training_call(rule, made_here, test, seen | {id(made_here)}, frozenset(), turned_off) is not None:
                return call
    return None


def _factories(rule) -> dict[str, list[cst.FunctionDef]]:
    """The module's functions that return a function they define, by name, with those (most
    modules have none: the calls of a walked function are then not looked into for one)."""

    def compute() -> dict[str, list[cst.FunctionDef]]:
        made = {name: _returned_functions(f) for name, f in module_functions(rule).items()}
        return {name: functions for name, functions in made.items() if functions}

    return rule.context.memo("training.factories", compute)


def _returned_functions(node: cst.CSTNode) -> list[cst.FunctionDef]:
    """The functions ``node`` (a function) defines in its body and returns by name, without
    calling them there: they run where the caller calls what it got."""
    if not isinstance(node, cst.FunctionDef) or not isinstance(node.body, cst.IndentedBlock):
        return []
    defined = {s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)}
    if not defined:  # most functions: nothing to walk for
        return []
    returned = {r.value.value for r in find(node, cst.Return) if isinstance(r.value, cst.Name)}
    called = {c.func.value for c in find(node, cst.Call) if isinstance(c.func, cst.Name)}
    return [f for name, f in defined.items() if name in returned and name not in called]


def _result_only_called(scope: cst.CSTNode, call: cst.Call) -> bool:
    """Whether ``scope`` (a function) binds the result of ``call`` to a name once and only calls
    that name (`model_fn = get_model_fn(...)`, then `model_fn(...)`): what the result runs is
    then followed at those calls."""
    if not isinstance(scope, cst.FunctionDef):
        return False
    binding = [a for a in find(scope, cst.Assign) if a.value is call and len(a.targets) == 1
               and isinstance(a.targets[0].target, cst.Name)]
    if len(binding) != 1:
        return False
    name = binding[0].targets[0].target
    uses = [n for n in find(scope, cst.Name) if n.value == name.value and n is not name]
    callees = {id(c.func) for c in find(scope, cst.Call)}
    return bool(uses) and all(id(n) in callees for n in uses)


def _made_function(rule, scope: cst.CSTNode, call: cst.Call) -> cst.FunctionDef | None:
    """What ``call`` runs when it calls a name ``scope`` binds once to the call of a module
    function that returns a function it defines (`model_fn = get_model_fn(...)`, then
    `model_fn(inp, is_training=is_training)`)."""
    if not isinstance(call.func, cst.Name) or not isinstance(scope, cst.FunctionDef):
        return None
    bound = [a.value for a in find(scope, cst.Assign)
             if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name) and a.targets[0].target.value == call.func.value]
    if len(bound) != 1 or not isinstance(bound[0], cst.Call) or not isinstance(bound[0].func, cst.Name):
        return None
    made = _factories(rule).get(bound[0].func.value, [])
    return made[0] if len(made) == 1 else None


def _parameters_off(function: cst.FunctionDef, call: cst.Call, off: frozenset) -> frozenset:
    """The parameters of ``function`` that ``call`` passes `False` or `None` (or a name of the
    caller's own that is)."""
    params = [p.name.value for p in function.params.params]
    found = set()
    for position, arg in enumerate(call.args):
        if arg.star:
            break
        name = arg.keyword.value if arg.keyword is not None else (params[position] if position < len(params) else None)
        value = arg.value
        if name in params and isinstance(value, cst.Name) and (value.value in ("False", "None") or value.value in off):
            found.add(name)
    return frozenset(found)


def called_functions(rule, call: cst.Call) -> list[str]:
    """The module's functions ``call`` may call: the one it names, or every function of a
    module-level table it looks one up in (finetune-transformer-lm's `opt_fns[opt](params,
    grads, ...)` over `opt_fns = {'adam': adam}`)."""
    functions = module_functions(rule)
    func = call.func
    if isinstance(func, cst.Name):
        return [func.value] if func.value in functions else []
    if isinstance(func, cst.Subscript) and isinstance(func.value, cst.Name):
        values = rule.context.memo("training.bindings", lambda: _bindings_and_appends(rule.context.module))[0].get(
            func.value.value, [])
        if len(values) == 1 and isinstance(values[0], cst.Dict):
            names = [e.value.value for e in values[0].elements if isinstance(e, cst.DictElement)
                     and isinstance(e.value, cst.Name)]
            return [name for name in names if name in functions]
    return []


def _live_calls(node: cst.CSTNode, lists: frozenset, off: frozenset = frozenset(),
                skipped: frozenset = frozenset()) -> list[cst.Call]:
    """The calls under ``node``, but those of an `if` branch that cannot run when the names in
    ``lists`` hold lists and those in ``off`` are false, and those in the nodes whose ids are
    ``skipped``."""
    if not lists and not off and not skipped:
        return find(node, cst.Call)
    dead = set(skipped)
    for branch in find(node, cst.If):
        holds = _list_test(branch.test, lists)
        if holds is None:
            holds = _off_test(branch.test, off)
        if holds is False:
            dead.add(id(branch.body))
        elif holds is True and branch.orelse is not None:
            dead.add(id(branch.orelse))
    return [n for n in own_nodes(node, frozenset(dead), into_scopes=True) if type(n) is cst.Call]


def _off_test(test: cst.BaseExpression, off: frozenset) -> bool | None:
    """Whether `if flag:` (or `if not flag:`) holds for a ``flag`` in ``off``; None otherwise."""
    if isinstance(test, cst.Name) and test.value in off:
        return False
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _off_test(test.expression, off)
        return None if inner is None else not inner
    return None


def _list_test(test: cst.BaseExpression, lists: frozenset) -> bool | None:
    """Whether `type(x) is list`, `isinstance(x, list)` (or their negations) holds for ``x`` in
    ``lists``; None for any other test."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _list_test(test.expression, lists)
        return None if inner is None else not inner
    if (isinstance(test, cst.Call) and code(test.func) == "isinstance" and len(test.args) == 2
            and code(test.args[0].value) in lists and code(test.args[1].value) == "list"):
        return True
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        left, (target,) = test.left, test.comparisons
        if (isinstance(left, cst.Call) and code(left.func) == "type" and len(left.args) == 1
                and code(left.args[0].value) in lists and code(target.comparator) == "list"):
            if isinstance(target.operator, (cst.Is, cst.Equal)):
                return True
            if isinstance(target.operator, (cst.IsNot, cst.NotEqual)):
                return False
    return None


def _list_parameters(rule, function: cst.FunctionDef, call: cst.Call) -> frozenset:
    """The parameters of ``function`` that it tests for being a list and that ``call`` passes
    a list (:func:`_known_list`)."""
    params = [p.name.value for p in function.params.params]
    tested = rule.context.memo(("training.list_tests", id(function)), lambda: frozenset(
        name for name in params
        if any(_list_test(branch.test, frozenset({name})) is not None for branch in find(function, cst.If))))
    found = set()
    for position, arg in enumerate(call.args):
        if arg.star or not tested:
            break
        name = arg.keyword.value if arg.keyword is not None else (params[position] if position < len(params) else None)
        if name in tested and _known_list(rule, arg.value):
            found.add(name)
    return frozenset(found)


def _known_list(rule, value: cst.BaseExpression, depth: int = 0) -> bool:
    """A list for sure: a list display, `tf.gradients(...)`, a name the module binds once to
    one, or an item of a list the module fills only with them (`grads[0]` of `grads.append(
    tf.gradients(...))`)."""
    if isinstance(value, (cst.List, cst.ListComp)):
        return True
    if isinstance(value, cst.Call):
        return rule.imports.resolve(value.func) == "tensorflow.gradients"
    if depth > 2:
        return False
    bindings, appended = rule.context.memo("training.bindings", lambda: _bindings_and_appends(rule.context.module))
    if isinstance(value, cst.Name):
        values = bindings.get(value.value, [])
        return len(values) == 1 and _known_list(rule, values[0], depth + 1)
    if isinstance(value, cst.Subscript) and isinstance(value.value, cst.Name):
        values = appended.get(value.value.value, [])
        return bool(values) and all(_known_list(rule, a, depth + 1) for a in values)
    return False


def _bindings_and_appends(module: cst.Module) -> tuple[dict, dict]:
    """What the module assigns to each plain name, and appends to each list named plainly."""
    bindings: dict[str, list[cst.BaseExpression]] = {}
    for assign in find(module, cst.Assign):
        for target in assign.targets:
            if isinstance(target.target, cst.Name):
                bindings.setdefault(target.target.value, []).append(assign.value)
    appended: dict[str, list[cst.BaseExpression]] = {}
    for call in find(module, cst.Call):
        if method_call(call, "append") and len(call.args) == 1 and isinstance(call.func.value, cst.Name):
            appended.setdefault(call.func.value.value, []).append(call.args[0].value)
    return bindings, appended


def module_functions(rule) -> dict[str, cst.FunctionDef]:
    """The module's top-level functions by name, found once per module."""
    return rule.context.memo("training.functions", lambda: {
        s.name.value: s for s in rule.context.module.body if isinstance(s, cst.FunctionDef)})


def gradient_computation(rule, call: cst.Call) -> bool:
    return method_call(call, "compute_gradients") or rule.imports.resolve(call.func) in _GRADIENT_COMPUTATIONS


# What trains: optimizer steps, gradients, and the names projects give their own training helpers
# (`optimize_loss`, an `Optimizer` class, `register_gradients` / `apply_updates`).
_TRAINING_METHODS = ("minimize", "apply_gradients", "compute_gradients", "register_gradients", "apply_updates",
                     # Keras trains through the model: a functional model over the towers' outputs.
                     "compile", "fit", "fit_generator", "train_on_batch")


def trains(rule, call: cst.Call) -> bool:
    name = code(call.func).rsplit(".", 1)[-1]
    return (any(method_call(call, m) for m in _TRAINING_METHODS) or name == "optimize_loss" or name.endswith("Optimizer")
            or rule.imports.resolve(call.func) in {"tensorflow.gradients", "tensorflow.GradientTape"})


#: Where the Estimator API lives (TF1's `tf.estimator`, `tf.contrib.learn`, TPUEstimator, the
#: `tensorflow_estimator` package).
ESTIMATOR_MODULES = ("tensorflow.estimator", "tensorflow.contrib.learn", "tensorflow.contrib.tpu",
                     "tensorflow.python.estimator", "tensorflow_estimator")


def uses_estimators(rule) -> bool:
    """Whether the module reads the Estimator API anywhere: a function with a `model_fn`'s
    signature (`features`, `labels`, `mode`) is an Estimator's only then; a Session program's
    own `model_fn(features, labels, mode, params)` is a plain function (found once per module)."""

    def compute() -> bool:
        return any((rule.imports.resolve(node) or "").startswith(ESTIMATOR_MODULES)
                   for node in find(rule.context.module, cst.Attribute, cst.Name))

    return rule.context.memo("training.uses_estimators", compute)

