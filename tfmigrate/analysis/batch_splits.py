"""Batch splits: one batch cut into a piece per device, and the code that reads the pieces.

Shared by TFM105 (a split whose towers' outputs are joined again: ``make_parallel``) and
TFM111 (every other batch cut by hand). A cut is a batch split only where the pieces are read
one per device, which is what tells it from a split of channels or attention heads inside a
model:

- by a tower loop (TFM101), indexed with the loop's index (``images_splits[i]``,
  ``tf.split(x, n)[i]``, ``[x0, x1][i]``) or iterated by the loop itself
  (``for i, piece in enumerate(tf.split(x, n))``, ``zip(pieces, gpus)``);
- or, without a loop, piece by piece under fixed GPU scopes
  (``a, b = tf.split(x, 2)``, ``a`` read under ``'/gpu:0'`` and ``b`` under ``'/gpu:1'``).

The cuts understood: ``tf.split`` in TF 1.x's argument order (positional or keywords in any
order) and TF 0.x's (``tf.split(0, num_gpus, images)``), along axis 0; ``tf.unstack`` (``unpack``)
along axis 0; and ``tf.py_func`` / ``tf.numpy_function`` / ``tf.py_function`` returning the
pieces. The rules find the calls in their own walk and ask :func:`batch_split` about each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.cst.callargs import argument, is_legacy_split, is_zero, split_arguments
from tfmigrate.analysis.devices import (
    TowerLoop, collected_names, device_scopes, enclosing_tower, fixed_gpu, gradient_lists, module_tower_loops,
    tower_loop_at,
)
from tfmigrate.cst.traversal import children, find, init_of, names_used, walk
from tfmigrate.cst.traversal import module_parents

SPLIT = "tensorflow.split"
UNSTACKS = {"tensorflow.unstack", "tensorflow.unpack"}
PY_FUNCS = {"tensorflow.py_func", "tensorflow.numpy_function", "tensorflow.py_function"}
SPLITTERS = {SPLIT} | UNSTACKS | PY_FUNCS
UNSTACK_PARAMS = ("value", "num", "axis", "name")

# What joins the towers' outputs again (TFM105): TensorFlow and the Keras merges of the
# `make_parallel` / `ParallelModel` helpers.
JOINS = {
    "tensorflow.concat",
    "tensorflow.stack",
    "keras.layers.concatenate",
    "keras.layers.merge",
    "keras.layers.merge.concatenate",
    "keras.engine.topology.merge",
    "keras.backend.concatenate",
}
REDUCTIONS = {"tensorflow.reduce_mean", "tensorflow.reduce_sum", "tensorflow.math.reduce_mean",
              "tensorflow.math.reduce_sum"}
#: Keras's `Lambda` layer, which a `make_parallel` helper slices each GPU's piece of the batch with.
KERAS_LAMBDAS = {"keras.layers.Lambda", "keras.layers.core.Lambda"}
JOIN_LAYERS = {"keras.layers.Concatenate", "keras.layers.merge.Concatenate", "keras.layers.Merge"}


@dataclass
class BatchSplit:
    """A batch cut per device: ``call`` cuts it, ``tower`` (or, with no loop, ``blocks``, the
    fixed-GPU scopes) reads one piece per device."""

    call: cst.Call
    api: str  # the qualified name of the cutting call
    tower: TowerLoop | None = None
    blocks: list[cst.With] = field(default_factory=list)

    @property
    def legacy(self) -> bool:
        """``tf.split(0, n, x)``: TF 0.x's argument order."""
        return self.api == SPLIT and is_legacy_split(self.call)


def is_splitter(name: str | None) -> bool:
    return name in SPLITTERS


def batch_split(context, call: cst.Call, api: str) -> BatchSplit | None:
    """The batch split ``call`` (a call of ``api``, one of :data:`SPLITTERS`) makes, else None
    (a cut along another axis, or pieces not read one per device). Ask once the walk is over."""
    cache = context.memo("batch_splits", dict)
    if id(call) not in cache:
        cache[id(call)] = _batch_split(context, call, api) if along_batch_axis(call, api) else None
    return cache[id(call)]


def along_batch_axis(call: cst.Call, api: str) -> bool:
    """Whether a cut of ``api`` is along axis 0 (the default), as a batch is cut."""
    if api == SPLIT:
        axis = split_arguments(call)[2]
    elif api in UNSTACKS:
        axis = argument(call, UNSTACK_PARAMS, "axis")
    else:
        return True
    return axis is None or is_zero(axis)


