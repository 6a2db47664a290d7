"""Where the strategy is made and what it is made from (part of :mod:`.replica_loop`).

- The devices: the list the towers ran on, read from the loop (`range(N)`, a device list, a
  zip of devices and batch pieces). A list of objects of the module's own classes (device
  setters) is refused: MirroredStrategy takes device names.
- The towers' functions: a function only the loop calls loses its device scope.
- The scope: at module level, the run of statements that builds the graph goes under
  `with strategy.scope():`, and the plain statements the device list reads move above the
  strategy with it.
- Settings: where the strategy is made above the code that binds the device count from a
  setting (`n_gpus = FLAGS.n_gpus`), or in a caller of the towers' function, the list reads
  the setting itself.
- Cleanup: the averaging helper and device functions only the loop used go with it.
"""

from __future__ import annotations

import ast

import libcst as cst

from tfmigrate.analysis.devices import DEVICE_SPECS, is_device_function, ops_device
from tfmigrate.cst.callargs import callee_name, method_call, split_arguments
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import (
    ReplaceById, assigned_pairs, assignments, blank_lines_unindented, contains, enclosing, find, free_names, name_reads,
    names_used, placed_after_imports, scope_bindings, single_small, target_names, walk,
)
from tfmigrate.rewrites.mirrored import (
    device_helpers, devices_argument, made_before_scope, references, resets_graph, runs_before_strategy,
    scope_ended, scoped_until, strategy_scope_owner,
)
from tfmigrate.rewrites.refusal import Refused
from tfmigrate.rewrites.tower_body import ReplicaBody, indexable, is_enumerate_index, is_range_index
from tfmigrate.analysis.training import GLOBAL_STEP_MAKERS, VARIABLE_MAKERS
from tfmigrate.rewrites.tower_callers import PassedArguments, arguments_passed
from tfmigrate.rewrites.tower_code import (
    Region, Update, index_of, line_of, module_calls, simple_statements, single_binding,
)
from tfmigrate.rewrites.tower_variables import variable_calls
from tfmigrate.rule import ImportItem


def strategy_devices(rule, tower) -> str:
    """The strategy's device list: the towers' own device expression for each loop value."""
    loop, imports = tower.loop, rule.imports
    if not tower.scopes:
        raise Refused("cannot tell the towers' devices")
    device = _body_value(loop, _in_loop_terms(tower, tower.scopes[0].device))  # `setter = ...; with tf.device(setter):`
    if isinstance(device, cst.Call) and imports.resolve(device.func) in DEVICE_SPECS:
        device = cst.parse_expression(f"{code(device)}.to_string()")
    elif _spec_string(device, imports):
        pass  # `tf.DeviceSpec(device_type='GPU', device_index=k).to_string()`: a device name already
    elif isinstance(device, cst.Call) and not device.args and callee_name(device) is not None:
        pass  # `self._next_device()` (textsum's round robin): the next device's name; once per tower below
    elif is_device_function(device, imports):
        # A device function: `assign_to_device('/gpu:%d' % i, ...)`, `replica_device_setter(worker_device=...)`.
        device = ops_device(device, imports)
        if device is None:
            raise Refused(f"cannot tell the towers' devices from `{code(tower.scopes[0].device)}`")
        if is_range_index(loop, device):  # `assign_to_gpu(i, ps_device)`: the GPU's number, not its name
            return devices_argument(loop)
        if is_enumerate_index(loop, device):  # the same over `enumerate(zip(*splits))` (finetune-transformer-lm)
            count = _pieces_count(rule, tower, loop.iter, device)
            if count is None:
                raise Refused(f"cannot tell how many GPUs `{code(tower.scopes[0].device)}` numbers from `{code(loop.iter)}`")
            return f"['/gpu:%d' % k for k in range({code(count)})]"
    targets = names_used(loop.target)
    device = _body_value(loop, device)
    body_bound = set().union(*(scope_bindings(s) for s in loop.body.body))
    if names_used(device) & (body_bound - targets):
        return devices_argument(loop)  # computed in the body (a device setter): the loop's own count
    if (isinstance(device, cst.Subscript) and len(device.slice) == 1 and code(device.slice[0].slice) == code(loop.target)
            and code(loop.iter) == f"range(len({code(device.value)}))"):
        return code(device.value)  # `for i in range(len(devices)): device = devices[i]`
    if code(device) == code(loop.target):
        return indexable(loop.iter) if not isinstance(loop.iter, cst.Call) else f"list({code(loop.iter)})"
    if (isinstance(loop.iter, cst.Call) and code(loop.iter.func) == "enumerate" and isinstance(loop.target, cst.Tuple)
            and code(loop.target.elements[1].value) == code(device)):
        return code(loop.iter.args[0].value)
    zipped = _zipped_devices(loop, device)
    if zipped is not None:  # `for i, (device, x) in enumerate(zip(DEVICES, x_parts))`
        return zipped
    count = _pieces_count(rule, tower, loop.iter, device)
    if count is not None:  # `for i, (x, y) in enumerate(zip(x_splits, y_splits))`: one device per piece
        index = code(loop.target.elements[0].value)
        return f"[{code(device)} for {index} in range({code(count)})]"
    return f"[{code(device)} for {code(loop.target)} in {code(loop.iter)}]"


