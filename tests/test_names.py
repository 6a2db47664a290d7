"""Name resolution from the module's import table (tfmigrate/cst/names.py)."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from tfmigrate.cst.names import ImportTable, canonical, dotted_name


def _last_expression(source: str) -> tuple[ImportTable, cst.BaseExpression]:
    module = cst.parse_module(textwrap.dedent(source))
    table = ImportTable.from_module(module)
    last = module.body[-1]
    assert isinstance(last, cst.SimpleStatementLine) and isinstance(last.body[0], cst.Expr)
    expression = last.body[0].value
    if isinstance(expression, cst.Call):
        expression = expression.func
    return table, expression


def resolve(source: str) -> str | None:
    """The canonical name of the callee (or name) on the snippet's last line."""
    table, expression = _last_expression(source)
    return table.resolve(expression)


def resolve_all(source: str) -> list[str]:
    table, expression = _last_expression(source)
    return table.resolve_all(expression)


# --- tf.train.batch and friends: every spelling resolves to tensorflow.train.<name> ---------

TRAIN_BATCH = [
    ("import tensorflow as tf", "tf.train.batch(x, 32)"),
    ("import tensorflow as tf", "tf.compat.v1.train.batch(x, 32)"),
    ("import tensorflow.compat.v1 as tf", "tf.train.batch(x, 32)"),
    ("import tensorflow.compat.v1 as v1", "v1.train.batch(x, 32)"),
    ("from tensorflow.compat import v1", "v1.train.batch(x, 32)"),
    ("from tensorflow.compat import v1 as compat", "compat.train.batch(x, 32)"),
    ("from tensorflow import train as tftrain", "tftrain.batch(x, 32)"),
    ("from tensorflow.compat.v1 import train", "train.batch(x, 32)"),
    ("from tensorflow.compat.v1.train import batch", "batch(x, 32)"),
    ("from tensorflow.train import batch as queue_batch", "queue_batch(x, 32)"),
    ("import tensorflow", "tensorflow.train.batch(x, 32)"),
    ("import tensorflow.compat.v1", "tensorflow.compat.v1.train.batch(x, 32)"),
    ("from tensorflow._api.v1 import train", "train.batch(x, 32)"),
    ("from tensorflow.python.training.input import batch", "batch(x, 32)"),
    ("from tensorflow.compat.v1.train import *", "batch(x, 32)"),
    ("from tensorflow.compat.v1 import *", "train.batch(x, 32)"),
    ("from tensorflow import *", "train.batch(x, 32)"),
    ("import tensorflow as tf\nv1 = tf.compat.v1", "v1.train.batch(x, 32)"),
    ("import tensorflow as tf\ntf = tf.compat.v1", "tf.train.batch(x, 32)"),
]


@pytest.mark.parametrize("imports, call", TRAIN_BATCH, ids=[f"{i} | {c}" for i, c in TRAIN_BATCH])
def test_train_batch_spellings(imports, call):
    assert resolve(f"{imports}\n{call}\n") == "tensorflow.train.batch"


@pytest.mark.parametrize(
    "imports, call, expected",
    [
        ("import tensorflow as tf", "tf.train.start_queue_runners(sess)", "tensorflow.train.start_queue_runners"),
        ("import tensorflow as tf", "tf.train.queue_runner.QueueRunner(q, ops)", "tensorflow.train.QueueRunner"),
        (
            "import tensorflow as tf",
            "tf.compat.v1.train.queue_runner.add_queue_runner(qr)",
            "tensorflow.train.add_queue_runner",
        ),
        ("import tensorflow.compat.v1 as tf", "tf.train.Coordinator()", "tensorflow.train.Coordinator"),
        (
            "from tensorflow.python.training import coordinator",
            "coordinator.Coordinator()",
            "tensorflow.train.Coordinator",
        ),
        ("import tensorflow as tf", "tf.queue.FIFOQueue(8, [tf.float32])", "tensorflow.queue.FIFOQueue"),
        ("import tensorflow.compat.v1 as tf", "tf.RandomShuffleQueue(8, 2, [tf.float32])", "tensorflow.RandomShuffleQueue"),
        ("import tensorflow.compat.v1 as tf", "tf.data.make_one_shot_iterator(ds)", "tensorflow.data.make_one_shot_iterator"),
        (
            "from tensorflow.python.training import queue_runner",
            "queue_runner.start_queue_runners(sess)",
            "tensorflow.train.start_queue_runners",
        ),
        ("from tensorflow.python.training import supervisor", "supervisor.Supervisor()", "tensorflow.train.Supervisor"),
        ("import tensorflow.compat.v1 as tf", "tf.io.PaddingFIFOQueue(8, [tf.int32], [[None]])", "tensorflow.io.PaddingFIFOQueue"),
    ],
)
def test_queue_api_spellings(imports, call, expected):
    assert resolve(f"{imports}\n{call}\n") == expected


