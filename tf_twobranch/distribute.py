"""Losses over the global batch under any `tf.distribute` strategy.

Every loss in this package that ranks against in-batch negatives sees the
*global* batch: each replica all-gathers the embeddings (and the ids that say
which pairs match) of every replica, computes the per-example loss of its own
*local* anchors against that global gallery, sums it, and divides by the
global number of anchors.  Keras sums gradients over replicas, so the update
equals the gradient of the mean loss of one big single-device batch — the
property `tests/test_distribute.py` checks with two worker processes.

The contract, for a loss computed inside ``strategy.run`` / ``train_step``:

    gathered = cross_replica_concat(local)                 # global gallery
    start = local_row_offset(tf.shape(local)[0])           # my rows in it
    per_example = f(gathered[start:start + n_local], gathered, ...)
    loss = tf.reduce_sum(per_example) / global_count(n_local)

Outside a multi-replica context every function is the identity (offset 0,
global count = local count), so single-device code pays nothing.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["num_replicas", "cross_replica_concat", "local_row_offset", "global_count",
           "replica_share"]


def _replica_context():
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return None
    return ctx


def num_replicas() -> int:
    """Replicas in sync (1 outside a distributed replica context)."""
    ctx = tf.distribute.get_replica_context()
    return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def cross_replica_concat(x: tf.Tensor) -> tf.Tensor:
    """Concatenates `x` of every replica along axis 0, in replica order.

    Differentiable: the gradient of the gathered tensor is summed over
    replicas and each replica receives the rows it contributed.  Every
    replica must pass the same number of rows (the samplers guarantee it).
    """
    ctx = _replica_context()
    if ctx is None:
        return x
    return ctx.all_gather(x, axis=0)


def local_row_offset(local_rows) -> tf.Tensor:
    """Index of this replica's first row in a `cross_replica_concat` result."""
    ctx = _replica_context()
    if ctx is None:
        return tf.constant(0, tf.int32)
    replica_id = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
    return replica_id * tf.cast(local_rows, tf.int32)


def global_count(local_count) -> tf.Tensor:
    """Sum of `local_count` over replicas (as float32, for dividing a loss)."""
    local_count = tf.cast(local_count, tf.float32)
    ctx = _replica_context()
    if ctx is None:
        return local_count
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, local_count)


def replica_share(loss: tf.Tensor) -> tf.Tensor:
    """This replica's share of a loss that every replica computed in full.

    For losses that are not a sum over anchors (e.g. a mean over top-K
    violations of the whole global batch), each replica computes the same
    global value on gathered tensors; dividing by the number of replicas makes
    the summed gradient that of the global loss.
    """
    return loss / tf.cast(num_replicas(), loss.dtype)