def _spec_string(device: cst.BaseExpression, imports) -> bool:
    """`tf.DeviceSpec(...).to_string()`: the name of the device the spec describes."""
    return (isinstance(device, cst.Call) and isinstance(device.func, cst.Attribute) and device.func.attr.value == "to_string"
            and isinstance(device.func.value, cst.Call) and imports.resolve(device.func.value.func) in DEVICE_SPECS)


def check_device_names(rule, devices: str) -> None:
    """The strategy takes device names. A device list the module fills with objects of its own
    classes (tf_cnn_benchmarks' `get_devices()`: a `ParamServerDeviceSetter` per GPU, a device
    function) is refused: passed on, MirroredStrategy failed on the first ("Unknown attribute
    ... while parsing the device spec")."""
    module = rule.context.module
    classes = {s.name.value for s in module.body if isinstance(s, cst.ClassDef)}
    makers = [node for node in assignments(rule.context).get(devices, []) if isinstance(node.value, cst.Call)]
    functions: dict[str, list[cst.FunctionDef]] = {}
    for function in find(module, cst.FunctionDef) if makers else []:
        functions.setdefault(function.name.value, []).append(function)
    for node in makers:
        func = node.value.func
        name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else ""
        for function in functions.get(name, []):
            for returned in find(function, cst.Return):
                value = returned.value
                items = [value.elt] if isinstance(value, cst.ListComp) else (
                    [e.value for e in value.elements] if isinstance(value, cst.List) else [])
                made = next((callee_name(i) for i in items if isinstance(i, cst.Call) and callee_name(i) in classes), None)
                if made is not None:
                    raise Refused(f"line {line_of(rule, node)}: the towers' devices `{devices}` come from "
                                  f"`{code(func)}()`, which makes `{made}` objects (device functions), not device "
                                  "names: MirroredStrategy needs the devices' names (those they place the towers on)")


def _zipped_devices(loop: cst.For, device: cst.BaseExpression) -> str | None:
    """The device list a loop over `zip(DEVICES, pieces)` (or `enumerate` of it) takes its
    device from: that argument of the zip, when the device is its element's name."""
    target, iterable = loop.target, loop.iter
    if (isinstance(iterable, cst.Call) and code(iterable.func) == "enumerate" and len(iterable.args) == 1
            and isinstance(target, cst.Tuple) and len(target.elements) == 2):
        target, iterable = target.elements[1].value, iterable.args[0].value
    if not (isinstance(iterable, cst.Call) and code(iterable.func) == "zip" and isinstance(target, cst.Tuple)
            and len(target.elements) == len(iterable.args) and not any(a.star or a.keyword for a in iterable.args)):
        return None
    for element, zipped in zip(target.elements, iterable.args):
        if isinstance(element.value, cst.Name) and isinstance(device, cst.Name) and element.value.value == device.value:
            return indexable(zipped.value)
    return None


def _pieces_count(rule, tower, iterable: cst.BaseExpression, device: cst.BaseExpression) -> cst.BaseExpression | None:
    """How many pieces `enumerate(<pieces>)` walks, when the device reads only the index and
    the pieces are a batch cut with `tf.split(x, n)` (or a zip of such cuts, a comprehension
    over them, or a literal list): ``n``. The strategy is made before the graph, so it must
    not read the pieces."""
    if not (isinstance(iterable, cst.Call) and code(iterable.func) == "enumerate" and len(iterable.args) == 1
            and isinstance(tower.loop.target, cst.Tuple) and len(tower.loop.target.elements) == 2):
        return None
    if names_used(device) & names_used(tower.loop.target.elements[1].value):
        return None
    owner = tower.owner if tower.owner is not None else rule.context.module
    pieces = [iterable.args[0].value]
    while pieces:
        node = pieces.pop(0)
        if isinstance(node, cst.Call) and code(node.func) == "zip" and rule.imports.resolve(node.func) is None:
            pieces += [a.value for a in node.args if not a.star]
            # `zip(*[tf.split(x, n) for x in xs])`: as many as each zipped list has (also through a
            # name bound to the comprehension: `xs = (tf.split(x, n) for x in xs)`, `zip(*xs)`)
            starred = [single_binding(owner, a.value) if isinstance(a.value, cst.Name) else a.value
                       for a in node.args if a.star == "*"]
            pieces += [value.elt for value in starred if isinstance(value, (cst.ListComp, cst.GeneratorExp))]
        elif (isinstance(node, (cst.ListComp, cst.GeneratorExp)) and node.for_in.inner_for_in is None
              and not node.for_in.ifs):
            pieces.append(node.for_in.iter)  # one piece per element it walks (Show-and-Tell's dict per shard)
        elif isinstance(node, (cst.List, cst.Tuple)) and not any(isinstance(e, cst.StarredElement) for e in node.elements):
            return cst.Integer(str(len(node.elements)))
        elif isinstance(node, cst.Call) and rule.imports.resolve(node.func) == "tensorflow.split":
            count = split_arguments(node)[1]
            if count is not None and not isinstance(count, (cst.List, cst.Tuple)):
                return count
        elif isinstance(node, cst.Name) and single_binding(owner, node) is not None:
            pieces.append(single_binding(owner, node))
    return None


