"""Is a program TF1 code that needs legacy mode? Decided from its source, without TensorFlow.

Legacy mode means: ``import tensorflow`` yields ``tensorflow.compat.v1`` with v2 behaviour
disabled, and Keras is Keras 2 (``tf_keras``). A program needs it when it uses an API that
TensorFlow 2 removed from the top-level namespace (``tf.placeholder``, ``tf.Session``,
``tf.train.GradientDescentOptimizer``, ``tf.get_variable``, ...), ``tf.contrib``, or Keras's
``multi_gpu_model``. Code already written against ``tf.compat.v1`` is valid TF2 and runs as is.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from tfmigrate.tf_api import tf1_only

#: names that mark a Keras program
KERAS_MARKERS = {"keras", "tf_keras"}


@dataclass
class Detection:
    legacy: bool
    keras: bool
    reasons: list[str] = field(default_factory=list)
    #: The program calls TF1's layers or RNN cells through `tf.compat.v1` (`v1.layers.dense`,
    #: `v1.nn.rnn_cell.GRUCell`): TensorFlow 2.16+ builds them from Keras 2 only (with Keras 3
    #: they raise "not available with Keras 3"), so it runs with `TF_USE_LEGACY_KERAS=1`.
    keras2: bool = False
    #: A Keras program of TF 2.0-2.3, which had both `multi_gpu_model` and TF2's `tf.random.set_seed`
    #: (no TF1-only API; maybe Keras 2.3's module paths, `keras.layers.core`): it runs as TF2, with
    #: Keras 2 (``tf_keras``) and `multi_gpu_model` restored. In TF1 mode its `tf.random.set_seed`
    #: does not exist.
    multi_gpu_tf2: bool = False


def _keras_backed(parts: list[str]) -> bool:
    """`layers.X` or `nn.rnn_cell.X` of the TF1 API (``parts`` after the compat.v1 module)."""
    return (len(parts) > 1 and parts[0] == "layers") or parts[:2] == ["nn", "rnn_cell"]


#: Modules of Keras 2.0-2.2 that Keras 3 does not have: a program importing them was written for
#: Keras 2 on TF1, and runs as one (tf_keras, which maps them to the packages above them).
KERAS_2_0_MODULES = ("keras.engine", "keras.legacy", "keras.layers.core", "keras.layers.merge",
                     "keras.layers.convolutional", "keras.layers.recurrent", "keras.layers.normalization",
                     "keras.layers.pooling", "keras.layers.embeddings", "keras.layers.wrappers",
                     "keras.layers.advanced_activations", "keras.layers.noise", "keras.utils.np_utils",
                     "keras.utils.generic_utils", "keras.utils.data_utils", "keras.utils.conv_utils")


def _keras_2_0(module: str) -> bool:
    return any(module == old or module.startswith(old + ".") for old in KERAS_2_0_MODULES)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def detect(source: str) -> Detection:
    """Look at imports and attribute chains; a syntax error means "not legacy" (the run will say)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return Detection(False, "keras" in source)
    tf_aliases: set[str] = set()       # names bound to the top-level tensorflow module
    v1_aliases: set[str] = set()       # names bound to tensorflow.compat.v1
    reasons: list[str] = []
    keras_paths: list[str] = []  # the reasons that are Keras 2.0-2.3 module paths
    keras = keras2 = tf2_seed = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tensorflow":
                    tf_aliases.add(alias.asname or "tensorflow")
                if alias.name == "tensorflow.compat.v1" and alias.asname:
                    v1_aliases.add(alias.asname)
                if alias.name.split(".")[0] in KERAS_MARKERS:
                    keras = True
                if alias.name.startswith("tensorflow.contrib"):
                    reasons.append(f"import {alias.name}")
                if alias.name.startswith("keras.utils.training_utils") or _keras_2_0(alias.name):
                    reasons.append(f"import {alias.name}")
                    keras_paths.append(reasons[-1])
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in KERAS_MARKERS or ".keras" in node.module:
                keras = True
            for alias in node.names:
                if alias.name == "multi_gpu_model":
                    reasons.append(f"from {node.module} import multi_gpu_model")
                if node.module == "tensorflow.compat" and alias.name == "v1":
                    v1_aliases.add(alias.asname or "v1")
            if node.module.startswith("tensorflow.contrib") or _keras_2_0(node.module):
                reasons.append(f"from {node.module} import ...")
                if not node.module.startswith("tensorflow.contrib"):
                    keras_paths.append(reasons[-1])
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = _dotted(node)
        if not name:
            continue
        parts = name.split(".")
        if "keras" in parts:
            keras = True
        if parts[-1] == "multi_gpu_model":
            reasons.append(name)
        if (parts[0] in v1_aliases and _keras_backed(parts[1:])) or (
                parts[0] in tf_aliases and parts[1:3] == ["compat", "v1"] and _keras_backed(parts[3:])):
            keras2 = True
        if parts[0] not in tf_aliases or len(parts) < 2:
            continue
        if parts[1:] == ["random", "set_seed"]:
            tf2_seed = True
        if tf1_only(parts[1:]):
            reasons.append(name)
    if any(isinstance(n, ast.Name) and n.id == "multi_gpu_model" for n in ast.walk(tree)):
        reasons.append("multi_gpu_model")
    unique = list(dict.fromkeys(reasons))
    # Standalone Keras 2.3 ran on TF 2.0-2.3 and still had its 2.0 module paths.
    if tf2_seed and unique and all("multi_gpu_model" in reason or reason in keras_paths for reason in unique):
        return Detection(False, keras, unique, keras2=True, multi_gpu_tf2=True)
    return Detection(bool(unique), keras, unique, keras2=keras2)
