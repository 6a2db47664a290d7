"""How fast `tfmigrate check` is, next to the tools users already have.

Generates a tree of legacy and modern TensorFlow modules in a temporary folder and times, in
one run, each tool as a whole process:

- `tfmigrate check` cold (`--no-cache`), and warm (after a run that filled the cache);
- `tf_upgrade_v2 --intree ... --outtree ...` and `fixit lint` (on trees up to --slow-max files);
- the parse floor: LibCST's `parse_module` of every file, in this process (what any
  LibCST-based checker must pay), per file and as wall time spread over tfmigrate's jobs;
- a one-file `tfmigrate check`, process start to exit, median of 7 runs: cold (`--no-cache`),
  from the cache, and the pre-commit case (the file changed since the last run).

Corpora (`--corpus`): `realistic` (default; ~140-line modules: model, input, utility and
already-modern code with the legacy patterns inside them, see realistic_corpus.py) or `small`
(~22-line modules that are almost all legacy pattern, the shape of DESIGN.md's 400-file tree).

Each tool runs `--repeat` times (default 3); the table gives the minimum and the spread (max -
min), wall seconds and CPU seconds (the process and its children: tfmigrate's workers). Ratios
use the minima. A warm run is only valid if nobody edits tfmigrate's or the rules' sources
meanwhile (the cache is keyed by their hash): such rows are labelled INVALID.

Usage: python benchmarks/bench_check.py [--sizes 400,1600] [--corpus realistic] [--repeat 3]
                                        [--skip-slow] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realistic_corpus  # noqa: E402  (the folder of this script)

BIN = Path(sys.executable).parent


def _tool(name: str) -> str | None:
    candidate = BIN / name
    return str(candidate) if candidate.exists() else shutil.which(name)


# --- the generated code ---------------------------------------------------------------------
DEVICE_SPELLINGS = [
    "'/gpu:%d' % {i}",
    "'/gpu:{{}}'.format({i})",
    "f'/gpu:{{{i}}}'",
    "'/device:GPU:%d' % {i}",
    "'/gpu:' + str({i})",
    "tf.DeviceSpec(device_type='GPU', device_index={i})",
]
IMPORTS = ["import tensorflow as tf", "import tensorflow.compat.v1 as tf"]


def tower_module(rng: random.Random, n: int) -> str:
    i = rng.choice(["i", "gpu_id", "k", "d"])
    device = rng.choice(DEVICE_SPELLINGS).format(i=i)
    return f"""\
{rng.choice(IMPORTS)}

FLAGS = tf.app.flags.FLAGS


def tower_loss_{n}(images, labels, scope):
    logits = inference_{n}(images)
    loss = tf.losses.softmax_cross_entropy(labels, logits)
    return loss


def build_train_op_{n}(opt, images, labels):
    tower_grads = []
    for {i} in range(FLAGS.num_gpus):
        with tf.device({device}):
            with tf.name_scope('tower_%d' % {i}) as scope:
                loss = tower_loss_{n}(images[{i}], labels[{i}], scope)
                tf.get_variable_scope().reuse_variables()
                grads = opt.compute_gradients(loss)
                tower_grads.append(grads)
    grads = average_gradients(tower_grads)
    return opt.apply_gradients(grads)
"""


def queue_module(rng: random.Random, n: int) -> str:
    batch = rng.choice(["tf.train.shuffle_batch", "tf.train.batch"])
    extra = "min_after_dequeue=1000, " if batch.endswith("shuffle_batch") else ""
    return f"""\
{rng.choice(IMPORTS)}


def read_records_{n}(filenames, batch_size={rng.choice([32, 64, 128])}):
    queue = tf.train.string_input_producer(filenames, num_epochs=None)
    reader = tf.TFRecordReader()
    _, serialized = reader.read(queue)
    features = tf.parse_single_example(serialized, {{
        'image': tf.FixedLenFeature([], tf.string),
        'label': tf.FixedLenFeature([], tf.int64),
    }})
    image = tf.decode_raw(features['image'], tf.uint8)
    return {batch}([image, features['label']], batch_size=batch_size, {extra}capacity=2000)


