"""Keras programs whose batch normalization Keras 3 under a strategy would run otherwise.

`multi_gpu_model` ran the template on each GPU's slice of the batch, so a `BatchNormalization`
layer normalized each slice by its own statistics, as MirroredStrategy's replicas do in `fit`.
Two things Keras 3 does differently break that:

- `train_on_batch` under a strategy runs the whole batch on every replica (checked: the same
  weights as one device, to the bit): statistics over the whole batch. (`fit` splits it: the
  fix trains such a batch through `fit`.)
- A frozen layer (`layer.trainable = False`, fine-tuning a base model; a GAN's discriminator
  inside the combined model) runs in inference mode in Keras 3, normalizing by its moving
  statistics; Keras 2 still normalized by the batch's statistics while training (a held-out
  MobileNet fine-tuning differed from the first step: 1.48 against 1.39).
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import short_name
from tfmigrate.cst.codegen import code_in
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import assignments, find, module_parents

__all__ = ["frozen_assignments", "frozen_batch_norm", "whole_batch_steps"]

#: Keras applications built with batch normalization (VGG16/VGG19 have none).
_NORMALIZED_APPLICATIONS = ("MobileNet", "ResNet", "Inception", "Xception", "DenseNet", "NASNet", "EfficientNet",
                            "ConvNeXt", "RegNet")


def _normalizing(name: str) -> bool:
    """Whether the callee ``name`` (resolved) makes batch normalization: the layer, or an
    application built with it."""
    if name.startswith("keras.applications."):
        return name.rsplit(".", 1)[-1].startswith(_NORMALIZED_APPLICATIONS)
    return name.endswith(".BatchNormalization")


def _normalized(rule) -> bool:
    """Whether the module makes a `BatchNormalization` layer or an application that has some."""
    return any(_normalizing(rule.imports.resolve(call.func) or "") for call in find(rule.context.module, cst.Call))


def frozen_assignments(module: cst.Module) -> list[tuple[cst.Assign, cst.Attribute]]:
    """The module's `<x>.trainable = False` statements, each with its `<x>.trainable` target."""
    return [(assign, target.target) for assign in find(module, cst.Assign)
            if isinstance(assign.value, cst.Name) and assign.value.value == "False" for target in assign.targets
            if isinstance(target.target, cst.Attribute) and target.target.attr.value == "trainable"]


def whole_batch_steps(rule, models: set) -> list[cst.Call]:
    """The `train_on_batch(...)` calls of one of ``models`` in a module with batch normalization:
    Keras 3 under a strategy would run each on the whole batch on every replica
    (:mod:`tfmigrate.rewrites.keras3_batch_steps` splits them as the parallel model did)."""
    stepped = [call for call in find(rule.context.module, cst.Call) if isinstance(call.func, cst.Attribute)
               and call.func.attr.value == "train_on_batch" and dotted_name(call.func.value) in models]
    return stepped if stepped and _normalized(rule) else []


def frozen_batch_norm(rule) -> str | None:
    """Why a module that freezes batch normalization (`layer.trainable = False` over all of a
    model's layers, a whole model, a `BatchNormalization` layer) cannot keep its meaning, else
    None. Only what surely holds batch normalization counts: a model an application with it
    makes, or a function of the module that makes such layers (a GAN's discriminator frozen in
    the combined model counts only if its builder normalizes); some layers picked by position
    (`model.layers[i]`, unless of such an application) do not."""
    module = rule.context.module
    if not _normalized(rule):
        return None
    makers = {name: calls[-1] for name, made in assignments(rule.context).items()  # the last call bound to each
              if (calls := [assign.value for assign in made if isinstance(assign.value, cst.Call)])}
    parents = module_parents(rule.context)
    for assign, frozen in frozen_assignments(module):
        loop = _loop_binding(module, assign, code_in(module, frozen.value), parents)
        if _holds_batch_norm(rule, code_in(module, frozen.value), makers, loop):
            return (f"line {rule.position(assign).start.line}: `{code_in(module, frozen)} = False` freezes batch "
                    "normalization, and Keras 3 runs a frozen `BatchNormalization` in inference mode (its moving "
                    "statistics) where Keras 2 still normalized by the batch's statistics while training: "
                    "freeze only layers without batch normalization, or keep them trainable")
    return None


def _loop_binding(module: cst.Module, node: cst.CSTNode, name: str, parents: dict) -> cst.For | None:
    """The `for` loop around ``node`` whose target is ``name``, else None."""
    while id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, cst.For) and code_in(module, node.target) == name:
            return node
    return None


def _holds_batch_norm(rule, frozen: str, makers: dict, loop: cst.For | None) -> bool:
    """Whether what ``frozen`` names surely holds batch normalization: each layer of a model
    (``loop``: `for layer in base.layers`), a model, or a layer, as the module makes them."""
    module = rule.context.module
    if loop is not None:  # `for layer in <model>.layers` (or a slice of them)
        if _skips_batch_norm(module, loop):
            return False
        walked = loop.iter
        whole = isinstance(walked, cst.Attribute) and walked.attr.value == "layers"
        sliced = isinstance(walked, cst.Subscript) and isinstance(walked.value, cst.Attribute) \
            and walked.value.attr.value == "layers"
        if not (whole or sliced):
            return False
        model = code_in(module, (walked if whole else walked.value).value)
        return _made_normalized(rule, makers.get(model), whole)
    return _made_normalized(rule, makers.get(frozen), True)


def _skips_batch_norm(module: cst.Module, loop: cst.For) -> bool:
    """Whether the loop tells batch normalization apart (`if isinstance(layer,
    BatchNormalization): continue`, PyImageSearch's fine-tuning): it freezes the other layers."""
    return any(short_name(call.func) == "isinstance" and len(call.args) == 2
               and code_in(module, call.args[0].value) == code_in(module, loop.target)
               and "BatchNormalization" in code_in(module, call.args[1].value)
               for call in find(loop.body, cst.Call))


def _made_normalized(rule, made: cst.Call | None, whole: bool) -> bool:
    """Whether the call that made a model (or layer) surely makes batch normalization: an
    application with it, a `BatchNormalization` layer, a function of the module that makes one;
    for all of the model (``whole``), also a model assembled where the module makes one."""
    if made is None:
        return False
    name = rule.imports.resolve(made.func) or ""
    if name.startswith(("keras.applications.", "keras.layers.")):
        return _normalizing(name)
    function = _module_function(rule.context.module, made)
    if function is not None:
        return any((rule.imports.resolve(call.func) or "").endswith(".BatchNormalization")
                   for call in find(function, cst.Call))
    return whole and name.rsplit(".", 1)[-1] in ("Model", "Sequential")


def _module_function(module: cst.Module, made: cst.Call) -> cst.FunctionDef | None:
    """The module's function (or method, `self.build()`) ``made`` calls, by name."""
    return next((f for f in find(module, cst.FunctionDef) if f.name.value == short_name(made.func)), None)
