"""A Keras 2.x model trained on several GPUs with multi_gpu_model (removed in TensorFlow 2.4)."""
import numpy as np
from keras.layers import Dense
from keras.models import Sequential
from keras.utils import multi_gpu_model

model = Sequential([
    Dense(64, activation='relu', input_shape=(32,)),
    Dense(10, activation='softmax'),
])
parallel_model = multi_gpu_model(model, gpus=2)
parallel_model.compile(loss='categorical_crossentropy', optimizer='adam')

x = np.random.random((1024, 32))
y = np.eye(10)[np.random.randint(10, size=1024)]
# The global batch of 256 is split across the 2 GPUs: 128 examples each.
parallel_model.fit(x, y, epochs=2, batch_size=256)