def train_{n}(sess, train_op):
    coord = tf.train.Coordinator()
    threads = tf.train.start_queue_runners(sess=sess, coord=coord)
    try:
        while not coord.should_stop():
            sess.run(train_op)
    finally:
        coord.request_stop()
        coord.join(threads)
"""


def keras_module(rng: random.Random, n: int) -> str:
    imp = rng.choice([
        "from keras.utils import multi_gpu_model",
        "from tensorflow.keras.utils import multi_gpu_model",
        "from keras.utils.training_utils import multi_gpu_model",
    ])
    return f"""\
import keras
{imp}


def build_model_{n}(input_shape, classes={rng.choice([10, 100, 1000])}):
    model = keras.Sequential([
        keras.layers.Conv2D(32, 3, activation='relu', input_shape=input_shape),
        keras.layers.Flatten(),
        keras.layers.Dense(classes, activation='softmax'),
    ])
    return model


def train_{n}(x, y, gpus={rng.choice([2, 4, 8])}):
    model = build_model_{n}(x.shape[1:])
    parallel_model = multi_gpu_model(model, gpus=gpus)
    parallel_model.compile(loss='categorical_crossentropy', optimizer='rmsprop')
    parallel_model.fit(x, y, epochs=20, batch_size=256)
    return model
"""


def plain_module(rng: random.Random, n: int) -> str:
    return f"""\
import json
import os


def load_config_{n}(path):
    with open(path) as handle:
        return json.load(handle)


def list_checkpoints_{n}(folder, prefix='model'):
    found = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(prefix) and name.endswith('.index'):
            found.append(os.path.join(folder, name[:-6]))
    return found


def latest_{n}(folder):
    checkpoints = list_checkpoints_{n}(folder)
    return checkpoints[-1] if checkpoints else None
"""


def modern_module(rng: random.Random, n: int) -> str:
    return f"""\
import tensorflow as tf


def make_dataset_{n}(files, batch_size={rng.choice([32, 64])}):
    dataset = tf.data.TFRecordDataset(files)
    dataset = dataset.shuffle(10000).batch(batch_size)
    return dataset.prefetch(tf.data.AUTOTUNE)


def train_{n}(model, files):
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model.compile(optimizer='adam', loss='sparse_categorical_crossentropy')
    model.fit(make_dataset_{n}(files), epochs=10)
"""


SHAPES = [(tower_module, 3), (queue_module, 2), (keras_module, 1), (plain_module, 2), (modern_module, 2)]


def generate(folder: Path, count: int, seed: int = 0) -> int:
    """``count`` modules in packages of 50; returns the number of lines written."""
    rng = random.Random(seed)
    makers = [maker for maker, weight in SHAPES for _ in range(weight)]
    lines = 0
    for n in range(count):
        package = folder / f"pkg{n // 50:03}"
        package.mkdir(parents=True, exist_ok=True)
        text = rng.choice(makers)(rng, n)
        (package / f"{rng.choice(['model', 'train', 'input', 'util', 'net'])}_{n:05}.py").write_text(text)
        lines += text.count("\n")
    return lines


# --- timing ---------------------------------------------------------------------------------
@dataclass
class Timing:
    """One tool's runs: wall and CPU seconds (the process and its children) of each."""

    name: str
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    valid: bool = True

    @property
    def wall(self) -> float:
        return min(self.walls)

    @property
    def cpu(self) -> float:
        return min(self.cpus)

    def spread(self, values: list[float]) -> float:
        return max(values) - min(values)


def timed(command: list[str], cwd: Path, env: dict | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``command`` (CPU: user + system of it and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):  # 1: findings, which the trees are full of
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr.decode(errors='replace')[-2000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _byte_compile_tfmigrate(env: dict) -> None:
    import importlib.util

    folders = [str(Path(importlib.util.find_spec("tfmigrate").origin).parent)]
    rules = importlib.util.find_spec("tfmigrate.rules")
    if rules is not None and rules.submodule_search_locations:
        folders += list(rules.submodule_search_locations)
    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], env=env, check=False,
                   stdout=subprocess.DEVNULL)


