"""Realistic modules for the speed benchmarks: ~150 lines each, legacy and modern mixed.

A project being migrated is not a tree of 20-line tower loops: most of its files are model code,
input code, utilities and already-modern code, each a few hundred lines, and the legacy patterns
sit inside them. Each generated module is one of six kinds (weights in KINDS) built from a
header, a few helper functions drawn from a pool (layers, metrics, file handling, schedules),
the kind's own core, and a ``main``; names are numbered so that no two files are equal.
"""

from __future__ import annotations

import random
from pathlib import Path

HEADER = '''\
# Copyright {year} The {team} Authors. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# ==============================================================================
"""{doc}"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import os
import time
{imports}
'''

LAYER_HELPERS = [
    '''
def _variable_on_cpu_{n}(name, shape, initializer):
    """Helper to create a Variable stored on CPU memory."""
    with tf.device('/cpu:0'):
        dtype = tf.float32
        var = tf.get_variable(name, shape, initializer=initializer, dtype=dtype)
    return var
''',
    '''
def conv2d_{n}(x, filters, kernel_size=3, stride=1, name='conv'):
    """A convolution followed by a ReLU."""
    with tf.variable_scope(name):
        in_channels = x.get_shape().as_list()[-1]
        kernel = tf.get_variable(
            'weights', [kernel_size, kernel_size, in_channels, filters],
            initializer=tf.truncated_normal_initializer(stddev=5e-2))
        biases = tf.get_variable('biases', [filters], initializer=tf.constant_initializer(0.0))
        conv = tf.nn.conv2d(x, kernel, [1, stride, stride, 1], padding='SAME')
        return tf.nn.relu(tf.nn.bias_add(conv, biases))
''',
    '''
def dense_{n}(x, units, activation=tf.nn.relu, name='fc'):
    with tf.variable_scope(name):
        dim = x.get_shape().as_list()[-1]
        weights = tf.get_variable('weights', [dim, units],
                                  initializer=tf.glorot_uniform_initializer())
        biases = tf.get_variable('biases', [units], initializer=tf.zeros_initializer())
        out = tf.matmul(x, weights) + biases
        if activation is not None:
            out = activation(out)
        return out
''',
    '''
def batch_norm_{n}(x, is_training, decay=0.997, epsilon=1e-5, name='bn'):
    """Batch normalization with moving statistics."""
    return tf.layers.batch_normalization(
        x, momentum=decay, epsilon=epsilon, training=is_training, name=name,
        fused=True)
''',
]

UTIL_HELPERS = [
    '''
def learning_rate_{n}(global_step, base_lr={lr}, decay_steps={steps}, decay_rate=0.1):
    """Step-wise exponential decay of the learning rate."""
    return tf.train.exponential_decay(base_lr, global_step, decay_steps, decay_rate,
                                      staircase=True)
''',
    '''
def format_eta_{n}(seconds):
    hours, rest = divmod(int(seconds), 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return '%dh%02dm' % (hours, minutes)
    return '%dm%02ds' % (minutes, seconds)
''',
    '''
class AverageMeter_{n}(object):
    """Computes and stores the average and current value."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count
''',
    '''
def list_files_{n}(data_dir, pattern='train-*'):
    """The shards of a data set, sorted."""
    import glob
    files = sorted(glob.glob(os.path.join(data_dir, pattern)))
    if not files:
        raise ValueError('No files found in %s matching %s' % (data_dir, pattern))
    return files
''',
    '''
def accuracy_{n}(logits, labels):
    correct = tf.equal(tf.argmax(logits, 1), tf.cast(labels, tf.int64))
    return tf.reduce_mean(tf.cast(correct, tf.float32))
''',
    '''
def save_config_{n}(config, path):
    import json
    with open(path, 'w') as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    print('config written to %s' % path)
''',
]