# --- multi_gpu_model: every home it ever had resolves to keras.utils.multi_gpu_model ------------

MULTI_GPU_MODEL = [
    ("from keras.utils import multi_gpu_model", "multi_gpu_model(m, gpus=2)"),
    ("from keras.utils import multi_gpu_model as mgm", "mgm(m, gpus=2)"),
    ("import keras", "keras.utils.multi_gpu_model(m, gpus=2)"),
    ("import keras", "keras.utils.training_utils.multi_gpu_model(m, gpus=2)"),
    ("from keras.utils.training_utils import multi_gpu_model", "multi_gpu_model(m, gpus=2)"),
    ("from keras.utils import training_utils", "training_utils.multi_gpu_model(m, gpus=2)"),
    ("import keras.utils.training_utils", "keras.utils.training_utils.multi_gpu_model(m, gpus=2)"),
    ("from keras.utils.multi_gpu_utils import multi_gpu_model", "multi_gpu_model(m, gpus=2)"),
    ("import tensorflow as tf", "tf.keras.utils.multi_gpu_model(m, gpus=2)"),
    ("import tensorflow as tf", "tf.compat.v1.keras.utils.multi_gpu_model(m, gpus=2)"),
    ("from tensorflow.keras.utils import multi_gpu_model", "multi_gpu_model(m, gpus=2)"),
    (
        "from tensorflow.python.keras.utils.multi_gpu_utils import multi_gpu_model",
        "multi_gpu_model(m, gpus=2)",
    ),
    ("import tensorflow", "tensorflow.python.keras.utils.multi_gpu_utils.multi_gpu_model(m, gpus=2)"),
    ("from tensorflow._api.v1.keras import utils", "utils.multi_gpu_model(m, gpus=2)"),
    ("from tensorflow._api.v1.keras.utils import multi_gpu_model", "multi_gpu_model(m, gpus=2)"),
    ("from tensorflow.compat.v1.keras.utils import multi_gpu_model", "multi_gpu_model(m, gpus=2)"),
    ("from tensorflow.contrib.keras import utils", "utils.multi_gpu_model(m, gpus=2)"),
    ("import tf_keras", "tf_keras.utils.multi_gpu_model(m, gpus=2)"),
    ("from keras.utils import *", "multi_gpu_model(m, gpus=2)"),
]


@pytest.mark.parametrize("imports, call", MULTI_GPU_MODEL, ids=[f"{i} | {c}" for i, c in MULTI_GPU_MODEL])
def test_multi_gpu_model_spellings(imports, call):
    assert resolve(f"{imports}\n{call}\n") == "keras.utils.multi_gpu_model"


def test_conditional_import_later_one_wins_but_all_are_known():
    source = """
    try:
        from keras.utils import multi_gpu_model
    except ImportError:
        from mylib.parallel import multi_gpu_model
    multi_gpu_model(m, gpus=2)
    """
    assert resolve(source) == "mylib.parallel.multi_gpu_model"
    assert resolve_all(source) == ["keras.utils.multi_gpu_model", "mylib.parallel.multi_gpu_model"]