def _cache_state(cache: Path) -> tuple[int, tuple[str, ...]]:
    """The number of cache entries and the engine folders (one per engine fingerprint)."""
    engines = tuple(sorted(str(p) for p in cache.glob("*/*") if p.is_dir()))
    return sum(1 for _ in cache.rglob("*.json")), engines


def parse_floor(tree: Path, repeat: int) -> float:
    """CPU seconds of LibCST's parse_module over every file of ``tree`` (minimum of ``repeat``)."""
    import libcst

    texts = [path.read_text() for path in sorted(tree.rglob("*.py"))]
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for text in texts:
            libcst.parse_module(text)
        best = min(best, time.process_time() - start)
    return best


def measure_tree(tree: Path, size: int, args, tools: dict, env: dict, cache: Path) -> list[Timing]:
    check = tools["check"]
    cold = Timing("tfmigrate check (cold)")
    warm = Timing("tfmigrate check (warm)")
    for _ in range(args.repeat):
        wall, cpu = timed(check + ["--no-cache", "."], tree, env)
        cold.walls.append(wall)
        cold.cpus.append(cpu)
        timed(check + ["."], tree, env)  # fills the cache
        before = _cache_state(cache)
        wall, cpu = timed(check + ["."], tree, env)
        warm.walls.append(wall)
        warm.cpus.append(cpu)
        # A new engine folder or new entries: the engine's or the rules' sources changed between
        # the runs (someone is editing the checkout), and the warm run was (partly) cold.
        warm.valid &= _cache_state(cache) == before
    results = [cold, warm]
    if not args.skip_slow and size <= args.slow_max:
        for name, command in (("tf_upgrade_v2", tools["upgrade"]), ("fixit lint", tools["fixit"])):
            if command is None:
                continue
            timing = Timing(name)
            for run in range(args.repeat if name == "tf_upgrade_v2" else 1):
                out = tree.parent / f"out{size}"
                full = ([command, "--intree", str(tree), "--outtree", str(out), "--reportfile",
                         str(tree.parent / "report.txt")] if name == "tf_upgrade_v2" else [command, "lint", "."])
                wall, cpu = timed(full, tree, env)
                shutil.rmtree(out, ignore_errors=True)
                timing.walls.append(wall)
                timing.cpus.append(cpu)
            results.append(timing)
    return results


def one_file(args, tools: dict, env: dict, temp: Path, cache: Path) -> tuple[float, float, float, bool]:
    check = tools["check"]
    one = temp / "one"
    if args.corpus == "small":
        generate(one, 1, seed=1)
    else:
        realistic_corpus.generate(one, 1, seed=3)
    (path,) = one.rglob("*.py")
    cold = statistics.median(timed(check + ["--no-cache", str(path)], one, env)[0] for _ in range(7))
    timed(check + [str(path)], one, env)
    before = _cache_state(cache)
    warm = statistics.median(timed(check + [str(path)], one, env)[0] for _ in range(7))
    valid = _cache_state(cache) == before
    original = path.read_text()
    changed = []
    for edit in range(7):
        path.write_text(original + f"# edit {edit}\n")  # content the cache has not seen
        changed.append(timed(check + [str(path)], one, env)[0])
    return cold, warm, statistics.median(changed), valid


