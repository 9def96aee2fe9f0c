"""InPlaceSGD: Keras' SGD update, bit for bit, in one in-place kernel."""
import json

import numpy as np
import pytest
import tensorflow as tf
import keras

from tf_twobranch.training.in_place_sgd import InPlaceSGD

from tests.support.forked_modules import REPO_ROOT, run_python

FUSED_KERNEL = "ResourceApplyKerasMomentum"


def _shared_classifier_model(classes=37, dim=12, seed=0):
    keras.utils.set_random_seed(seed)
    image, text = keras.Input((dim,)), keras.Input((dim,))
    hidden = keras.layers.Dense(dim, activation="relu")
    classifier = keras.layers.Dense(classes)
    return keras.Model([image, text], [classifier(hidden(image)), classifier(text)])


def _train(make_optimizer, steps=6, seed=0, strategy=None):
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = _shared_classifier_model(seed=seed)
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(8, 12)).astype("float32"), rng.normal(size=(8, 12)).astype("float32"),
                rng.integers(0, 37, size=8)) for _ in range(steps)]

    @tf.function(jit_compile=False)
    def step(a, b, y):
        def replica_step(a, b, y):
            with tf.GradientTape() as tape:
                la, lb = model([a, b])
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, la, from_logits=True)
                                      + keras.losses.sparse_categorical_crossentropy(y, lb, from_logits=True))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        strategy.run(replica_step, args=(a, b, y))

    for a, b, y in batches:
        step(a, b, y)
    graph = str(step.get_concrete_function(*batches[0]).graph.as_graph_def())
    values = [v.numpy() for v in model.trainable_variables] + [m.numpy() for m in optimizer.momentums]
    return values, graph.count(f'op: "{FUSED_KERNEL}"')


@pytest.mark.parametrize("kwargs", [
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.5, weight_decay=1e-2),
    dict(momentum=0.0),
])
def test_updates_equal_keras_sgd_bit_for_bit(kwargs):
    ours, fused = _train(lambda: InPlaceSGD(0.05, **kwargs))
    keras_sgd, keras_fused = _train(lambda: keras.optimizers.SGD(0.05, **kwargs))
    # every dense variable (two kernels, two biases) takes the kernel; plain SGD stays Keras'
    assert (fused, keras_fused) == ((4, 0) if kwargs["momentum"] else (0, 0))
    assert len(ours) == len(keras_sgd)
    for a, b in zip(ours, keras_sgd):
        np.testing.assert_array_equal(a, b)
    # the models moved: equality above is not two untouched initialisations
    initial = [v.numpy() for v in _shared_classifier_model().trainable_variables]
    assert len(initial) == 4
    assert all(not np.array_equal(a, b) for a, b in zip(ours, initial))


def test_equal_under_a_one_replica_mirrored_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    ours, fused = _train(lambda: InPlaceSGD(0.05, momentum=0.9), strategy=strategy)
    keras_sgd, _ = _train(lambda: keras.optimizers.SGD(0.05, momentum=0.9), strategy=strategy)
    assert fused == 4
    for a, b in zip(ours, keras_sgd):
        np.testing.assert_array_equal(a, b)


_TWO_REPLICAS = """
import json
import numpy as np, tensorflow as tf, keras
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
from tests.core.training import test_in_place_sgd as t
from tf_twobranch.training.in_place_sgd import InPlaceSGD
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
ours, fused = t._train(lambda: InPlaceSGD(0.05, momentum=0.9, nesterov=True), strategy=strategy)
theirs, _ = t._train(lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), strategy=strategy)
print(json.dumps({"replicas": strategy.num_replicas_in_sync, "fused": fused,
                  "equal": all(np.array_equal(a, b) for a, b in zip(ours, theirs))}))
"""


def test_equal_under_a_two_replica_mirrored_strategy():
    # each replica updates its own copy of every variable through that copy's handle
    proc = run_python(["-c", _TWO_REPLICAS], cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replicas"] == 2 and result["fused"] > 0 and result["equal"], result


def test_sparse_embedding_gradients_take_keras_update():
    def run(optimizer):
        keras.utils.set_random_seed(3)
        embedding = keras.layers.Embedding(20, 4)
        embedding.build((None, 3))
        optimizer.build(embedding.trainable_variables)
        ids = tf.constant([[1, 2, 3], [3, 4, 19]])
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(embedding(ids)))
            grads = tape.gradient(loss, embedding.trainable_variables)
            assert isinstance(grads[0], tf.IndexedSlices)
            optimizer.apply(grads, embedding.trainable_variables)
        return embedding.embeddings.numpy()

    np.testing.assert_array_equal(run(InPlaceSGD(0.1, momentum=0.9)), run(keras.optimizers.SGD(0.1, momentum=0.9)))


def test_config_round_trip_keeps_the_class():
    optimizer = InPlaceSGD(0.01, momentum=0.9, nesterov=True)
    again = optimizer.__class__.from_config(optimizer.get_config())
    assert isinstance(again, InPlaceSGD) and again.nesterov and again.momentum == 0.9
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored, InPlaceSGD)
