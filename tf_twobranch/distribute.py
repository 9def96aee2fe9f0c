"""Strategies, the chief, and losses over the global batch under any `tf.distribute` strategy.

`get_strategy` turns the one `--strategy` flag into a strategy; `is_chief`
says whether this process writes run directories and results (the chief
of a multi-worker cluster, or the only process).

Every loss in this package that ranks against in-batch negatives sees the
*global* batch: each replica all-gathers the embeddings (and the ids that say
which pairs match) of every replica, computes the per-example loss of its own
*local* anchors against that global gallery, sums it, and divides by the
global number of anchors.  Keras sums gradients over replicas, so the update
equals the gradient of the mean loss of one big single-device batch — the
property `tests/core/training/test_distribute.py` checks with two worker processes.

The contract, for a loss computed inside ``strategy.run`` / ``train_step``:

    gathered = cross_replica_concat(local)                 # global gallery
    start = local_row_offset(tf.shape(local)[0])           # my rows in it
    per_example = f(gathered[start:start + n_local], gathered, ...)
    loss = tf.reduce_sum(per_example) / global_count(n_local)

Outside a multi-replica context every function is the identity (offset 0,
global count = local count), so single-device code pays nothing.
"""
from __future__ import annotations

import json
import os

import tensorflow as tf

from tf_twobranch.errors import ConfigError

__all__ = ["STRATEGIES", "get_strategy", "cluster_resolver", "is_multi_worker", "is_chief",
           "num_replicas", "cross_replica_concat", "local_row_offset", "global_count",
           "replica_share", "split_global_batch", "distribute_global_batches", "distributed_stream",
           "without_autotuning", "keras_logs"]


STRATEGIES = ("default", "mirrored", "multi_worker", "tpu")


def get_strategy(name: str = "default") -> tf.distribute.Strategy:
    """One flag selects the distribution strategy."""
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker":
        if "TF_CONFIG" not in os.environ:
            raise ConfigError("strategy=multi_worker needs the TF_CONFIG environment variable "
                              "(cluster spec and this worker's task)")
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except (ValueError, tf.errors.NotFoundError) as e:
            raise ConfigError(f"strategy=tpu: no TPU available here ({e})") from None
        return tf.distribute.TPUStrategy(resolver)
    raise ConfigError(f"unknown strategy {name!r}; expected one of {STRATEGIES}")


def cluster_resolver(strategy: tf.distribute.Strategy | None):
    """The cluster resolver of a multi-worker strategy; None for any other strategy."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    return getattr(strategy, "cluster_resolver", None)


def _chief_of(task_type: str | None, task_id: int | None, cluster: dict) -> bool:
    if not task_type:
        return True  # not part of a cluster
    if task_type == "chief":
        return True
    return task_type == "worker" and not task_id and "chief" not in cluster


def is_multi_worker(strategy: tf.distribute.Strategy | None) -> bool:
    """True under a `MultiWorkerMirroredStrategy` whose cluster has several workers."""
    resolver = cluster_resolver(strategy)
    if resolver is None:
        return False
    cluster = resolver.cluster_spec().as_dict()
    return sum(len(cluster.get(k, ())) for k in ("chief", "worker")) > 1


def is_chief(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether this process writes the run directory.

    Under a multi-worker strategy: task type "chief", or worker 0 when the
    cluster has no chief (`strategy.cluster_resolver`).  Without a strategy
    the `TF_CONFIG` environment variable decides (no TF_CONFIG: chief).
    Every other strategy runs in one process, which is the chief.
    """
    if strategy is not None:
        resolver = cluster_resolver(strategy)
        if resolver is None:
            return True
        return _chief_of(resolver.task_type, resolver.task_id,
                         resolver.cluster_spec().as_dict())
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return True
    try:
        tf_config = json.loads(raw)
        task = tf_config.get("task") or {}
        return _chief_of(task.get("type"), task.get("index"), tf_config.get("cluster") or {})
    except (json.JSONDecodeError, AttributeError):
        raise ConfigError(f"TF_CONFIG is not a JSON object with 'cluster' and 'task': "
                          f"{raw[:200]!r}") from None


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


# ---------------------------------------------------------------------------
# Input side: one global batch of indices, split into equal per-replica rows.
# ---------------------------------------------------------------------------

# Batch keys whose leading axis runs over the rows one tower embeds; every
# other key (label matrices, masks over pairs of the global batch) stays
# global, because the loss is computed on the gathered embeddings.
IMAGE_ROW_KEYS = ("image_index", "region_index", "image")
TEXT_ROW_KEYS = ("text_index", "phrase_index", "text")