def report(rows: list[tuple[int, int, Timing]], floors: dict[int, float], jobs: int) -> None:
    print("| files | lines | tool | wall s (min) | spread | CPU s (min) | files/s | time vs tfmigrate cold |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    cold_by_size = {size: t.wall for size, _, t in rows if t.name.startswith("tfmigrate check (cold)")}
    for size, lines, timing in rows:
        name = timing.name if timing.valid else timing.name + " INVALID: cache invalidated"
        print(f"| {size:,} | {lines:,} | {name} | {timing.wall:.2f} | {timing.spread(timing.walls):.2f} | "
              f"{timing.cpu:.2f} | {size / timing.wall:,.0f} | {timing.wall / cold_by_size[size]:.2f}x |")
    print()
    for size, lines, timing in rows:
        if size not in floors:
            continue
        floor = floors[size]
        if timing.name == "tfmigrate check (cold)":
            print(f"{size:,} files: LibCST parse floor {floor * 1000 / size:.1f} ms CPU per file "
                  f"({floor / jobs:.2f} s wall over {jobs} jobs); tfmigrate cold {timing.cpu * 1000 / size:.1f} ms "
                  f"CPU per file = {timing.cpu / floor:.2f}x the floor, {timing.wall / (floor / jobs):.2f}x in wall time")
        if timing.name == "tf_upgrade_v2":
            cold = next(t for s, _, t in rows if s == size and t.name == "tfmigrate check (cold)")
            warm = next(t for s, _, t in rows if s == size and t.name == "tfmigrate check (warm)")
            print(f"{size:,} files: tfmigrate cold is {timing.wall / cold.wall:.1f}x faster than tf_upgrade_v2 in wall "
                  f"time ({timing.cpu / cold.cpu:.1f}x in CPU), warm {timing.wall / warm.wall:.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="400,1600", help="tree sizes in files (comma-separated)")
    parser.add_argument("--corpus", choices=["realistic", "small"], default="realistic")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool (min and spread reported)")
    parser.add_argument("--skip-slow", action="store_true", help="do not run tf_upgrade_v2 and fixit")
    parser.add_argument("--slow-max", type=int, default=1600, help="largest tree to run tf_upgrade_v2 and fixit on")
    parser.add_argument("--jobs", type=int, default=None, help="tfmigrate --jobs (default: one per core)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tfmigrate = _tool("tfmigrate")
    if tfmigrate is None:
        sys.exit("tfmigrate is not installed in this environment")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jobs = args.jobs or cores
    tools = {"check": [tfmigrate, "check", "--quiet", *(["--jobs", str(args.jobs)] if args.jobs else [])],
             "upgrade": _tool("tf_upgrade_v2"), "fixit": _tool("fixit")}

    rows: list[tuple[int, int, Timing]] = []
    floors: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="tfmigrate-bench-") as temp:
        temp_path = Path(temp)
        # pip byte-compiles what it installs, so tf_upgrade_v2 and fixit start from .pyc files;
        # tfmigrate, run from an editable checkout with PYTHONDONTWRITEBYTECODE set (as in some
        # containers), would compile its modules from source at every start: compile them once.
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        env["TFMIGRATE_CACHE_DIR"] = str(temp_path / "cache")
        _byte_compile_tfmigrate(env)
        for size in sizes:
            tree = temp_path / f"tree{size}"
            if args.corpus == "small":
                lines = generate(tree, size)
            else:
                lines, kinds = realistic_corpus.generate(tree, size)
                print(f"  kinds: {kinds}", file=sys.stderr, flush=True)
            print(f"{size} files, {lines} lines ...", file=sys.stderr, flush=True)
            floors[size] = parse_floor(tree, args.repeat)
            rows += [(size, lines, t) for t in measure_tree(tree, size, args, tools, env, temp_path / "cache")]
            shutil.rmtree(tree)
        one_cold, one_warm, one_changed, one_valid = one_file(args, tools, env, temp_path, temp_path / "cache")

    print(f"\nPython {sys.version.split()[0]}, {cores} cores, tfmigrate --jobs {jobs}, corpus {args.corpus}, "
          f"{args.repeat} runs each\n")
    report(rows, floors, jobs)
    print(f"\nOne file, process start to exit (median of 7): {one_cold:.3f} s cold (--no-cache), "
          f"{one_warm:.3f} s from the cache{'' if one_valid else ' (INVALID: cache invalidated)'}, "
          f"{one_changed:.3f} s changed since the last run (pre-commit)")


if __name__ == "__main__":
    main()