def tower_functions(rule, tower) -> dict[int, cst.CSTNode]:
    """The tower functions the loop calls (`build_tower(i, ...)` opening `tf.device('/gpu:%d' %
    gpu_id)` on its parameter) without their device scopes: the strategy places each replica.
    Only functions that the tower loop alone calls: any other caller would lose its placement."""
    changes = {}
    for function in tower.via:
        name = function.name.value
        outside = next((call for call in module_calls(rule) if _calls(call, name) and not contains(tower.loop, call)), None)
        if outside is not None:
            raise Refused(f"the towers are built by `{name}`, which line {line_of(rule, outside)} also calls outside the "
                          "tower loop: its device scope cannot go (that call would lose its placement)")
        scopes = {id(scope.with_node) for scope in tower.scopes if contains(function, scope.with_node)}
        replica = ReplicaBody(scopes, {}, rule.imports, set(), variables=frozenset(variable_calls(rule)))
        changes[id(function)] = function.visit(replica)
    return changes


def _calls(call: cst.Call, name: str) -> bool:
    """`name(...)` or `<object>.name(...)`."""
    func = call.func
    return (isinstance(func, cst.Name) and func.value == name) or (isinstance(func, cst.Attribute) and func.attr.value == name)


def _in_loop_terms(tower, device: cst.BaseExpression) -> cst.BaseExpression:
    """A tower function's device expression with its parameters replaced by what the loop's call
    passes (`'/gpu:%d' % gpu_id` of `build_tower(i, ...)` is `'/gpu:%d' % i`)."""
    function = next((f for f in tower.via if contains(f, device)), None)
    if function is None:
        return device
    call = next(c for c in find(tower.loop.body, cst.Call) if _calls(c, function.name.value))
    params = [p.name.value for p in function.params.params]
    if isinstance(call.func, cst.Attribute) and params[:1] == ["self"]:
        params = params[1:]
    passed: dict[str, cst.BaseExpression] = {}
    for position, arg in enumerate(call.args):
        if arg.star:
            break
        if arg.keyword is not None:
            passed[arg.keyword.value] = arg.value
        elif position < len(params):
            passed[params[position]] = arg.value
    receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
    if isinstance(receiver, cst.Name) and params != [p.name.value for p in function.params.params]:
        passed["self"] = receiver  # `self.build_tower(i)`: the method's `self` is the caller's receiver
    unbound = names_used(device) & ({p.name.value for p in find(function.params, cst.Param)} - set(passed))
    if unbound:
        raise Refused(f"cannot tell the towers' devices from `{code(device)}`: `{sorted(unbound)[0]}` is not passed by the loop")
    return device.visit(PassedArguments(passed))


def _body_value(loop: cst.For, device: cst.BaseExpression) -> cst.BaseExpression:
    """A device named in the body (`device = DEVICES[i]`, first statements) is its value."""
    if not isinstance(device, cst.Name):
        return device
    for statement in loop.body.body:
        small = single_small(statement)
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and code(small.targets[0].target) == device.value:
            return small.value
        if device.value in scope_bindings(statement):
            break
    return device


def module_run(rule, region: Region) -> list[cst.BaseStatement]:
    """At module level with no `with` that opens the graph: the run of statements around the
    loop, in its own block, that the strategy scope covers (up to the nearest import, definition,
    docstring or `if __name__ == '__main__':`; over definitions, up to the variables the module
    makes above them, which must be made under the scope). The block is the module or the body
    of a module level `if` (`if __name__ == '__main__':`), which runs once. A module level `with`
    runs once too (`with tf.variable_scope(tf.get_variable_scope()):` around the loop): it goes
    under the scope whole, with the code around it. Empty elsewhere."""
    module = rule.context.module
    if strategy_scope_owner(region.loop, region.parents, rule.imports) is not module:
        return []
    unit = node = region.loop  # the statement of the block that holds the loop
    while node is not module:
        node = region.parents[id(node)]
        if isinstance(node, cst.With):
            unit = node
        elif not isinstance(node, (cst.If, cst.Else, cst.IndentedBlock, cst.Module)):
            raise Refused(f"line {line_of(rule, node)}: the tower loop is inside a block at module level that may run "
                          "more than once: move it into a function so the graph can be built under strategy.scope()")
    block = region.parents[id(unit)]
    body = list(block.body)
    at = index_of(body, unit)
    start, end = at, at
    while start > 0 and _plain_module_statement(body[start - 1]):
        start -= 1
    while end + 1 < len(body) and _plain_module_statement(body[end + 1]):
        end += 1
    # Variables made further up, above the module's function definitions (`W1 = tf.Variable(...)`,
    # then `def model(x): ...`, then the towers) must be made under the scope too, or the update
    # applies to plain variables in a replica (a "Reading data" how-to script failed so): the run
    # then reaches up to the first of them, the definitions between with it (a `def` under a
    # `with` is the same def).
    above = start
    while above > 0 and _plain_module_statement(body[above - 1], definitions=True):
        above -= 1
    first = next((i for i in range(above, start) if _makes_variables(rule, body[i])), None)
    if first is not None:
        start = first
        while start > 0 and _plain_module_statement(body[start - 1]):
            start -= 1
    # A `tf.reset_default_graph()` before the loop throws away what was built above it, and must
    # not run under the scope (a held-out Kaggle kernel's reset crashed there): the run starts
    # after it, and after the settings and imports that go before the strategy is made.
    start = max([start, *(i + 1 for i in range(start, at) if resets_graph(body[i]))])
    while start < at and runs_before_strategy(body[start]):
        start += 1
    return body[start:end + 1]


