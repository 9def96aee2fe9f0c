"""Two-replica check of `localization_batch_loss` (run as a script by tests/systems/npair/test_losses_npair.py).

Splits this machine's CPU into two logical devices (before anything else
touches TensorFlow), runs the loss under `tf.distribute.MirroredStrategy`
with each replica given its half of a random batch, and computes the loss
and its gradients on the whole batch with no strategy. Prints one JSON
object: per loss, both values, the largest gradient differences, and
``num_replicas_in_sync``.
"""
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# This checkout's package, not whichever one is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

from tf_twobranch.systems.npair.losses import localization_batch_loss  # noqa: E402

BATCH, HEIGHT, WIDTH, TOKENS, DEPTH = 8, 3, 3, 5, 4


def random_batch(seed=0):
    rng = np.random.default_rng(seed)
    maps = rng.normal(size=(BATCH, HEIGHT, WIDTH, DEPTH)).astype(np.float32)
    tokens = rng.normal(size=(BATCH, TOKENS, DEPTH)).astype(np.float32)
    lengths = np.array([5, 1, 3, 2, 4, 5, 2, 3])
    mask = np.arange(TOKENS)[None, :] < lengths[:, None]
    return maps, tokens, mask


def loss_and_gradients(maps, tokens, mask, options):
    maps, tokens = tf.convert_to_tensor(maps), tf.convert_to_tensor(tokens)
    with tf.GradientTape() as tape:
        tape.watch([maps, tokens])
        loss = localization_batch_loss(maps, tokens, mask, **options)
    map_grad, token_grad = tape.gradient(loss, [maps, tokens])
    return loss, map_grad, token_grad


def main() -> int:
    strategy = tf.distribute.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    replicas = strategy.num_replicas_in_sync
    maps, tokens, mask = random_batch()
    half = BATCH // replicas

    def per_replica(array):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(array[ctx.replica_id_in_sync_group * half:
                                          (ctx.replica_id_in_sync_group + 1) * half]))

    inputs = [per_replica(x) for x in (maps, tokens, mask)]
    out = {"num_replicas_in_sync": replicas}
    # npair in a tf.function (as in a train_step), triplet eagerly: both paths, one trace.
    for loss_name, options, compiled in (("npair", dict(loss="npair", temperature=0.5), True),
                                         ("triplet", dict(loss="triplet", margin=0.3), False)):
        def distributed(m, s, k, options=options):
            return strategy.run(lambda *a: loss_and_gradients(*a, options), args=(m, s, k))

        if compiled:
            distributed = tf.function(distributed, autograph=False)
        loss, map_grad, token_grad = distributed(*inputs)
        total = float(strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None))
        gathered_maps = np.concatenate([g.numpy() for g in strategy.experimental_local_results(map_grad)])
        gathered_tokens = np.concatenate([g.numpy()
                                          for g in strategy.experimental_local_results(token_grad)])
        single, single_maps, single_tokens = loss_and_gradients(maps, tokens, mask, options)
        out[loss_name] = {
            "distributed": total, "single": float(single),
            "map_gradient_max_diff": float(np.abs(gathered_maps - single_maps.numpy()).max()),
            "token_gradient_max_diff": float(np.abs(gathered_tokens - single_tokens.numpy()).max()),
            "map_gradient_max": float(np.abs(single_maps.numpy()).max()),
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
