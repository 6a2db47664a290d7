"""A loss returned as one mean for the batch, given per example for Keras 3.

Keras 2's parallel model computed a loss like keras's `mnist_siamese` contrastive loss,
`return K.mean(y_true * K.square(y_pred) + ...)`, once on the merged batch. Keras 3 under a
distribution strategy adds such a loss over the replicas (2 replicas: twice the loss and twice
the step; checked on TF 2.21), where it averages a loss given per example. A mean over every
element of the batch is the mean of per-example means (each example holds as many elements),
so the fix gives the mean per example, `K.mean(..., axis=-1)`, and the batch's loss is the
same (:func:`tfmigrate.analysis.keras_losses.batch_value_returned` finds it,
:func:`~tfmigrate.analysis.keras_losses.per_example_mean` says when it cannot be given so).
"""

from __future__ import annotations

import libcst as cst

from tfmigrate.analysis.keras_losses import (
    batch_coupled, batch_value_returned, compiled_loss, compiled_losses, examples_weighted, loss_label,
    per_example_mean,
)
from tfmigrate.cst.callargs import keyword_is, with_keyword
from tfmigrate.cst.codegen import code
from tfmigrate.cst.traversal import contains, find
from tfmigrate.rewrites.keras3_leftovers import made_within
from tfmigrate.rewrites.mirrored import TfNames

__all__ = ["ON_WHOLE_BATCH", "on_whole_batch_function", "per_example_losses", "whole_batch_functions"]

_WHY = ("Per example (axis=-1): Keras 3 under a strategy averages per-example losses over the",
        "replicas, where it would add up one mean per replica; the batch's mean is the same.")


def per_example_losses(module: cst.Module, compiles: list[cst.Call], changes: dict) -> dict:
    """The returns of the losses ``compiles`` compile that give one mean for the batch, given
    per example (`axis=-1`, on the mean as ``changes`` make it: `ops.mean`), a function's said
    why in a comment."""
    made: dict = {}
    for compiled in compiles:
        loss = compiled_loss(compiled)
        for function in compiled_losses(module, loss) if loss is not None else ():
            found = batch_value_returned(function)
            if found is None or not found[1] or per_example_mean(module, function) is not None:
                continue
            mean = found[0]
            made[mean] = with_keyword(changes.get(mean, mean), "axis", "-1")
            line = next((line for line in find(function, cst.SimpleStatementLine)
                         if isinstance(line.body[0], cst.Return) and line.body[0].value is mean), None)
            if line is not None:  # not a lambda's
                comment = [cst.EmptyLine(comment=cst.Comment(f"# {text}")) for text in _WHY]
                made[line] = line.with_changes(leading_lines=[*line.leading_lines, *comment])
    return made


#: What computes a loss or metric on the whole batch under a strategy (written into the module).
ON_WHOLE_BATCH = "on_whole_batch"

_ON_WHOLE_BATCH = '''
def on_whole_batch(function, share=False):
    """`function(y_true, y_pred)` on the whole batch, as Keras 2's parallel model computed it on
    its merged outputs: under a distribution strategy each replica gathers every replica's part
    first. A loss (`share=True`) of one value returns each replica's share of it, as Keras 3
    adds such a loss over the replicas (it averages a loss of per-example values)."""

    def on_batch(y_true, y_pred):
        context = {get_replica_context}()
        if context is None or context.num_replicas_in_sync == 1:
            return function(y_true, y_pred)
        value = function(context.all_gather(y_true, axis=0), context.all_gather(y_pred, axis=0))
        if share and len(value.shape) == 0:
            return value / context.num_replicas_in_sync
        return value

    on_batch.__name__ = getattr(function, "__name__", "on_batch")
    return on_batch
'''


def on_whole_batch_function(rule) -> tuple[cst.BaseStatement, list]:
    """The :data:`ON_WHOLE_BATCH` function, through the module's own TensorFlow import: (function,
    imports)."""
    tf = TfNames(rule)
    function = cst.parse_statement(_ON_WHOLE_BATCH.format(
        get_replica_context=tf("tensorflow.distribute.get_replica_context")))
    return function, tf.imports


