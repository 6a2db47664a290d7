"""The queue-pipeline rewrite (TFM301-TFM303) on the shapes public TF1 input code takes beyond
one producer, one read and one batch of names: a producer's slices read by position, the
static shapes `tf.train.batch(shapes=...)` gave, `enqueue_many=True`, an index or row queue
dequeued by the program and then batched, and the refusals where the meaning cannot be kept.
The fixed programs that run are in tests/test_fix_runs.py (same batches, same order)."""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import run_check, unsafe_fix


def _fixed(code: str) -> str:
    return unsafe_fix(textwrap.dedent(code).lstrip("\n"))


def _blocker(code: str, rule: str = "TFM303") -> str:
    (finding,) = [f for f in run_check(code) if f.code == rule]
    assert not finding.fixable, finding.message
    return finding.message.split("no automatic fix: ", 1)[1]


def test_slices_read_by_position_are_the_map_function_s_tuple():
    fixed = _fixed("""
        import tensorflow as tf

        def batches(paths, labels):
            input_queue = tf.train.slice_input_producer([paths, labels], shuffle=False)
            label = input_queue[1]
            image = tf.image.decode_png(tf.read_file(input_queue[0]))
            return tf.train.batch([image, label], batch_size=8)
        """)
    assert "    def _parse(*input_queue):\n        label = input_queue[1]\n" in fixed
    assert "tf.data.Dataset.from_tensor_slices((paths, labels))" in fixed and "input_producer" not in fixed


def test_a_slice_batched_by_position_is_returned_by_position():
    fixed = _fixed("""
        import tensorflow as tf

        def batches(paths, labels):
            queue = tf.train.slice_input_producer([paths, labels], shuffle=False)
            text = tf.read_file(queue[0])
            return tf.train.batch([text, queue[1]], batch_size=8)
        """)
    assert "        return text, queue[1]\n" in fixed


def test_slices_used_otherwise_than_by_position_are_refused():
    message = _blocker("""
        import tensorflow as tf

        def batches(paths, labels):
            queue = tf.train.slice_input_producer([paths, labels], shuffle=False)
            text = tf.read_file(queue[0])
            parts = queue + [text]
            return tf.train.batch([text, parts[1]], batch_size=8)
        """)
    assert "`queue`, the producer's list of slices, is used otherwise than by position" in message


def test_shapes_become_the_map_function_s_shape_checks():
    fixed = _fixed("""
        import tensorflow as tf

        def batches(xs, ys):
            x, y = tf.train.slice_input_producer([xs, ys], shuffle=False)
            x = tf.reshape(x, [-1])
            return tf.train.batch([x, y], batch_size=4, shapes=[[6], []])
        """)
    assert "        return tf.ensure_shape(x, [6]), tf.ensure_shape(y, [])\n" in fixed


def test_shapes_that_are_not_a_list_per_tensor_are_refused():
    code = """
        import tensorflow as tf

        def batches(xs, ys):
            x, y = tf.train.slice_input_producer([xs, ys], shuffle=False)
            return tf.train.batch([x, y], batch_size=4, shapes=SHAPES)
        """
    assert _blocker(code) == "`shapes=` is not a list with one shape per batched tensor"


def test_enqueue_many_over_constants_is_the_dataset_of_their_rows_repeated():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(table, targets):
            features = tf.constant(table)
            labels = tf.constant(targets)
            return tf.train.batch([features, labels], batch_size=4, enqueue_many=True)
        """)
    assert ("        tf.data.Dataset.from_tensor_slices((features, labels))\n"
            "        .repeat()\n"
            "        .batch(4, drop_remainder=True)\n") in fixed
    assert "unbatch" not in fixed


def test_enqueue_many_after_a_producer_unbatches_what_was_enqueued():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(chunks, targets):
            chunk, target = tf.train.slice_input_producer([chunks, targets], shuffle=False)
            return tf.train.batch([chunk, target], batch_size=4, enqueue_many=True)
        """)
    assert "        .repeat()\n        .unbatch()\n        .batch(4, drop_remainder=True)\n" in fixed


def test_enqueue_many_over_tensors_that_may_change_is_refused():
    code = """
        import tensorflow as tf

        def inputs(table):
            features = tf.random.shuffle(tf.constant(table))
            return tf.train.batch([features], batch_size=4, enqueue_many=True)
        """
    assert "nor `tf.constant`s made there" in _blocker(code)


def test_a_constant_rebound_before_the_batch_is_not_taken_for_a_constant():
    code = """
        import tensorflow as tf

        def inputs(table):
            features = tf.constant(table)
            features = features + tf.random.normal([4])
            return tf.train.batch([features], batch_size=4, enqueue_many=True)
        """
    assert "nor `tf.constant`s made there" in _blocker(code)


def test_batch_outputs_assigned_to_attributes_are_kept():
    fixed = _fixed("""
        import tensorflow as tf

        class Input(object):
            def __init__(self, xs, ys):
                x, y = tf.train.slice_input_producer([xs, ys], shuffle=False)
                self.x, self.y = tf.train.batch([x, y], batch_size=2)
        """)
    assert "        self.x, self.y = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()\n" in fixed