def _makes_variables(rule, statement: cst.BaseStatement) -> bool:
    """A statement that makes a TF1 variable when it runs (not a definition, whose body runs
    later): `tf.Variable`, `tf.get_variable`, the global step (a held-out script made it above its
    tower function, then `apply_gradients(..., global_step=...)` failed in the replicas on a plain
    variable)."""
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return False
    return any(rule.imports.resolve(call.func) in VARIABLE_MAKERS | GLOBAL_STEP_MAKERS
               for call in find(statement, cst.Call))


def _plain_module_statement(statement: cst.BaseStatement, definitions: bool = False) -> bool:
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return definitions
    if isinstance(statement, cst.If) and "__name__" in code(statement.test):
        return False
    small = single_small(statement)
    return not (isinstance(small, (cst.Import, cst.ImportFrom))
                or (isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString))))


def module_scope(rule, region: Region, region_changes: dict, creates: list, scope_item: cst.WithItem,
                 made_first: list = (), ends_before: cst.BaseStatement | None = None) -> dict:
    """The module run around the loop under `with strategy.scope():` (up to ``ends_before``, see
    :func:`scope_end`), the strategy made before it, and the ``made_first`` statements of the
    run (a global step kept TF1's variable) between."""
    run = module_run(rule, region)
    region_changes, end = scope_ended(region_changes, ends_before)
    statements: list[cst.BaseStatement] = []
    first = {id(statement) for statement in made_first}
    for statement in run:
        change = region_changes.get(id(statement))
        if change is cst.RemovalSentinel.REMOVE or id(statement) in first:
            continue
        if isinstance(change, cst.FlattenSentinel):
            statements += list(change.nodes)
        else:
            statements.append(change or statement.visit(ReplaceById(region_changes)))
    ends_at = next((i for i, statement in enumerate(statements) if statement is end), None)
    statements = [blank_lines_unindented(s) for s in statements]
    statements[0] = statements[0].with_changes(leading_lines=[])
    end = statements[ends_at] if ends_at is not None else None  # the same statement, unindented
    creates[0] = creates[0].with_changes(leading_lines=run[0].leading_lines)
    moved = [statement.with_changes(leading_lines=()) for statement in made_first]
    scoped = scoped_until(statements, end, scope_item)
    changes: dict = {run[0]: cst.FlattenSentinel([*creates, *made_before_scope(moved), *scoped])}
    changes.update((statement, cst.RemovalSentinel.REMOVE) for statement in run[1:])
    return changes


def device_prelude(rule, region: Region, create: cst.BaseStatement) -> tuple[list, list]:
    """The statements before the loop that the strategy's device list reads (`devices = [...]`):
    they move up with the strategy, above the scope, which is only safe for plain Python.
    Returns (the statements that move, what takes their place above the strategy: the same,
    reading settings where they read names set later, see :func:`_inline_settings`)."""
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    block = owner.body.body if isinstance(owner, (cst.With, cst.FunctionDef)) else module_run(rule, region)
    # Not the comprehension's own `i`; `self` is a parameter: its attributes are followed instead.
    needed = free_names(create, keywords=False) - {"tf", "self"}
    needed_attributes = _self_attributes(create)  # `self.devices`, set in `__init__` above the loop
    prelude, moved = [], []
    for statement in reversed([s for s in region.preceding if any(s is t for t in block)]):
        builds_graph = any(_builds_graph(rule, n) for n in find(statement, cst.Name, cst.Attribute))
        if scope_bindings(statement) & needed or _assigned_attributes(statement) & needed_attributes:
            if builds_graph:
                raise Refused(f"line {line_of(rule, statement)}: the towers' devices come from TensorFlow code in the "
                              "graph; name the device list before the graph is built")
        elif not (_changes_by_call(statement, needed) and not builds_graph):
            continue
        # A call made for its effect on a name the devices read (`parser.add_argument(...)`
        # before `args = parser.parse_args()`) moves up with it, in its place.
        prelude.insert(0, statement)
        inlined = _inline_settings(rule, region, statement)
        moved.insert(0, inlined)
        needed |= free_names(inlined, keywords=False) - {"self"}
        needed_attributes |= _self_attributes(inlined)
    _check_bound_before(rule, owner, [create, *moved], prelude, block)
    declarations = _declarations(prelude, block)
    return declarations + prelude, declarations + moved


