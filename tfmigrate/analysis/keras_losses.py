"""Keras losses that couple the examples of a batch.

`multi_gpu_model` runs the template on each GPU's slice and concatenates the outputs on the
CPU: the loss is computed once, on the merged outputs of the whole batch. MirroredStrategy
computes it on each replica's part and averages the parts. For a loss that is a mean over
examples the two agree; for one built from sums over the whole batch and divided by another
(Dice, Jaccard/IoU, Tversky: `2 * K.sum(y_true * y_pred) / (K.sum(y_true) + K.sum(y_pred))`)
the average of the parts' ratios is another loss (a held-out U-Net trained differently from the
first step).
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.cst.callargs import is_false, keyword_is, short_name
from tfmigrate.cst.traversal import assignments, find, names_used, scope_bindings

__all__ = [
    "batch_coupled", "batch_value_returned", "compiled_loss", "compiled_losses", "examples_weighted", "loss_label",
    "masked_steps", "model_tensors_in_losses", "per_example_mean",
]

#: Layers that mask time steps out of the loss (`Embedding(mask_zero=True)`, `Masking()`).
_MASKING = ("keras.layers.Masking", "tensorflow.keras.layers.Masking")
_EMBEDDING = ("keras.layers.Embedding", "tensorflow.keras.layers.Embedding")
#: Recurrent layers, which return one vector (and drop the mask) unless `return_sequences=True`.
_RECURRENT = {"LSTM", "GRU", "SimpleRNN", "CuDNNLSTM", "CuDNNGRU", "ConvLSTM2D", "RNN"}

#: Reductions that, without an axis, sum or average over every element of the batch.
_REDUCTIONS = {"sum", "mean", "reduce_sum", "reduce_mean"}


def batch_coupled(module: cst.Module, name: str) -> tuple[str, cst.BinaryOperation] | None:
    """Where the module function ``name`` (a loss), or a module function it calls, divides one
    whole-batch reduction by another: (that function's name, the division); else None."""
    functions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    seen: set[str] = set()
    pending = [name]
    while pending:
        current = pending.pop()
        if current in seen or current not in functions:
            continue
        seen.add(current)
        function = functions[current]
        reduced = _reduced_names(function)
        for division in find(function.body, cst.BinaryOperation):
            if isinstance(division.operator, cst.Divide) and all(
                    _reduces_batch(side, reduced) for side in (division.left, division.right)):
                return current, division
        pending += [call.func.value for call in find(function.body, cst.Call) if isinstance(call.func, cst.Name)]
    return None


def _reduced_names(function: cst.FunctionDef) -> dict[str, cst.Call]:
    """The names the function binds to a whole-batch reduction (`intersection = K.sum(a * b)`),
    each with that reduction (for a name bound through another, the first such name's)."""
    reduced: dict[str, cst.Call] = {}
    for assign in find(function.body, cst.Assign):
        if len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name):
            found = _whole_batch_reduction(assign.value, reduced)
            if found is not None:
                reduced[assign.targets[0].target.value] = found
    return reduced


def _whole_batch_reduction(node: cst.CSTNode, reduced: dict[str, cst.Call]) -> cst.Call | None:
    """The reduction without an axis (`K.sum(x)`, `tf.reduce_sum(x)`) ``node`` holds, else the one
    behind the first name of ``reduced`` it reads (in the order they were bound), else None."""
    calls = [call for call in find(node, cst.Call) if short_name(call.func) in _REDUCTIONS and not _has_axis(call)]
    if calls:
        return calls[0]
    read = {name.value for name in find(node, cst.Name)}
    return next((call for name, call in reduced.items() if name in read), None)


def _reduces_batch(node: cst.CSTNode, reduced: dict[str, cst.Call]) -> bool:
    """Whether ``node`` holds a reduction without an axis, or reads a name bound to one."""
    return _whole_batch_reduction(node, reduced) is not None


#: Reductions that average.
_MEANS = {"mean", "reduce_mean"}


def compiled_loss(call: cst.Call) -> cst.BaseExpression | None:
    """What a `compile(...)` call gives as its loss (`loss=`, or its second argument by position)."""
    return next((arg.value for arg in call.args if keyword_is(arg, "loss")),
                call.args[1].value if len(call.args) > 1 and call.args[1].keyword is None else None)


def compiled_losses(module: cst.Module, loss: cst.BaseExpression) -> list[cst.FunctionDef | cst.Lambda]:
    """The loss functions a `compile(loss=...)` argument gives: the lambdas it holds, and the
    module's functions it names (made anywhere in the module: a builder's own `def my_loss`)."""
    functions = {function.name.value: function for function in reversed(find(module, cst.FunctionDef))}
    named = [functions[name.value] for name in find(loss, cst.Name) if name.value in functions]
    return [*find(loss, cst.Lambda), *named]


