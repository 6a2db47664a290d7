"""Where the towers' results go when the code around the loop does not update the model itself.

A function may build the towers and hand their results on: returned to its one caller
(DeepSpeech's `get_tower_results`), left on `self` for the class's other methods (a trainer's
`_build_towers()` then `_build_update()`), or left on the object a model class's constructor
makes for the module code that trains on it (siamese_tf_mnist). The rewrite then makes the
strategy where the update is: each finder here returns the :class:`Region` around that call,
as the loop's own region would be, or None. The device list the strategy is made from reads
the caller's arguments in place of the tower function's parameters.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.training import optimizer_step
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import enclosing, find, free_names, names_used, scope_bindings
from tfmigrate.rewrites.mirrored import references
from tfmigrate.rewrites.refusal import Refused
from tfmigrate.rewrites.tower_code import (
    Region, collected_appends, left_by_towers, loop_region, module_calls, self_method, statement_lines,
)

__all__ = ["PassedArguments", "arguments_passed", "check_devices_visible", "constructor_caller", "function_caller",
           "method_caller", "user_called_update"]


def function_caller(rule, region: Region) -> Region | None:
    """Where the towers' results go when the function with the loop returns them to its one
    caller, a function of the module or its top level, which combines them and updates
    (DeepSpeech's `get_tower_results`), or when a method returns them to the one method of its
    class that calls it (UnFlow's `tower_losses, tower_grads = self._build_towers(opt, shards)`):
    the region around that call, as the loop's region would be. None when the function updates
    itself, or has no such caller."""
    owner, module = region.owner, rule.context.module
    if not isinstance(owner, cst.FunctionDef):
        return None
    holder = region.parents.get(id(region.parents.get(id(owner))))
    method = isinstance(holder, cst.ClassDef) and _first_parameter(owner) == "self"
    if not method and not any(s is owner for s in module.body):
        return None
    filled = left_by_towers(region.loop)
    returned = set().union(*(names_used(r) for r in find(owner, cst.Return) if r.value is not None))
    lines = statement_lines(region.following)
    if not filled & returned or any(optimizer_step(c) for line in lines for c in find(line, cst.Call)):
        return None
    name = owner.name.value
    if method:
        calls = [c for c in find(holder, cst.Call) if self_method(c) == name]
    else:
        calls = [c for c in module_calls(rule) if isinstance(c.func, cst.Name) and c.func.value == name]
    if len(calls) != 1 or references(module, name) != 2:  # the definition and the one call
        return None  # used elsewhere too, or not here: no one caller to hold the strategy
    statement = enclosing(calls[0], region.parents, cst.SimpleStatementLine)
    caller = enclosing(statement, region.parents, cst.FunctionDef) or module  # (a script's top level)
    if caller is owner or statement is None or (method and enclosing(caller, region.parents, cst.ClassDef) is not holder):
        return None
    found = loop_region(rule.context, statement, caller, rule.imports)
    found.call = calls[0]
    return found


def constructor_caller(rule, region: Region) -> Region | None:
    """A model class whose constructor builds the towers and leaves their results on `self`
    (`self.loss = tf.reduce_mean(tower_losses)`), made once in the module by code that then
    trains on them (siamese_tf_mnist: `net = siamese()`, then `minimize(net.loss)` at module
    level): the region around that construction, as the loop's region would be; else None."""
    owner, parents, module = region.owner, region.parents, rule.context.module
    holder = parents.get(id(parents.get(id(owner)))) if isinstance(owner, cst.FunctionDef) else None
    if not (isinstance(holder, cst.ClassDef) and owner.name.value == "__init__" and any(s is holder for s in module.body)):
        return None
    lines = statement_lines([region.loop.body, *region.following])
    if any(optimizer_step(c) for line in statement_lines(region.following) for c in find(line, cst.Call)):
        return None  # the constructor updates itself
    if not any(code(t.target).startswith("self.") for line in lines for t in find(line, cst.AssignTarget)):
        return None  # nothing left on the object
    name = holder.name.value
    calls = [c for c in module_calls(rule) if isinstance(c.func, cst.Name) and c.func.value == name]
    if len(calls) != 1 or references(module, name) != 2:
        return None
    statement = parents.get(id(parents.get(id(calls[0]))))
    if not isinstance(statement, cst.SimpleStatementLine):
        return None
    home = enclosing(statement, parents, cst.FunctionDef) or module
    found = loop_region(rule.context, statement, home, rule.imports)
    if not any(optimizer_step(c) for line in statement_lines(found.following) for c in find(line, cst.Call)):
        return None
    found.call = calls[0]
    return found


def method_caller(rule, region: Region) -> Region | None:
    """A trainer class whose one method builds the towers into `self` (`self.tower_grads.append(
    ...)`) and whose other methods combine and apply them, all called in turn by one method::

        def __init__(self, ...):                 def _build_towers(self):
            self.devices = [...]                     for i, dev in enumerate(self.devices):
            self._build_towers()                         ... self.tower_grads.append(grads)
            self._build_update()                 def _build_update(self):
                                                     ... opt.apply_gradients(average(self.tower_grads))

    The region around that call (``__init__``'s), its code followed into the methods it calls
    after it on `self` (``reaches``), as the loop's region would be; else None."""
    owner, parents = region.owner, region.parents
    holder = parents.get(id(parents.get(id(owner)))) if isinstance(owner, cst.FunctionDef) else None
    if not isinstance(holder, cst.ClassDef) or _first_parameter(owner) != "self":
        return None
    kept = [c.target for c in collected_appends(region.loop)] + [
        code(t.target) for line in region.following for t in find(line, cst.AssignTarget)]
    if not any(target.startswith("self.") for target in kept):
        return None  # the results do not stay on the object (`self.tower_grads`, `self.d_loss = mean(d_losses)`)
    if any(optimizer_step(c) for line in statement_lines(region.following) for c in find(line, cst.Call)):
        return None  # the method updates itself
    methods = {s.name.value: s for s in holder.body.body if isinstance(s, cst.FunctionDef)}
    calls = [c for c in find(holder, cst.Call) if self_method(c) == owner.name.value]
    if len(calls) != 1 or references(rule.context.module, owner.name.value) != 2:
        return None
    statement = parents[id(calls[0])]
    statement = parents.get(id(statement)) if isinstance(statement, cst.Expr) else None
    caller = enclosing(statement, parents, cst.FunctionDef) if statement is not None else None
    if not isinstance(statement, cst.SimpleStatementLine) or caller is None or caller is owner or methods.get(caller.name.value) is not caller:
        return None
    found = loop_region(rule.context, statement, caller, rule.imports)
    pending, seen = list(found.following), {id(owner), id(caller)}
    while pending:  # the methods called after it on self, and those they call
        for call in find(pending.pop(0), cst.Call):
            method = methods.get(self_method(call) or "")
            if method is not None and id(method) not in seen:
                seen.add(id(method))
                found.reaches.append(method)
                found.following += list(method.body.body)
                pending += list(method.body.body)
    if not found.reaches:
        results = {c.target for c in collected_appends(region.loop)} | {
            code(t.target) for line in region.following for t in find(line, cst.AssignTarget)}
        found.external = _external_updates(holder, methods, owner, caller, results)
        found.reaches = list(found.external)
        found.following += [s for method in found.external for s in method.body.body]
    return found if found.reaches else None


def user_called_update(rule, region: Region) -> Region | None:
    """A trainer class whose constructor builds the towers into `self` and whose update is
    another method, which the class's user calls after building the object (`trainer =
    Trainer(cfg)`, then `trainer.train_step()`, maybe through `trainer.fit()`); or a method the
    user calls to build them, then the update (Tacotron-2's `model.initialize(...)`, then
    `model.add_optimizer(global_step)`). The building method's own region, its code followed
    into those methods (``reaches``, ``external``): the strategy is made where the towers are
    built and kept on `self`, and the update methods run under its scope."""
    owner, parents = region.owner, region.parents
    holder = parents.get(id(parents.get(id(owner)))) if isinstance(owner, cst.FunctionDef) else None
    if not (isinstance(holder, cst.ClassDef) and _first_parameter(owner) == "self"):
        return None
    if owner.name.value != "__init__" and owner.name.value in _called_by_class(holder):
        return None  # built by another method of the class (see method_caller)
    if any(optimizer_step(c) for line in statement_lines(region.following) for c in find(line, cst.Call)):
        return None  # the constructor updates itself
    methods = {s.name.value: s for s in holder.body.body if isinstance(s, cst.FunctionDef)}
    results = {c.target for c in collected_appends(region.loop)} | {
        code(t.target) for line in [region.loop.body, *region.following] for t in find(line, cst.AssignTarget)}
    external = _updating_methods(methods, [owner], {r for r in results if r.startswith("self.")})
    if not external:
        return None
    found = loop_region(rule.context, region.loop, owner, rule.imports)
    found.reaches, found.external = list(external), list(external)
    found.following += [s for method in external for s in method.body.body]
    return found


def _external_updates(holder: cst.ClassDef, methods: dict, owner, caller, results: set[str]) -> list[cst.FunctionDef]:
    """The methods of the class that update the model from what the towers left on `self`
    (`self.d_loss`), that no method of the class calls: the class's user calls them after
    building it (carpedm20 DCGAN: `__init__` calls `build_model()`, the script calls `train()`)."""
    called = _called_by_class(holder)
    return [method for method in _updating_methods(methods, [owner, caller], results) if method.name.value not in called]


def _called_by_class(holder: cst.ClassDef) -> set:
    """The names of the methods the class calls on `self` itself."""
    return {self_method(c) for c in find(holder, cst.Call)}


def _updating_methods(methods: dict, skipped: list, results: set[str]) -> list[cst.FunctionDef]:
    """The methods, but ``skipped``, that update the model from what the towers left on `self`:
    they read one of ``results`` and step an optimizer."""
    return [method for method in methods.values()
            if not any(method is other for other in skipped) and _first_parameter(method) == "self"
            and results & {code(a) for a in find(method, cst.Attribute)}
            and any(optimizer_step(c) for c in find(method, cst.Call))]


def _first_parameter(function: cst.FunctionDef) -> str | None:
    params = function.params.params
    return params[0].name.value if params else None


def arguments_passed(owner: cst.CSTNode, call: cst.Call | None) -> dict[str, cst.BaseExpression]:
    """What ``call`` passes for each parameter of ``owner`` (a function or constructor), or the
    parameter's default: a device list made by the caller of the function with the loop reads
    these in its parameters' place (`range(n_gpus)` of `def __init__(self, n_gpus=N_GPUS)` is
    `range(N_GPUS)` for `siamese()`)."""
    if call is None or not isinstance(owner, cst.FunctionDef):
        return {}
    params = list(owner.params.params)
    if params and params[0].name.value == "self" and (owner.name.value == "__init__" or self_method(call)):
        params = params[1:]  # `C(...)`, `self.m(...)` pass the rest
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    passed: dict[str, cst.BaseExpression] = {}
    for position, param in enumerate(params):
        keyword = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == param.name.value), None)
        value = keyword if keyword is not None else (positional[position] if position < len(positional) else param.default)
        if value is not None:
            passed[param.name.value] = value
    return passed


def check_devices_visible(rule, region: Region, devices: str, passed: dict) -> None:
    """The strategy is made by the caller: its device list must not read the tower function's
    names, but the parameters the caller's call gives values for (``passed``)."""
    owner = region.owner
    bound_in_body = scope_bindings(owner.body)
    local = {p.name.value for p in find(owner.params, cst.Param)} | bound_in_body
    local.discard("self")  # a method of the caller's own object (method_caller): the same `self`
    local -= set(passed) - bound_in_body  # a parameter the body never rebinds reads what the caller passed
    hidden = sorted(free_names(cst.parse_expression(devices), keywords=False) & local)
    if hidden:
        raise Refused(f"the towers' devices ({', '.join(f'`{n}`' for n in hidden)}) are computed inside "
                      f"`{owner.name.value}`, but the strategy must be made by its caller")


class PassedArguments(cst.CSTTransformer):
    """Parameter names replaced by the arguments passed for them (attribute names stay)."""

    def __init__(self, passed: dict[str, cst.BaseExpression]):
        super().__init__()
        self.passed = passed

    def leave_Name(self, original, updated):
        return self.passed.get(original.value, updated)

    def leave_Attribute(self, original, updated):
        return updated.with_changes(attr=original.attr)
