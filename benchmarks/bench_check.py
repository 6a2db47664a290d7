"""How fast `tfmigrate check` is, next to the tools users already have.

Generates trees of small legacy TensorFlow modules (100, 1,000 and 10,000 files by default;
~22 lines each on average, the shape of the 400-file / 9k-line tree in DESIGN.md) in a
temporary folder and times, in one run:

- `tfmigrate check` cold (`--no-cache`), and warm (after a run that filled the cache);
- `tf_upgrade_v2 --intree ... --outtree ...` and `fixit lint` (on the trees up to
  --slow-max files: both take minutes on 10,000 files);
- a one-file `tfmigrate check`, process start to exit, median of 7 runs: cold (`--no-cache`),
  from the cache, and the pre-commit case (the file changed since the last run: its result is
  not in the cache, the rule catalog is).

A warm run is only valid if nobody edits tfmigrate's or the rules' sources meanwhile (the cache is
keyed by their hash): the benchmark retries a warm run up to 3 times and, if the cache was still
invalidated, labels the row INVALID and prints a warning.

Usage: python benchmarks/bench_check.py [--sizes 100,1000,10000] [--skip-slow] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
def timed(command: list[str], cwd: Path, env: dict | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: findings, which the trees are full of
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr.decode(errors='replace')[-2000:]}")
    return elapsed


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="tree sizes in files (comma-separated)")
    parser.add_argument("--skip-slow", action="store_true", help="do not run tf_upgrade_v2 and fixit")
    parser.add_argument("--slow-max", type=int, default=1000, help="largest tree to run tf_upgrade_v2 and fixit on")
    parser.add_argument("--jobs", type=int, default=None, help="tfmigrate --jobs (default: one per core)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tfmigrate = _tool("tfmigrate")
    upgrade, fixit = _tool("tf_upgrade_v2"), _tool("fixit")
    if tfmigrate is None:
        sys.exit("tfmigrate is not installed in this environment")
    jobs = ["--jobs", str(args.jobs)] if args.jobs else []
    check = [tfmigrate, "check", "--quiet", *jobs]

    rows: list[tuple] = []
    growth: list[tuple] = []
    invalidated: list[int] = []
    with tempfile.TemporaryDirectory(prefix="tfmigrate-bench-") as temp:
        temp_path = Path(temp)
        # pip byte-compiles what it installs, so tf_upgrade_v2 and fixit start from .pyc files;
        # tfmigrate, run from an editable checkout with PYTHONDONTWRITEBYTECODE set (as in some
        # containers), would compile its ~40 modules from source at every start: compile them
        # once and let Python use the .pyc files, as a regular install would.
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        env["TFMIGRATE_CACHE_DIR"] = str(temp_path / "cache")
        _byte_compile_tfmigrate(env)
        for size in sizes:
            tree = temp_path / f"tree{size}"
            lines = generate(tree, size)
            print(f"{size} files, {lines} lines ...", file=sys.stderr, flush=True)
            cold = timed(check + ["--no-cache", "."], tree, env)
            cache = temp_path / "cache"
            valid = False
            for _ in range(3):
                timed(check + ["."], tree, env)  # fills the cache
                before = _cache_state(cache)
                warm = timed(check + ["."], tree, env)
                # A new engine folder or new entries mean the engine's or the rules' sources
                # changed between the runs (someone is editing the checkout): the warm run was
                # (partly) cold. Measure again; say so if it never held.
                if _cache_state(cache) == before:
                    valid = True
                    break
                print("  sources changed during the warm run; again", file=sys.stderr, flush=True)
            if not valid:
                invalidated.append(size)
            warm_name = "tfmigrate check (warm)" if valid else "tfmigrate check (warm, INVALID: cache invalidated)"
            results = [("tfmigrate check (cold)", cold), (warm_name, warm)]
            if not args.skip_slow and size <= args.slow_max:
                if upgrade:
                    out = temp_path / f"out{size}"
                    results.append(("tf_upgrade_v2", timed(
                        [upgrade, "--intree", str(tree), "--outtree", str(out), "--reportfile", str(temp_path / "report.txt")],
                        temp_path, env)))
                    shutil.rmtree(out, ignore_errors=True)
                if fixit:
                    results.append(("fixit lint", timed([fixit, "lint", "."], tree, env)))
            for name, seconds in results:
                rows.append((size, name, seconds, size / seconds, seconds / cold))
            growth.append((size, cold * 1000 / size, warm * 1000 / size))
            shutil.rmtree(tree)

        one = temp_path / "one"
        generate(one, 1, seed=1)
        (path,) = one.rglob("*.py")
        one_cold = statistics.median(timed(check + ["--no-cache", str(path)], one, env) for _ in range(7))
        timed(check + [str(path)], one, env)
        before = _cache_state(temp_path / "cache")
        one_warm = statistics.median(timed(check + [str(path)], one, env) for _ in range(7))
        if _cache_state(temp_path / "cache") != before:
            invalidated.append(1)
        original = path.read_text()
        changed = []
        for edit in range(7):
            path.write_text(original + f"# edit {edit}\n")  # content the cache has not seen
            changed.append(timed(check + [str(path)], one, env))
        one_changed = statistics.median(changed)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\nPython {sys.version.split()[0]}, {cores} cores, tfmigrate --jobs {args.jobs or cores}\n")
    print("| files | tool | seconds | files/s | time vs tfmigrate cold |")
    print("|---:|---|---:|---:|---:|")
    for size, name, seconds, rate, ratio in rows:
        print(f"| {size:,} | {name} | {seconds:.2f} | {rate:,.0f} | {ratio:.2f}x |")
    print("\nGrowth (seconds per 1,000 files):\n")
    print("| files | cold | warm |")
    print("|---:|---:|---:|")
    for size, cold_rate, warm_rate in growth:
        print(f"| {size:,} | {cold_rate:.2f} | {warm_rate:.2f} |")
    print(f"\nOne file, process start to exit (median of 7): {one_cold:.3f} s cold (--no-cache), "
          f"{one_warm:.3f} s from the cache, {one_changed:.3f} s changed since the last run (pre-commit)")
    if invalidated:
        print(f"\nWARNING: the cache was invalidated during the warm runs on {', '.join(map(str, invalidated))} "
              "file(s): tfmigrate's or the rules' sources changed while the benchmark ran, so those warm "
              "figures include re-checking. Re-run on a checkout nobody is editing.")
    by = {(size, name): seconds for size, name, seconds, _, _ in rows}
    for size in sizes:
        if (size, "tf_upgrade_v2") in by and (size, "tfmigrate check (warm)") in by:
            base = by[(size, "tf_upgrade_v2")]
            print(f"{size:,} files: tfmigrate cold is {base / by[(size, 'tfmigrate check (cold)')]:.1f}x and warm "
                  f"{base / by[(size, 'tfmigrate check (warm)')]:.1f}x faster than tf_upgrade_v2")


if __name__ == "__main__":
    main()