def batch_value_returned(loss: cst.FunctionDef | cst.Lambda) -> tuple[cst.CSTNode, bool] | None:
    """The whole-batch reduction (no axis) behind what the loss function ``loss`` returns, as
    one number for the batch, and whether the loss is that one mean itself (`return
    K.mean(K.square(y_pred - y_true))`); else None. Keras 3 under MirroredStrategy adds the
    replicas' values of such a loss (2 replicas: twice the loss and twice the step, checked on
    TF 2.21), where it averages a loss given per example. A mean over every element of the
    batch is the mean of per-example means (equal counts), so the bare mean can be given per
    example (`axis=-1`); a value made from one (the root of a mean: RMSE) cannot."""
    reduced = _reduced_names(loss) if isinstance(loss, cst.FunctionDef) else {}
    values = [loss.body] if isinstance(loss, cst.Lambda) else [r.value for r in find(loss.body, cst.Return)]
    for value in values:
        reduction = _whole_batch_reduction(value, reduced) if value is not None else None
        if reduction is None:
            continue
        if (reduction is value and short_name(value.func) in _MEANS
                and not any(_reduces_batch(arg.value, reduced) for arg in value.args)):
            return value, True
        return reduction, False
    return None


def loss_label(loss: cst.FunctionDef | cst.Lambda) -> str:
    """How a message names the loss: its function's name, or `lambda`."""
    return loss.name.value if isinstance(loss, cst.FunctionDef) else "lambda"


def per_example_mean(module: cst.Module, loss: cst.FunctionDef | cst.Lambda) -> str | None:
    """Why the loss function ``loss``, returning one mean for the batch, cannot be given per
    example with the same meaning, else None: the function read elsewhere than in `compile`
    (its value's shape would change there), or examples weighted (Keras 2 scaled one number by
    the weights' mean, not each example by its own weight)."""
    compiled = [node for node in find(module, cst.Call)
                if isinstance(node.func, cst.Attribute) and node.func.attr.value == "compile"]
    in_compile = {id(name) for node in compiled for name in find(node, cst.Name)}
    for name in find(module, cst.Name) if isinstance(loss, cst.FunctionDef) else ():
        if name.value == loss.name.value and id(name) not in in_compile and name is not loss.name:
            return f"`{loss.name.value}` is also read outside `compile`, where its value would change shape"
    return examples_weighted(module)


def examples_weighted(module: cst.Module) -> str | None:
    """How the module weights examples (`sample_weight=`, `class_weight=`, a generator yielding
    weights), as a reason: Keras 2 applied the weights to a loss of one value for the batch
    otherwise than Keras 3 does; else None."""
    for node in find(module, cst.Arg):
        if node.keyword is not None and node.keyword.value in _WEIGHTINGS:
            return f"the examples are weighted (`{node.keyword.value}=`), which Keras 2 applied to the one mean"
    for node in find(module, cst.Yield):
        if isinstance(node.value, cst.Tuple) and len(node.value.elements) == 3:
            return "a generator yields (inputs, targets, weights): the examples are weighted"
    return None


#: Keyword arguments that weight examples in the loss.
_WEIGHTINGS = {"sample_weight", "class_weight", "sample_weight_mode"}


def _has_axis(call: cst.Call) -> bool:
    positional = [arg for arg in call.args if arg.keyword is None]
    return len(positional) > 1 or any(arg.keyword is not None and arg.keyword.value in ("axis", "reduction_indices")
                                      for arg in call.args)


def masked_steps(rule) -> str | None:
    """Why a module masking the time steps of a per-step output cannot keep its meaning, else
    None. The parallel model averaged the loss over the unmasked steps of the merged batch;
    Keras 3 averages each replica's part over its own unmasked steps and then averages the
    replicas, another mean where the parts hold unequal counts (a held-out BiLSTM tagger with
    `mask_zero=True`: 1.5e-4 apart at step 1, the same with and without per-step weights). A
    mask that a last recurrent layer returning one vector consumes never reaches the loss."""
    if not _per_step_output(rule):
        return None
    for call in find(rule.context.module, cst.Call):
        names = rule.imports.resolve_all(call.func)
        masking = any(name in _MASKING for name in names)
        zero_masked = any(name in _EMBEDDING for name in names) and any(
            keyword_is(arg, "mask_zero", lambda value: not is_false(value)) for arg in call.args)
        if masking or zero_masked:
            return (f"`{rule.context.module.code_for_node(call.func)}(...)` (line {rule.position(call).start.line}) "
                    "masks time steps: the parallel model averaged the loss over the unmasked steps of the whole "
                    "batch, Keras 3 averages each replica's part over its own and then the replicas, another loss "
                    "where they hold different counts; keep the model on one device, or write the loss to divide "
                    "by the batch's count of steps across replicas")
    return None