def test_a_dequeued_index_queue_feeding_a_batch_is_one_dataset():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(features):
            idx = tf.train.range_input_producer(100, shuffle=False).dequeue()
            row = tf.gather(features, idx)
            return tf.train.batch([row], batch_size=4)
        """)
    assert "    def _parse(idx):\n        row = tf.gather(features, idx)\n        return row\n" in fixed
    assert ("        tf.data.Dataset.range(100)\n        .repeat()\n        .map(lambda i: tf.cast(i, tf.int32))\n"
            "        .map(_parse)\n        .batch(4, drop_remainder=True)\n") in fixed
    assert fixed.count("make_one_shot_iterator") == 1


def test_a_row_queue_keeps_its_element_shape():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(rows):
            row_queue = tf.train.input_producer(rows, element_shape=[5], shuffle=False)
            row = row_queue.dequeue()
            return tf.train.batch([row[:4], row[4:]], batch_size=4)
        """)
    assert ".map(lambda element: tf.ensure_shape(element, [5]))" in fixed and "row_queue" not in fixed


def test_a_refused_batch_over_a_dequeued_queue_still_gets_the_queue_rewritten():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(features):
            idx = tf.train.range_input_producer(100, shuffle=False).dequeue()
            row = tf.gather(features, idx)
            return tf.train.batch([row], batch_size=4, shared_name="rows")
        """)
    assert "idx = tf.compat.v1.data.make_one_shot_iterator(positions).get_next()" in fixed
    assert 'tf.train.batch([row], batch_size=4, shared_name="rows")' in fixed


def test_a_parse_s_throwaway_bound_again_later_is_not_a_use_of_the_pipeline():
    fixed = _fixed("""
        import tensorflow as tf

        def train(xs, ys, sess, op):
            x, y = tf.train.slice_input_producer([xs, ys], shuffle=False)
            image, _, _ = tf.py_func(load, [x], [tf.float32, tf.int64, tf.int64])
            images, labels = tf.train.batch([image, y], batch_size=4)
            for _ in range(3):
                sess.run(op)
        """)
    assert "slice_input_producer" not in fixed


def test_a_parsed_tensor_read_after_the_batch_is_refused():
    code = """
        import tensorflow as tf

        def train(xs, ys):
            x, y = tf.train.slice_input_producer([xs, ys], shuffle=False)
            image = tf.cast(x, tf.float32)
            images, labels = tf.train.batch([image, y], batch_size=4)
            tf.summary.image("one", image[None])
        """
    assert _blocker(code) == "a tensor of the queue pipeline is used after the batching call"


READER_FUNCTION = """
    import tensorflow as tf

    def read_and_decode(filename_queue):
        reader = tf.TFRecordReader()
        _, serialized_example = reader.read(filename_queue)
        features = tf.parse_single_example(serialized_example, features=FEATURES)
        return features["image"], features["label"]

    def inputs(files):
        filename_queue = tf.train.string_input_producer(files, shuffle=False)
        image, label = read_and_decode(filename_queue)
        return tf.train.batch([image, label], batch_size=32)
    """


def test_a_reader_function_given_the_queue_decodes_the_dataset_s_records():
    fixed = _fixed(READER_FUNCTION)
    assert "def read_and_decode(serialized_example):\n    features = tf.parse_single_example(" in fixed
    assert "    def _parse(serialized_example):\n        image, label = read_and_decode(serialized_example)\n" in fixed
    assert "        tf.data.TFRecordDataset(files)\n        .repeat()\n        .map(_parse)\n" in fixed
    assert "TFRecordReader" not in fixed and "reader.read" not in fixed


def test_a_batch_of_what_a_reader_function_returns_says_to_name_it_and_named_is_rewritten():
    """`tf.train.batch(read_csv(filename_queue), ...)` (the Titanic CSV example): the batched
    tensors are a call; named first (`row = read_csv(filename_queue)`), the pipeline is rewritten
    (a held-out program so changed by hand matched its original)."""
    inline = READER_FUNCTION.replace(
        "        image, label = read_and_decode(filename_queue)\n        return tf.train.batch([image, label], batch_size=32)",
        "        return tf.train.batch(read_and_decode(filename_queue), batch_size=32)")
    assert "batch(read_and_decode(filename_queue)" in inline
    assert _blocker(textwrap.dedent(inline)).startswith(
        "the batched tensors are what `read_and_decode(...)` returns: name them first (`row = read_and_decode(...)`")
    named = inline.replace("return tf.train.batch(read_and_decode(filename_queue), batch_size=32)",
                           "row = read_and_decode(filename_queue)\n        return tf.train.batch(row, batch_size=32)")
    fixed = _fixed(named)
    assert "        row = read_and_decode(serialized_example)\n        return row\n" in fixed
    assert "string_input_producer" not in fixed and "tf.train.batch" not in fixed


def test_a_reader_method_called_on_self_is_rewritten_too():
    fixed = _fixed("""
        import tensorflow as tf

        class Loader(object):
            def _read(self, queue, scale):
                reader = tf.TextLineReader()
                _, line = reader.read(queue)
                return tf.string_to_number(line) * scale

            def batch(self, files):
                queue = tf.train.string_input_producer(files, shuffle=False)
                value = self._read(queue, 2.0)
                self.values = tf.train.batch([value], batch_size=4)
        """)
    assert "    def _read(self, line, scale):\n        return tf.string_to_number(line) * scale\n" in fixed
    assert "            value = self._read(line, 2.0)\n" in fixed and "tf.data.TextLineDataset(files)" in fixed


def test_a_reader_function_also_used_elsewhere_is_refused():
    code = READER_FUNCTION + "\n    other = read_and_decode\n"
    assert _blocker(code) == "`read_and_decode` is also used where no queue pipeline is rewritten"


def test_a_reader_function_shared_by_two_pipelines_is_rewritten_for_both():
    code = READER_FUNCTION + """
    def eval_inputs(files):
        queue = tf.train.string_input_producer(files, num_epochs=1, shuffle=False)
        image, label = read_and_decode(queue)
        return tf.train.batch([image, label], batch_size=100)
    """
    fixed = _fixed(code)
    assert fixed.count("image, label = read_and_decode(serialized_example)") == 2 and "input_producer" not in fixed


def test_a_reader_function_shared_with_a_refused_pipeline_is_refused_for_both():
    code = READER_FUNCTION + """
    def eval_inputs(files):
        queue = tf.train.string_input_producer(files, num_epochs=1, shuffle=False)
        image, label = read_and_decode(queue)
        return tf.train.batch([image, label], batch_size=100, shared_name="eval")
    """
    blockers = [f.message.split("no automatic fix: ", 1)[1] for f in run_check(code) if f.code == "TFM303"]
    assert blockers[0] == "`read_and_decode` is also used where no queue pipeline is rewritten"
    assert blockers[1] == "a shared batching queue (`shared_name=`) has no tf.data equivalent"


def test_reader_arguments_computed_inside_the_reader_function_are_refused():
    code = READER_FUNCTION.replace("def read_and_decode(filename_queue):", "def read_and_decode(filename_queue, size):").replace(
        "        reader = tf.TFRecordReader()\n",
        "        record_bytes = 1 + size\n        reader = tf.FixedLengthRecordReader(record_bytes=record_bytes)\n").replace(
        "read_and_decode(filename_queue)\n", "read_and_decode(filename_queue, 3072)\n")
    assert _blocker(code) == (
        "the reader's arguments are computed inside `read_and_decode`; the dataset that replaces it is made by the caller")


CIFAR10_READER = """
    import tensorflow as tf

    def read_cifar10(filename_queue):
        class CIFAR10Record(object):
            pass
        result = CIFAR10Record()
        label_bytes = 1
        result.height = 32
        result.width = 32
        result.depth = 3
        image_bytes = result.height * result.width * result.depth
        record_bytes = label_bytes + image_bytes
        reader = tf.FixedLengthRecordReader(record_bytes=record_bytes)
        result.key, value = reader.read(filename_queue)
        record_bytes = tf.decode_raw(value, tf.uint8)
        result.label = tf.cast(tf.strided_slice(record_bytes, [0], [label_bytes]), tf.int32)
        result.uint8image = tf.reshape(tf.strided_slice(record_bytes, [1], [3073]), [32, 32, 3])
        return result

    def inputs(filenames, batch_size):
        filename_queue = tf.train.string_input_producer(filenames, shuffle=False)
        read_input = read_cifar10(filename_queue)
        image = tf.cast(read_input.uint8image, tf.float32)
        return tf.train.batch([image, read_input.label], batch_size=batch_size)
    """


def test_cifar10_s_record_size_set_inside_its_reader_is_written_out_for_the_dataset():
    fixed = _fixed(CIFAR10_READER)
    assert "tf.data.FixedLengthRecordDataset(filenames, 1 + (32 * 32 * 3))" in fixed
    assert "def read_cifar10(value):" in fixed and "result.key" not in fixed
    assert "        return image, read_input.label\n" in fixed


def test_a_record_size_set_again_is_written_out_as_last_set():
    code = CIFAR10_READER.replace("        result.depth = 3\n", "        result.depth = 3\n        result.depth = 1\n")
    assert "tf.data.FixedLengthRecordDataset(filenames, 1 + (32 * 32 * 1))" in _fixed(code)


def test_a_record_size_set_to_something_else_than_integers_is_refused():
    code = CIFAR10_READER.replace("        result.depth = 3\n", "        result.depth = 3\n        result.depth = depth()\n")
    assert "computed inside `read_cifar10`" in _blocker(code)
    code = CIFAR10_READER.replace("        label_bytes = 1\n", "        label_bytes = 1\n        if big:\n            label_bytes = 2\n")
    assert "computed inside `read_cifar10`" in _blocker(code)


def test_a_record_key_kept_on_the_record_and_read_is_refused():
    code = CIFAR10_READER + "\n    def describe(record):\n        return record.key\n"
    assert "the record key `result.key` from `reader.read` may be read (`.key`)" in _blocker(code)


BATCH_HELPER = """
    import tensorflow as tf

    def make_batch(image, label, batch_size):
        images, labels = tf.train.batch([image, label], batch_size=batch_size, num_threads=4)
        tf.summary.image("images", images)
        return images, labels

    def build_inputs(files):
        filename_queue = tf.train.string_input_producer(files, shuffle=False)
        reader = tf.TFRecordReader()
        _, record = reader.read(filename_queue)
        features = tf.parse_single_example(record, FEATURES)
        return make_batch(features["image"], features["label"], 32)
    """


def test_a_batching_helper_is_given_the_dataset_of_examples():
    fixed = _fixed(BATCH_HELPER)
    assert "def make_batch(examples, batch_size):\n    batches = (\n        examples\n        .batch(batch_size, drop_remainder=True)\n" in fixed
    assert '        return features["image"], features["label"]\n' in fixed
    assert "        .map(_parse, num_parallel_calls=4)\n    )\n    return make_batch(dataset, 32)\n" in fixed


def test_a_batching_helper_also_used_elsewhere_is_refused():
    code = BATCH_HELPER + "\n    other = make_batch\n"
    assert _blocker(code) == "`make_batch` is also used where no queue pipeline is rewritten"


def test_a_batching_helper_given_examples_not_made_from_a_queue_is_refused():
    code = BATCH_HELPER + "\n    def constant_batch():\n        return make_batch(tf.zeros([4]), tf.zeros([]), 8)\n"
    assert _blocker(code).startswith("`make_batch` is shared with a queue pipeline that is not rewritten")


def test_a_batching_helper_using_an_example_otherwise_is_refused():
    code = BATCH_HELPER.replace('        tf.summary.image("images", images)', '        tf.summary.image("image", image[None])')
    assert _blocker(code) == "`make_batch` uses the examples it batches for something else too"


def test_a_reader_function_using_the_queue_otherwise_is_refused():
    code = READER_FUNCTION.replace(
        "        return features", "        tf.summary.scalar('queued', filename_queue.size())\n        return features")
    assert "`read_and_decode` uses the filename queue (or the record's name) otherwise than by reading it once" in _blocker(code)


def test_a_queue_given_to_another_module_s_function_is_refused():
    code = READER_FUNCTION.replace("image, label = read_and_decode(filename_queue)",
                                   "image, label = readers.read_and_decode(filename_queue)")
    assert _blocker(code) == "the filename queue is passed to a function that is not this module's"


EXAMPLES_FUNCTION = """
    import tensorflow as tf

    def read_and_decode(filename):
        filename_queue = tf.train.string_input_producer([filename], shuffle=False)
        reader = tf.TFRecordReader()
        _, serialized_example = reader.read(filename_queue)
        features = tf.parse_single_example(serialized_example, features=FEATURES)
        img = tf.reshape(tf.decode_raw(features['img_raw'], tf.uint8), [8, 8, 3])
        return img, features['label']

    img, label = read_and_decode("train.tfrecords")
    img_batch, label_batch = tf.train.batch([img, label], batch_size=30, num_threads=1)
    """


def test_a_function_returning_the_examples_of_its_own_queue_returns_their_dataset():
    fixed = _fixed(EXAMPLES_FUNCTION)
    assert "        return img, features['label']\n\n    dataset = (\n        tf.data.TFRecordDataset([filename])\n" in fixed
    assert "    return dataset\n" in fixed
    assert "examples = read_and_decode(\"train.tfrecords\")\ndataset = (\n    examples\n    .batch(30, drop_remainder=True)\n" in fixed


def test_a_function_returning_examples_twice_is_refused():
    code = EXAMPLES_FUNCTION.replace("        return img, features['label']",
                                     "        if filename.endswith('.gz'):\n            return None, None\n"
                                     "        return img, features['label']")
    assert _blocker(code) == "`read_and_decode` does not end with one `return` of its examples"


def test_examples_not_unpacked_as_returned_are_refused():
    code = EXAMPLES_FUNCTION.replace('img, label = read_and_decode("train.tfrecords")',
                                     'example = read_and_decode("train.tfrecords")\n    img, label = example')
    assert _blocker(code) == "`read_and_decode`'s examples are not unpacked as it returns them"


READER_BATCHES = """
    import tensorflow as tf

    def read_batch(filename_queue, batch_size):
        reader = tf.TextLineReader()
        _, line = reader.read(filename_queue)
        x, y = tf.decode_csv(line, record_defaults=[[0.0], [0]])
        return tf.train.batch([x, y], batch_size=batch_size)

    def inputs(files):
        filename_queue = tf.train.string_input_producer(files, shuffle=False)
        return read_batch(filename_queue, 16)
    """


def test_a_reader_function_that_batches_is_given_the_dataset_of_records():
    fixed = _fixed(READER_BATCHES)
    assert "def read_batch(records, batch_size):\n    def _parse(line):\n" in fixed
    assert "    records = (\n        tf.data.TextLineDataset(files)\n        .repeat()\n    )\n    return read_batch(records, 16)\n" in fixed


def test_a_reader_function_that_batches_a_queue_made_elsewhere_is_refused():
    code = READER_BATCHES.replace("        filename_queue = tf.train.string_input_producer(files, shuffle=False)\n", "")
    code = code.replace("def inputs(files):", "def inputs(filename_queue):")
    assert _blocker(code) == "`read_batch` is shared with a queue pipeline that is not rewritten " \
                             "(the filename queue `read_batch` reads is not made by its caller)"


def test_a_reader_function_that_batches_and_uses_its_queue_otherwise_is_refused():
    code = READER_BATCHES.replace("        return tf.train.batch(", "        tf.summary.scalar('size', filename_queue.size())\n"
                                  "        return tf.train.batch(")
    assert _blocker(code) == "`read_batch` uses the filename queue otherwise than by reading it once"


def test_a_slice_producer_s_list_batched_whole_is_the_dataset_of_its_tuples():
    fixed = _fixed("""
        import tensorflow as tf

        data_queues = tf.train.slice_input_producer([trX, trY], shuffle=False)
        X_all, labels_all = tf.train.batch(data_queues, batch_size=8, num_threads=1)
        """)
    assert ("dataset = (\n    tf.data.Dataset.from_tensor_slices((trX, trY))\n    .repeat()\n"
            "    .batch(8, drop_remainder=True)\n") in fixed and "_parse" not in fixed


def test_slices_of_a_variable_are_refused_a_one_shot_iterator_cannot_hold_it():
    code = """
        import tensorflow as tf

        def inputs(images):
            images_initializer = tf.placeholder(tf.float32, images.shape)
            input_images = tf.Variable(images_initializer, trainable=False, collections=[])
            image = tf.train.slice_input_producer([input_images], num_epochs=4, shuffle=False)[0]
            return tf.train.batch([image], batch_size=8)
        """
    code = code.replace("[0]\n", "\n").replace("image = tf.train", "image, = tf.train")
    assert _blocker(code).startswith("the dataset would read `input_images`, a `Variable`, which a one-shot iterator cannot hold")


def test_a_map_function_reading_a_placeholder_is_refused():
    code = """
        import tensorflow as tf

        scale = tf.placeholder(tf.float32, [])
        x, y = tf.train.slice_input_producer([xs, ys], shuffle=False)
        x = x * scale
        xb, yb = tf.train.batch([x, y], batch_size=8)
        """
    assert _blocker(code).startswith("the dataset would read `scale`, a `placeholder`")


def test_a_whole_file_reader_s_files_are_read_by_the_dataset_and_their_names_kept_where_used():
    fixed = _fixed("""
        import tensorflow as tf

        def load_examples(input_paths):
            path_queue = tf.train.string_input_producer(input_paths, shuffle=False)
            reader = tf.WholeFileReader()
            paths, contents = reader.read(path_queue)
            image = tf.image.decode_png(contents)
            return tf.train.batch([paths, image], batch_size=1)
        """)
    assert ("        tf.data.Dataset.from_tensor_slices(input_paths)\n        .repeat()\n"
            "        .map(lambda filename: (filename, tf.io.read_file(filename)))\n        .map(_parse)\n") in fixed
    assert "    def _parse(paths, contents):\n" in fixed


def test_a_whole_file_reader_s_unused_name_is_not_kept():
    fixed = _fixed("""
        import tensorflow as tf

        def load_examples(input_paths):
            path_queue = tf.train.string_input_producer(input_paths, shuffle=False)
            _, contents = tf.WholeFileReader().read(path_queue)
            image = tf.image.decode_png(contents)
            return tf.train.batch([image], batch_size=1)
        """)
    assert "        .map(tf.io.read_file)\n        .map(_parse)\n" in fixed and "    def _parse(contents):\n" in fixed


def test_if_and_with_statements_on_what_was_read_move_into_the_map_function():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(files, which):
            queue = tf.train.string_input_producer(files, shuffle=False)
            _, value = tf.TFRecordReader().read(queue)
            image = tf.decode_raw(value, tf.uint8)
            check = tf.assert_equal(tf.size(image), 12)
            with tf.control_dependencies([check]):
                image = tf.identity(image)
            if which == "AtoB":
                first, second = image[:6], image[6:]
            else:
                first, second = image[6:], image[:6]
            return tf.train.batch([first, second], batch_size=4)
        """)
    body = fixed.split("    def _parse(value):\n", 1)[1].split("\n\n    dataset", 1)[0]
    assert "        with tf.control_dependencies([check]):\n            image = tf.identity(image)\n" in body
    assert '        if which == "AtoB":\n' in body and body.endswith("        return first, second")
    assert fixed.count("with tf.control_dependencies") == 1 and fixed.count('if which == "AtoB"') == 1


