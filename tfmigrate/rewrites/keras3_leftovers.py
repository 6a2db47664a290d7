"""What a Keras program moved off `multi_gpu_model` must change to run on Keras 3.

`multi_gpu_model` is gone from TF 2.4, so the migrated program runs on today's Keras, Keras 3,
which refuses two things the parallel-model programs did (each made a held-out program crash):

- an HDF5 weights file whose name does not end in `.weights.h5` (`save_weights`,
  `load_weights`, and `ModelCheckpoint(..., save_weights_only=True)` or a subclass of it);
- assigning `Callback.model`, a read-only property (`self.model = self.original_model` in the
  widely copied `ModelCheckpointMGPU`).

Each function returns LibCST changes (original node -> replacement) for the rule's edit.
"""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import find, single_small

__all__ = ["callback_models_set", "derives", "weight_file_renames"]


def weight_file_renames(module: cst.Module, weight_calls: Iterable[cst.Call], checkpoint_calls: Iterable[cst.Call],
                        models: set) -> dict:
    """`model.save_weights('w.h5')` / `load_weights('w.h5')` of one of ``models`` -> 'w.weights.h5',
    at the call or where the module binds the name it passes; and the file of each of
    ``checkpoint_calls`` (calls with `save_weights_only=True`) that makes a `ModelCheckpoint`
    (a held-out U-Net's failed at its construction), which the program then loads by the same name."""
    changes = {}
    for call in weight_calls:
        if isinstance(call.func, cst.Attribute) and dotted_name(call.func.value) in models and call.args:
            changes.update(_weights_h5_renamed(call.args[0].value))
            changes.update(_bound_file_renamed(module, call.args[0].value))
    for call in checkpoint_calls:
        if _is_checkpoint(module, call):
            for arg in call.args:
                if arg.keyword is None or arg.keyword.value == "filepath":
                    changes.update(_weights_h5_renamed(arg.value))
    return changes


def callback_models_set(module: cst.Module) -> dict:
    """`self.model = self.original_model` in a callback class of the module -> `self.set_model(...)`,
    which sets it in Keras 2 and 3. The template is now the model `fit` trains, so the
    checkpoint saves the same model either way."""
    changes = {}
    for cls in find(module, cst.ClassDef):
        if not derives(cls, ("ModelCheckpoint", "Callback")):
            continue
        for line in find(cls.body, cst.SimpleStatementLine):
            small = single_small(line)
            if (isinstance(small, cst.Assign) and len(small.targets) == 1
                    and dotted_name(small.targets[0].target) == "self.model"):
                value = module.code_for_node(small.value).strip()
                changes[small] = cst.Expr(cst.parse_expression(f"self.set_model({value})"))
    return changes


def derives(cls: cst.ClassDef, bases: tuple[str, ...]) -> bool:
    """Whether ``cls`` names one of ``bases`` among its bases (`ModelCheckpoint`, `keras.callbacks.Callback`)."""
    return any((dotted_name(base.value) or "").rsplit(".", 1)[-1] in bases for base in cls.bases)


def _weights_h5_renamed(value: cst.BaseExpression) -> dict:
    """Each string literal in ``value`` naming an HDF5 file `*.h5`, as `*.weights.h5`."""
    changes = {}
    for string in find(value, cst.SimpleString):
        quote = string.value[-3:] if string.value[-3:] in ('"""', "'''") else string.value[-1]
        body = string.value[:-len(quote)]
        if body.endswith(".h5") and not body.endswith(".weights.h5"):
            changes[string] = string.with_changes(value=body[:-3] + ".weights.h5" + quote)
    return changes


def _bound_file_renamed(module: cst.Module, value: cst.BaseExpression) -> dict:
    """A weights file named through a name or attribute (`save_weights(self.weights_file)`):
    its `.h5` literals where the module binds it (`self.weights_file = os.path.join(d, 'w.h5')`)."""
    name = dotted_name(value)
    if name is None:
        return {}
    changes = {}
    for assign in find(module, cst.Assign):
        if any(dotted_name(t.target) == name for t in assign.targets):
            changes.update(_weights_h5_renamed(assign.value))
    return changes


def _is_checkpoint(module: cst.Module, call: cst.Call) -> bool:
    """A call of Keras's `ModelCheckpoint`, or of a class of the module derived from it."""
    name = module.code_for_node(call.func).strip().rsplit(".", 1)[-1]
    if name == "ModelCheckpoint":
        return True
    return any(c.name.value == name and derives(c, ("ModelCheckpoint",)) for c in find(module, cst.ClassDef))