def _batch_split(context, call: cst.Call, api: str) -> BatchSplit | None:
    parents = module_parents(context)
    parent = parents.get(id(call))
    tower = enclosing_tower(context, call)
    if tower is not None:
        # `tf.split(x, n)[i]` in the tower, or `for i, piece in enumerate(tf.split(x, n))`.
        indexed = isinstance(parent, cst.Subscript) and parent.value is call and _by_index(parent, tower)
        if indexed or any(node is call for node in walk(tower.loop.iter)):
            return BatchSplit(call, api, tower=tower)
    targets = _assigned(call, parent, parents)
    if targets is None:
        return None
    owner = _owner(call, parents)
    for candidate in module_tower_loops(context):
        if (candidate.owner is owner or candidate is tower) and _reads_per_device(candidate, targets):
            return BatchSplit(call, api, tower=candidate)
    blocks = _fixed_device_blocks(context, owner, targets)
    return BatchSplit(call, api, blocks=blocks) if blocks else None


def _assigned(call: cst.Call, parent, parents) -> list[str] | None:
    """The names ``name = call`` or ``a, b = call`` binds, else None."""
    if not isinstance(parent, cst.Assign) or parent.value is not call or len(parent.targets) != 1:
        return None
    target = parent.targets[0].target
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)) and all(isinstance(e.value, cst.Name) for e in target.elements):
        return [e.value.value for e in target.elements]
    return None


def _owner(node: cst.CSTNode, parents) -> cst.CSTNode:
    """The function (or the module) a node is in."""
    current = parents.get(id(node))
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
        current = parents.get(id(current))
    return current


def _by_index(subscript: cst.Subscript, tower: TowerLoop) -> bool:
    """``pieces[i]`` with ``i`` the tower loop's index (or a name computed from it)."""
    return any(
        isinstance(element.slice, cst.Index) and names_used(element.slice.value) & tower.loop_names
        for element in subscript.slice
    )


def _reads_per_device(tower: TowerLoop, targets: list[str]) -> bool:
    """Whether the tower loop takes one piece per device: iterates the pieces
    (`enumerate(pieces)`, `zip([a, b], gpus)`) or indexes them with its index (`pieces[i]`,
    `[a, b][i]`)."""
    wanted = set(targets)
    if names_used(tower.loop.iter) & wanted:
        return True
    for node in walk(tower.loop.body):
        if type(node) is not cst.Subscript or not _by_index(node, tower):
            continue
        value = node.value
        if isinstance(value, cst.Name) and len(targets) == 1 and value.value in wanted:
            return True
        if isinstance(value, (cst.List, cst.Tuple)) and names_used(value) & wanted:
            return True
    return False


def _fixed_device_blocks(context, owner: cst.CSTNode, targets: list[str]) -> list[cst.With]:
    """With no loop: the fixed-GPU scopes that each read a different piece (`a` under
    '/gpu:0', `b` under '/gpu:1'; or `pieces[0]`, `pieces[1]`), when two GPUs or more do."""
    taken: dict[str, cst.With] = {}  # gpu -> its scope
    pieces: set[str] = set()
    for scope in device_scopes(owner, context.imports):
        gpu = fixed_gpu(scope.device, context.imports)
        piece = _piece_read(scope.with_node.body, targets)
        if gpu is None or piece is None or piece in pieces or gpu in taken:
            continue
        taken[gpu] = scope.with_node
        pieces.add(piece)
    return list(taken.values()) if len(taken) >= 2 else []


def _piece_read(body: cst.CSTNode, targets: list[str]) -> str | None:
    """The one piece a device block reads: a name of an unpacked split, or `pieces[k]`."""
    read: set[str] = set()
    for node in walk(body):
        if len(targets) > 1 and type(node) is cst.Name and node.value in targets:
            read.add(node.value)
        elif len(targets) == 1 and type(node) is cst.Subscript and isinstance(node.value, cst.Name):
            element = node.slice[0].slice if len(node.slice) == 1 else None
            if node.value.value == targets[0] and isinstance(element, cst.Index) and isinstance(
                    element.value, cst.Integer):
                read.add(element.value.value)
    return read.pop() if len(read) == 1 else None


def is_join(call: cst.Call, imports) -> bool:
    """`tf.concat`, `tf.stack`, a Keras merge (`concatenate`, `merge`, `K.concatenate`), or a
    call of a Keras `Concatenate(...)` layer."""
    return imports.resolve(call.func) in JOINS or (
        isinstance(call.func, cst.Call) and imports.resolve(call.func.func) in JOIN_LAYERS
    )