def test_a_loop_filling_a_list_made_outside_it_is_refused():
    code = """
        import tensorflow as tf

        def inputs(files):
            queue = tf.train.string_input_producer(files, shuffle=False)
            _, value = tf.TFRecordReader().read(queue)
            parts = []
            for i in range(3):
                parts.append(tf.strings.substr(value, i, 1))
            stacked = tf.stack(parts)
            return tf.train.batch([stacked], batch_size=4)
        """
    assert _blocker(code).startswith("`parts` is made outside what would move into the map function and changed there")


def test_a_loop_over_what_was_read_moves_into_the_map_function():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(files):
            queue = tf.train.string_input_producer(files, shuffle=False)
            _, value = tf.TFRecordReader().read(queue)
            frames = tf.decode_raw(value, tf.uint8)
            for i in range(3):
                frames = tf.concat([frames, frames[:1]], 0)
            return tf.train.batch([frames], batch_size=4)
        """)
    assert "        for i in range(3):\n            frames = tf.concat([frames, frames[:1]], 0)\n        return frames\n" in fixed


def test_a_guard_that_returns_a_shuffled_batch_shares_the_dataset_with_the_batch_after_it():
    """`if shuffle: return shuffle_batch(...)` then `return batch(...)` (the TensorFlow for Machine
    Intelligence CSV reader): what follows the guard is its `else`."""
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(files, shuffle):
            queue = tf.train.string_input_producer(files, shuffle=False)
            _, value = tf.TFRecordReader().read(queue)
            frames = tf.decode_raw(value, tf.uint8)
            if shuffle:
                return tf.train.shuffle_batch([frames], batch_size=4, capacity=50, min_after_dequeue=10)
            return tf.train.batch([frames], batch_size=4)
        """)
    assert "    examples = (\n        tf.data.TFRecordDataset(files)\n        .repeat()\n        .map(_parse)\n    )\n    if shuffle:\n" in fixed
    assert fixed.count("def _parse") == 1 and "        .shuffle(10)\n" in fixed
    assert "    batches_2 = (\n        examples\n        .batch(4, drop_remainder=True)\n" in fixed