LEGACY_TOWERS = '''
def inference_{n}(images):
    net = conv2d_core_{n}(images, 64, name='conv1')
    net = tf.nn.max_pool(net, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1], padding='SAME')
    net = conv2d_core_{n}(net, 64, name='conv2')
    net = tf.reshape(net, [FLAGS.batch_size, -1])
    return tf.layers.dense(net, NUM_CLASSES, name='logits')


def conv2d_core_{n}(x, filters, name):
    return tf.layers.conv2d(x, filters, 5, padding='same', activation=tf.nn.relu, name=name)


def tower_loss_{n}(scope, images, labels):
    logits = inference_{n}(images)
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    tf.add_to_collection('losses', tf.reduce_mean(cross_entropy))
    losses = tf.get_collection('losses', scope)
    total_loss = tf.add_n(losses, name='total_loss')
    return total_loss


def average_gradients(tower_grads):
    average_grads = []
    for grad_and_vars in zip(*tower_grads):
        grads = []
        for g, _ in grad_and_vars:
            grads.append(tf.expand_dims(g, 0))
        grad = tf.reduce_mean(tf.concat(axis=0, values=grads), 0)
        average_grads.append((grad, grad_and_vars[0][1]))
    return average_grads


def train_{n}(images, labels):
    global_step = tf.train.get_or_create_global_step()
    opt = tf.train.GradientDescentOptimizer({lr})
    tower_grads = []
    with tf.variable_scope(tf.get_variable_scope()):
        for {i} in range(FLAGS.num_gpus):
            with tf.device({device}):
                with tf.name_scope('tower_%d' % {i}) as scope:
                    loss = tower_loss_{n}(scope, images[{i}], labels[{i}])
                    tf.get_variable_scope().reuse_variables()
                    summaries = tf.get_collection(tf.GraphKeys.SUMMARIES, scope)
                    grads = opt.compute_gradients(loss)
                    tower_grads.append(grads)
    grads = average_gradients(tower_grads)
    apply_op = opt.apply_gradients(grads, global_step=global_step)
    with tf.Session(config=tf.ConfigProto(allow_soft_placement=True)) as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(FLAGS.max_steps):
            start = time.time()
            _, loss_value = sess.run([apply_op, loss])
            if step % 10 == 0:
                print('step %d, loss = %.2f (%.3f sec/batch)' % (step, loss_value, time.time() - start))
'''

LEGACY_QUEUE = '''
def read_example_{n}(filename_queue):
    reader = tf.TFRecordReader()
    _, serialized = reader.read(filename_queue)
    features = tf.parse_single_example(serialized, features={{
        'image/encoded': tf.FixedLenFeature([], tf.string),
        'image/class/label': tf.FixedLenFeature([], tf.int64),
    }})
    image = tf.image.decode_jpeg(features['image/encoded'], channels=3)
    image = tf.image.resize_images(image, [IMAGE_SIZE, IMAGE_SIZE])
    label = tf.cast(features['image/class/label'], tf.int32)
    return image, label


def distort_{n}(image):
    image = tf.image.random_flip_left_right(image)
    image = tf.image.random_brightness(image, max_delta=63)
    image = tf.image.random_contrast(image, lower=0.2, upper=1.8)
    return tf.image.per_image_standardization(image)


def inputs_{n}(data_dir, batch_size):
    filenames = [os.path.join(data_dir, 'train-%05d' % i) for i in range(8)]
    filename_queue = tf.train.string_input_producer(filenames, shuffle=True)
    image, label = read_example_{n}(filename_queue)
    image = distort_{n}(image)
    images, labels = tf.train.shuffle_batch(
        [image, label], batch_size=batch_size, num_threads=4,
        capacity={capacity}, min_after_dequeue={min_after})
    return images, labels


def run_{n}(train_op):
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        coord = tf.train.Coordinator()
        threads = tf.train.start_queue_runners(sess=sess, coord=coord)
        try:
            step = 0
            while not coord.should_stop() and step < FLAGS.max_steps:
                sess.run(train_op)
                step += 1
        except tf.errors.OutOfRangeError:
            print('Done training for %d steps.' % step)
        finally:
            coord.request_stop()
        coord.join(threads)
'''

LEGACY_KERAS = '''
def build_model_{n}(input_shape, num_classes={classes}):
    inputs = Input(shape=input_shape)
    x = Conv2D(32, (3, 3), padding='same', activation='relu')(inputs)
    x = Conv2D(32, (3, 3), activation='relu')(x)
    x = MaxPooling2D(pool_size=(2, 2))(x)
    x = Dropout(0.25)(x)
    x = Flatten()(x)
    x = Dense(512, activation='relu')(x)
    outputs = Dense(num_classes, activation='softmax')(x)
    return Model(inputs, outputs)


def train_{n}(x_train, y_train, x_test, y_test):
    model = build_model_{n}(x_train.shape[1:])
    parallel_model = multi_gpu_model(model, gpus={gpus})
    parallel_model.compile(loss='categorical_crossentropy',
                           optimizer=keras.optimizers.RMSprop(lr=0.0001, decay=1e-6),
                           metrics=['accuracy'])
    parallel_model.fit(x_train, y_train, batch_size={batch}, epochs=EPOCHS,
                       validation_data=(x_test, y_test), shuffle=True)
    model.save(os.path.join(SAVE_DIR, 'keras_cifar10_trained_model.h5'))
    scores = model.evaluate(x_test, y_test, verbose=1)
    print('Test loss:', scores[0])
    print('Test accuracy:', scores[1])
'''