def _declarations(prelude: list[cst.BaseStatement], block) -> list[cst.BaseStatement]:
    """The `global`/`nonlocal` statements of ``block`` for names ``prelude`` binds (DeepSpeech's
    `global available_devices` above the device list): they move up first, as Python wants a
    declaration before any use of the name."""
    bound = set().union(set(), *(scope_bindings(statement) for statement in prelude))
    moved = {id(statement) for statement in prelude}
    return [statement for statement in block if id(statement) not in moved
            and isinstance(single_small(statement), (cst.Global, cst.Nonlocal))
            and {item.name.value for item in single_small(statement).names} & bound]


def _self_attributes(node: cst.CSTNode) -> set[str]:
    """The `self.x` an expression or statement reads (or writes)."""
    return {code(n) for n in find(node, cst.Attribute) if isinstance(n.value, cst.Name) and n.value.value == "self"}


def _assigned_attributes(statement: cst.CSTNode) -> set[str]:
    return {code(t.target) for t in find(statement, cst.AssignTarget) if isinstance(t.target, cst.Attribute)}


def _changes_by_call(statement: cst.CSTNode, names: set[str]) -> bool:
    """Whether ``statement`` is a call made for its effect that may change one of ``names``:
    a method of it (`parser.add_argument(...)`), or a function given it whole (`add_flags(parser)`).
    Reading one in an argument (`images.set_shape([FLAGS.batch_size, ...])`) changes nothing."""
    small = single_small(statement)
    if not (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)):
        return False
    receiver = small.value.func.value if isinstance(small.value.func, cst.Attribute) else None
    while isinstance(receiver, (cst.Attribute, cst.Call, cst.Subscript)):
        receiver = receiver.func if isinstance(receiver, cst.Call) else receiver.value
    if isinstance(receiver, cst.Name) and receiver.value in names:
        return True
    return any(isinstance(arg.value, cst.Name) and arg.value.value in names for arg in small.value.args)


# TensorFlow calls that ask the runtime what it has, or log, without building the graph: a
# device list made with them can be worked out above the strategy.
_DEVICE_QUERIES = ("tensorflow.python.client.device_lib", "tensorflow.config", "tensorflow.test.is_gpu_available",
                   "tensorflow.test.gpu_device_name", "tensorflow.test.is_built_with_cuda", "tensorflow.logging",
                   "tensorflow.compat.v1.logging", "tensorflow.get_logger",
                   # Command-line settings (`FLAGS = tf.app.flags.FLAGS`; DeepSpeech's device list
                   # from `FLAGS.num_gpus`) build nothing in a graph either.
                   "tensorflow.app.flags", "tensorflow.flags", "tensorflow.compat.v1.app.flags",
                   "tensorflow.compat.v1.flags")


def _builds_graph(rule, node: cst.CSTNode) -> bool:
    name = rule.imports.resolve(node) or ""
    return name.startswith("tensorflow") and not name.startswith(_DEVICE_QUERIES)


def settings_inlined(rule, region: Region, devices: str) -> str:
    """The device list, reading `FLAGS.n_gpus` itself where it read `n_gpus` set from it by
    `n_gpus = FLAGS.n_gpus` inside the code the scope covers (BERT-GPU's `if FLAGS.do_train:`
    block): the strategy is made above that code (see :func:`_inline_settings`)."""
    return code(_inline_settings(rule, region, cst.parse_expression(devices)))


def _inline_settings(rule, region: Region, node: cst.CSTNode) -> cst.CSTNode:
    """``node`` reading the value of each name the loop's function binds once, inside a block,
    by a plain assignment, to a plain reading of settings (:func:`_plain_setting`) that reads
    nothing the function binds but its parameters it never rebinds (`hp = self._hparams` inside
    Tacotron-2's `with tf.device(split_device):`): it has the same value in both places. A name
    bound by a statement of the block the strategy scope covers stays: that statement moves up
    (:func:`device_prelude`), as it does at module level."""
    owner = region.owner
    if not isinstance(owner, cst.FunctionDef):
        return node
    scope_owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    movable = {id(s) for s in [*owner.body.body, *(scope_owner.body.body if isinstance(scope_owner, cst.With) else ())]}
    statements = [s for s in simple_statements(owner) if id(s) not in movable]
    bound_in_body = scope_bindings(owner)
    bound_in_owner = {p.name.value for p in find(owner.params, cst.Param)} | bound_in_body
    other_binders = _other_binders(owner)
    values: dict[str, cst.BaseExpression] = {}
    for name in (free_names(node) & bound_in_owner) - other_binders:
        if any(name in scope_bindings(s) for s in simple_statements(owner) if id(s) in movable):
            continue
        value = _plain_binding(statements, name)
        if value is not None and not names_used(value) & bound_in_body:
            values[name] = value
    return _read_as(node, values)


