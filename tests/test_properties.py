"""Property tests: `check` and `fix --unsafe-fixes` over generated legacy programs.

Hypothesis writes TF1 multi-GPU programs the way people did: tower loops with every device
spelling, the textbook ``tower_grads`` / ``average_gradients`` shape, queue pipelines,
``multi_gpu_model`` calls and one-shot iterators, at module level, in functions and in
``with tf.Graph().as_default(), tf.device('/cpu:0'):``, with decorators, blank lines and
comments. For every program:

- ``check`` does not crash (an exception out of ``check_text`` is an internal error);
- the fixed program compiles, a second fix changes nothing (idempotence);
- every comment outside the statements a fix rewrites survives: those comments carry unique
  tokens (``KEEP<n>``), and each must be in the output.

The in-process API is used for speed; ``test_cli_round_trip`` runs the command line on a few.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfmigrate.engine.config import Config
from tfmigrate.engine.fixer import fix_source, fix_text
from tfmigrate.engine.runner import check_text
from tfmigrate.engine.source import decode_source

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Config(root=ROOT)
# 100 examples per property (30 for the mixed one) keep the file near a minute on 2 cores;
# TFMIGRATE_PROPERTY_EXAMPLES=1000 for a deeper run (every property passed at 200).
EXAMPLES = int(os.environ.get("TFMIGRATE_PROPERTY_EXAMPLES", "100"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # the same examples on every run: a CI failure reproduces locally
    database=None,
)


# --------------------------------------------------------------------------- program builder


@dataclass
class Program:
    """Lines of code (unindented blocks are indented by the builder) and the comment tokens
    that must survive a fix."""

    lines: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    count: int = 0

    def token(self, keep: bool = True) -> str:
        self.count += 1
        name = f"{'KEEP' if keep else 'MAYBE'}{self.count}"
        if keep:
            self.keep.append(name)
        return name

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def indent(lines: list[str], level: int) -> list[str]:
    return [("    " * level + line) if line.strip() else "" for line in lines]


LOOP_VARS = st.sampled_from(["i", "gpu", "gpu_id", "tower", "idx", "n"])
COUNTS = st.sampled_from(["2", "4", "8", "num_gpus", "FLAGS.num_gpus", "NUM_GPUS"])
BLANKS = st.integers(min_value=0, max_value=2)


def device_spelling(var: str, kind: str) -> str:
    return {
        "percent": f"'/gpu:%d' % {var}",
        "percent_upper": f"'/GPU:%d' % {var}",
        "device_gpu": f"'/device:GPU:%d' % {var}",
        "format": f"'/gpu:{{}}'.format({var})",
        "format_named": f"'/gpu:{{n}}'.format(n={var})",
        "fstring": f"f'/gpu:{{{var}}}'",
        "concat": f"'/gpu:' + str({var})",
        "devicespec": f"tf.DeviceSpec(device_type='GPU', device_index={var})",
        "devicespec_str": f"tf.DeviceSpec(device_type='GPU', device_index={var}).to_string()",
    }[kind]


SPELLINGS = st.sampled_from(
    ["percent", "percent_upper", "device_gpu", "format", "format_named", "fstring", "concat", "devicespec",
     "devicespec_str", "list", "enumerate_list"]
)


@st.composite
def comment_lines(draw, program: Program, keep: bool = True) -> list[str]:
    """Zero to two comment lines and blank lines, each comment with a unique token."""
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        lines += [""] * draw(st.integers(0, 1))
        lines.append(f"# {program.token(keep)} {draw(st.sampled_from(['note', 'TODO: later', 'see the paper']))}")
    return lines


@st.composite
def filler(draw, program: Program, keep: bool = True) -> list[str]:
    """A harmless statement, maybe with comments above it and after it."""
    statement = draw(st.sampled_from([
        "learning_rate = 0.1", "batch_size = 128", "print('building the graph')", "x = tf.placeholder(tf.float32, [None, 10])",
        "summaries = []", "step = 0", "assert batch_size > 0", "config = tf.ConfigProto(allow_soft_placement=True)",
    ]))
    lines = draw(comment_lines(program, keep))
    if draw(st.booleans()):
        statement += f"  # {program.token(keep)}"
    return lines + [statement]


DECORATORS = st.sampled_from([[], ["@staticmethod_like"], ["@functools.lru_cache(maxsize=None)"], ["@a.b(1)", "@c"]])


@st.composite
def helper_function(draw, program: Program) -> list[str]:
    """A function no rule touches, with comments inside and decorators."""
    name = draw(st.sampled_from(["build_model", "tower_loss", "make_layer", "inference"]))
    lines = [*draw(comment_lines(program)), *draw(DECORATORS), f"def {name}(inputs, reuse=None):"]
    body = draw(filler(program)) + [f"# {program.token()} the body", "return tf.layers.dense(inputs, 10)"]
    return lines + indent(body, 1)


AVERAGE_GRADIENTS = [
    "def average_gradients(tower_grads):",
    "    average_grads = []",
    "    for grad_and_vars in zip(*tower_grads):",
    "        grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]",
    "        grad = tf.reduce_mean(tf.concat(grads, 0), 0)",
    "        average_grads.append((grad, grad_and_vars[0][1]))",
    "    return average_grads",
]


@st.composite
def tower_loop(draw, program: Program) -> list[str]:
    """A tower loop: textbook gradients, or towers that only build outputs."""
    var = draw(LOOP_VARS)
    count = draw(COUNTS)
    spelling = draw(SPELLINGS)
    textbook = draw(st.booleans())
    before: list[str] = []
    if spelling in ("list", "enumerate_list"):
        before.append(f"devices = ['/gpu:%d' % k for k in range({count})]")
        head = f"for {var} in devices:" if spelling == "list" else f"for {var}, dev in enumerate(devices):"
        device = var if spelling == "list" else "dev"
    else:
        head = f"for {var} in range({count}):"
        device = device_spelling(var, spelling)
    body: list[str] = []
    if textbook:
        before.append("tower_grads = []")
        body += ["loss = build_model(x)" if draw(st.booleans()) else "loss = tf.reduce_mean(build_model(x))"]
        if draw(st.booleans()):
            body.append("tf.get_variable_scope().reuse_variables()")
        if draw(st.booleans()):
            body.append("tower_grads.append(opt.compute_gradients(loss))")
        else:
            body += ["grads = opt.compute_gradients(loss)", "tower_grads.append(grads)"]
    else:
        before.append("outputs = []")
        body.append("outputs.append(build_model(x))")
    if draw(st.booleans()):
        body = [f"# {program.token(keep=False)} inside the tower"] + body
    scopes = [f"with tf.device({device}):"]
    if draw(st.booleans()):
        scopes.append(f"with tf.name_scope('tower_%d' % {var if spelling != 'list' else 0}):")
    block = [head]
    for depth, scope in enumerate(scopes, start=1):
        block.append("    " * depth + scope)
    block += indent(body, len(scopes) + 1)
    after: list[str] = []
    if textbook:
        after += draw(comment_lines(program))
        after += ["grads = average_gradients(tower_grads)", "train_op = opt.apply_gradients(grads, global_step=gs)"]
    else:
        after += ["logits = tf.concat(outputs, axis=0)"]
    setup = ["opt = tf.train.GradientDescentOptimizer(learning_rate)", "gs = tf.train.get_or_create_global_step()"]
    return setup + before + block + after


@st.composite
def placed(draw, program: Program, block: list[str], name: str = "train") -> list[str]:
    """The block at module level, in a function, or in a graph + cpu scope (either place)."""
    context = draw(st.sampled_from(["module", "function", "graph", "function_graph"]))
    fillers_before = draw(st.lists(filler(program), max_size=2))
    fillers_after = draw(st.lists(filler(program), max_size=2))
    body = [line for f in fillers_before for line in f] + block + [line for f in fillers_after for line in f]
    if context in ("graph", "function_graph"):
        body = ["with tf.Graph().as_default(), tf.device('/cpu:0'):"] + indent(body, 1)
    if context in ("function", "function_graph"):
        lines = draw(comment_lines(program)) + draw(DECORATORS) + [f"def {name}(x, num_gpus=2):"]
        body = indent(body + ["return 0"], 1)
        return lines + body
    return body


PREAMBLE_IMPORTS = st.sampled_from([
    ["import tensorflow as tf"],
    ["import functools", "", "import tensorflow as tf"],
    ["from __future__ import print_function", "", "import tensorflow as tf"],
    ["import tensorflow.compat.v1 as tf"],
])


@st.composite
def module(draw, parts) -> tuple[str, list[str]]:
    """A whole module: header comments, imports, module-level fillers, then the parts."""
    program = Program()
    lines = [f"# {program.token()} header", '"""Docstring of a legacy script."""' if draw(st.booleans()) else ""]
    lines += draw(PREAMBLE_IMPORTS)
    lines += ["", "FLAGS = None", "NUM_GPUS = 2", ""]
    for part in parts:
        lines += [""] * draw(BLANKS)
        lines += draw(part(program))
    lines += ["", f"# {program.token()} end of the module"]
    program.lines = lines
    return program.text(), program.keep


@st.composite
def tower_parts(draw, program: Program) -> list[str]:
    """A helper no rule touches, the tower loop placed somewhere, and the averaging helper
    before or after it (the TFM101 unsafe fix removes that helper when it inlines it)."""
    helper_first = draw(st.booleans())
    lines = draw(helper_function(program)) + [""]
    if helper_first:
        lines += AVERAGE_GRADIENTS + ["", ""]
    lines += draw(placed(program, draw(tower_loop(program))))
    if not helper_first:
        lines += ["", ""] + AVERAGE_GRADIENTS
    return lines


def assert_sound(text: str, keep: list[str]) -> str:
    """The rules run without crashing; the fix compiles, is idempotent and keeps the comments;
    return the fixed text.

    The first pass of ``fix_source`` is ``check``'s analysis (``analyze_source`` on the same
    text, every rule enabled): an exception out of a rule raises here as it would in `check`.
    ``test_check_finds_the_pattern`` runs ``check_text`` itself on a sample of every generator.
    """
    result = fix_source(decode_source("<generated>", text.encode("utf-8")), CONFIG, unsafe=True)
    assert result.fixed or result.remaining
    fixed = result.new_text if result.changed else text
    compile(fixed, "<fixed>", "exec", dont_inherit=True)
    lost = [token for token in keep if token not in fixed]
    assert not lost, f"comments lost: {lost}"
    assert fix_text(fixed, CONFIG, unsafe=True) == fixed, "a second fix changed the result"
    return fixed


# ---------------------------------------------------------------------------- the properties


@SETTINGS
@given(module([tower_parts]))
def test_tower_programs(generated):
    text, keep = generated
    compile(text, "<generated>", "exec", dont_inherit=True)  # the generator writes valid Python
    assert_sound(text, keep)


@st.composite
def queue_pipeline(draw, program: Program) -> list[str]:
    producer = draw(st.sampled_from([
        "tf.train.string_input_producer(filenames{args})",
        "tf.train.string_input_producer(filenames{args})",
        "tf.compat.v1.train.string_input_producer(filenames{args})",
    ]))
    args = ""
    if draw(st.booleans()):
        args += f", num_epochs={draw(st.sampled_from(['None', '1', 'num_epochs', '10']))}"
    if draw(st.booleans()):
        args += f", shuffle={draw(st.sampled_from(['True', 'False']))}"
    reader = draw(st.sampled_from(["tf.TFRecordReader()", "tf.WholeFileReader()", "tf.FixedLengthRecordReader(record_bytes=3073)"]))
    batcher = draw(st.sampled_from(["shuffle_batch", "batch"]))
    batch_args = f"batch_size={draw(st.sampled_from(['32', 'batch_size', 'FLAGS.batch_size']))}"
    if draw(st.booleans()):
        batch_args += f", num_threads={draw(st.integers(1, 16))}"
    batch_args += f", capacity={draw(st.sampled_from(['1000', '3 * batch_size + 100']))}"
    if batcher == "shuffle_batch":
        batch_args += f", min_after_dequeue={draw(st.sampled_from(['500', '10']))}"
    lines = [
        "def inputs(filenames, batch_size, num_epochs=None):",
        f"    filename_queue = {producer.format(args=args)}",
        f"    reader = {reader}",
        "    _, value = reader.read(filename_queue)",
        *indent(draw(filler(program, keep=False)), 1),  # inside the rewritten pipeline
        "    image = tf.decode_raw(value, tf.uint8)",
        "    label = tf.cast(image[0], tf.int32)",
        f"    return tf.train.{batcher}([image, label], {batch_args})",
        "",
        "",
        *draw(comment_lines(program)),
        "def train(filenames):",
        "    images, labels = inputs(filenames, 32)",
        *indent(draw(filler(program)), 1),
        "    with tf.Session() as sess:",
        "        sess.run(tf.global_variables_initializer())",
        "        coord = tf.train.Coordinator()",
        "        threads = tf.train.start_queue_runners(sess=sess, coord=coord)",
        "        try:",
        "            while not coord.should_stop():",
        "                sess.run([images, labels])",
        "        except tf.errors.OutOfRangeError:",
        "            pass",
        "        finally:",
        "            coord.request_stop()",
        "        coord.join(threads)",
    ]
    return lines


@SETTINGS
@given(module([queue_pipeline]))
def test_queue_pipelines(generated):
    text, keep = generated
    assert_sound(text, keep)


@st.composite
def keras_multi_gpu(draw, program: Program) -> list[str]:
    call = draw(st.sampled_from([
        "tf.keras.utils.multi_gpu_model(model, {gpus})",
        "tf.keras.utils.multi_gpu_model(model, gpus={gpus})",
        "multi_gpu_model(model, gpus={gpus})",
        "multi_gpu_model(model, {gpus}, cpu_merge=False)",
    ])).format(gpus=draw(st.sampled_from(["2", "4", "[0, 1]", "num_gpus", "G"])))
    build = ["model = tf.keras.Sequential([tf.keras.layers.Dense(10)])"]
    if draw(st.booleans()):
        build = ["with tf.device('/cpu:0'):"] + indent(build, 1)
    use = [f"parallel = {call}", "parallel.compile(loss='mse', optimizer='sgd')", "parallel.fit(x, y, batch_size=64)"]
    if draw(st.booleans()):
        use = ["try:"] + indent(use, 1) + ["except ValueError:", "    parallel = model"]
    block = ["from tensorflow.keras.utils import multi_gpu_model", "G = 2"] + build + draw(filler(program)) + use
    return draw(placed(program, block, name="fit_model"))


@SETTINGS
@given(module([keras_multi_gpu]))
def test_multi_gpu_model_calls(generated):
    text, keep = generated
    assert_sound(text, keep)


@st.composite
def iterator_use(draw, program: Program) -> list[str]:
    receiver = draw(st.sampled_from(["dataset", "ds", "self.dataset", "make_ds()", "tf.data.Dataset.range(10).batch(2)"]))
    method = draw(st.sampled_from(["make_one_shot_iterator", "make_initializable_iterator"]))
    line = f"iterator = {receiver}.{method}()"
    if draw(st.booleans()):
        line = f"next_element = {receiver}.{method}().get_next()"
    block = ["dataset = tf.data.Dataset.range(100)", *draw(filler(program)), line]
    return draw(placed(program, block, name="input_fn"))


@SETTINGS
@given(module([iterator_use, iterator_use]))
def test_dataset_iterators(generated):
    text, keep = generated
    fixed = assert_sound(text, keep)
    assert "make_one_shot_iterator()" not in fixed and "make_initializable_iterator()" not in fixed


@settings(SETTINGS, max_examples=max(10, EXAMPLES * 3 // 10))
@given(st.lists(st.sampled_from([tower_parts, queue_pipeline, keras_multi_gpu, iterator_use]), min_size=2, max_size=3)
       .flatmap(module))
def test_mixed_programs(generated):
    """Several legacy patterns in one module: the fixes must not trip over each other."""
    text, keep = generated
    assert_sound(text, keep)


EXPECTED = {"tower_parts": {"TFM101"}, "queue_pipeline": {"TFM301", "TFM302", "TFM303"},
            "keras_multi_gpu": {"TFM201"}, "iterator_use": {"TFM305"}}


@settings(SETTINGS, max_examples=max(10, EXAMPLES // 2))
@given(st.sampled_from(sorted(EXPECTED)).flatmap(lambda name: st.tuples(st.just(name), module([globals()[name]]))))
def test_check_finds_the_pattern(generated):
    """``check_text`` (what `check` runs on each file) does not crash and finds what each
    generator wrote."""
    name, (text, _) = generated
    assert EXPECTED[name] <= {f.code for f in check_text(text, CONFIG)}


# ------------------------------------------------------------------------- a few CLI runs


def test_cli_round_trip(tmp_path):
    """`fix --write --unsafe-fixes` on generated files, then again: nothing changes, exit codes
    are the documented ones, every file compiles and keeps its comments."""
    examples = {}
    for index, strategy in enumerate([module([tower_parts]), module([queue_pipeline]),
                                      module([keras_multi_gpu]), module([iterator_use])]):
        for number, (text, keep) in enumerate(_examples(strategy, 3)):
            examples[f"g{index}_{number}.py"] = (text, keep)
    for name, (text, _) in examples.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    cli = [sys.executable, "-m", "tfmigrate"]
    env = {**os.environ, "TFMIGRATE_CACHE_DIR": str(tmp_path / ".cache")}
    first = subprocess.run(cli + ["check", "."], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert first.returncode == 1, first.stderr
    assert "Traceback" not in first.stderr + first.stdout and "internal error" not in first.stderr
    fixed = subprocess.run(cli + ["fix", "--write", "--unsafe-fixes", "."], cwd=tmp_path, capture_output=True,
                           text=True, env=env)
    assert fixed.returncode in (0, 1), fixed.stderr
    assert "Traceback" not in fixed.stderr and "error:" not in fixed.stderr
    snapshot = {name: (tmp_path / name).read_bytes() for name in examples}
    again = subprocess.run(cli + ["fix", "--write", "--unsafe-fixes", "."], cwd=tmp_path, capture_output=True,
                           text=True, env=env)
    assert again.returncode in (0, 1) and "Fixed 0 findings in 0 files." in again.stderr, again.stderr
    for name, (_, keep) in examples.items():
        data = (tmp_path / name).read_bytes()
        assert data == snapshot[name]
        compile(data, name, "exec", dont_inherit=True)
        assert all(token.encode() in data for token in keep)


def _examples(strategy, count: int) -> list:
    """``count`` different examples of a strategy, the same on every run (``.example()`` is
    neither; the first example Hypothesis tries is the simplest, so several are drawn)."""
    found: list = []

    @settings(max_examples=count * 4, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def grab(value):
        if value not in found:
            found.append(value)

    grab()
    return found[-count:]