def _row_slice(value, num_slices: int, slice_id, key: str):
    rows = value.shape[0]
    if rows is None:
        rows_t = tf.shape(value)[0]
        size = rows_t // num_slices
        tf.debugging.assert_equal(rows_t % num_slices, 0, message=(
            f"batch key {key!r}: rows not divisible by the number of replicas"))
    else:
        if rows % num_slices:
            raise ConfigError(
                f"batch key {key!r} has {rows} rows, not divisible by the "
                f"{num_slices} replicas; choose a batch size that is a multiple of the "
                f"number of replicas")
        size = rows // num_slices
    start = slice_id * size
    return value[start:start + size]


def split_global_batch(batch: dict, num_slices: int, slice_id) -> dict:
    """The rows of a global index batch that replica `slice_id` embeds.

    Tower-input keys (`IMAGE_ROW_KEYS`, `TEXT_ROW_KEYS`) are cut into
    `num_slices` equal consecutive blocks; everything else is kept whole.
    Concatenating the replicas' tower outputs in replica order
    (`cross_replica_concat`) restores the global batch's row order, so the
    global label matrices and masks apply unchanged.
    """
    if num_slices == 1:
        return batch
    row_keys = IMAGE_ROW_KEYS + TEXT_ROW_KEYS
    return {k: (_row_slice(v, num_slices, slice_id, k) if k in row_keys else v)
            for k, v in batch.items()}


def without_autotuning(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` without tf.data's autotuning thread: every training stream, and the
    long evaluation passes that are iterated like one (the dual path's test images).

    TensorFlow 2.21 deletes an autotuned iterator only after its autotuning
    thread (`Model::OptimizeLoop`) wakes from its timed wait, which the deletion
    does not interrupt; the wait doubles with the iterator's age up to a minute.
    Every `fit` on an infinite stream ends by deleting its iterator, so each
    training call ended with 0-45 s of nothing (seen at the end of the main
    job's rows: BUILD_NOTES "Session 19"). Without autotuning, an AUTOTUNE
    `num_parallel_calls` is TensorFlow's default parallelism (one call per
    core, at most 16) and the elements are the same.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def distributed_stream(strategy: tf.distribute.Strategy, global_batches_fn, attach_fn=None):
    """``start_step -> distributed dataset``, the form `trainer.train` resumes from.

    `global_batches_fn(start_step)` gives the global index batches from
    `start_step` on; see `distribute_global_batches`.
    """
    def stream(start_step: int = 0):
        return distribute_global_batches(strategy, lambda: global_batches_fn(start_step),
                                         attach_fn)
    return stream


def distribute_global_batches(strategy: tf.distribute.Strategy, global_batches_fn,
                              attach_fn=None):
    """A distributed dataset: every replica gets its rows of each global batch.

    Args:
      strategy: the `tf.distribute` strategy training runs under.
      global_batches_fn: ``() -> tf.data.Dataset`` of global index batches —
        a deterministic function of the step (the samplers in
        `tf_twobranch.sampling`), so every worker builds the same stream and
        nothing is duplicated or dropped: replica r of the cluster takes block
        r of every global batch.
      attach_fn: optional ``dataset -> dataset`` that loads the replica's
        rows (e.g. `sampling.attach_features`), applied after the split so a
        worker only reads the features of its own rows.

    Returns the dataset itself under a single-replica strategy; either way the
    pipelines run `without_autotuning`.
    """
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        ds = global_batches_fn()
        return without_autotuning(attach_fn(ds) if attach_fn is not None else ds)

    def dataset_fn(ctx: tf.distribute.InputContext):
        local = replicas // ctx.num_input_pipelines
        first = ctx.input_pipeline_id * local

        # Replicas of one worker take consecutive elements of its dataset,
        # so each global batch becomes `local` elements, in replica order.
        def slices(batch):
            parts = [split_global_batch(batch, replicas, first + j) for j in range(local)]
            return tf.data.Dataset.from_tensors(parts[0]) if local == 1 else \
                tf.data.Dataset.from_tensor_slices(
                    {k: tf.stack([p[k] for p in parts]) for k in parts[0]})

        ds = global_batches_fn().flat_map(slices)
        if attach_fn is not None:
            ds = attach_fn(ds)
        return without_autotuning(ds)

    options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    return strategy.distribute_datasets_from_function(dataset_fn, options=options)


def keras_logs(logs: dict) -> dict:
    """`train_step` logs in the shape Keras can reduce under every strategy.

    Keras 3 reduces per-replica logs of a multi-worker strategy with
    ``strategy.reduce("MEAN", v, axis=0)``, which rejects scalars; a
    one-element vector reduces to the same scalar.
    """
    strategy = tf.distribute.get_strategy()
    multi_worker = (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
                    and strategy.extended._in_multi_worker_mode())  # noqa: SLF001
    if not multi_worker:
        return logs
    return {k: tf.reshape(v, [1]) for k, v in logs.items()}
