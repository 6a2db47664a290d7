"""Towers built without a ``for`` statement: a ``while`` counter loop, or a comprehension
that calls a tower function once per device.

    gpu = 0                                   towers = [build_tower(i, x_parts[i])
    while gpu < num_gpus:                               for i in range(num_gpus)]
        with tf.device('/gpu:%d' % gpu):
            ...
        gpu += 1

Both mean the ``for`` loop the tower rewrite knows (``for gpu in range(num_gpus):``), so they
are found here and rewritten as that loop first (:mod:`tfmigrate.rewrites.loop_forms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.analysis.devices import (
    derived_names, device_scopes, enclosing_tower, is_plumbing, looks_per_device, mentions_gpu,
    mentions_only_cpu, module_walk, tower_function,
)
from tfmigrate.cst.callargs import callee_name
from tfmigrate.cst.traversal import find, module_parents, names_used, walk


@dataclass
class TowerForm:
    """A tower loop in another form than ``for``."""

    statement: cst.BaseStatement  # the `while`, or the statement that holds the comprehension
    owner: cst.CSTNode  # the function (or module) it is in
    device: cst.BaseExpression  # the device its towers are placed on (for the message)
    counter: str = ""  # `while`: the counter
    comprehension: cst.ListComp | cst.GeneratorExp | None = None
    via: list[cst.FunctionDef] = field(default_factory=list)  # tower functions it calls

    @property
    def kind(self) -> str:
        return "comprehension" if self.comprehension is not None else "while"


def module_tower_forms(context) -> list[TowerForm]:
    """The module's towers built by a ``while`` counter loop or by a comprehension, in source
    order (computed once per run)."""

    def compute() -> list[TowerForm]:
        walked = module_walk(context)
        tower_functions = _tower_functions(walked, context.imports)
        found = [form for loop, owner in walked.whiles
                 if (form := _counter_towers(loop, owner, tower_functions, context)) is not None]
        if tower_functions:
            found += _comprehension_towers(context, tower_functions)
        return [form for form in found if enclosing_tower(context, form.statement) is None]

    return context.memo("tower_forms", compute)


def _tower_functions(walked, imports) -> dict[str, tuple[cst.FunctionDef, cst.BaseExpression]]:
    """Name -> (tower function, its device) for the functions that place their body on a device
    computed from their parameters (`def tower(i): with tf.device('/gpu:%d' % i): ...`)."""
    found = {}
    for function in walked.scoped_functions:
        tower = tower_function(function, imports)
        if tower is not None:
            found.setdefault(function.name.value, (function, tower[1][0].device))
    return found


def counter_of(test: cst.BaseExpression) -> tuple[str, cst.BaseExpression, bool] | None:
    """(counter, bound, inclusive) of a loop test `i < n` (`i <= n`, `n > i`, `n >= i`)."""
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return None
    target = test.comparisons[0]
    left, right, operator = test.left, target.comparator, type(target.operator)
    if operator in (cst.GreaterThan, cst.GreaterThanEqual):
        left, right = right, left
        operator = cst.LessThan if operator is cst.GreaterThan else cst.LessThanEqual
    if operator not in (cst.LessThan, cst.LessThanEqual) or not isinstance(left, cst.Name):
        return None
    return left.value, right, operator is cst.LessThanEqual


def _counter_towers(loop: cst.While, owner, tower_functions, context) -> TowerForm | None:
    counted = counter_of(loop.test)
    if counted is None or not _increments(loop, counted[0]) or is_plumbing(loop, context.imports):
        return None
    derived = derived_names(loop.body, {counted[0]})
    for scope in device_scopes(loop.body, context.imports):
        if (names_used(scope.device) & derived and not mentions_only_cpu(scope.device, context.imports)
                and any(isinstance(n, cst.Call) for n in walk(scope.with_node.body))):
            return TowerForm(statement=loop, owner=owner, device=scope.device, counter=counted[0])
    for call in find(loop.body, cst.Call):
        function = _called_tower(call, tower_functions)
        if function is not None and any(names_used(arg.value) & derived for arg in call.args):
            return TowerForm(statement=loop, owner=owner, device=function[1], counter=counted[0], via=[function[0]])
    return None


def _increments(loop: cst.While, counter: str) -> bool:
    return any(isinstance(n, cst.AugAssign) and isinstance(n.target, cst.Name) and n.target.value == counter
               and isinstance(n.operator, cst.AddAssign) for n in walk(loop.body))


def _called_tower(call: cst.Call, tower_functions):
    return tower_functions.get(callee_name(call) or "")


def _comprehension_towers(context, tower_functions) -> list[TowerForm]:
    parents = module_parents(context)
    found: list[TowerForm] = []
    for comprehension in find(context.module, cst.ListComp, cst.GeneratorExp):
        loop_names = names_used(comprehension.for_in.target)
        for call in find(comprehension.elt, cst.Call):
            function = _called_tower(call, tower_functions)
            if function is None or not any(names_used(arg.value) & loop_names for arg in call.args):
                continue
            if not (mentions_gpu(function[1], context.imports) or looks_per_device(comprehension.for_in.iter)):
                continue
            statement, owner = _statement_and_owner(comprehension, parents)
            if owner is not function[0]:
                found.append(TowerForm(statement=statement, owner=owner, device=function[1],
                                       comprehension=comprehension, via=[function[0]]))
            break
    return found


def _statement_and_owner(node: cst.CSTNode, parents) -> tuple[cst.BaseStatement, cst.CSTNode]:
    statement = None
    while node is not None and not isinstance(node, (cst.FunctionDef, cst.Module)):
        if statement is None and isinstance(node, cst.BaseStatement):
            statement = node
        node = parents.get(id(node))
    return statement, node