def callee_settings_inlined(region: Region, devices: str) -> str:
    """The device list, for a strategy its caller makes, reading the value of each name the
    towers' function binds once, by a plain assignment, to a plain setting computed from its
    parameters it never rebinds and the module's names (`devices = ['/gpu:0', '/gpu:1',
    '/gpu:2', '/gpu:3'][:num_gpus]` in a `build_towers(opt, tensors, num_gpus)`), and that
    nothing changes in place: the same value in the caller, where the parameters read what the
    call passes (:class:`tfmigrate.rewrites.tower_callers.PassedArguments`)."""
    owner = region.owner
    node = cst.parse_expression(devices)
    bound_in_body = scope_bindings(owner.body)
    other_binders = _other_binders(owner)
    parameters = {p.name.value for p in find(owner.params, cst.Param)}
    values: dict[str, cst.BaseExpression] = {}
    for name in (free_names(node) & bound_in_body) - other_binders:
        value = _plain_binding(simple_statements(owner), name, comprehensions=True)
        if value is None:
            continue
        reads = free_names(value)
        # (a comprehension's own name that a parameter also has would read the caller's argument)
        if not reads & bound_in_body and not (names_used(value) - reads) & parameters \
                and not _changed_in_place(owner, name):
            values[name] = value
    return code(_read_as(node, values)) if values else devices


def _plain_binding(statements: list, name: str, comprehensions: bool = False) -> cst.BaseExpression | None:
    """The value the one statement of ``statements`` that binds ``name`` gives it, when that is
    a plain assignment (`name = value`, or one of `mc, n = self.model_config, self.config.num_gpus`)
    of a plain setting (:func:`_plain_setting`)."""
    bindings = [s for s in statements if name in scope_bindings(s)]
    pairs = (assigned_pairs(bindings[0]) or []) if len(bindings) == 1 else []
    value = next((v for t, v in pairs if isinstance(t, cst.Name) and t.value == name), None)
    return value if value is not None and _plain_setting(value, comprehensions) else None


def _read_as(node: cst.CSTNode, values: dict[str, cst.BaseExpression]) -> cst.CSTNode:
    """``node`` with each read of a name in ``values`` replaced by its value."""
    reads = {id(read): values[read.value] for read in name_reads(node) if read.value in values}
    return node.visit(ReplaceById(reads)) if reads else node


def _other_binders(owner: cst.CSTNode) -> set[str]:
    """Names ``owner`` binds other than by a plain assignment (loop targets, `as` names, `+=`,
    `:=`): not settings."""
    return set().union(set(), *(target_names(n.target) for n in find(owner, cst.For, cst.AugAssign, cst.NamedExpr)),
                       *(target_names(n.name) for n in find(owner, cst.AsName)))


def _changed_in_place(scope: cst.CSTNode, name: str) -> bool:
    """Whether code in ``scope`` may change the object ``name`` holds without rebinding the name:
    an attribute of it used (`devices.append(...)`), an item of it assigned or deleted."""
    if any(type(n.value) is cst.Name and n.value.value == name for n in find(scope, cst.Attribute)):
        return True
    targets = [t.target for t in find(scope, cst.AssignTarget, cst.AugAssign)]
    for statement in find(scope, cst.Del):
        target = statement.target
        targets += [e.value for e in target.elements] if isinstance(target, cst.Tuple) else [target]
    return any(isinstance(t, cst.Subscript) and type(t.value) is cst.Name and t.value.value == name for t in targets)


# Calls that only read a setting: `len(cfgs.GPU_GROUP.strip().split(','))` (FPN_Tensorflow).
_PLAIN_FUNCTIONS = {"len", "int", "str", "list", "tuple", "range", "sorted"}


_PLAIN_METHODS = {"split", "strip", "lstrip", "rstrip", "lower", "upper", "replace"}


def _plain_setting(value: cst.BaseExpression, comprehensions: bool = False) -> bool:
    """Names, attributes, literals and calls of ``_PLAIN_FUNCTIONS`` or string methods on them
    (`'/gpu:{}'.format(k)` on a literal); with ``comprehensions``, also list comprehensions of
    those (`['/gpu:%d' % k for k in range(n_gpus)]`)."""
    for node in walk(value):
        if type(node) is cst.Call:
            func = node.func
            if not ((type(func) is cst.Name and func.value in _PLAIN_FUNCTIONS)
                    or (type(func) is cst.Attribute and func.attr.value in _PLAIN_METHODS)
                    or (type(func) is cst.Attribute and func.attr.value == "format" and type(func.value) is cst.SimpleString)):
                return False
        elif type(node) is cst.ListComp and comprehensions:
            continue
        elif isinstance(node, (cst.Lambda, cst.BaseComp, cst.NamedExpr, cst.Await, cst.Yield)):
            return False
    return True