def test_import_inside_if_and_function_counts():
    source = """
    import keras
    if keras.__version__ < "2.1.0":
        from keras.utils.training_utils import multi_gpu_model
    else:
        from keras.utils import multi_gpu_model

    def build():
        from tensorflow.compat import v1

    multi_gpu_model(m, gpus=4)
    """
    assert resolve(source) == "keras.utils.multi_gpu_model"
    assert resolve_all(source) == ["keras.utils.multi_gpu_model"]
    assert resolve(source.replace("multi_gpu_model(m, gpus=4)", "v1.train.shuffle_batch(x, 8, 100, 10)")) == (
        "tensorflow.train.shuffle_batch"
    )


# --- slim -----------------------------------------------------------------------------------

SLIM_PREFETCH = [
    ("import tensorflow as tf", "tf.contrib.slim.prefetch_queue.prefetch_queue([x])"),
    ("import tensorflow.contrib.slim as slim", "slim.prefetch_queue.prefetch_queue([x])"),
    ("from tensorflow.contrib import slim", "slim.prefetch_queue.prefetch_queue([x])"),
    ("from tensorflow.contrib.slim import prefetch_queue", "prefetch_queue.prefetch_queue([x])"),
    ("import tensorflow as tf\nslim = tf.contrib.slim", "slim.prefetch_queue.prefetch_queue([x])"),
    ("import tf_slim as slim", "slim.prefetch_queue.prefetch_queue([x])"),
]


@pytest.mark.parametrize("imports, call", SLIM_PREFETCH, ids=[f"{i} | {c}" for i, c in SLIM_PREFETCH])
def test_slim_prefetch_queue_spellings(imports, call):
    assert resolve(f"{imports}\n{call}\n") == "slim.prefetch_queue.prefetch_queue"


# --- what must not resolve -------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import queue\nqueue.Queue()\n", "queue.Queue"),
        ("from queue import Queue\nQueue(maxsize=4)\n", "queue.Queue"),
        ("import multiprocessing as mp\nmp.Queue()\n", "multiprocessing.Queue"),
        ("import tensorflow as tf\ndef batch(x, n):\n    return x\nbatch(x, 2)\n", None),
        ("from tensorflow.compat.v1.train import *\ndef batch(x, n):\n    return x\nbatch(x, 2)\n", None),
        ("import tensorflow as tf\nclass Coordinator:\n    pass\nCoordinator()\n", None),
        ("import tensorflow as tf\nds.batch(32)\n", None),
        ("from tensorflow.compat.v1 import *\ntrain = load()\ntrain.batch(32)\n", None),
        ("from tensorflow.compat.v1 import *\ndef f(train):\n    pass\ntrain.batch(32)\n", None),
        ("from tensorflow.compat.v1 import *\nfor train in loaders:\n    pass\ntrain.batch(32)\n", None),
        ("from tensorflow.compat.v1 import *\nwith open_split() as train:\n    pass\ntrain.batch(32)\n", None),
        ("import tensorflow as tf\ntrain.batch(x, 2)\n", None),
        ("from . import train\ntrain.batch(x, 2)\n", None),
        ("from mypkg import train\ntrain.batch(x, 2)\n", "mypkg.train.batch"),
    ],
)
def test_names_that_are_not_tensorflow(source, expected):
    assert resolve(source) == expected


def test_an_alias_assigned_twice_is_not_trusted():
    source = """
    import tensorflow as tf
    import mylib
    train = tf.train
    train = mylib.train
    train.batch(x, 2)
    """
    assert resolve(source) is None


def test_an_alias_also_assigned_a_value_is_not_trusted():
    source = """
    import tensorflow as tf
    batch = tf.train.batch
    batch = next(loader)
    batch(x, 2)
    """
    assert resolve(source) is None


def test_alias_does_not_hide_the_import_it_shadows():
    source = """
    import tensorflow as tf
    tf = tf.compat.v1
    tf, other = make()
    tf.train.batch(x, 2)
    """
    # The alias is dropped (tf is also unpacked into); the import binding still answers.
    assert resolve(source) == "tensorflow.train.batch"


