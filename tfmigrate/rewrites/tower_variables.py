"""Towers that each make their own copy of the model's variables: not replicas of one model.

MirroredStrategy keeps one variable for every replica (a mirrored copy per device, always
equal), and a replica after the first may only take the variables replica 0 made under the
same names. A tower loop whose towers made separate variables (each trained on its own
gradients, or on gradients summed across the copies) cannot keep that meaning: refused, with
the line. Two spellings are recognised:

- a variable scope named by the tower and not reused (`tf.variable_scope('replicated_%s' %
  device_id)`: TF_Face_Toolbox's in-graph replication with NCCL all-reduce);
- a model function whose `reuse` parameter is left at its default in every tower
  (`model_fn(inputs, reuse=False)` opening `tf.variable_scope('model', reuse=reuse)`), with
  nothing else in or around the loop reusing: TF1 layers number their names apart
  (`model/conv2d`, `model/conv2d_4`), so each tower trained its own weights;
- a TF1 layer function called by every tower, in the loop or a function of the module it
  calls, with nothing asking for reuse (`tf.layers.dense(x, 8)` makes `dense`, then `dense_1`).

For the rest of the rewrite it also finds the variables a replica sees differently from a
tower: the module's `tf.Variable` calls that leave `trainable` to its default
(:func:`variable_calls`), and the reads of a variable's op name (:func:`variable_op_names`).
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.project_imports import project_function
from tfmigrate.analysis.training import VARIABLE_MAKERS, module_functions
from tfmigrate.cst.callargs import argument
from tfmigrate.cst.codegen import code
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import find, find_own, module_parents, name_reads, names_used, scope_bindings
from tfmigrate.rewrites.refusal import Refused
from tfmigrate.rewrites.tower_code import (
    class_methods, functions_called, line_of, module_calls, replica_code, self_method,
)

__all__ = ["check_variable_copies", "tensors_made_outside"]

_VARIABLE_SCOPE = "tensorflow.variable_scope"
_VARIABLE_SCOPE_PARAMETERS = ("name_or_scope", "default_name", "values", "initializer", "regularizer",
                              "caching_device", "partitioner", "custom_getter", "reuse")


def check_variable_copies(rule, loop: cst.For) -> None:
    """Refused when the towers of ``loop`` each make their own copy of the variables."""
    _check_scopes_named_by_tower(rule, loop)
    _check_variables_named_by_tower(rule, loop)
    _check_reuse_left_at_default(rule, loop)
    _check_layers_made_per_tower(rule, loop)


def _check_layers_made_per_tower(rule, loop: cst.For) -> None:
    """A TF1 layer function (`tf.layers.dense(x, 8)`) called by every tower, in the loop or in
    a function of the module it calls, with nothing asking for reuse: each call made a layer
    of its own (`dense`, `dense_1`), so each tower trained its own weights."""
    if _reuses_somehow(rule, loop):
        return
    for call in find(loop.body, cst.Call):
        layer = call if _makes_layer(rule, call) else None
        function = _function(rule, call) if layer is None else None
        if function is not None and not _asks_for_reuse(function):
            layer = next((c for c in find(function.body, cst.Call) if _makes_layer(rule, c)), None)
        if layer is not None:
            raise Refused(f"line {line_of(rule, call)}: every tower makes its own `{code(layer.func)}` layer (nothing "
                          "asks for reuse: TF1 layers number their names apart), so each tower trained its own "
                          "weights, which MirroredStrategy cannot keep; if the towers were meant to share them, "
                          "open `tf.variable_scope(..., reuse=(i > 0))` around the tower and fix again")


def _makes_layer(rule, call: cst.Call) -> bool:
    """A call of one of TF1's functional layers that make weights (`tf.layers.dense`,
    `tf.compat.v1.layers.conv2d`), without `reuse=`."""
    module, _, function = (rule.imports.resolve(call.func) or "").rpartition(".")
    return module in _LAYER_MODULES and function in _WEIGHTED_LAYERS and argument(call, (), "reuse") is None


_LAYER_MODULES = {"tensorflow.layers", "tensorflow.compat.v1.layers"}
_WEIGHTED_LAYERS = {"dense", "conv1d", "conv2d", "conv3d", "conv2d_transpose", "conv3d_transpose", "separable_conv1d",
                    "separable_conv2d", "batch_normalization"}


def _asks_for_reuse(node: cst.CSTNode) -> bool:
    """Whether code in ``node`` asks for reuse some way: `reuse_variables()`, a `reuse=`
    argument other than a literal False/None."""
    for call in find(node, cst.Call):
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "reuse_variables":
            return True
        if any(arg.keyword is not None and arg.keyword.value == "reuse" and code(arg.value) not in ("False", "None")
               for arg in call.args):
            return True
    return False


def _check_scopes_named_by_tower(rule, loop: cst.For) -> None:
    indices = names_used(loop.target)
    for call in _variable_scopes(rule, loop.body):
        name = argument(call, _VARIABLE_SCOPE_PARAMETERS, "name_or_scope")
        if name is not None and names_used(name) & indices and argument(call, _VARIABLE_SCOPE_PARAMETERS, "reuse") is None:
            raise Refused(f"line {line_of(rule, call)}: each tower makes its own copy of the variables, in a variable "
                          f"scope named by the tower (`{code(call)}`): MirroredStrategy keeps one copy for every "
                          "replica, so the towers' separate copies cannot be kept")


def _check_variables_named_by_tower(rule, loop: cst.For) -> None:
    """A variable each tower makes under a name of its own (big-LSTM language models keep each
    tower's LSTM state in `tf.Variable(..., name="state_%d_%d" % (gpu, layer))`): replicas after
    the first may only take replica 0's variables, under its names ("Tried to create variable
    state_1_0 with mismatching name on device 1")."""
    index = names_used(loop.target)
    for node in [loop.body, *functions_called(rule, [loop.body], class_methods(rule, loop))]:
        per_tower = index if node is loop.body else _parameters_given(rule, loop, node, index)
        for call in find(node, cst.Call):
            if rule.imports.resolve(call.func) not in VARIABLE_MAKERS or _made_by_one_tower(rule, call, node, per_tower):
                continue
            name = argument(call, _MAKER_PARAMETERS.get(rule.imports.resolve(call.func), ()), "name")
            if name is not None and names_used(name) & per_tower:
                raise Refused(f"line {line_of(rule, call)}: each tower makes its own variable, named by the tower "
                              f"(`{code(name)}`): under MirroredStrategy a replica after the first can only take "
                              "replica 0's variables, under the same names, so the towers' own variables cannot "
                              "be kept")


def _made_by_one_tower(rule, call: cst.Call, within: cst.CSTNode, index: set[str]) -> bool:
    """Whether ``call`` runs under a condition on the tower index (`tf.Variable(..., name='b_%d' %
    i) if i == 0 else b`): one tower makes it, under the one name."""
    parents, node = module_parents(rule.context), call
    while node is not within and id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, (cst.If, cst.IfExp)) and names_used(node.test) & index:
            return True
    return False