def _per_step_output(rule) -> bool:
    """Whether the module's model seems to output one prediction per time step: it uses
    `TimeDistributed` or per-step sample weights, or its last recurrent layer (in the source)
    returns sequences."""
    returned = []
    for call in find(rule.context.module, cst.Call):
        layers = {name.rsplit(".", 1)[-1] for name in rule.imports.resolve_all(call.func)}
        if "TimeDistributed" in layers or any(keyword_is(arg, "sample_weight_mode") for arg in call.args):
            return True
        if layers & _RECURRENT:
            returned.append(any(keyword_is(arg, "return_sequences", lambda value: not is_false(value))
                                for arg in call.args))
    return bool(returned) and returned[-1]


def model_tensors_in_losses(rule, compiles: list[cst.Call]) -> str | None:
    """Why a model whose loss is made from the model's own tensors cannot run on Keras 3, else
    None: `model.add_loss(term)` on a functional model (Keras 3 raises NotImplementedError: only
    a layer's `call` adds losses), or a loss or metric function that reads a tensor the model
    made (a VAE's `z_mean`, captured from the module: Keras 3 cannot use a KerasTensor outside a
    layer). Keras 2's VAE example did both; held-out VAEs of each kind crashed."""
    module = rule.context.module
    for call in find(module, cst.Call):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "add_loss" and not (
                isinstance(func.value, cst.Name) and func.value.value == "self"):
            return (f"line {rule.position(call).start.line}: `{module.code_for_node(func)}(...)` adds a loss to a "
                    "functional model, which Keras 3 does not do (NotImplementedError: only a layer's `call` adds "
                    "losses): add the term in a custom layer's `call` (`self.add_loss(...)`), or compute it in the loss")
    tensors = _model_tensors(rule)
    for compiled in compiles:
        metrics = [arg.value for arg in compiled.args if keyword_is(arg, "metrics")]
        given = [value for value in (compiled_loss(compiled), *metrics) if value is not None]
        for function in (f for value in given for f in compiled_losses(module, value)):
            read = sorted((names_used(function.body) - _bound_within(function)) & set(tensors))
            if read:
                label = loss_label(function)
                return (f"the loss or metric `{label}` reads `{read[0]}`, a tensor of the model (line "
                        f"{rule.position(tensors[read[0]]).start.line}), which Keras 3 cannot use outside a layer (a "
                        "KerasTensor): add the term in a custom layer's `call` (`self.add_loss(...)`), or make it an "
                        "output of the model")
    return None


def _bound_within(function: cst.FunctionDef | cst.Lambda) -> set[str]:
    """The names ``function`` or a function inside it binds: parameters, assignment and loop
    targets (a loss factory's inner `vae_loss` slicing `x_decoded` out of `y_pred`)."""
    targets = [*find(function, cst.AssignTarget), *find(function, cst.AugAssign), *find(function, cst.For),
               *find(function, cst.CompFor)]
    bound = {param.name.value for param in find(function, cst.Param)}
    return bound | {name.value for node in targets for name in find(node.target, cst.Name)} | scope_bindings(function.body)


def _model_tensors(rule) -> dict[str, cst.Assign]:
    """The module's names bound to a tensor of a functional model: an `Input(...)`, a layer
    called on something (`Dense(8)(h)`, `hidden(h)` of a layer bound before), or one of Keras's
    merging functions (`concatenate([a, b])`)."""
    bound = assignments(rule.context)
    layers = {name for name, made in bound.items()
              if any(isinstance(a.value, cst.Call) and (rule.imports.resolve(a.value.func) or "").startswith("keras.layers.")
                     for a in made)}
    tensors = {}
    for name, made in bound.items():
        for assign in made:
            value = assign.value
            if not isinstance(value, cst.Call):
                continue
            callee = rule.imports.resolve(value.func) or ""
            if (isinstance(value.func, cst.Call) or (isinstance(value.func, cst.Name) and value.func.value in layers)
                    or callee.endswith((".Input", ".concatenate", ".add", ".multiply", ".average", ".dot"))):
                tensors[name] = assign
    return tensors
