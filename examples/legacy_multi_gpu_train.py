"""A legacy TensorFlow 1 training script parallelised by hand over the GPUs.

This is the shape tfmigrate was built for: input through queue runners, one model "tower"
per GPU built in a loop under tf.device, variables shared with reuse_variables(), a
hand-written gradient-averaging helper, and everything else pinned to the CPU.

    tfmigrate check examples/
    tfmigrate fix examples/ --unsafe-fixes     # preview the migration
"""
import time

import tensorflow as tf

NUM_GPUS = 2
BATCH_SIZE = 64
MAX_STEPS = 1000


def read_records(filenames):
    filename_queue = tf.train.string_input_producer(filenames, num_epochs=None, shuffle=True)
    reader = tf.TFRecordReader()
    _, serialized = reader.read(filename_queue)
    features = tf.parse_single_example(serialized, {
        'image': tf.FixedLenFeature([784], tf.float32),
        'label': tf.FixedLenFeature([], tf.int64),
    })
    return tf.train.shuffle_batch(
        [features['image'], features['label']], batch_size=BATCH_SIZE,
        capacity=2000, min_after_dequeue=1000, num_threads=4)


def inference(images):
    hidden = tf.layers.dense(images, 128, activation=tf.nn.relu, name='hidden')
    return tf.layers.dense(hidden, 10, name='logits')


def tower_loss(scope, images, labels):
    logits = inference(images)
    loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    tf.add_to_collection('losses', loss)
    return tf.add_n(tf.get_collection('losses', scope), name='total_loss')


def average_gradients(tower_grads):
    average_grads = []
    for grad_and_vars in zip(*tower_grads):
        grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
        grad = tf.reduce_mean(tf.concat(grads, 0), 0)
        average_grads.append((grad, grad_and_vars[0][1]))
    return average_grads


def train(filenames):
    with tf.Graph().as_default(), tf.device('/cpu:0'):
        global_step = tf.train.get_or_create_global_step()
        opt = tf.train.GradientDescentOptimizer(0.1)
        images, labels = read_records(filenames)

        tower_grads = []
        with tf.variable_scope(tf.get_variable_scope()):
            for i in range(NUM_GPUS):
                with tf.device('/gpu:%d' % i):
                    with tf.name_scope('tower_%d' % i) as scope:
                        loss = tower_loss(scope, images, labels)
                        tf.get_variable_scope().reuse_variables()
                        tower_grads.append(opt.compute_gradients(loss))

        grads = average_gradients(tower_grads)
        train_op = opt.apply_gradients(grads, global_step=global_step)

        sess = tf.Session(config=tf.ConfigProto(allow_soft_placement=True))
        sess.run(tf.global_variables_initializer())
        coord = tf.train.Coordinator()
        threads = tf.train.start_queue_runners(sess=sess, coord=coord)
        try:
            for step in range(MAX_STEPS):
                start = time.time()
                _, loss_value = sess.run([train_op, loss])
                if step % 10 == 0:
                    rate = BATCH_SIZE * NUM_GPUS / (time.time() - start)
                    print('step %d, loss = %.3f (%.1f examples/sec)' % (step, loss_value, rate))
        except tf.errors.OutOfRangeError:
            print('done')
        finally:
            coord.request_stop()
            coord.join(threads)


if __name__ == '__main__':
    train(['train.tfrecords'])