def _check_bound_before(rule, owner: cst.CSTNode, above: list, prelude: list, block: list) -> None:
    """The strategy is made before what its scope covers: the device list, and the statements
    that move ``above`` it, must not read a name that code there binds (`n_gpus = FLAGS.n_gpus`
    inside an `if` above the loop)."""
    block = owner.body.body if isinstance(owner, (cst.With, cst.FunctionDef)) else block
    moved = {id(s) for s in prelude}
    covered = [s for s in block if id(s) not in moved]
    read = set().union(*(free_names(s, keywords=False) for s in above)) - set().union(set(), *(scope_bindings(s) for s in above[1:]))
    late = read & set().union(*(scope_bindings(s) for s in covered))
    if late:
        # The line that binds it: a simple statement inside what is covered, else the compound
        # statement itself (`for name in ...`, `with ... as name`: az05's tf_cnn_benchmarks).
        binding = next((s for s in simple_statements(owner) if scope_bindings(s) & late and id(s) not in moved),
                       next(s for s in covered if scope_bindings(s) & late))
        raise Refused(f"line {line_of(rule, binding)}: the towers' devices read "
                      f"{', '.join(f'`{n}`' for n in sorted(late))}, set inside the code the strategy scope must "
                      "cover; set it before that code (or at the top of the function)")


def remove_unused_helpers(changes: dict, tower, module: cst.Module, update: Update, devices: str) -> None:
    """The averaging helper and device functions only the loop used go with it (a device
    function the strategy's ``devices`` call, `next_device()` of a round robin, stays)."""
    removed = [scope.device for scope in tower.scopes]
    named = names_used(cst.parse_expression(devices)) if devices else set()
    names = [name for name, _ in device_helpers(tower, module) if name not in named]
    if update.helper:
        names.append(update.helper)
    definitions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    for name in names:
        definition = definitions.get(name)
        if definition is None or definition in changes:  # rebuilt with the strategy scope
            continue
        inside = sum(references(node, name) for node in removed)
        if name == update.helper:
            inside += 1  # its one call went with the averaging statement
        if references(module, name) - 1 - inside == 0:
            changes[definition] = cst.RemovalSentinel.REMOVE


def is_metric(rule, call: cst.Call) -> bool:
    """A TF1 streaming metric (`tf.metrics.accuracy`): its counters aggregate across replicas."""
    name = rule.imports.resolve(call.func) or ""
    return name.startswith(("tensorflow.metrics.", "tensorflow.compat.v1.metrics."))


def scope_end(rule, region: Region) -> tuple[cst.BaseStatement | None, str | None]:
    """The statement of the scope's block where the strategy's scope ends, and None; or None and
    why it cannot end there. It ends before the first statement after the loop that makes a TF1
    metric, itself or in a function it calls (`tf.metrics.accuracy` over the towers' joined
    predictions, a held-out text CNN): under the scope, outside the replicas, a metric fails
    when it is made (it asks for the replica context; checked on TF 2.21), and outside the scope
    it is TF1's metric again. The statements from there on run outside the scope, so none may
    make a variable the replicas would use. (None, None) where the code makes no metric outside
    the replicas. Found once per region (the checks ask, then the rewrite)."""
    if not any(is_metric(rule, call) for call in module_calls(rule)):
        return None, None
    return rule.context.memo(("tower_scope.scope_end", id(region.loop), id(region.owner)),
                             lambda: _scope_end(rule, region))


def _scope_end(rule, region: Region) -> tuple[cst.BaseStatement | None, str | None]:
    owner = strategy_scope_owner(region.loop, region.parents, rule.imports)
    block = module_run(rule, region) if isinstance(owner, cst.Module) else list(owner.body.body)
    at = next((i for i, s in enumerate(block) if contains(s, region.loop)), len(block))
    # The loop's own statement: its calls outside the loop only (what the towers call is replica code).
    reached = [[c for c in find(s, cst.Call) if not contains(region.loop, c)] if i == at else _reached_calls(rule, s)
               for i, s in enumerate(block)]
    made = [(i, call) for i, calls in enumerate(reached) for call in calls if is_metric(rule, call)]
    made += [(None, call) for method in region.reaches for call in _reached_calls(rule, method) if is_metric(rule, call)]
    if not made:
        return None, None
    first, call = made[0]
    if any(i is None or i <= at for i, _ in made):
        call = next(call for i, call in made if i is None or i <= at)
        return None, (f"line {line_of(rule, call)}: `{code(call.func)}` makes its counters under the strategy scope, "
                      "outside the replicas, where a metric cannot be made; compute the metric in numpy from fetched "
                      "values, or make it after the code that builds the model")
    builder = next((node for s in block[first:] for node in _reached_calls(rule, s) if _builds_variables(rule, node)),
                   None)
    if builder is not None:
        return None, (f"line {line_of(rule, call)}: `{code(call.func)}` must be made outside the strategy scope, and "
                      f"line {line_of(rule, builder)} after it builds model variables, which must be made under it: "
                      "make the metric after them")
    return block[first], None


# What makes or updates model variables, by TF name prefix or method name.
_BUILDERS = ("tensorflow.layers.", "tensorflow.keras.", "tensorflow.contrib.", "tensorflow.nn.rnn_cell.",
             "tensorflow.compat.v1.layers.", "tensorflow.train.ExponentialMovingAverage", "tensorflow.make_template")
_BUILDING_METHODS = ("minimize", "apply_gradients", "compute_gradients", "reuse_variables")


def _builds_variables(rule, call: cst.Call) -> bool:
    name = rule.imports.resolve(call.func) or ""
    return (name in VARIABLE_MAKERS | GLOBAL_STEP_MAKERS or name.startswith(_BUILDERS)
            or any(method_call(call, method) for method in _BUILDING_METHODS))


