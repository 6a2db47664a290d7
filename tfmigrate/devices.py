"""Device placement analysis shared by the rules: which ``with`` opens a device scope, whether
a device expression names a GPU, and which loops build one tower per device.

Rules ask for these through ``RuleContext.memo`` (``module_tower_loops``, ``enclosing_tower``,
``tower_loop_at``) so a module is analysed once per run, in a number of tree walks that does
not grow with the number of rules or of nodes asked about.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Iterator

import libcst as cst

from tfmigrate.names import ImportTable

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


# --- fast traversal ------------------------------------------------------------------------
# `CSTNode.visit` rebuilds every node it passes (a full walk costs about as much as parsing),
# and matcher `findall` adds more on top. The analysis here only reads the tree, so it walks
# the dataclass fields directly and skips whitespace and punctuation.

_LEAVES = (
    cst.BaseParenthesizableWhitespace,
    cst.TrailingWhitespace,
    cst.EmptyLine,
    cst.Newline,
    cst.Comment,
    cst.Comma,
    cst.Dot,
    cst.LeftParen,
    cst.RightParen,
    cst.AssignEqual,
    cst.Colon,
    cst.Semicolon,
)
_FIELDS: dict[type, tuple[str, ...]] = {}


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The child nodes of ``node`` that can hold code, in source order."""
    names = _FIELDS.get(type(node))
    if names is None:
        names = _FIELDS[type(node)] = tuple(f.name for f in dataclasses.fields(node))
    found: list[cst.CSTNode] = []
    for name in names:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            if not isinstance(value, _LEAVES):
                found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, cst.CSTNode) and not isinstance(v, _LEAVES))
    return found


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """``node`` and every node under it, in pre-order."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(children(current)))


def events(node: cst.CSTNode) -> Iterator[tuple[cst.CSTNode, bool]]:
    """(node, True) on entering and (node, False) on leaving each node under ``node``."""
    stack: list[tuple[cst.CSTNode, bool]] = [(node, True)]
    while stack:
        current, entering = stack.pop()
        yield current, entering
        if entering:
            stack.append((current, False))
            stack.extend((child, True) for child in reversed(children(current)))


def find(node: cst.CSTNode, *types: type) -> list:
    """Every node of the given types under ``node`` (``node`` included)."""
    return [n for n in walk(node) if isinstance(n, types)]


def names_used(node: cst.CSTNode) -> set[str]:
    """Every plain name read in an expression (attribute names like ``x.gpu`` excluded)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.Name):
            found.add(current.value)
        elif isinstance(current, cst.Attribute):
            stack.append(current.value)
        else:
            stack.extend(children(current))
    return found


def identifiers(node: cst.CSTNode) -> set[str]:
    """Every name and attribute name in an expression (``FLAGS.num_gpus`` gives both)."""
    return {n.value for n in find(node, cst.Name)}


def contains(ancestor: cst.CSTNode, node: cst.CSTNode) -> bool:
    """Whether ``node`` (by identity) is ``ancestor`` or lies inside it (one walk: prefer
    ``enclosing_tower`` when asking about many nodes)."""
    return any(candidate is node for candidate in walk(ancestor))