def test_a_statement_that_returns_other_than_a_batch_is_refused():
    code = """
        import tensorflow as tf

        def inputs(files, debug):
            queue = tf.train.string_input_producer(files, shuffle=False)
            _, value = tf.TFRecordReader().read(queue)
            frames = tf.decode_raw(value, tf.uint8)
            if debug:
                return frames
            return tf.train.batch([frames], batch_size=4)
        """
    assert _blocker(code).startswith("a statement between the read and the batching call that cannot move into the map")


def test_a_keyword_argument_named_like_a_pipeline_tensor_is_not_a_use_of_it():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(xs, ys):
            x, y = tf.train.slice_input_producer([xs, ys], shuffle=False)
            inputs = x * 2.0
            xb, yb = tf.train.batch([inputs, y], batch_size=4)
            return dict(inputs=xb, targets=yb)
        """)
    assert "slice_input_producer" not in fixed


BRANCHES = """
    import tensorflow as tf

    def load(files, training):
        queue = tf.train.string_input_producer(files, shuffle=False)
        _, value = tf.TFRecordReader().read(queue)
        image = tf.decode_raw(value, tf.uint8)
        if training:
            images = tf.train.shuffle_batch([image], batch_size=8, capacity=100, min_after_dequeue=50)
        else:
            images = tf.train.batch([image], batch_size=8)
        return images
    """


def test_batches_in_the_branches_of_an_if_share_one_dataset_made_before_it():
    fixed = _fixed(BRANCHES)
    assert ("    examples = (\n        tf.data.TFRecordDataset(files)\n        .repeat()\n        .map(_parse)\n    )\n"
            "    if training:\n        batches = (\n            examples\n            .shuffle(50)\n") in fixed
    assert "    else:\n        batches_2 = (\n            examples\n            .batch(8, drop_remainder=True)\n" in fixed
    assert fixed.count("def _parse(") == 1


def test_a_branch_that_does_not_batch_the_input_is_refused():
    code = BRANCHES.replace("            images = tf.train.batch([image], batch_size=8)", "            images = tf.expand_dims(image, 0)")
    assert _blocker(code) == "a branch of the `if` around the batching call neither batches the input nor raises"


def test_a_refused_branch_refuses_the_other():
    code = BRANCHES.replace("images = tf.train.batch([image], batch_size=8)", "images = tf.train.batch([image], batch_size=8, shared_name='q')")
    blockers = [f.message.split("no automatic fix: ", 1)[1] for f in run_check(code) if f.code == "TFM303"]
    assert blockers[0] == ("the `if` on line 7 is shared with a queue pipeline that is not rewritten "
                           "(a shared batching queue (`shared_name=`) has no tf.data equivalent)")


SLICES_TO_A_FUNCTION = """
    import tensorflow as tf

    def read_images_from_disk(input_queue, input_size):
        img = tf.image.decode_jpeg(tf.read_file(input_queue[0]), channels=3)
        label = tf.image.decode_png(tf.read_file(input_queue[1]), channels=1)
        return img, label

    def create_inputs(images, labels, batch_size):
        queue = tf.train.slice_input_producer([images, labels], shuffle=False)
        image, label = read_images_from_disk(queue, (8, 8))
        return tf.train.batch([image, label], batch_size)
    """


def test_slices_handed_to_a_function_that_reads_them_by_position_are_its_tuple():
    fixed = _fixed(SLICES_TO_A_FUNCTION)
    assert "    def _parse(*queue):\n        image, label = read_images_from_disk(queue, (8, 8))\n" in fixed
    assert "def read_images_from_disk(input_queue, input_size):\n" in fixed  # the function is unchanged


def test_slices_handed_to_a_function_that_uses_the_list_otherwise_are_refused():
    code = SLICES_TO_A_FUNCTION.replace("        return img, label", "        input_queue.append(img)\n        return img, label")
    assert "`queue`, the producer's list of slices, is used otherwise than by position" in _blocker(code)


IMAGE_READER = SLICES_TO_A_FUNCTION.split("    def create_inputs")[0] + """
    class ImageReader(object):
        def __init__(self, images, labels, input_size):
            self.input_size = input_size
            self.queue = tf.train.slice_input_producer([images, labels], shuffle=False)
            self.image, self.label = read_images_from_disk(self.queue, self.input_size)

        def dequeue(self, num_elements):
            image_batch, label_batch = tf.train.batch([self.image, self.label], num_elements)
            return image_batch, label_batch

    reader = ImageReader(image_paths, label_paths, (8, 8))
    image_batch, label_batch = reader.dequeue(4)
    """


def test_examples_kept_on_the_object_and_batched_by_another_method_keep_their_dataset_there():
    fixed = _fixed(IMAGE_READER)
    assert ("        def _parse(*queue):\n            image, label = read_images_from_disk(queue, self.input_size)\n"
            "            return image, label\n") in fixed
    assert "        self.examples = dataset\n" in fixed and "self.queue" not in fixed and "self.image" not in fixed
    assert "        batches = (\n            self.examples\n            .batch(num_elements, drop_remainder=True)\n" in fixed


def test_examples_kept_on_the_object_and_batched_twice_are_refused():
    code = IMAGE_READER + "\n    more_images, more_labels = reader.dequeue(8)\n"
    assert "`dequeue` is called more than once" in _blocker(code)


def test_examples_kept_on_the_object_and_read_elsewhere_are_refused():
    code = IMAGE_READER.replace("            return image_batch, label_batch",
                                "            tf.summary.image('one', self.image[None])\n            return image_batch, label_batch")
    assert "are read elsewhere too" in _blocker(code)


# --- queues built by hand (TFM304): a queue, its enqueue op, its QueueRunner and a dequeue of a batch


def _hand_built_findings(code: str) -> dict[str, list]:
    found: dict[str, list] = {}
    for finding in run_check(textwrap.dedent(code).lstrip("\n")):
        found.setdefault(finding.code, []).append(finding)
    return found


CONSTANT_ROWS = """
    import numpy as np
    import tensorflow as tf

    data = np.zeros((100, 4), np.float32)
    target = np.zeros((100,), np.int32)

    # ---- input queue ----
    queue = tf.FIFOQueue(capacity=50, dtypes=[tf.float32, tf.int32], shapes=[[4], []])
    enqueue_op = queue.enqueue_many([tf.constant(data), tf.constant(target)])
    data_batch, label_batch = queue.dequeue_many(32)
    loss = tf.reduce_mean(data_batch) + tf.reduce_mean(tf.cast(label_batch, tf.float32))

    qr = tf.train.QueueRunner(queue, [enqueue_op] * 4)
    tf.train.add_queue_runner(qr)
    with tf.Session() as sess:
        coord = tf.train.Coordinator()
        threads = tf.train.start_queue_runners(sess=sess, coord=coord)
        print(sess.run(loss))
        coord.request_stop()
        sess.run(queue.close(cancel_pending_enqueues=True))
        coord.join(threads)
    """


def test_a_hand_built_queue_of_constant_rows_is_the_rows_dataset():
    """The CS20SI queue lecture's shape: `enqueue_many` of constants, a runner registered by
    name after the model, a `close` at the end: one dataset where the batch was taken."""
    fixed = _fixed(CONSTANT_ROWS)
    assert (
        "# ---- input queue ----\n"
        "dataset = (\n"
        "    tf.data.Dataset.from_tensor_slices((tf.constant(data), tf.constant(target)))\n"
        "    .repeat()\n"
        "    .batch(32, drop_remainder=True)\n"
        "    .prefetch(tf.data.AUTOTUNE)\n"
        ")\n"
        "data_batch, label_batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()\n"
        "loss = "
    ) in fixed
    for gone in ("FIFOQueue", "enqueue_op", "QueueRunner", "add_queue_runner", "close(", "Coordinator", "coord."):
        assert gone not in fixed, gone


def test_the_queue_s_runner_findings_carry_the_queue_s_fix():
    found = _hand_built_findings(CONSTANT_ROWS)
    assert [f.fixable for f in found["TFM304"]] == [True]
    assert all(f.fixable for f in found["TFM301"]), [f.message for f in found["TFM301"]]


def test_a_random_shuffle_queue_shuffles_the_dataset_with_its_buffer_and_seed():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(files, batch_size):
            filename_queue = tf.train.string_input_producer(files, shuffle=False)
            _, serialized = tf.TFRecordReader().read(filename_queue)
            image = tf.decode_raw(serialized, tf.uint8)
            queue = tf.RandomShuffleQueue(1000, 400, [tf.uint8], seed=7)
            enqueue = queue.enqueue([image])
            tf.train.add_queue_runner(tf.train.QueueRunner(queue, [enqueue]))
            return queue.dequeue_up_to(batch_size)
        """)
    assert ("        .map(_parse)\n        .shuffle(400, seed=7)\n        .batch(batch_size)\n"
            "        .prefetch(tf.data.AUTOTUNE)\n    )\n"
            "    return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()\n") in fixed
    assert "Queue" not in fixed