_MAKER_PARAMETERS = {"tensorflow.get_variable": ("name",), "tensorflow.Variable": ("initial_value", "trainable")}


def _parameters_given(rule, loop: cst.For, function: cst.FunctionDef, index: set[str]) -> set[str]:
    """The parameters of ``function`` that a call of it in the loop passes the tower index to."""
    params = [p.name.value for p in function.params.params]
    given = set()
    for call in find(loop.body, cst.Call):
        if self_method(call) == function.name.value:
            names = params[1:]
        elif isinstance(call.func, cst.Name) and call.func.value == function.name.value:
            names = params
        else:
            continue
        passed = {name: argument(call, names, name) for name in names}
        given |= {name for name, value in passed.items() if value is not None and names_used(value) & index}
    return given


def tensors_made_outside(rule, tower, region) -> list[cst.BaseStatement]:
    """The statements before the loop that compute a tensor from trainable variables which the
    towers read (Kyubyong's transformer: `self.embeddings = get_token_embeddings(...)`, a
    `tf.concat` of a zero row and the embedding variable, read in `encode`/`decode`): each tower's
    gradient reached the one variable through it, but a replica reads a tensor made outside the
    replicas from replica 0's copy, so the other replicas gave no gradient to theirs ("len(v) ==
    27, len(v0) == 28"). Each replica must compute it from its own copy: the rewrite moves them
    to the start of the replica function. Refused where that cannot keep the meaning: code after
    them or outside the towers also reads what they bind, or their variables would be made again
    by a replica after the first (no `tf.AUTO_REUSE` around them)."""
    replicas = replica_code(rule, [tower])
    read = _read_by(replicas)
    variables: set[str] = set()
    moved = []
    for position, statement in enumerate(region.preceding):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            continue
        for assign in find_own(statement, cst.Assign):
            targets = {dotted_name(t.target) for t in assign.targets} - {None}
            if _makes_trainable(rule, assign.value):
                variables |= targets
            elif targets & read and _computed_from_variables(rule, assign.value, variables):
                _check_movable(rule, tower, region, position, sorted(targets & read)[0], assign)
                moved.append(statement)
                break
    return moved