def test_is_bound_and_aliases_of():
    module = cst.parse_module("import tensorflow.compat.v1 as tf\nimport keras\nslim = tf.contrib.slim\n")
    table = ImportTable.from_module(module)
    assert table.is_bound("tf") and table.is_bound("slim") and not table.is_bound("np")
    assert table.aliases_of("tensorflow") == ["tf"]


def test_canonical_and_dotted_name():
    assert canonical("tensorflow.compat.v1.keras.utils.multi_gpu_model") == "keras.utils.multi_gpu_model"
    assert canonical("tensorflow._api.v1.compat.v1.train.batch") == "tensorflow.train.batch"
    assert canonical("tensorflow.contrib.slim.prefetch_queue.prefetch_queue") == "slim.prefetch_queue.prefetch_queue"
    assert dotted_name(cst.parse_expression("a.b.c")) == "a.b.c"
    assert dotted_name(cst.parse_expression("a().b")) is None


# --- the table is built from the statements alone ------------------------------------------
STATEMENT_SHAPES = textwrap.dedent("""\
    import os, tensorflow as tf
    try:
        import keras
    except ImportError as missing:
        keras = None
    else:
        slim = tf.contrib.slim
    finally:
        done = True
    if os.name: import numpy as np
    elif os.sep: from tensorflow.compat import v1
    else:
        v1 = None
    while False: counter: int = 0
    for (i, j) in []:
        with open('x') as handle, tf.device('/gpu:0'):
            total += 1
    class Model:
        layers = tf.keras.layers
        def call(self, x, /, y=lambda tf: tf, *args, z, **kwargs):
            async def inner(): pass
    match os.name:
        case 'nt':
            from tensorflow import keras as k
        case _:
            pass
    f = lambda inner_name: inner_name
    """)


def _full_walk_table(module: cst.Module) -> ImportTable:
    from tfmigrate.cst.walker import visit_read_only

    table = ImportTable()
    visit_read_only(module, table)
    for name in table._reassigned:
        table.aliases.pop(name, None)
    return table


def _state(table: ImportTable) -> tuple:
    return (table.bindings, table.all_bindings, table.star_modules, table.aliases, table._reassigned, table._local_defs)


def test_statement_walk_builds_the_full_walks_table_but_for_lambda_parameters():
    from tests.conftest import FIXTURES, ROOT

    texts = [STATEMENT_SHAPES] + [
        path.read_text(encoding="utf-8", errors="replace")
        for path in sorted(FIXTURES.rglob("*.py")) + sorted((ROOT / "tfmigrate").glob("*.py"))
    ]
    compared = 0
    for text in texts:
        try:
            module = cst.parse_module(text)
        except cst.ParserSyntaxError:
            continue
        fast, full = _state(ImportTable.from_module(module)), _state(_full_walk_table(module))
        assert fast[:5] == full[:5]
        lambdas = {p.name.value for node in _lambdas(module) for p in node.params.params}
        assert fast[5] <= full[5] and full[5] - fast[5] <= lambdas
        compared += 1
    assert compared > 50
    table = ImportTable.from_module(cst.parse_module(STATEMENT_SHAPES))
    assert {"missing", "handle", "i", "j", "total", "keras", "v1", "counter"} <= table._reassigned
    assert {"Model", "call", "inner", "self", "x", "y", "args", "z", "kwargs"} <= table._local_defs
    assert table.bindings["np"] == "numpy" and table.bindings["k"] == "tensorflow.keras"


def _lambdas(module: cst.Module) -> list[cst.Lambda]:
    from tfmigrate.cst.traversal import find

    return find(module, cst.Lambda)


def test_beside_a_star_import_lambda_parameters_are_local_names():
    source = "from tensorflow import *\nif map(lambda device: device, []):\n    pass\ndevice\n"
    assert resolve(source) is None  # bound by the lambda: not tensorflow.device
    assert resolve("from tensorflow import *\ndevice\n") == "tensorflow.device"
