"""Device placement analysis shared by the rules: which ``with`` opens a device scope, whether
a device expression names a GPU, and which loops build one tower per device.

Rules ask for these through ``RuleContext.memo`` (``module_tower_loops``, ``enclosing_tower``,
``tower_loop_at``) so a module is analysed once per run, in a number of tree walks that does
not grow with the number of rules or of nodes asked about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.cst.callargs import callee_name
from tfmigrate.cst.codegen import code
from tfmigrate.cst.names import ImportTable
from tfmigrate.cst.traversal import (
    children, contains, enclosing, events, find, identifiers, module_parents, names_used, string_parts, walk,
)

DEVICE_SCOPES = {"tensorflow.device", "tensorflow.device_scope"}
DEVICE_SPECS = {"tensorflow.DeviceSpec", "tensorflow.python.framework.device_spec.DeviceSpecV1"}
# TF2's own device listings: a loop over their result is the documented TF2 way to place work
# by hand (see `is_device_listing_loop`), not a TF1 tower loop.
DEVICE_LISTINGS = {
    "tensorflow.config.list_logical_devices",
    "tensorflow.config.experimental.list_logical_devices",
    "tensorflow.config.list_physical_devices",
    "tensorflow.config.experimental.list_physical_devices",
}
# Words that, in a loop's iterable, say "one iteration per device" (`range(FLAGS.num_gpus)`).
_PER_DEVICE_WORDS = re.compile(r"gpu|device|tower|replica", re.I)
_FIXED_GPU = re.compile(r"(?:^|/)(?:device:)?gpu:(\d+)", re.I)


def device_scope_arg(call: cst.CSTNode, imports: ImportTable) -> cst.BaseExpression | None:
    """The device expression of ``tf.device(x)`` / ``graph.device(x)``, else None."""
    if not isinstance(call, cst.Call) or not call.args:
        return None
    qualified = imports.resolve(call.func)
    if qualified in DEVICE_SCOPES:
        return call.args[0].value
    # `g.device(...)`, `tf.get_default_graph().device(...)`: a Graph's device scope.
    if (
        qualified is None
        and isinstance(call.func, cst.Attribute)
        and call.func.attr.value == "device"
        and not (isinstance(call.func.value, cst.Name) and imports.is_bound(call.func.value.value))
    ):
        return call.args[0].value
    return None


def is_device_spec(node: cst.CSTNode, imports: ImportTable) -> bool:
    return isinstance(node, cst.Call) and imports.resolve(node.func) in DEVICE_SPECS


def _device_text(node: cst.CSTNode, imports: ImportTable) -> str:
    """The literal text of a device expression, lower-cased. A device function's
    parameter-server arguments (where variables go: `assign_to_device(d, ps_device='/cpu:0')`,
    `assign_to_device(d, '/cpu:0')`, `local_device_setter(ps_device_type='cpu', ...)`,
    `replica_device_setter(ps_tasks=1, ps_device='/cpu:0', worker_device=d)`) say nothing
    about where the ops go, so only the ops' device is read: its ``worker_device=`` argument,
    else its first positional argument and the keywords that are not ``ps_*``."""
    if (
        isinstance(node, cst.Call)
        and not is_device_spec(node, imports)
        and not _is_string_format(node)
    ):
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        if "worker_device" in keywords:
            kept = [keywords["worker_device"]]
        else:
            positional = [a.value for a in node.args if a.keyword is None and not a.star]
            kept = positional[:1] + [
                value for name, value in keywords.items() if not name.startswith("ps_")
            ]
        return " ".join(" ".join(string_parts(v)) for v in kept).lower()
    return " ".join(string_parts(node)).lower()


def is_device_function(node: cst.CSTNode, imports: ImportTable) -> bool:
    """A call in a device scope that is neither a device string (`'/gpu:{}'.format(i)`) nor a
    DeviceSpec: a function choosing the device (`assign_to_device(...)`, a device setter)."""
    return isinstance(node, cst.Call) and not is_device_spec(node, imports) and not _is_string_format(node)


def ops_device(node: cst.CSTNode, imports: ImportTable) -> cst.BaseExpression | None:
    """For a device function (`assign_to_device(d, ps_device='/cpu:0')`,
    `replica_device_setter(ps_tasks=1, ps_device='/cpu:0', worker_device=d)`), the expression
    naming where its ops go: the ``worker_device=`` argument, else the first positional one.
    None for anything else (a device string, `'/gpu:{}'.format(i)`, a DeviceSpec) and for a
    device function that names no device for its ops."""
    if not is_device_function(node, imports):
        return None
    for argument in node.args:
        if argument.keyword is not None and argument.keyword.value == "worker_device":
            return argument.value
    if imports.resolve(node.func) == "tensorflow.train.replica_device_setter":
        return None  # its positional arguments are the parameter servers'
    positional = [a.value for a in node.args if a.keyword is None and not a.star]
    return positional[0] if positional else None


def _is_string_format(node: cst.Call) -> bool:
    """`'/gpu:{}'.format(i)`: a device string, not a device function."""
    return (
        isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "format"
        and isinstance(node.func.value, (cst.SimpleString, cst.ConcatenatedString))
    )


def mentions_gpu(node: cst.CSTNode, imports: ImportTable) -> bool:
    return "gpu" in _device_text(node, imports)


def mentions_only_cpu(node: cst.CSTNode, imports: ImportTable) -> bool:
    text = _device_text(node, imports)
    return "cpu" in text and "gpu" not in text


def fixed_gpu(node: cst.CSTNode, imports: ImportTable) -> str | None:
    """The GPU a device expression names when it is a constant, normalised ('/gpu:1'), else
    None: `'/gpu:1'`, `'/device:GPU:1'`, `'/job:w/task:0/gpu:1'`, `DeviceSpec(device_type='GPU',
    device_index=1)`. Formatted strings and names are not constants."""
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        match = _FIXED_GPU.search(value)
        if match is None:
            return None
        prefix = value[: match.start()].lower()
        return f"{prefix}/gpu:{int(match.group(1))}"
    if is_device_spec(node, imports):
        kinds = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        kind, index = kinds.get("device_type"), kinds.get("device_index")
        if (
            isinstance(kind, cst.SimpleString)
            and kind.evaluated_value.lower() == "gpu"
            and isinstance(index, cst.Integer)
        ):
            return f"/gpu:{int(index.value)}"
    return None


@dataclass
class DeviceScope:
    with_node: cst.With
    device: cst.BaseExpression


def device_scopes(node: cst.CSTNode, imports: ImportTable) -> list[DeviceScope]:
    """Every ``with`` under ``node`` that opens a device scope (not looking into nested defs)."""
    scopes: list[DeviceScope] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.FunctionDef) and current is not node:
            continue
        if isinstance(current, cst.With):
            for item in current.items:
                device = device_scope_arg(item.item, imports)
                if device is not None:
                    scopes.append(DeviceScope(current, device))
        stack.extend(reversed(children(current)))
    return scopes


@dataclass
class TowerLoop:
    """A loop that builds one replica of the model per device.

    ``scopes`` are the device scopes that make it one: those in the loop's body, or, for a
    loop that only calls a tower function (``for i in range(n): build_tower(i)``, where
    ``build_tower`` opens ``tf.device('/gpu:%d' % i)`` on its parameter), that function's
    scopes, which then lie outside the loop. ``via`` lists such functions; nodes inside them
    count as inside the tower (``enclosing_tower``), and ``loop_names`` then also holds the
    names the function derives from its parameters.
    """

    loop: cst.For
    loop_names: set[str]  # the loop variables and names computed from them in the body
    scopes: list[DeviceScope] = field(default_factory=list)
    via: list[cst.FunctionDef] = field(default_factory=list)
    #: The function (or module) the loop is in.
    owner: cst.CSTNode | None = field(default=None, repr=False, compare=False)

    def contains(self, node: cst.CSTNode) -> bool:
        return contains(self.loop, node)


def loop_derived_names(loop: cst.For) -> set[str]:
    """Loop variables, plus names assigned (in the body) from expressions that use them."""
    return derived_names(loop.body, names_used(loop.target))


def derived_names(body: cst.CSTNode, seeds: set[str]) -> set[str]:
    """``seeds``, plus the names assigned in ``body`` from expressions that use them (to a
    fixed point: `dev = '/gpu:%d' % i; spec = dev + '/'` derives `dev` and `spec` from `i`)."""
    derived = set(seeds)
    assignments: list[tuple[set[str], set[str]]] = []  # (names bound, names read)
    items: list[cst.WithItem] = []
    for node in walk(body):  # one walk for the three kinds of node
        kind = type(node)
        if kind is cst.Assign:
            read = names_used(node.value)
            assignments += [(names_used(target.target), read) for target in node.targets]
        elif kind is cst.AnnAssign and node.value is not None:
            assignments.append((names_used(node.target), names_used(node.value)))
        elif kind is cst.WithItem:
            items.append(node)
        elif kind is cst.FunctionDef:
            # A device function defined in the loop, closing over its device (chqiwang/transformer's
            # `balanced_device_setter` returning `device`): its name is the loop's too.
            assignments.append(({node.name.value}, names_used(node.body)))
    changed = True
    while changed:
        changed = False
        for bound, read in assignments:
            if read & derived:
                new = bound - derived
                if new:
                    derived |= new
                    changed = True
    # `with tf.name_scope('tower_%d' % i) as scope:` binds a loop-derived name too.
    for item in items:
        if item.asname is not None and names_used(item.item) & derived:
            derived |= names_used(item.asname.name)
    return derived


def _builds_something(with_node: cst.With) -> bool:
    return any(isinstance(n, cst.Call) for n in walk(with_node.body))


@dataclass
class ModuleWalk:
    """What one walk of the module collects for the tower analysis."""

    scopes: list[tuple[DeviceScope, list[cst.For]]] = field(default_factory=list)
    listing_names: set[str] = field(default_factory=set)
    # Calls of a plain or `self.` function made inside a loop (same function), with the loops.
    loop_calls: list[tuple[cst.Call, str, list[cst.For]]] = field(default_factory=list)
    functions: dict[str, list[cst.FunctionDef]] = field(default_factory=dict)
    owner: dict[int, cst.CSTNode] = field(default_factory=dict)  # id(for) -> function or module
    # `while` loops, with the function (or module) they are in: towers are sometimes built by a
    # counter loop (analysis.tower_forms).
    whiles: list[tuple[cst.While, cst.CSTNode]] = field(default_factory=list)
    # Functions that open a device scope outside any loop of theirs: the tower functions a
    # comprehension may call once per device are among them.
    scoped_functions: list[cst.FunctionDef] = field(default_factory=list)


def _names_a_listing(text: str) -> bool:
    """Whether a source can call a TF2 device listing: any spelling of one (`tf.config.
    list_logical_devices`, `from tensorflow.config import list_logical_devices as lld`, an
    alias assignment, a star import then the bare name) has its name in the text."""
    return any(name.rsplit(".", 1)[1] in text for name in DEVICE_LISTINGS)


def _device_withs(module: cst.Module, imports: ImportTable, may_list_devices: bool = True) -> ModuleWalk:
    """One walk of the module: each device scope with the ``for`` loops around it (in the
    same function, outermost first), the names bound to a TF2 device listing, the calls
    made in loops and the functions they may call, and the function each loop is in."""
    loops: list[list[cst.For]] = [[]]  # a stack of enclosing loops per function
    owners: list[cst.CSTNode] = [module]
    walked = ModuleWalk()
    # `events(module)`, with two savings: a leave step only for the two node types that need
    # one, and no walk into an expression outside a loop (an expression holds no statement,
    # and its calls matter only in a loop).
    # Node types are compared with `is`: isinstance on LibCST's classes goes through ABCMeta.
    stack: list[tuple[cst.CSTNode, bool]] = [(module, True)]
    while stack:
        node, entering = stack.pop()
        kind = type(node)
        if entering and (loops[-1] or not _is_expression_part(kind)):
            if kind is cst.FunctionDef or kind is cst.For:
                stack.append((node, False))
            stack.extend((child, True) for child in reversed(children(node)))
        if kind is cst.FunctionDef:
            if entering:
                loops.append([])
                owners.append(node)
                walked.functions.setdefault(node.name.value, []).append(node)
            else:
                loops.pop()
                owners.pop()
        elif kind is cst.For:
            if entering:
                loops[-1].append(node)
                walked.owner[id(node)] = owners[-1]
            else:
                loops[-1].pop()
        elif not entering:
            continue
        elif kind is cst.While:
            walked.whiles.append((node, owners[-1]))
        elif kind is cst.With and loops[-1]:
            for item in node.items:
                device = device_scope_arg(item.item, imports)
                if device is not None:
                    walked.scopes.append((DeviceScope(node, device), list(loops[-1])))
        elif kind is cst.With and type(owners[-1]) is cst.FunctionDef:
            if any(device_scope_arg(item.item, imports) is not None for item in node.items):
                if not walked.scoped_functions or walked.scoped_functions[-1] is not owners[-1]:
                    walked.scoped_functions.append(owners[-1])
        elif kind is cst.Call and loops[-1] and node.args:
            name = callee_name(node)
            if name is not None:
                walked.loop_calls.append((node, name, list(loops[-1])))
        elif kind is cst.Assign and may_list_devices and _calls_device_listing(node.value, imports):
            for target in node.targets:
                walked.listing_names |= names_used(target.target)
    return walked


_EXPRESSION_PART: dict[type, bool] = {}


def _is_expression_part(kind: type) -> bool:
    """Whether nodes of this type hold expressions only (never a statement)."""
    answer = _EXPRESSION_PART.get(kind)
    if answer is None:
        answer = _EXPRESSION_PART[kind] = issubclass(
            kind, (cst.BaseExpression, cst.Arg, cst.Decorator, cst.Parameters, cst.Annotation, cst.WithItem)
        )
    return answer


def _colocates(device: cst.CSTNode) -> bool:
    """`tf.device(var.device)`, `tf.device(op.device)`: placing work next to an existing
    variable or op (per-variable gradient averaging), not one replica per device."""
    return isinstance(device, cst.Attribute) and device.attr.value == "device"


def _parameters(function: cst.FunctionDef) -> set[str]:
    params = function.params
    found = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
    found += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    return {p.name.value for p in found} - {"self", "cls"}


def tower_function(function: cst.FunctionDef, imports: ImportTable) -> tuple[set[str], list[DeviceScope]] | None:
    """(parameter-derived names, scopes) when ``function`` opens a device scope computed from
    its parameters and builds ops in it (`def tower(i): with tf.device('/gpu:%d' % i): ...`)."""
    scopes = device_scopes(function, imports)
    if not scopes:
        return None
    derived = derived_names(function.body, _parameters(function))
    kept = [
        scope
        for scope in scopes
        if names_used(scope.device) & derived
        and not mentions_only_cpu(scope.device, imports)
        and _builds_something(scope.with_node)
    ]
    return (derived, kept) if kept else None
def _calls_device_listing(node: cst.CSTNode, imports: ImportTable) -> bool:
    return any(imports.resolve(c.func) in DEVICE_LISTINGS for c in find(node, cst.Call))


def is_device_listing_loop(loop: cst.For, imports: ImportTable, listing_names: set[str] = frozenset()) -> bool:
    """``for gpu in tf.config.list_logical_devices('GPU'): with tf.device(gpu.name): ...``.

    TensorFlow's own GPU guide shows this loop for placing independent work (inference,
    benchmarks) on each device in TF2. It is not a TF1 tower loop: there is no graph, no
    variable reuse and no gradient averaging to migrate, so it is not a tower loop here."""
    return _calls_device_listing(loop.iter, imports) or bool(names_used(loop.iter) & listing_names)


def tower_loops(module: cst.Module, imports: ImportTable, text: str | None = None) -> list[TowerLoop]:
    """Loops that open a device scope depending on the loop variable and build ops in it,
    and loops that call a tower function with an argument computed from the loop variable.

    A loop that lists GPUs without placing anything on them, that places everything on
    one fixed device, that places only on CPUs, or that iterates over TF2's
    ``tf.config.list_logical_devices()``, is not a tower loop; nor is one that only moves
    data or updates per device (:func:`is_plumbing`). ``text``, the module's source when
    known, spares looking for those listings where it does not name them.
    """
    return classified_loops(module, imports, text)[0]


def classified_loops(module: cst.Module, imports: ImportTable, text: str | None = None):
    """(tower loops, per-device plumbing loops, the walk) of the module: see :func:`tower_loops`."""
    walked = _device_withs(module, imports, may_list_devices=text is None or _names_a_listing(text))
    listing_names = walked.listing_names
    candidates: dict[int, tuple[cst.For, list[DeviceScope]]] = {}
    for scope, loops in walked.scopes:
        for loop in loops:
            candidates.setdefault(id(loop), (loop, []))[1].append(scope)
    towers: dict[int, TowerLoop] = {}
    plumbing: list[TowerLoop] = []
    derived_of: dict[int, set[str]] = {}

    def derived(loop: cst.For) -> set[str]:
        if id(loop) not in derived_of:
            derived_of[id(loop)] = loop_derived_names(loop)
        return derived_of[id(loop)]

    for loop, scopes in candidates.values():
        if is_device_listing_loop(loop, imports, listing_names):
            continue
        kept = [
            scope
            for scope in scopes
            if not _colocates(scope.device)
            and (names_used(scope.device) & derived(loop) or _next_device_each_tower(scope.device, loop, walked, imports))
            and not mentions_only_cpu(scope.device, imports)
            and _builds_something(scope.with_node)
        ]
        if kept and is_plumbing(loop, imports):
            plumbing.append(TowerLoop(loop=loop, loop_names=derived(loop), scopes=kept))
        elif kept:
            towers[id(loop)] = TowerLoop(loop=loop, loop_names=derived(loop), scopes=kept)
    _add_tower_function_loops(walked, imports, towers, derived)
    order = {key: index for index, key in enumerate(walked.owner)}  # pre-order of the loops
    ordered = sorted(towers.values(), key=lambda t: order.get(id(t.loop), 0))
    for tower in ordered:
        tower.owner = walked.owner.get(id(tower.loop))
    # A tower loop nested in another tower loop (rare) is reported once, at the outer loop.
    nested = {id(loop) for tower in ordered for loop in find(tower.loop.body, cst.For)}
    for loop in plumbing:
        loop.owner = walked.owner.get(id(loop.loop))
    return [tower for tower in ordered if id(tower.loop) not in nested], plumbing, walked


def _next_device_each_tower(device: cst.CSTNode, loop: cst.For, walked: ModuleWalk, imports: ImportTable) -> bool:
    """`tf.device(self._next_device())` in a loop that computes gradients (textsum's round robin):
    a call, with no arguments, of a function of the module that names a GPU and moves a counter
    of its own (`self._cur_gpu = ...`, or a global): each call names the next device. Textsum also
    places an encoder's layers this way, one per GPU, which is no replica: those loops compute no
    gradients."""
    if not isinstance(device, cst.Call) or device.args:
        return False
    name = callee_name(device)
    functions = walked.functions.get(name or "", [])
    if len(functions) != 1 or not any("gpu" in s.value.lower() for s in find(functions[0], cst.SimpleString)):
        return False
    globals_ = {n.name.value for g in find(functions[0], cst.Global) for n in g.names if isinstance(n.name, cst.Name)}
    targets = [node.target for node in find(functions[0], cst.AssignTarget, cst.AugAssign)]
    moves = any((isinstance(t, cst.Attribute) and code(t.value) == "self")
                or (isinstance(t, cst.Name) and t.value in globals_) for t in targets)
    return moves and any(computes_gradients(node, imports) for node in walk(loop.body))


# What a per-device loop may call and still only move data or updates between devices: apply
# gradients, assign, create or feed queues and staging areas, pack, copy and group tensors.
_PLUMBING_METHODS = {
    "apply_gradients", "assign", "assign_add", "assign_sub", "put", "get", "enqueue", "enqueue_many",
    "dequeue", "dequeue_many", "dequeue_up_to", "close", "size", "append", "extend", "get_shape", "as_list",
    "format",  # an op's name: `name='apply_grad_{}'.format(idx)`
}
_PLUMBING_FUNCTIONS = {
    "identity", "concat", "split", "reshape", "group", "stack", "unstack", "tuple", "no_op", "add_n",
    "control_dependencies", "Variable", "get_variable", "zeros", "ones", "zeros_like", "cast", "shape", "size",
    "FIFOQueue", "RandomShuffleQueue", "PaddingFIFOQueue", "PriorityQueue", "StagingArea", "colocate_with",
    "name_scope", "device", "len", "range", "enumerate", "zip", "list", "int", "str", "print",
}


def is_plumbing(loop: cst.For, imports: ImportTable) -> bool:
    """Whether a per-device loop only moves data or updates between devices (a harness's
    per-device `apply_gradients`, queues or staging areas made per GPU, gradient packing)
    instead of building a model replica: every call in it is such a step, and there is one.
    The calls that open a `with` block are its scopes (tensorpack's
    `override_to_local_variable(enable=idx > 0)` around a per-device `apply_gradients`), not
    its work, so they decide nothing."""
    calls = [n for n in walk(loop.body) if isinstance(n, cst.Call)]
    if not calls or any(isinstance(n, (cst.FunctionDef, cst.Lambda)) for n in walk(loop.body)):
        return False
    scopes = {id(n) for item in find(loop.body, cst.WithItem) if not _opens_device(item, imports) for n in walk(item)}
    for call in calls:
        if id(call) in scopes:
            continue
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in _PLUMBING_METHODS:
            continue
        resolved = imports.resolve(func) or ""
        name = resolved.rsplit(".", 1)[-1] if resolved else (func.value if isinstance(func, cst.Name) else "")
        # An optimizer made per device for that device's `apply_gradients` (replicated variables
        # updated each on its own GPU after an all-reduce) builds no model either.
        if name not in _PLUMBING_FUNCTIONS and not (resolved.startswith("tensorflow.") and name.endswith("Optimizer")):
            return False
    return True


def _opens_device(item: cst.WithItem, imports: ImportTable) -> bool:
    call = item.item
    return isinstance(call, cst.Call) and (imports.resolve(call.func) or "").endswith(".device")


def _add_tower_function_loops(walked: ModuleWalk, imports: ImportTable, towers: dict[int, TowerLoop], derived) -> None:
    """`for i in range(num_gpus): towers.append(build_tower(i))`, where `build_tower` opens
    `tf.device('/gpu:%d' % i)` on its parameter: a tower loop through a tower function."""
    analysed: dict[int, tuple[set[str], list[DeviceScope]] | None] = {}
    for call, name, loops in walked.loop_calls:
        functions = walked.functions.get(name)
        if not functions:
            continue
        for function in functions:
            if id(function) not in analysed:
                analysed[id(function)] = tower_function(function, imports)
            found = analysed[id(function)]
            if found is None:
                continue
            function_names, scopes = found
            on_gpu = any(mentions_gpu(scope.device, imports) for scope in scopes)
            for loop in loops:
                if walked.owner.get(id(loop)) is function:
                    continue  # a loop inside the tower function itself
                if is_device_listing_loop(loop, imports, walked.listing_names):
                    continue
                if not (on_gpu or looks_per_device(loop.iter)):
                    continue
                if not any(names_used(arg.value) & derived(loop) for arg in call.args):
                    continue
                tower = towers.get(id(loop))
                if tower is None:
                    tower = towers[id(loop)] = TowerLoop(
                        loop=loop, loop_names=set(derived(loop)), scopes=list(scopes)
                    )
                if all(f is not function for f in tower.via):
                    tower.via.append(function)
                    tower.loop_names = tower.loop_names | function_names
            break
def describe_device(node: cst.CSTNode, module: cst.Module) -> str:
    code = module.code_for_node(node)
    return code if len(code) <= 60 else code[:57] + "..."


def looks_per_device(iterable: cst.CSTNode) -> bool:
    """Whether a loop's iterable reads as one iteration per device: `range(FLAGS.num_gpus)`,
    `enumerate(devices)`, `range(len(gpus))`, `range(n_towers)`."""
    return any(_PER_DEVICE_WORDS.search(word) for word in identifiers(iterable) | set(string_parts(iterable)))


# --- memoized per file ------------------------------------------------------------------


def module_tower_loops(context) -> list[TowerLoop]:
    """The tower loops of the module a rule is checking, computed once per run."""
    return _module_loops(context)[0]


def module_plumbing_loops(context) -> list[TowerLoop]:
    """The per-device loops of the module that are not tower loops (:func:`is_plumbing`)."""
    return _module_loops(context)[1]


def module_walk(context) -> ModuleWalk:
    """The walk the tower analysis made of the module (while loops, tower functions, ...)."""
    return _module_loops(context)[2]


def _module_loops(context):
    return context.memo("tower_loops", lambda: classified_loops(context.module, context.imports, text=context.text))


def _tower_membership(context) -> dict[int, TowerLoop]:
    """id(node) -> the tower loop it lies in, for every node inside a tower loop (or inside a
    tower function that a tower loop calls)."""

    def compute() -> dict[int, TowerLoop]:
        members: dict[int, TowerLoop] = {}
        for tower in module_tower_loops(context):
            for node in walk(tower.loop):
                members[id(node)] = tower
        for tower in module_tower_loops(context):
            for function in tower.via:
                for node in walk(function.body):
                    members.setdefault(id(node), tower)
        return members

    return context.memo("tower_membership", compute)


def enclosing_tower(context, node: cst.CSTNode) -> TowerLoop | None:
    """The tower loop that ``node`` lies in (or is), else None."""
    return _tower_membership(context).get(id(node))


def tower_loop_at(context, loop: cst.CSTNode) -> TowerLoop | None:
    """The tower loop whose ``for`` statement is ``loop``, else None."""
    tower = enclosing_tower(context, loop)
    return tower if tower is not None and tower.loop is loop else None


def _filled_names(loop: cst.For) -> set[str]:
    """Names a loop's body fills or binds: `out.append(..)`, `out[i] = ..`, `x = ..`."""
    found: set[str] = set()
    for node in walk(loop.body):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            if node.func.attr.value in ("append", "extend", "insert", "add", "update", "setdefault"):
                found |= names_used(node.func.value)
        elif isinstance(node, cst.Assign):
            for target in node.targets:
                found |= names_used(target.target)
        elif isinstance(node, (cst.AugAssign, cst.AnnAssign)):
            found |= names_used(node.target)
    return found


def collected_names(loop: cst.For) -> set[str]:
    """Names a loop collects results in: `out.append(..)` (`extend`, `insert`), `out[i] = ..`,
    `out += ..`."""
    found: set[str] = set()
    for node in walk(loop.body):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            if node.func.attr.value in ("append", "extend", "insert"):
                found |= _base_names(node.func.value)
        elif isinstance(node, cst.Assign):
            for target in node.targets:
                if isinstance(target.target, cst.Subscript):
                    found |= _base_names(target.target)
        elif isinstance(node, cst.AugAssign):
            found |= _base_names(node.target)
    return found


def computes_gradients(node: cst.CSTNode | None, imports: ImportTable | None) -> bool:
    """`opt.compute_gradients(...)`, or `tf.gradients(...)` (told only with the module's ``imports``)."""
    return isinstance(node, cst.Call) and (
        (isinstance(node.func, cst.Attribute) and node.func.attr.value == "compute_gradients")
        or (imports is not None and imports.resolve(node.func) == "tensorflow.gradients"))


def gradient_lists(loop: cst.For, imports: ImportTable) -> set[str]:
    """The lists a loop collects gradients in: `tower_grads.append(opt.compute_gradients(loss))`,
    or of a name the body binds to such a call (`grads = tf.gradients(loss, params)`). What is
    stacked from them after the loop is an average of gradients, not the towers' outputs joined."""
    computed = {name for node in walk(loop.body) if isinstance(node, cst.Assign) and computes_gradients(node.value, imports)
                for target in node.targets for name in names_used(target.target)}
    found: set[str] = set()
    for node in walk(loop.body):
        if (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "append"
                and len(node.args) == 1):
            value = node.args[0].value
            if computes_gradients(value, imports) or (isinstance(value, cst.Name) and value.value in computed):
                found |= _base_names(node.func.value)
    return found


def _base_names(node: cst.CSTNode) -> set[str]:
    while isinstance(node, (cst.Subscript, cst.Attribute)):
        node = node.value
    return {node.value} if isinstance(node, cst.Name) else set()


def tower_collections(context) -> frozenset[str]:
    """Every name a tower loop of the module collects its towers' results in."""
    return context.memo(
        "tower_collections",
        lambda: frozenset().union(*(collected_names(t.loop) for t in module_tower_loops(context))),
    )


def _reads(node: cst.CSTNode) -> set[str]:
    """Plain names an expression or block reads (keyword argument names excluded)."""
    return names_used(node, keywords=False) - {"True", "False", "None"}


def iteration_key(iterable: cst.CSTNode, module: cst.Module) -> str:
    """What a loop iterates over, spelled one way: `enumerate(X)` and `range(len(X))` are X,
    `range(0, n)` and `xrange(n)` are `range(n)`."""
    node = iterable
    while True:
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
            args = [a.value for a in node.args if a.keyword is None and not a.star]
            if node.func.value in ("enumerate", "list", "tuple") and len(args) == 1:
                node = args[0]
                continue
            if node.func.value in ("range", "xrange") and len(args) == 2 and isinstance(args[0], cst.Integer) and args[0].value == "0":
                return "range(" + "".join(module.code_for_node(args[1]).split()) + ")"
            if node.func.value == "xrange" and len(args) == 1:
                return "range(" + "".join(module.code_for_node(args[0]).split()) + ")"
            if node.func.value == "range" and len(args) == 1 and isinstance(args[0], cst.Call):
                inner = args[0]
                if isinstance(inner.func, cst.Name) and inner.func.value == "len" and len(inner.args) == 1:
                    node = inner.args[0].value
                    continue
        return "".join(module.code_for_node(node).split())


def tower_groups(context) -> dict[int, list[TowerLoop]]:
    """id(tower loop) -> the loops that build the same towers, in source order.

    Towers are often built in several loops over the same devices: the model in one, the
    loss in the next, the gradients in a third, each reading what the one before filled
    (`logits[i]`). Loops in the same function, over the same devices (`range(num_gpus)`,
    `enumerate(gpus)` and `range(len(gpus))` are the same), where each later loop reads a
    name an earlier one fills, are one group. A loop alone is a group of one."""

    def compute() -> dict[int, list[TowerLoop]]:
        towers = module_tower_loops(context)
        groups: dict[int, list[TowerLoop]] = {id(t.loop): [t] for t in towers}
        if len(towers) < 2:
            return groups
        open_groups: dict[tuple[int, str], list[tuple[list[TowerLoop], set[str]]]] = {}
        for tower in towers:
            key = (id(tower.owner), iteration_key(tower.loop.iter, context.module))
            filled = _filled_names(tower.loop)
            used = _reads(tower.loop.body) - filled  # what it reads, not what it collects in
            for group, group_filled in open_groups.get(key, []):
                if used & group_filled:
                    group.append(tower)
                    group_filled |= filled
                    groups[id(tower.loop)] = group
                    break
            else:
                group = groups[id(tower.loop)]
                open_groups.setdefault(key, []).append((group, set(filled)))
        return groups

    return context.memo("tower_groups", compute)


def tower_group(context, loop: cst.CSTNode) -> list[TowerLoop]:
    """The tower loops building the same towers as the tower loop at ``loop`` (itself
    included, first loop first); empty when ``loop`` is not a tower loop."""
    return tower_groups(context).get(id(loop), [])


def method_tower_group(context, loop: cst.CSTNode) -> list[TowerLoop]:
    """The tower loops of one class that build the same towers across its methods, in the order
    they run, the loop at ``loop`` included (Tacotron-2: `initialize` fills
    `self.tower_decoder_output` per tower, `add_loss` reads it and fills `self.tower_loss`,
    `add_optimizer` reads that). A loop runs after the loops whose results it reads, so the
    first is the one loop that reads none of the others'. Empty when ``loop`` shares nothing
    across methods, or the loops do not make such a chain (two in one method, two that could
    run first, a cycle)."""
    parents = module_parents(context)
    home = enclosing_class(loop, parents)
    if home is None:
        return []
    loops = [t for t in module_tower_loops(context) if enclosing_class(t.loop, parents) is home]
    reads = {id(t.loop): {code(node) for node in find(t.loop.body, cst.Attribute)} for t in loops}
    fills = {id(t.loop): self_results(t.loop) for t in loops}

    def feeds(first: TowerLoop, later: TowerLoop) -> bool:
        return first is not later and bool(fills[id(first.loop)] & reads[id(later.loop)])

    members = [t for t in loops if t.loop is loop]
    grown = True
    while grown:
        linked = [t for t in loops if t not in members and any(feeds(t, m) or feeds(m, t) for m in members)]
        members += linked
        grown = bool(linked)
    ordered: list[TowerLoop] = []
    pending = sorted(members, key=lambda t: loops.index(t))
    while pending:
        ready = [t for t in pending if not any(feeds(other, t) for other in pending)]
        if len(ready) != 1 and not (ordered and ready):
            return []  # no loop or two loops could run first, or a cycle
        ordered.append(ready[0])
        pending.remove(ready[0])
    if len(ordered) < 2 or len({id(t.owner) for t in ordered}) != len(ordered):
        return []
    if len({iteration_key(t.loop.iter, context.module) for t in ordered}) > 1:
        return []  # over different devices (or spelled so): not one set of replicas
    return ordered


def enclosing_class(node: cst.CSTNode, parents: dict) -> cst.ClassDef | None:
    return enclosing(node, parents, cst.ClassDef)


def self_results(loop: cst.For) -> set[str]:
    """`self.<name>` chains the loop collects its towers' results in (`self.x.append(...)`,
    `self.x[i] = ...`)."""
    found = set()
    for node in find(loop.body, cst.Call, cst.Assign):
        if isinstance(node, cst.Call):
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value in ("append", "extend", "insert"):
                found.add(code(func.value))
        else:
            found.update(code(t.target.value) for t in node.targets if isinstance(t.target, cst.Subscript))
    return {name for name in found if name.startswith("self.")}


def _per_device_names(context) -> dict[int, frozenset[str]]:
    """id(node) -> the loop-derived names of the per-device loops around it: tower loops, and
    `for` loops or comprehensions whose iterable reads as one iteration per device
    (`looks_per_device`)."""

    def compute() -> dict[int, frozenset[str]]:
        found: dict[int, frozenset[str]] = {}

        stack: list[frozenset[str]] = [frozenset()]
        opened: set[int] = set()
        for node, entering in events(context.module):
            if not entering:
                if id(node) in opened:
                    stack.pop()
                continue
            names = _opened_names(context, node)
            if names:
                stack.append(stack[-1] | names)
                opened.add(id(node))
            if len(stack) > 1:
                found[id(node)] = stack[-1]
        return found

    return context.memo("per_device_names", compute)


def _comprehension_names(comp: cst.CompFor) -> frozenset[str] | None:
    names: set[str] = set()
    while comp is not None:
        if looks_per_device(comp.iter):
            names |= names_used(comp.target)
        comp = comp.inner_for_in
    return frozenset(names) or None


def per_device_names(context, node: cst.CSTNode) -> frozenset[str]:
    """The loop variables (and names derived from them) of the per-device loops around
    ``node``; empty when ``node`` is in none."""
    parents = context.parents
    if id(node) not in parents:  # not from the rules' walk: every node's names, in one walk
        return _per_device_names(context).get(id(node), frozenset())
    # From the node up through its parents (what the rules' walk has recorded so far).
    opened: dict[int, frozenset[str] | None] = context.memo("per_device_names_opened", dict)
    names: frozenset[str] = frozenset()
    current = node
    while current is not None:
        key = id(current)
        if key not in opened:
            opened[key] = _opened_names(context, current)
        if opened[key]:
            names |= opened[key]
        current = parents.get(key)
    return names


def _opened_names(context, node: cst.CSTNode) -> frozenset[str] | None:
    """The names a per-device loop or comprehension at ``node`` opens, else None."""
    towers = context.memo("tower_loop_ids", lambda: {id(t.loop): t for t in module_tower_loops(context)})
    if id(node) in towers:
        return frozenset(towers[id(node)].loop_names)
    if isinstance(node, cst.For) and looks_per_device(node.iter):
        return frozenset(loop_derived_names(node))
    if isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
        return _comprehension_names(node.for_in)
    return None