def _reached_calls(rule, node: cst.CSTNode) -> list[cst.Call]:
    """The calls in ``node`` and in the module's functions, classes and methods (`self.build()`)
    it calls, followed once each."""
    definitions = rule.context.memo("tower_scope.definitions", lambda: _definitions(rule.context.module))
    calls, seen, todo = [], set(), [node]
    while todo:
        for call in find(todo.pop(), cst.Call):
            calls.append(call)
            func = call.func
            name = func.value if isinstance(func, cst.Name) else (
                func.attr.value if isinstance(func, cst.Attribute) and code(func.value) == "self" else None)
            for definition in definitions.get(name, []):
                if id(definition) not in seen:
                    seen.add(id(definition))
                    todo.append(definition)
    return calls


def _definitions(module: cst.Module) -> dict[str, list[cst.CSTNode]]:
    """The module's functions and classes, and its classes' methods, by name."""
    found: dict[str, list[cst.CSTNode]] = {}
    for statement in module.body:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            found.setdefault(statement.name.value, []).append(statement)
        if isinstance(statement, cst.ClassDef):
            for method in statement.body.body:
                if isinstance(method, cst.FunctionDef):
                    found.setdefault(method.name.value, []).append(method)
    return found


_GRAPH_STRATEGY = '''
_MIRRORED_STRATEGIES = weakref.WeakKeyDictionary()


def graph_mirrored_strategy(devices):
    """The default graph's one MirroredStrategy, made by the first call: the towers are built
    into the graph more than once (for training and for evaluation, sharing variables), and
    every build must run on the strategy that mirrors those variables."""
    graph = {get_default_graph}()
    if graph not in _MIRRORED_STRATEGIES:
        _MIRRORED_STRATEGIES[graph] = {mirrored_strategy}(devices=devices)
    strategy = _MIRRORED_STRATEGIES[graph]
    if len(devices) != strategy.num_replicas_in_sync:
        raise ValueError("the towers are built on %d devices here and on %d before, in one graph"
                         % (len(devices), strategy.num_replicas_in_sync))
    return strategy
'''


def graph_strategy_call(rule, region: Region, tf, devices: str, builds: list[cst.Call]) -> str:
    """`graph_mirrored_strategy(<devices>)`, the strategy of a function (or constructor) that
    builds towers into one graph more than once (``builds``, see
    :func:`tfmigrate.rewrites.replica_loop._builds_into_one_graph`). Refused where the builds pass
    different constants for what the device list reads."""
    read = free_names(cst.parse_expression(devices), keywords=False)
    passed = [{name: value for name, value in arguments_passed(region.owner, call).items() if name in read}
              for call in builds]
    # Constants that differ (`Model(..., 1)` and `Model(..., 2)`); other values (`config` and
    # `eval_config`, alike in their device count) are checked when the graph is built.
    differing = sorted({name for each in passed for name in each
                        if _differ(each.get(name), passed[0].get(name))})
    if differing:
        lines = ", ".join(str(line_of(rule, call)) for call in builds)
        raise Refused(f"`{_builder(region)}` builds its towers into one graph {len(builds)} times (lines {lines}) "
                      f"with different `{differing[0]}`: one strategy cannot run them on different devices")
    return f"graph_mirrored_strategy({devices})"


def _differ(one: cst.BaseExpression | None, other: cst.BaseExpression | None) -> bool:
    """Whether two passed values are constants of different values."""
    try:
        return ast.literal_eval(code(one)) != ast.literal_eval(code(other))
    except (ValueError, SyntaxError, TypeError):
        return False


def graph_strategy_why(rule, region: Region, builds: list[cst.Call]) -> list[str]:
    """Why the strategy is the graph's (a comment's lines)."""
    lines = ", ".join(str(line_of(rule, call)) for call in builds)
    return [f"`{_builder(region)}` builds its towers into one graph {len(builds)} times (lines {lines}),",
            "sharing their variables: every build runs them on the graph's one MirroredStrategy."]


def _builder(region: Region) -> str:
    """The name of what builds the towers: the function with the loop, or the class whose
    constructor it is."""
    owner = region.owner
    holder = enclosing(owner, region.parents, cst.ClassDef) if owner.name.value == "__init__" else None
    return (holder or owner).name.value


def graph_strategy_definitions(rule, tf, changes: dict) -> dict:
    """The changes that write `graph_mirrored_strategy` (and the dictionary it keeps) after the
    module's imports, once."""
    module = rule.context.module
    if any(isinstance(s, cst.FunctionDef) and s.name.value == "graph_mirrored_strategy" for s in module.body):
        return {}
    text = _GRAPH_STRATEGY.format(get_default_graph=tf("tensorflow.get_default_graph"),
                                  mirrored_strategy=tf("tensorflow.distribute.MirroredStrategy"))
    tf.imports.append(ImportItem("weakref"))
    placed = placed_after_imports(module, changes, list(cst.parse_module(text).body))
    if not placed:
        raise Refused("the module imports nothing after which the graph's strategy can be written")
    return placed