def _read_by(nodes: list) -> set[str]:
    """Attributes (`self.embeddings`) wherever ``nodes`` read them; a plain name where the code
    does not bind it itself."""
    read = set()
    for node in nodes:
        read |= {name for name in _dotted_reads(node) if "." in name}
        read |= {name.value for name in name_reads(node, targets=False)} - scope_bindings(node)
    return read


def _check_movable(rule, tower, region, position: int, name: str, assign: cst.Assign) -> None:
    """Refused unless the statement at ``position`` of ``region.preceding`` (binding ``name``
    from the variables) can run in each replica instead, first."""
    statement = region.preceding[position]
    why = (f"line {line_of(rule, assign)}: `{name}` is computed from the model's variables before the towers, which "
           "read it: a replica would read replica 0's and give no gradient to its own copy of those variables")
    block = region.parents.get(id(statement))
    alone = isinstance(block, cst.IndentedBlock) and len(block.body) == 1  # its block would be left empty
    if alone or not isinstance(statement, (cst.SimpleStatementLine, cst.With)) or len(find_own(statement, cst.Assign)) != 1:
        raise Refused(why + "; compute it in the towers (in the code they run)")
    binds = {dotted_name(t.target) for t in assign.targets} - {None}
    replicas = {id(node) for code_run in replica_code(rule, [tower]) for node in find(code_run, cst.Attribute)}
    later = [*region.preceding[position + 1:], *region.following]
    if _read_by(later) & binds or _read_elsewhere(rule, binds, statement, replicas):
        raise Refused(why + ", and code outside the towers reads it too; compute it in the towers")
    if not _reused_automatically(rule, [statement, *_functions_called_by(rule, statement)], region):
        raise Refused(why + "; open it under `tf.variable_scope(..., reuse=tf.AUTO_REUSE)` and fix again, or "
                      "compute it in the towers")


def _read_elsewhere(rule, names: set[str], statement: cst.CSTNode, replicas: set[int]) -> bool:
    """Whether the module reads one of ``names`` (attributes) outside ``statement`` and the code the
    replicas run (a class's inference method reading `self.embeddings`)."""
    own = {id(node) for node in find(statement, cst.Attribute)}
    own |= {id(target.target) for target in find(rule.context.module, cst.AssignTarget)}  # stores (`= None` first)
    for attribute in find(rule.context.module, cst.Attribute):
        if id(attribute) not in own and id(attribute) not in replicas and dotted_name(attribute) in names:
            return True
    return False


def _functions_called_by(rule, statement: cst.CSTNode) -> list[cst.FunctionDef]:
    return [f for call in find(statement, cst.Call) if (f := _function(rule, call)) is not None]


def _reused_automatically(rule, nodes: list, region) -> bool:
    """Whether `tf.AUTO_REUSE` is asked for in ``nodes`` or in a `with` around the loop: the
    variables a moved statement gets are then replica 0's again in the replicas after it."""
    around = _withs_around(region.loop, region.parents)
    return any(rule.imports.resolve(attribute) == "tensorflow.AUTO_REUSE"
               for node in [*nodes, *around] for attribute in find(node, cst.Attribute))


