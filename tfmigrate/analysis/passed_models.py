"""Where a model a function receives as a parameter comes from, and where one it returns goes.

Keras programs often build the template in one place and wrap it in `multi_gpu_model` inside
the function that trains it (`def train_model(model, train, test): parallel =
multi_gpu_model(model, gpus=2)`, Keras's mnist_transfer_cnn example with GPUs added). The
template's weights are made where it is built, by the caller: that is where a strategy's scope
must be. :func:`passed_models` finds, for the function's parameter, what each of its calls passes.

Others build it in a function that returns the parallel model for its caller to compile
(`def get_model(num_gpus): ... return template, multi_gpu_model(template, gpus=num_gpus)`, the
argparse `train.py` layout). Keras 3 makes the optimizer where `compile` runs, so the caller's
`compile` must be under the model's strategy: :func:`returned_models` finds the names each call
binds the returned model to.
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import callee_name
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import enclosing, find, name_nodes

__all__ = ["passed_models", "returned_models"]


def passed_models(module: cst.Module, parents: dict, function: cst.FunctionDef,
                  parameter: str) -> tuple[list[tuple[cst.Call, str]], str | None]:
    """Each call of ``function`` (a module function called by name, or a method called on `self`
    in its own class) with the name or attribute it passes for ``parameter``:
    ([(call, passed)], None), or ([], why not) when a caller is not known or passes an
    expression, or the function is read other than by being called."""
    name = function.name.value
    calls, params, why = _calls(module, parents, function)
    if why is not None:
        return [], why
    position = next((i for i, p in enumerate(params) if p.name.value == parameter), None)
    if position is None:
        return [], f"`{parameter}` is not a parameter of `{name}`"
    passed = []
    for call in calls:
        value = _argument(call, parameter, position)
        model = dotted_name(value) if value is not None else None
        if model is None:
            return [], f"a call of `{name}` does not pass the model by name"
        passed.append((call, model))
    return passed, None


def returned_models(module: cst.Module, parents: dict, function: cst.FunctionDef,
                    positions: set[int] | None) -> tuple[list[tuple[cst.SimpleStatementLine, set[str]]], str | None]:
    """Each call of ``function`` (as :func:`passed_models` finds them) with the names its
    statement binds the returned value to, at ``positions`` of a returned tuple (None: the whole
    value; none where the call's result is dropped, `self.build()` keeping its models on `self`):
    ([(statement, names)], None), or ([], why not) when a call's result is used but not assigned
    to names (`template, model = get_model(2)`)."""
    name = function.name.value
    calls, _, why = _calls(module, parents, function)
    if why is not None:
        return [], why
    bound = []
    for call in calls:
        line = enclosing(call, parents, cst.SimpleStatementLine)
        assign = line.body[0] if line is not None and len(line.body) == 1 else None
        if isinstance(assign, cst.Expr) and assign.value is call:
            bound.append((line, set()))
            continue
        if not (isinstance(assign, cst.Assign) and assign.value is call and len(assign.targets) == 1):
            return [], f"a call of `{name}` does not assign what it returns to names"
        target = assign.targets[0].target
        if positions is None:
            targets = [target]
        elif isinstance(target, (cst.Tuple, cst.List)) and max(positions) < len(target.elements) and not any(
                isinstance(element, cst.StarredElement) for element in target.elements):
            targets = [target.elements[position].value for position in sorted(positions)]
        else:
            return [], f"a call of `{name}` does not unpack the models it returns by position"
        names = {dotted_name(each) for each in targets}
        if None in names:
            return [], f"a call of `{name}` does not assign the models it returns to names"
        bound.append((line, names))
    return bound, None


def _calls(module: cst.Module, parents: dict, function: cst.FunctionDef) -> tuple[list[cst.Call], list, str | None]:
    """The calls of ``function`` (a module function called by name, or a method called on `self`
    in its own class) and its parameters less `self`: (calls, parameters, None), or ([], [], why
    not) when it is read other than by being called, or not called."""
    name = function.name.value
    params = list(function.params.params)
    holder = enclosing(function, parents, cst.ClassDef)
    method = holder is not None and parents.get(id(parents.get(id(function)))) is holder
    if method:
        if not params or params[0].name.value != "self":
            return [], [], f"`{name}` is not a method of its object"
        params, scope = params[1:], holder
        calls = [c for c in find(holder, cst.Call) if callee_name(c, receivers=("self",), plain=False) == name]
        read = [n for n in find(holder, cst.Attribute) if n.attr.value == name and not any(c.func is n for c in calls)]
    else:
        if not any(statement is function for statement in module.body):
            return [], [], f"`{name}` is not a function of the module"
        scope = module
        calls = [c for c in find(module, cst.Call) if isinstance(c.func, cst.Name) and c.func.value == name]
        read = [n for n in name_nodes(module).get(name, ()) if n is not function.name and not any(c.func is n for c in calls)]
    if read or not calls:
        return [], [], (f"`{name}` is passed around, not only called" if read else
                        f"`{name}` is not called in this {'class' if scope is holder else 'module'}")
    return calls, params, None


def _argument(call: cst.Call, parameter: str, position: int) -> cst.BaseExpression | None:
    if any(arg.star for arg in call.args):
        return None
    keyword = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == parameter), None)
    if keyword is not None:
        return keyword
    positional = [a.value for a in call.args if a.keyword is None]
    return positional[position] if position < len(positional) else None