def whole_batch_functions(module: cst.Module, compiles: list[cst.Call], changes: dict,
                          on_batch: cst.Call | None = None) -> tuple[dict, str | None]:
    """The losses and metrics ``compiles`` compile that compute one value for the whole batch
    (a Dice loss dividing whole-batch sums, an RMSE's root of the batch's mean), computed on the
    whole batch under the strategy as the parallel model did (:data:`ON_WHOLE_BATCH`): checked on
    TF 2.21, a Dice-trained model's losses and weights equal one device's on the whole batch to
    float precision. Returns (changes, why not) where the examples are weighted, a function is given
    otherwise than by name, as a lambda or as a factory's call, or another change already gives
    it per output. Where
    the models step by ``on_batch`` (a `train_on_batch` or `test_on_batch` call that Keras 3 runs
    on the whole batch on every replica), nothing is gathered: a metric is the batch's as it is,
    and a loss of one value is refused (Keras 3 adds it over the replicas)."""
    made: dict = {}
    losses: list = []
    for compiled in compiles:
        loss = compiled_loss(compiled)
        metrics = next((arg.value for arg in compiled.args if keyword_is(arg, "metrics")), None)
        for value, share in ((loss, True), (metrics, False)):
            if value is None:
                continue
            given = _given(value)
            wanted = [node for node in given if _on_whole_batch(module, node, share)]
            hidden = _given_otherwise(module, value, given, share)
            if hidden is not None:
                return {}, _refused(f"{hidden} and is given through `{code(value)}`: give the function itself to "
                                    "`compile`")
            if wanted and value in changes:
                return {}, _refused(f"{_whole_batch_label(wanted[0])} computes one value for the whole batch and is "
                                    "given once for several outputs")
            # The function as the other changes leave it (a lambda's backend calls), in a copy: the
            # fix's last pass makes the changes inside each replacement, and would wrap it again.
            if on_batch is None:
                made.update((node, _wrapped(made_within(node, changes).deep_clone(), share)) for node in wanted)
            losses += wanted if share else []
    if losses and on_batch is not None:
        return {}, _refused(f"{_whole_batch_label(losses[0])} computes one value for the whole batch, and "
                            f"`{code(on_batch.func)}` runs the whole batch on every replica, where Keras 3 adds such a "
                            "loss over the replicas")
    # Keras weighs a loss by the examples' weights (not a metric, unless compiled as weighted).
    why = examples_weighted(module) if losses else None
    if why:
        return {}, _refused(f"{_whole_batch_label(losses[0])} computes one value for the whole batch, and {why}")
    return made, None


def _refused(reason: str) -> str:
    return (f"{reason}: the parallel model computed such a value once on the merged outputs, MirroredStrategy "
            "computes it on each replica's part; compute it per example by hand, or keep the model on one device")


def _given_otherwise(module: cst.Module, value: cst.BaseExpression, given: list, share: bool) -> str | None:
    """What in ``value`` computes one value for the whole batch but is not given as a function
    (`compile(loss=bce_dice_loss(bce_weight=0.3))`, a factory's call), as the start of a reason."""
    for name in find(value, cst.Name):
        coupled = batch_coupled(module, name.value)
        if coupled is not None and not any(contains(node, name) for node in given):
            return f"`{coupled[0]}` divides sums over the whole batch"
    handled = [function for node in given for function in compiled_losses(module, node)]
    for function in compiled_losses(module, value) if share else ():
        found = batch_value_returned(function)
        if found is not None and not any(function is h for h in handled) and (
                not found[1] or per_example_mean(module, function)):
            return f"the loss `{loss_label(function)}` returns one value for the whole batch"
    return None


def _whole_batch_label(node: cst.CSTNode) -> str:
    return "a lambda" if isinstance(node, cst.Lambda) else f"`{code(node)}`"


def _given(value: cst.BaseExpression) -> list[cst.CSTNode]:
    """The functions a `loss=` or `metrics=` value gives by name, as a lambda or as a factory's
    call (`tversky_loss(0.7, 0.3)`): itself, or the elements (and dictionary values) of its
    lists, tuples and dictionaries."""
    if isinstance(value, (cst.Name, cst.Lambda)) or (isinstance(value, cst.Call) and isinstance(value.func, cst.Name)):
        return [value]
    if isinstance(value, (cst.List, cst.Tuple)):
        return [node for element in value.elements if isinstance(element, cst.Element)
                for node in _given(element.value)]
    if isinstance(value, cst.Dict):
        return [node for element in value.elements if isinstance(element, cst.DictElement)
                for node in _given(element.value)]
    return []


def _on_whole_batch(module: cst.Module, node: cst.CSTNode, share: bool) -> bool:
    """Whether the loss (``share``) or metric ``node`` names (or is) computes one value for the
    whole batch that the strategy's replicas would compute otherwise: sums divided (Dice), or
    a value made from a whole-batch reduction; a loss's bare mean only where it cannot be given
    per example (:func:`per_example_losses`), a metric's never (the replicas' means average to
    the batch's)."""
    named = node.func if isinstance(node, cst.Call) else node  # a factory's call: what the factory makes
    if isinstance(named, cst.Name) and batch_coupled(module, named.value) is not None:
        return True
    functions = compiled_losses(module, node)
    found = batch_value_returned(functions[0]) if functions else None
    if found is None:
        return False
    return not found[1] or (share and per_example_mean(module, functions[0]) is not None)


def _wrapped(node: cst.BaseExpression, share: bool) -> cst.Call:
    """`on_whole_batch(node)` (`share=True` for a loss)."""
    args = [cst.Arg(node)]
    if share:
        args = [cst.Arg(node, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                cst.Arg(cst.Name("True"), keyword=cst.Name("share"), equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))]
    return cst.Call(func=cst.Name(ON_WHOLE_BATCH), args=args)