def _withs_around(loop: cst.For, parents: dict) -> list[cst.WithItem]:
    """The items of the `with` statements around ``loop``, innermost first."""
    items, node = [], loop
    while id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, cst.With):
            items += list(node.items)
    return items


def _dotted_reads(node: cst.CSTNode) -> set[str]:
    """The names and `a.b` attribute chains ``node`` reads."""
    parts = [*find(node, cst.Name), *find(node, cst.Attribute)]
    return {name for part in parts if (name := dotted_name(part)) is not None}


def _makes_trainable(rule, value: cst.BaseExpression) -> bool:
    """Whether ``value`` is a call that makes a trainable variable (not `trainable=False`)."""
    if not isinstance(value, cst.Call) or rule.imports.resolve(value.func) not in VARIABLE_MAKERS:
        return False
    trainable = argument(value, (), "trainable")
    return trainable is None or code(trainable) != "False"


def _computed_from_variables(rule, value: cst.BaseExpression, variables: set[str], seen: frozenset = frozenset()) -> bool:
    """Whether ``value`` computes something from a trainable variable: reads one of ``variables``,
    makes one inside a larger expression, or calls a function of the module that returns
    something computed from a variable it makes (``seen``: the functions already asked, against
    recursion). The variables themselves, or a list of them (`params = [W1, b1]`), are no
    computation: a replica reads its own copies through them."""
    if isinstance(value, (cst.List, cst.Tuple, cst.Set)):
        return any(_computed_from_variables(rule, element.value, variables, seen) for element in value.elements)
    if dotted_name(value) in variables or _makes_trainable(rule, value):
        return False
    if _dotted_reads(value) & variables or any(_makes_trainable(rule, call) for call in find(value, cst.Call)):
        return True
    functions = [f for call in find(value, cst.Call) if (f := _function(rule, call)) is not None and id(f) not in seen]
    return any(_returns_computed(rule, function, seen | {id(function)}) for function in functions)


def _returns_computed(rule, function: cst.FunctionDef, seen: frozenset) -> bool:
    """Whether ``function`` makes a trainable variable and returns something computed from it:
    an expression over it, or its name bound to something else too (`table = tf.concat(...)`)."""
    assigns = find(function.body, cst.Assign)
    made = {dotted_name(t.target) for a in assigns if _makes_trainable(rule, a.value) for t in a.targets}
    rebound = {dotted_name(t.target) for a in assigns if not _makes_trainable(rule, a.value) for t in a.targets}
    for returned in find(function.body, cst.Return):
        if returned.value is None:
            continue
        name = dotted_name(returned.value)
        if name in made and name in rebound or _computed_from_variables(rule, returned.value, made, seen):
            return True
    return False


def _check_reuse_left_at_default(rule, loop: cst.For) -> None:
    if _reuses_somehow(rule, loop):
        return
    for call in find(loop.body, cst.Call):
        function = _function(rule, call)
        if function is None:
            continue
        params = [p.name.value for p in function.params.params]
        reuse = next((p for p in function.params.params if p.name.value == "reuse"), None)
        if reuse is None or reuse.default is None or code(reuse.default) not in ("False", "None"):
            continue
        if argument(call, params, "reuse") is not None or any(arg.star for arg in call.args):
            continue
        if not any(code(argument(scope, _VARIABLE_SCOPE_PARAMETERS, "reuse") or cst.Name("None")) == "reuse"
                   for scope in _variable_scopes(rule, function.body)):
            continue
        raise Refused(f"line {line_of(rule, call)}: `{code(call.func)}` makes the model's variables with `reuse` left at "
                      f"its default ({code(reuse.default)}) in every tower: each tower made its own copy of the weights "
                      "(TF1 layers number their names apart), which MirroredStrategy cannot keep; if the towers were "
                      "meant to share them, pass `reuse=(i > 0)` and fix again")


def _reuses_somehow(rule, loop: cst.For) -> bool:
    """Whether the loop, or a `with` around it, asks for reuse some way: `reuse_variables()`,
    a `reuse=` argument other than a literal False/None, or a class of the module it enters
    that does (tensorpack's `TowerContext`, whose `__enter__` opens the tower's variable scope
    with `reuse=index > 0`)."""
    around = [item.item for item in _withs_around(loop, module_parents(rule.context))]
    entered = [*(item.item for w in find(loop.body, cst.With) for item in w.items), *around]
    classes = {c.name.value: c for c in rule.context.module.body if isinstance(c, cst.ClassDef)}
    contexts = [classes[call.func.value] for call in entered
                if isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value in classes]
    return any(_asks_for_reuse(part) for part in [loop.body, *around, *contexts])


