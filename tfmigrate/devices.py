"""Device placement analysis shared by the rules: which ``with`` opens a device scope, whether
a device expression names a GPU, and which loops build one tower per device.

Rules ask for these through ``RuleContext.memo`` so a module is analysed once per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from tfmigrate.names import ImportTable

DEVICE_SCOPES = {"tensorflow.device", "tensorflow.device_scope"}
DEVICE_SPECS = {"tensorflow.DeviceSpec", "tensorflow.python.framework.device_spec.DeviceSpecV1"}


def names_used(node: cst.CSTNode) -> set[str]:
    """Every plain name read in an expression (attribute names like ``x.gpu`` excluded)."""
    found: set[str] = set()

    class Collect(cst.CSTVisitor):
        def visit_Attribute(self, attr: cst.Attribute) -> bool:
            attr.value.visit(self)
            return False

        def visit_Name(self, name: cst.Name) -> None:
            found.add(name.value)

    node.visit(Collect())
    return found


class _Found(Exception):
    pass


def contains(ancestor: cst.CSTNode, node: cst.CSTNode) -> bool:
    """Whether ``node`` (by identity) is ``ancestor`` or lies inside it."""

    class Search(cst.CSTVisitor):
        def on_visit(self, candidate: cst.CSTNode) -> bool:
            if candidate is node:
                raise _Found
            return True

    try:
        ancestor.visit(Search())
    except _Found:
        return True
    return False


def string_parts(node: cst.CSTNode) -> list[str]:
    """The literal text in an expression: strings, f-string pieces, concatenations."""
    parts: list[str] = []
    for s in m.findall(node, m.SimpleString() | m.FormattedStringText()):
        parts.append(s.value)
    return parts


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


def mentions_gpu(node: cst.CSTNode, imports: ImportTable) -> bool:
    text = " ".join(string_parts(node)).lower()
    if "gpu" in text:
        return True
    for call in m.findall(node, m.Call()):
        if is_device_spec(call, imports):
            for arg in call.args:
                if arg.keyword is None or arg.keyword.value == "device_type":
                    if "gpu" in " ".join(string_parts(arg.value)).lower():
                        return True
    return False


def mentions_only_cpu(node: cst.CSTNode, imports: ImportTable) -> bool:
    text = " ".join(string_parts(node)).lower()
    return "cpu" in text and not mentions_gpu(node, imports)


@dataclass
class DeviceScope:
    with_node: cst.With
    device: cst.BaseExpression


def device_scopes(node: cst.CSTNode, imports: ImportTable) -> list[DeviceScope]:
    """Every ``with`` under ``node`` that opens a device scope (not looking into nested defs)."""
    scopes: list[DeviceScope] = []

    class Collect(cst.CSTVisitor):
        def visit_FunctionDef(self, fn: cst.FunctionDef) -> bool:
            return fn is node

        def visit_With(self, with_node: cst.With) -> None:
            for item in with_node.items:
                device = device_scope_arg(item.item, imports)
                if device is not None:
                    scopes.append(DeviceScope(with_node, device))

    node.visit(Collect())
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
    derived = names_used(loop.target)
    assignments = [
        (target, assign.value)
        for assign in m.findall(loop.body, m.Assign())
        for target in assign.targets
    ]
    changed = True
    while changed:
        changed = False
        for target, value in assignments:
            if names_used(value) & derived:
                new = names_used(target.target) - derived
                if new:
                    derived |= new
                    changed = True
    # `with tf.name_scope('tower_%d' % i) as scope:` binds a loop-derived name too.
    for item in m.findall(loop.body, m.WithItem()):
        if item.asname is not None and names_used(item.item) & derived:
            derived |= names_used(item.asname.name)
    return derived


def _builds_something(with_node: cst.With) -> bool:
    return bool(m.findall(with_node.body, m.Call()))


def tower_loops(module: cst.Module, imports: ImportTable) -> list[TowerLoop]:
    """Loops that open a device scope depending on the loop variable and build ops in it.

    A loop that lists GPUs without placing anything on them, or that places everything on
    one fixed device, is not a tower loop.
    """
    towers: list[TowerLoop] = []
    for loop in m.findall(module, m.For()):
        derived = loop_derived_names(loop)
        scopes = [
            scope
            for scope in device_scopes(loop.body, imports)
            if names_used(scope.device) & derived
            and not mentions_only_cpu(scope.device, imports)
            and _builds_something(scope.with_node)
        ]
        if scopes:
            towers.append(TowerLoop(loop=loop, loop_names=derived, scopes=scopes))
    # A tower loop nested in another tower loop (rare) is reported once, at the outer loop.
    outer = [t for t in towers if not any(o is not t and o.contains(t.loop) for o in towers)]
    return outer


def describe_device(node: cst.CSTNode, module: cst.Module) -> str:
    code = module.code_for_node(node)
    return code if len(code) <= 60 else code[:57] + "..."


def module_tower_loops(context) -> list[TowerLoop]:
    """The tower loops of the module a rule is checking, computed once per run."""
    return context.memo("tower_loops", lambda: tower_loops(context.module, context.imports))


def enclosing_tower(context, node: cst.CSTNode) -> TowerLoop | None:
    for tower in module_tower_loops(context):
        if tower.contains(node):
            return tower
    return None