MODERN_KERAS = '''
class ResidualBlock_{n}(tf.keras.layers.Layer):
    def __init__(self, filters, stride=1, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = tf.keras.layers.Conv2D(filters, 3, strides=stride, padding='same', use_bias=False)
        self.bn1 = tf.keras.layers.BatchNormalization()
        self.conv2 = tf.keras.layers.Conv2D(filters, 3, padding='same', use_bias=False)
        self.bn2 = tf.keras.layers.BatchNormalization()
        self.shortcut = None
        if stride != 1:
            self.shortcut = tf.keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)

    def call(self, inputs, training=False):
        x = tf.nn.relu(self.bn1(self.conv1(inputs), training=training))
        x = self.bn2(self.conv2(x), training=training)
        shortcut = inputs if self.shortcut is None else self.shortcut(inputs)
        return tf.nn.relu(x + shortcut)


def build_model_{n}(num_classes={classes}):
    inputs = tf.keras.Input(shape=(32, 32, 3))
    x = tf.keras.layers.Conv2D(64, 3, padding='same')(inputs)
    for filters, stride in [(64, 1), (128, 2), (256, 2)]:
        x = ResidualBlock_{n}(filters, stride)(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(num_classes)(x)
    return tf.keras.Model(inputs, outputs)


def train_{n}(train_ds, val_ds, epochs=EPOCHS):
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = build_model_{n}()
        model.compile(optimizer=tf.keras.optimizers.SGD({lr}, momentum=0.9),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=['accuracy'])
    callbacks = [tf.keras.callbacks.ModelCheckpoint('ckpt/weights.{{epoch:02d}}.weights.h5',
                                                    save_weights_only=True)]
    return model.fit(train_ds, validation_data=val_ds, epochs=epochs, callbacks=callbacks)
'''

MODERN_DATA = '''
def parse_{n}(record):
    features = tf.io.parse_single_example(record, {{
        'image': tf.io.FixedLenFeature([], tf.string),
        'label': tf.io.FixedLenFeature([], tf.int64),
    }})
    image = tf.io.decode_jpeg(features['image'], channels=3)
    image = tf.image.resize(image, [IMAGE_SIZE, IMAGE_SIZE]) / 255.0
    return image, features['label']


def augment_{n}(image, label):
    image = tf.image.random_flip_left_right(image)
    image = tf.image.random_brightness(image, 0.2)
    return image, label


def make_dataset_{n}(pattern, batch_size={batch}, training=True):
    files = tf.data.Dataset.list_files(pattern, shuffle=training)
    dataset = files.interleave(tf.data.TFRecordDataset, num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.map(parse_{n}, num_parallel_calls=tf.data.AUTOTUNE)
    if training:
        dataset = dataset.map(augment_{n}, num_parallel_calls=tf.data.AUTOTUNE)
        dataset = dataset.shuffle(10000)
    return dataset.batch(batch_size, drop_remainder=training).prefetch(tf.data.AUTOTUNE)
'''

PLAIN = '''
def parse_args_{n}(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description='{doc}')
    parser.add_argument('--data-dir', default='data')
    parser.add_argument('--out-dir', default='out')
    parser.add_argument('--epochs', type=int, default={epochs})
    parser.add_argument('--verbose', action='store_true')
    return parser.parse_args(argv)


def read_lines_{n}(path, limit=None):
    lines = []
    with open(path) as handle:
        for number, line in enumerate(handle):
            if limit is not None and number >= limit:
                break
            line = line.strip()
            if line and not line.startswith('#'):
                lines.append(line)
    return lines


def build_vocab_{n}(lines, min_count=2):
    counts = {{}}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    words = sorted(w for w, c in counts.items() if c >= min_count)
    return {{word: index for index, word in enumerate(words)}}
'''

PLAIN_EXTRA = [
    '''
def moving_average_{n}(values, window=10):
    averaged, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averaged.append(total / min(index + 1, window))
    return averaged
''',
    '''
def setup_logging_{n}(out_dir, level=logging.INFO):
    os.makedirs(out_dir, exist_ok=True)
    handler = logging.FileHandler(os.path.join(out_dir, 'train.log'))
    handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(message)s'))
    logger = logging.getLogger('train')
    logger.setLevel(level)
    logger.addHandler(handler)
    return logger
''',
    '''
def split_dataset_{n}(items, ratios=(0.8, 0.1, 0.1), seed=0):
    import random as _random
    items = list(items)
    _random.Random(seed).shuffle(items)
    first = int(len(items) * ratios[0])
    second = first + int(len(items) * ratios[1])
    return items[:first], items[first:second], items[second:]
''',
]