def _function(rule, call: cst.Call) -> cst.FunctionDef | None:
    """The module's function, or the one it imports from its project, that ``call`` names."""
    if not isinstance(call.func, cst.Name):
        return None
    local = module_functions(rule).get(call.func.value)
    if local is not None:
        return local
    imported = project_function(rule.context, call.func.value)
    return imported.definition if imported is not None else None


def _variable_scopes(rule, node: cst.CSTNode) -> list[cst.Call]:
    return [item.item for w in find(node, cst.With) for item in w.items
            if isinstance(item.item, cst.Call) and rule.imports.resolve(item.item.func) == _VARIABLE_SCOPE]


_VARIABLE_LISTS = {f"tensorflow.{name}" for name in (
    "trainable_variables", "global_variables", "all_variables", "model_variables", "local_variables", "get_collection")}


def variable_op_names(rule, towers: list) -> dict[int, tuple[cst.Attribute, cst.BaseExpression]]:
    """`v.op.name` of a variable the towers walk (`[v for v in tf.trainable_variables() if
    v.op.name in ('fc3/kernel', ...)]`, a weight-decay filter in the tower's loss) read as
    `v.name.split(':')[0]`: the same name in the legacy program, but in a replica after the
    first a mirrored variable's op is its own copy's, `fc3/kernel/replica_1`, where its name
    stays `fc3/kernel:0` (the filter selected nothing there and `tf.add_n([])` failed, a ResNet
    trainer class probe). Outside the replicas the op is replica 0's: left as written."""
    key = ("replica_loop.op_names", tuple(id(tower.loop) for tower in towers))
    return rule.context.memo(key, lambda: _find_variable_op_names(rule, towers))


def _find_variable_op_names(rule, towers: list) -> dict[int, tuple[cst.Attribute, cst.BaseExpression]]:
    found = {}
    for node in [n for body in replica_code(rule, towers) for n in find(body, cst.CompFor, cst.For)]:
        if not isinstance(node.target, cst.Name):
            continue
        if not (isinstance(node.iter, cst.Call) and rule.imports.resolve(node.iter.func) in _VARIABLE_LISTS):
            continue
        variable = node.target.value
        scope = module_parents(rule.context).get(id(node)) if isinstance(node, cst.CompFor) else node.body
        for read in find(scope, cst.Attribute):
            if (read.attr.value == "name" and isinstance(read.value, cst.Attribute) and read.value.attr.value == "op"
                    and isinstance(read.value.value, cst.Name) and read.value.value.value == variable):
                found[id(read)] = (read, cst.parse_expression(f"{variable}.name.split(':')[0]"))
    return found


def variable_calls(rule) -> dict[int, cst.Call]:
    """The module's `tf.Variable(...)` calls that leave `trainable` to its default, by id.

    TF1's default (None) means trainable. Under MirroredStrategy in graph mode, a compat.v1
    `tf.Variable` left at None puts its per-replica copies (`w:0`, `w/replica_1:0`) in the
    TRAINABLE_VARIABLES collection instead of the one mirrored variable (checked on TF 2.21):
    a replica minimising a loss made of every tower's then differentiates by every copy and
    the update counts each gradient N times. Said explicitly, the collection holds the
    mirrored variable, and the legacy program means the same."""
    return rule.context.memo("replica_loop.variable_calls", lambda: {
        id(call): call for call in module_calls(rule)
        if rule.imports.resolve(call.func) in ("tensorflow.Variable", "tensorflow.compat.v1.Variable")
        and not any(arg.keyword is not None and arg.keyword.value in ("trainable", "synchronization") for arg in call.args)
        and call.args and not any(arg.star for arg in call.args)
        and sum(1 for arg in call.args if arg.keyword is None) < 2  # Variable(initial_value, trainable, ...)
    })