def string_parts(node: cst.CSTNode) -> list[str]:
    """The literal text in an expression: strings, f-string pieces, concatenations."""
    return [s.value for s in find(node, cst.SimpleString, cst.FormattedStringText)]


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
    ``ps_device=`` argument (where variables go, `assign_to_device(d, ps_device='/cpu:0')`)
    says nothing about where the ops go, so it is left out."""
    if isinstance(node, cst.Call) and not is_device_spec(node, imports):
        kept = [a.value for a in node.args if not (a.keyword and a.keyword.value == "ps_device")]
        return " ".join(" ".join(string_parts(v)) for v in kept).lower()
    return " ".join(string_parts(node)).lower()


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
    """A loop that builds one replica of the model per device."""

    loop: cst.For
    loop_names: set[str]  # the loop variables and names computed from them in the body
    scopes: list[DeviceScope] = field(default_factory=list)

    def contains(self, node: cst.CSTNode) -> bool:
        return contains(self.loop, node)


def loop_derived_names(loop: cst.For) -> set[str]:
    """Loop variables, plus names assigned (in the body) from expressions that use them."""
    return derived_names(loop.body, names_used(loop.target))


def derived_names(body: cst.CSTNode, seeds: set[str]) -> set[str]:
    """``seeds``, plus the names assigned in ``body`` from expressions that use them (to a
    fixed point: `dev = '/gpu:%d' % i; spec = dev + '/'` derives `dev` and `spec` from `i`)."""
    derived = set(seeds)
    assignments = [
        (target.target, assign.value)
        for assign in find(body, cst.Assign)
        for target in assign.targets
    ]
    assignments += [(a.target, a.value) for a in find(body, cst.AnnAssign) if a.value]
    changed = True
    while changed:
        changed = False
        for target, value in assignments:
            if names_used(value) & derived:
                new = names_used(target) - derived
                if new:
                    derived |= new
                    changed = True
    # `with tf.name_scope('tower_%d' % i) as scope:` binds a loop-derived name too.
    for item in find(body, cst.WithItem):
        if item.asname is not None and names_used(item.item) & derived:
            derived |= names_used(item.asname.name)
    return derived


def _builds_something(with_node: cst.With) -> bool:
    return any(isinstance(n, cst.Call) for n in walk(with_node.body))


def _device_withs(module: cst.Module, imports: ImportTable):
    """One walk of the module: each device scope with the ``for`` loops around it (in the
    same function, outermost first), and the names bound to a TF2 device listing."""
    loops: list[list[cst.For]] = [[]]  # a stack of enclosing loops per function
    found: list[tuple[DeviceScope, list[cst.For]]] = []
    listing_names: set[str] = set()
    for node, entering in events(module):
        if isinstance(node, cst.FunctionDef):
            if entering:
                loops.append([])
            else:
                loops.pop()
        elif isinstance(node, cst.For):
            if entering:
                loops[-1].append(node)
            else:
                loops[-1].pop()
        elif isinstance(node, cst.With) and entering and loops[-1]:
            for item in node.items:
                device = device_scope_arg(item.item, imports)
                if device is not None:
                    found.append((DeviceScope(node, device), list(loops[-1])))
        elif isinstance(node, cst.Assign) and entering and _calls_device_listing(node.value, imports):
            for target in node.targets:
                listing_names |= names_used(target.target)
    return found, listing_names


def _calls_device_listing(node: cst.CSTNode, imports: ImportTable) -> bool:
    return any(imports.resolve(c.func) in DEVICE_LISTINGS for c in find(node, cst.Call))


def is_device_listing_loop(loop: cst.For, imports: ImportTable, listing_names: set[str] = frozenset()) -> bool:
    """``for gpu in tf.config.list_logical_devices('GPU'): with tf.device(gpu.name): ...``.

    TensorFlow's own GPU guide shows this loop for placing independent work (inference,
    benchmarks) on each device in TF2. It is not a TF1 tower loop: there is no graph, no
    variable reuse and no gradient averaging to migrate, so it is not a tower loop here."""
    return _calls_device_listing(loop.iter, imports) or bool(names_used(loop.iter) & listing_names)


def tower_loops(module: cst.Module, imports: ImportTable) -> list[TowerLoop]:
    """Loops that open a device scope depending on the loop variable and build ops in it.

    A loop that lists GPUs without placing anything on them, that places everything on
    one fixed device, that places only on CPUs, or that iterates over TF2's
    ``tf.config.list_logical_devices()``, is not a tower loop.
    """
    found, listing_names = _device_withs(module, imports)
    candidates: dict[int, tuple[cst.For, list[DeviceScope]]] = {}
    for scope, loops in found:
        for loop in loops:
            candidates.setdefault(id(loop), (loop, []))[1].append(scope)
    towers: list[TowerLoop] = []
    for loop, scopes in candidates.values():
        if is_device_listing_loop(loop, imports, listing_names):
            continue
        derived = loop_derived_names(loop)
        kept = [
            scope
            for scope in scopes
            if names_used(scope.device) & derived
            and not mentions_only_cpu(scope.device, imports)
            and _builds_something(scope.with_node)
        ]
        if kept:
            towers.append(TowerLoop(loop=loop, loop_names=derived, scopes=kept))
    # A tower loop nested in another tower loop (rare) is reported once, at the outer loop.
    nested = {id(loop) for tower in towers for loop in find(tower.loop.body, cst.For)}
    return [tower for tower in towers if id(tower.loop) not in nested]


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
    return context.memo("tower_loops", lambda: tower_loops(context.module, context.imports))


def _tower_membership(context) -> dict[int, TowerLoop]:
    """id(node) -> the tower loop it lies in, for every node inside a tower loop."""

    def compute() -> dict[int, TowerLoop]:
        members: dict[int, TowerLoop] = {}
        for tower in module_tower_loops(context):
            for node in walk(tower.loop):
                members[id(node)] = tower
        return members

    return context.memo("tower_membership", compute)


def enclosing_tower(context, node: cst.CSTNode) -> TowerLoop | None:
    """The tower loop that ``node`` lies in (or is), else None."""
    return _tower_membership(context).get(id(node))


def tower_loop_at(context, loop: cst.CSTNode) -> TowerLoop | None:
    """The tower loop whose ``for`` statement is ``loop``, else None."""
    tower = enclosing_tower(context, loop)
    return tower if tower is not None and tower.loop is loop else None


def _per_device_names(context) -> dict[int, frozenset[str]]:
    """id(node) -> the loop-derived names of the per-device loops around it: tower loops, and
    `for` loops or comprehensions whose iterable reads as one iteration per device
    (`looks_per_device`)."""

    def compute() -> dict[int, frozenset[str]]:
        towers = {id(t.loop): t for t in module_tower_loops(context)}
        found: dict[int, frozenset[str]] = {}

        stack: list[frozenset[str]] = [frozenset()]
        opened: set[int] = set()
        for node, entering in events(context.module):
            if not entering:
                if id(node) in opened:
                    stack.pop()
                continue
            names: frozenset[str] | None = None
            if id(node) in towers:
                names = frozenset(towers[id(node)].loop_names)
            elif isinstance(node, cst.For) and looks_per_device(node.iter):
                names = frozenset(loop_derived_names(node))
            elif isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
                names = _comprehension_names(node.for_in)
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
    return _per_device_names(context).get(id(node), frozenset())