def join_after(context, tower: TowerLoop) -> cst.Call | None:
    """The first join (:func:`is_join`), in the function (or module) with the tower loop and
    outside the loop, that reads what the towers collect (`outputs.append(..)`), directly or
    through a loop over it (`[concatenate(outs) for outs in outputs_all]`). Asked by both rules:
    computed once per tower loop."""
    joins = context.memo("tower_joins", dict)
    if id(tower.loop) not in joins:
        joins[id(tower.loop)] = _join_after(context, tower)
    return joins[id(tower.loop)]


def _join_after(context, tower: TowerLoop) -> cst.Call | None:
    # Gradients stacked to be averaged (TFM102's) are not the towers' outputs joined.
    outputs = collected_names(tower.loop) - gradient_lists(tower.loop, context.imports)
    owner = tower.owner if tower.owner is not None else context.module
    stack: list[tuple[cst.CSTNode, frozenset]] = [(owner, frozenset())]
    while stack:
        node, sources = stack.pop()
        if isinstance(node, cst.FunctionDef) and node is not owner:
            continue
        if isinstance(node, (cst.For, cst.CompFor)):
            sources = sources | {(frozenset(names_used(node.target)), frozenset(names_used(node.iter)))}
        elif isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
            sources = sources | _comprehension_sources(node.for_in)
        if isinstance(node, cst.Call) and _averages_stacked(node, context.imports):
            continue  # `tf.reduce_mean(tf.stack(tower_losses))`: the losses averaged, not outputs joined
        if isinstance(node, cst.Call) and is_join(node, context.imports):
            if enclosing_tower(context, node) is not tower and _through_loops(names_used(node), sources) & outputs:
                return node
        stack.extend((child, sources) for child in reversed(children(node)))
    return None


def _averages_stacked(call: cst.Call, imports) -> bool:
    """`tf.reduce_mean(tf.stack(xs))` (or `reduce_sum`), over every axis: a mean or sum of the
    stacked values (the towers' losses), which joins nothing the program reads per example."""
    if imports.resolve(call.func) not in REDUCTIONS or len(call.args) != 1 or call.args[0].keyword is not None:
        return False
    inner = call.args[0].value
    return isinstance(inner, cst.Call) and imports.resolve(inner.func) == "tensorflow.stack"


def _comprehension_sources(comp: cst.CompFor | None) -> frozenset:
    found = set()
    while comp is not None:
        found.add((frozenset(names_used(comp.target)), frozenset(names_used(comp.iter))))
        comp = comp.inner_for_in
    return frozenset(found)


def _through_loops(names: set[str], sources: frozenset) -> set[str]:
    """``names``, plus what the loops binding them iterate over (to a fixed point)."""
    names = set(names)
    changed = True
    while changed:
        changed = False
        for bound, iterated in sources:
            if bound & names and not iterated <= names:
                names |= iterated
                changed = True
    return names


def keras_parallel_helper(context, function: cst.FunctionDef) -> bool:
    """A hand-written Keras `make_parallel(model, gpu_count)` (the keras-extras gist): a tower
    loop whose towers slice the batch with `Lambda` layers, and a Keras `Model` returned around
    the template's inputs. Called on the template, it does what `multi_gpu_model` does."""
    resolve = context.imports.resolve
    if not function.params.params or not any(
            tower_loop_at(context, loop) is not None for loop in find(function, cst.For)):
        return False
    if not any(resolve(call.func) in KERAS_LAMBDAS for call in find(function, cst.Call)):
        return False
    returned = [r.value for r in find(function, cst.Return) if isinstance(r.value, cst.Call)]
    return any(_keras_model(resolve(value.func)) for value in returned)


def _keras_model(name: str | None) -> bool:
    """Keras's `Model` class under any of its names (`keras.models.Model`, `keras.engine.training.Model`)."""
    return (name or "").startswith("keras") and (name or "").endswith(".Model")


def keras_parallel_class(context, cls: cst.ClassDef) -> bool:
    """A hand-written Keras `ParallelModel(model, gpu_count)` (Mask R-CNN's, widely copied): a
    subclass of Keras's `Model` whose methods build the towers as :func:`keras_parallel_helper`
    does (Lambda slices of the batch per GPU) and that wraps the template's inputs. Made around
    the template, it is what `multi_gpu_model` makes."""
    resolve = context.imports.resolve
    if not any(_keras_model(resolve(base.value)) for base in cls.bases):
        return False
    init = init_of(cls)
    if init is None or len(init.params.params) < 3:  # (self, the template, the GPU count)
        return False
    if not any(tower_loop_at(context, loop) is not None for loop in find(cls, cst.For)):
        return False
    return any(resolve(call.func) in KERAS_LAMBDAS for call in find(cls, cst.Call))

