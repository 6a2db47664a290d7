"""Where a tower loop sits, and what its code binds, collects and reaches.

The pieces every part of the general tower rewrite (:mod:`.replica_loop`) reads: the loop's
:class:`Region` (its function or module, the statements around it), the simple statements of
a piece of code in the order they run, the lists the towers fill (`tower_grads.append(...)`),
the module's functions a piece of code calls, and the :class:`Update` the rewrite builds.
Read-only: nothing here changes the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.analysis.devices import computes_gradients, device_scope_arg, enclosing_class
from tfmigrate.analysis.training import called_functions, module_functions
from tfmigrate.cst.callargs import callee_name, method_call
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import (
    contains, find, find_own, module_parents, names_used, own_nodes, scope_bindings, single_small, walk,
)


@dataclass
class Region:
    """Where the loop sits: its function (or module), and the statements that follow it."""

    loop: cst.For
    owner: cst.CSTNode  # FunctionDef or Module
    parents: dict
    following: list[cst.BaseStatement]  # statements after the loop, in the blocks up to the owner
    preceding: list[cst.BaseStatement]  # statements before it, same blocks, nearest last
    # Methods whose bodies ``following`` also holds: they run after the loop, called by the
    # method that called the one with the loop (a trainer's `_build_update()`).
    reaches: list[cst.FunctionDef] = field(default_factory=list)
    # Those of them the class's user calls (carpedm20 DCGAN's `train()`): they run under the
    # strategy kept on `self`.
    external: list[cst.FunctionDef] = field(default_factory=list)
    # For a caller's region: its call of the function with the loop (its arguments give the
    # parameters the towers' devices read).
    call: cst.Call | None = None


def loop_region(context, loop: cst.For, owner: cst.CSTNode, imports) -> Region:
    """The :class:`Region` of ``loop`` in ``owner`` (its function, or the module)."""
    parents = module_parents(context)
    following, preceding = [], []
    node = loop
    while node is not owner:
        parent = parents[id(node)]
        if isinstance(parent, (cst.IndentedBlock, cst.Module)):
            statements = list(parent.body)
            at = index_of(statements, node)
            following += statements[at + 1:]
            preceding = statements[:at] + preceding
        node = parent
    return Region(loop=loop, owner=owner, parents=parents, following=open_device_blocks(following, imports),
                   preceding=open_device_blocks(preceding, imports))


def open_device_blocks(statements, imports) -> list[cst.BaseStatement]:
    """``statements`` with `with tf.device('/gpu:0'):` blocks opened: a fixed placement of the
    averaging and update (pixel-cnn's) does not change what runs after the loop."""
    opened = []
    for statement in statements:
        if isinstance(statement, cst.With) and all(device_scope_arg(i.item, imports) is not None for i in statement.items):
            opened += open_device_blocks(statement.body.body, imports)
        else:
            opened.append(statement)
    return opened


def outside_loop(region: Region) -> list[cst.BaseStatement]:
    """The statements around the loop in its blocks, before it then after it."""
    return [*region.preceding, *region.following]


def outside_statements(region: Region) -> list[cst.CSTNode]:
    """The owner's statements other than the loop (whole compound statements around it are
    represented by their other parts: ``preceding`` and ``following`` cover the blocks)."""
    body = region.owner.body.body if isinstance(region.owner, cst.FunctionDef) else region.owner.body
    result = []
    for statement in body:
        if any(node is region.loop for node in walk(statement)):
            continue
        result.append(statement)
    return [*result, *outside_loop(region)]


def method_of(region: Region, node: cst.CSTNode) -> cst.FunctionDef | None:
    """The method of ``region.reaches`` that holds ``node``, else None."""
    return next((method for method in region.reaches if contains(method, node)), None)


def index_of(statements: list, statement: cst.CSTNode) -> int:
    """The position of ``statement`` itself (LibCST nodes compare equal by value)."""
    return next(k for k, s in enumerate(statements) if s is statement)


def simple_statements(node: cst.CSTNode) -> list[cst.SimpleStatementLine]:
    """The simple statement lines of ``node`` in the order they run, outside nested scopes."""
    return find_own(node, cst.SimpleStatementLine)


def statement_lines(statements: list[cst.BaseStatement]) -> list[cst.SimpleStatementLine]:
    """The simple statement lines in ``statements``, compound statements opened."""
    return [line for statement in statements for line in simple_statements(statement)]


@dataclass
class Collected:
    """``<list>.append(<value>)`` in the loop body."""

    statement: cst.SimpleStatementLine
    target: str  # the list's code: `tower_grads`, `self.tower_grads`
    value: cst.BaseExpression
    compute: cst.Call | None  # `opt.compute_gradients(...)` / `tf.gradients(...)` the value is (or names)


def collected_appends(loop: cst.For, imports=None) -> list[Collected]:
    """Every `<list>.append(<value>)` statement of the loop body; ``compute`` is told for
    `tf.gradients` only with the module's ``imports``."""
    computed: dict[str, cst.Call] = {}
    found = []
    for statement in simple_statements(loop.body):
        small = single_small(statement)
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
            if computes_gradients(small.value, imports):
                computed[small.targets[0].target.value] = small.value
        if not (isinstance(small, cst.Expr) and method_call(small.value, "append") and len(small.value.args) == 1):
            continue
        holder = small.value.func.value
        if not isinstance(holder, (cst.Name, cst.Attribute)):
            continue
        value = small.value.args[0].value
        compute = value if computes_gradients(value, imports) else (
            computed.get(value.value) if isinstance(value, cst.Name) else None)
        found.append(Collected(statement, code(holder), value, compute))
    return found


def left_by_towers(loop: cst.For) -> set[str]:
    """What the towers leave: the lists the body collects into (`tower_grads`, `self.losses`)
    and the names it binds."""
    return {c.target for c in collected_appends(loop)} | scope_bindings(loop.body)


def statements_reaching(statements: list, names: set[str]) -> list:
    """The ``statements`` that read ``names``, or what earlier ones of them bound from them."""
    reached, found = set(names), []
    for statement in statements:
        if names_used(statement) & reached:
            found.append(statement)
            reached |= scope_bindings(statement)
    return found


def mentions(node: cst.CSTNode, target: str, skipped: frozenset = frozenset()) -> bool:
    """Whether ``node`` reads the name or attribute chain ``target`` (`x`, `self.x`), outside
    the nodes whose ids are ``skipped`` (those the rewrite replaces)."""
    if skipped:
        parts = list(own_nodes(node, skipped, into_scopes=True))
        if "." not in target:
            return any(isinstance(n, cst.Name) and n.value == target for n in parts)
        return any(isinstance(n, cst.Attribute) and code(n) == target for n in parts)
    if "." not in target:
        return target in names_used(node)
    return any(code(n) == target for n in find(node, cst.Attribute))


def single_binding(owner: cst.CSTNode, name: cst.Name) -> cst.BaseExpression | None:
    """The value of the one plain assignment to ``name`` in ``owner``, else None."""
    bound = [a.value for a in find(owner, cst.Assign) if len(a.targets) == 1 and code(a.targets[0].target) == name.value]
    return bound[0] if len(bound) == 1 else None


def class_methods(rule, loop: cst.For) -> dict[str, cst.FunctionDef]:
    """The methods of the class around the loop, by name (none outside a class)."""
    home = enclosing_class(loop, module_parents(rule.context))
    return {} if home is None else {s.name.value: s for s in home.body.body if isinstance(s, cst.FunctionDef)}


def self_method(call: cst.Call) -> str | None:
    """The method `self.<name>(...)` calls, else None."""
    return callee_name(call, receivers=("self",), plain=False)


def functions_called(rule, nodes: list, methods: dict | None = None) -> list[cst.FunctionDef]:
    """The module's functions that ``nodes`` call (by name, or through a table of them), and the
    ``methods`` they call on `self`, and those these call, once each: the code that runs when
    ``nodes`` do."""
    functions, found, pending = module_functions(rule), {}, list(nodes)
    while pending:
        for call in find(pending.pop(), cst.Call):
            called = [functions[name] for name in called_functions(rule, call)]
            if methods and self_method(call) in methods:
                called.append(methods[self_method(call)])
            for function in called:
                if id(function) not in found:
                    found[id(function)] = function
                    pending.append(function)
    return list(found.values())


def module_nodes(rule) -> list[cst.CSTNode]:
    """The module's calls, arguments and attributes, walked once per file for every tower."""
    return rule.context.memo("replica_loop.nodes", lambda: find(rule.context.module, cst.Arg, cst.Attribute, cst.Call))


def module_calls(rule) -> list[cst.Call]:
    """The module's calls (from :func:`module_nodes`)."""
    return rule.context.memo("replica_loop.calls", lambda: [n for n in module_nodes(rule) if isinstance(n, cst.Call)])


def line_of(rule, node: cst.CSTNode) -> int:
    """The line ``node`` starts on, for refusals."""
    return rule.position(node).start.line


@dataclass
class Update:
    """The one model update the towers feed, moved into the replica function."""

    statements: list[cst.BaseStatement]  # appended to the replica function
    changes: dict = field(default_factory=dict)  # id(node) after the loop -> replacement
    binds: set[str] = field(default_factory=set)  # names the moved update binds
    helper: str | None = None  # the averaging helper, if its call went
    note: str = ""
    wrapped: list = field(default_factory=list)  # statements after the loop whose optimizer call each replica runs
    after_run: list = field(default_factory=list)  # statements right after the strategy runs the replica function
    counted: set = field(default_factory=set)  # ids of `global_step=` arguments now counted once after the update
    first: list = field(default_factory=list)  # statements from before the loop each replica runs first


def replica_code(rule, towers: list) -> list[cst.CSTNode]:
    """What the replicas run: each loop's body and the functions (and own methods) it reaches
    (found once per group of loops: several checks and edits ask)."""

    def compute() -> list[cst.CSTNode]:
        replicas = []
        for tower in towers:
            replicas += [tower.loop.body, *functions_called(rule, [tower.loop.body], class_methods(rule, tower.loop))]
        return replicas

    return rule.context.memo(("replica_loop.replica_code", tuple(id(tower.loop) for tower in towers)), compute)