def test_a_padding_queue_pads_its_batches():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(files, batch_size):
            filename_queue = tf.train.string_input_producer(files, shuffle=False)
            _, line = tf.TextLineReader().read(filename_queue)
            tokens = tf.string_split([line]).values
            queue = tf.PaddingFIFOQueue(64, [tf.string], shapes=[[None]])
            enqueue = queue.enqueue([tokens])
            tf.train.add_queue_runner(tf.train.QueueRunner(queue, [enqueue]))
            tokens_batch = queue.dequeue_many(batch_size)
            return tokens_batch
        """)
    assert "        return tf.ensure_shape(tokens, [None])\n" in fixed
    assert ".padded_batch(batch_size, drop_remainder=True)" in fixed


def test_queues_an_if_chooses_shuffle_as_its_branches_did():
    fixed = _fixed("""
        import tensorflow as tf

        def inputs(files, batch_size, mode):
            filename_queue = tf.train.string_input_producer(files, shuffle=False)
            _, value = tf.TFRecordReader().read(filename_queue)
            image = tf.decode_raw(value, tf.uint8)
            if mode == 'train':
                queue = tf.RandomShuffleQueue(100, 50, [tf.uint8])
            else:
                queue = tf.RandomShuffleQueue(10, 5, [tf.uint8])
            enqueue = queue.enqueue([image])
            tf.train.add_queue_runner(tf.train.QueueRunner(queue, [enqueue]))
            return queue.dequeue_many(batch_size)
        """)
    assert ("    if mode == 'train':\n        dataset = dataset.shuffle(50)\n"
            "    else:\n        dataset = dataset.shuffle(5)\n"
            "    dataset = dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)\n") in fixed
    assert "if mode == 'train':\n        queue" not in fixed and "Queue" not in fixed  # the emptied `if` went


@pytest.mark.parametrize("code, reason", [
    ("""
        import threading
        import tensorflow as tf
        images = tf.placeholder(tf.float32, [None, 4])
        queue = tf.FIFOQueue(32, [tf.float32], shapes=[[4]])
        enqueue = queue.enqueue_many([images])
        batch = queue.dequeue_many(8)
        def feed(sess, data):
            for rows in data:
                sess.run(enqueue, feed_dict={images: rows})
        """, "no `QueueRunner` fills the queue: a Python thread feeding it (`sess.run(enqueue_op, feed_dict=...)`)"),
    ("""
        import tensorflow as tf
        queue = tf.FIFOQueue(32, [tf.float32], shapes=[[4]])
        enqueue = queue.enqueue_many([tf.constant(rows)])
        qr = tf.train.QueueRunner(queue, [enqueue])
        batch = queue.dequeue_many(8)
        with tf.Session() as sess:
            coord = tf.train.Coordinator()
            threads = qr.create_threads(sess, coord=coord, start=True)
        """, "the `QueueRunner` `qr` is used otherwise than registered with `tf.train.add_queue_runner`"),
    ("""
        import tensorflow as tf
        queue = tf.FIFOQueue(32, [tf.float32], shapes=[[4]])
        enqueue = queue.enqueue_many([tf.constant(rows)])
        tf.train.add_queue_runner(tf.train.QueueRunner(queue, [enqueue]))
        batch = queue.dequeue_many(8)
        tf.summary.scalar('queue_size', queue.size())
        """, "`queue` is used otherwise than to enqueue, run, dequeue and close it"),
    ("""
        import tensorflow as tf
        queue = tf.FIFOQueue(32, [tf.float32], names=['x'])
        enqueue = queue.enqueue_many({'x': tf.constant(rows)})
        tf.train.add_queue_runner(tf.train.QueueRunner(queue, [enqueue]))
        batch = queue.dequeue_many(8)
        """, "a queue with `names=` has no tf.data rewrite here"),
    # The runner runs another op, and the queue's own enqueue op is run by hand: the rewrite
    # removed the enqueue op's line and left `sess.run(enqueue)` naming nothing.
    ("""
        import tensorflow as tf
        queue = tf.FIFOQueue(32, [tf.float32], shapes=[[4]])
        enqueue = queue.enqueue_many([tf.constant(rows)])
        other = tf.no_op()
        tf.train.add_queue_runner(tf.train.QueueRunner(queue, [other]))
        batch = queue.dequeue_many(8)
        sess.run(enqueue)
        """, "the `QueueRunner`'s enqueue ops are not `[enqueue]` or `[enqueue] * num_threads`"),
    ("""
        import tensorflow as tf
        counter = tf.Variable(0)
        example = tf.gather(tf.constant(rows), tf.assign_add(counter, 1))
        queue = tf.FIFOQueue(32, [tf.float32], shapes=[[4]])
        enqueue = queue.enqueue([example])
        tf.train.add_queue_runner(tf.train.QueueRunner(queue, [enqueue]))
        batch = queue.dequeue_many(8)
        """, "the enqueued tensors are neither read from files by a producer and reader in this block"),
])
def test_hand_built_queues_the_rewrite_cannot_read_say_why(code, reason):
    assert reason in _blocker(code, rule="TFM304")


def test_dynamic_padding_over_a_sparse_tensor_is_refused():
    """DeepSpeech-style: `VarLenFeature` labels beside features padded by `dynamic_pad=True`. The
    queue batched the labels as a SparseTensor; `padded_batch` raised a TypeError on them."""
    message = _blocker("""
        import tensorflow as tf

        def inputs(files, batch_size):
            filename_queue = tf.train.string_input_producer(files, shuffle=False)
            _, serialized = tf.TFRecordReader().read(filename_queue)
            context = {"labels": tf.VarLenFeature(dtype=tf.int64)}
            sequence = {"feats": tf.FixedLenSequenceFeature([13], dtype=tf.float32)}
            parsed_context, parsed_sequence = tf.parse_single_sequence_example(
                serialized, context_features=context, sequence_features=sequence)
            return tf.train.batch([parsed_sequence["feats"], parsed_context["labels"]], batch_size, dynamic_pad=True)
        """)
    assert "`dynamic_pad=True` batches what `VarLenFeature` makes, a SparseTensor" in message


def test_files_matched_once_are_matched_by_the_dataset():
    """`string_input_producer(tf.train.match_filenames_once(pattern))`: the names matched once are
    held in a local variable, which a one-shot iterator cannot capture (a held-out PNG reader
    failed: "Cannot capture a stateful node"). `tf.io.matching_files`, the op that variable is
    initialised from, gives the dataset the same names."""
    fixed = _fixed("""
        import tensorflow as tf

        def images(pattern):
            queue = tf.train.string_input_producer(tf.train.match_filenames_once(pattern), shuffle=False)
            _, contents = tf.WholeFileReader().read(queue)
            image = tf.image.decode_png(contents)
            return tf.train.batch([image], batch_size=4)
        """)
    assert "tf.data.Dataset.from_tensor_slices(tf.io.matching_files(pattern))" in fixed
    assert "match_filenames_once" not in fixed


def test_files_matched_once_under_a_name_are_refused():
    blocker = _blocker("""
        import tensorflow as tf

        def images(pattern):
            files = tf.train.match_filenames_once(pattern)
            queue = tf.train.string_input_producer(files, shuffle=False)
            _, contents = tf.WholeFileReader().read(queue)
            image = tf.image.decode_png(contents)
            return tf.train.batch([image], batch_size=4)
        """)
    assert blocker.startswith("the dataset would read `files`, a `match_filenames_once`")


def test_record_fields_set_together_are_written_out_for_the_reader():
    """cifar10_input's `read_cifar10` written `result.height, result.width, result.depth = 16, 16, 3`:
    the record size the reader takes is still arithmetic on constants, which the caller's
    dataset can compute (it was refused as computed inside the function)."""
    fixed = _fixed("""
        import tensorflow as tf

        def read_record(filename_queue):
            class Record(object):
                pass
            result = Record()
            label_bytes = 1
            result.height, result.width, result.depth = 4, 4, 3
            record_bytes = label_bytes + result.height * result.width * result.depth
            reader = tf.FixedLengthRecordReader(record_bytes=record_bytes)
            result.key, value = reader.read(filename_queue)
            result.label = tf.decode_raw(value, tf.uint8)[0]
            return result

        def inputs(filenames):
            queue = tf.train.string_input_producer(filenames, shuffle=False)
            record = read_record(queue)
            return tf.train.batch([record.label], batch_size=4)
        """)
    assert "tf.data.FixedLengthRecordDataset(filenames, 1 + 4 * 4 * 3)" in fixed, fixed