MAIN = '''

def main(_):
    if not os.path.exists(FLAGS.train_dir):
        os.makedirs(FLAGS.train_dir)
    start = time.time()
    print('started at %s' % time.ctime(start))
    print('finished in %.1f s' % (time.time() - start))


if __name__ == '__main__':
    tf.app.run()
'''

FLAGS_BLOCK = '''
FLAGS = tf.app.flags.FLAGS
tf.app.flags.DEFINE_string('train_dir', '/tmp/train_{n}', """Directory for event logs.""")
tf.app.flags.DEFINE_integer('max_steps', {steps}, """Number of batches to run.""")
tf.app.flags.DEFINE_integer('num_gpus', {gpus}, """How many GPUs to use.""")
tf.app.flags.DEFINE_integer('batch_size', {batch}, """Batch size per tower.""")

NUM_CLASSES = {classes}
IMAGE_SIZE = 24
EPOCHS = 10
SAVE_DIR = os.path.join(os.getcwd(), 'saved_models')
'''

DEVICES = ["'/gpu:%d' % {i}", "'/gpu:{{}}'.format({i})", "'/device:GPU:%d' % {i}", "'/gpu:' + str({i})"]

# kind: (core block, TensorFlow import, extra imports, uses FLAGS/main)
KINDS = {
    "legacy_towers": (LEGACY_TOWERS, "import tensorflow as tf", "", True),
    "legacy_queue": (LEGACY_QUEUE, "import tensorflow.compat.v1 as tf", "", True),
    "legacy_keras": (LEGACY_KERAS, "import tensorflow as tf",
                     "import keras\nfrom keras.layers import Conv2D, Dense, Dropout, Flatten, Input, MaxPooling2D\n"
                     "from keras.models import Model\nfrom keras.utils import multi_gpu_model\n", True),
    "modern_keras": (MODERN_KERAS, "import tensorflow as tf", "", False),
    "modern_data": (MODERN_DATA, "import tensorflow as tf", "", False),
    "plain": (PLAIN, "", "import json\nimport logging\n", False),
}
WEIGHTS = {"legacy_towers": 2, "legacy_queue": 1, "legacy_keras": 1, "modern_keras": 2, "modern_data": 2, "plain": 2}


def module(rng: random.Random, n: int, kind: str) -> str:
    core, tf_import, extra, legacy_main = KINDS[kind]
    values = dict(
        n=n, i=rng.choice(["i", "gpu_id", "k"]), lr=rng.choice([0.1, 0.01, 0.001]),
        steps=rng.choice([1000, 10000, 100000]), gpus=rng.choice([2, 4, 8]), batch=rng.choice([32, 64, 128]),
        classes=rng.choice([10, 100, 1000]), capacity=rng.choice([2000, 5000]), min_after=rng.choice([1000, 2000]),
        epochs=rng.choice([10, 90]), doc=f"Module {n} of the benchmark project.",
    )
    values["device"] = rng.choice(DEVICES).format(i=values["i"])
    imports = "\n".join(part for part in (extra.rstrip("\n"), tf_import) if part)
    text = HEADER.format(year=rng.choice([2016, 2017, 2018]), team=rng.choice(["TensorFlow", "Example"]),
                         doc=values["doc"], imports=imports)
    if tf_import:
        text += FLAGS_BLOCK.format(**values)
        helpers = rng.sample(LAYER_HELPERS, 3) + rng.sample(UTIL_HELPERS, 5)
    else:
        helpers = [UTIL_HELPERS[1], UTIL_HELPERS[2], UTIL_HELPERS[3], UTIL_HELPERS[5]]  # the helpers without tf
        helpers += rng.sample(PLAIN_EXTRA, 2)
    for helper in helpers:
        text += "\n" + helper.format(**values)
    text += "\n" + core.format(**values)
    if legacy_main:
        text += MAIN
    return text


def generate(folder: Path, count: int, seed: int = 0) -> tuple[int, dict[str, int]]:
    """``count`` modules in packages of 50; the number of lines written and files per kind."""
    rng = random.Random(seed)
    kinds = [kind for kind, weight in WEIGHTS.items() for _ in range(weight)]
    lines, per_kind = 0, {kind: 0 for kind in KINDS}
    for n in range(count):
        package = folder / f"pkg{n // 50:03}"
        package.mkdir(parents=True, exist_ok=True)
        kind = rng.choice(kinds)
        text = module(rng, n, kind)
        (package / f"{rng.choice(['model', 'train', 'input', 'util', 'net'])}_{n:05}.py").write_text(text)
        lines += text.count("\n")
        per_kind[kind] += 1
    return lines, per_kind
