"""Checks that distributed training computes what one device computes.

Trains a small embedding network for a few steps on deterministic random
features under a chosen strategy and writes its final weights to an ``.npz``
file, with ``losses`` and ``num_replicas_in_sync`` (the number of replicas that
ran, also printed as ``replicas=N``).  Running it once with
``--strategy=default`` and once as two
`MultiWorkerMirroredStrategy` workers (``TF_CONFIG`` set per process) must
give the same weights: the in-batch ranking loss all-gathers the replicas'
embeddings, batch norm is synchronised, and each replica embeds a disjoint
block of every global batch (`tf_twobranch.distribute`).

Usage (one worker of two)::

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
                "task": {"type": "worker", "index": 0}}' \\
    python -m tf_twobranch.systems.two_branch.distributed_check --strategy=multi_worker --out=w0.npz

`--strategy=mirrored --cpu_replicas=2` splits this machine's CPU into two
logical devices, for a single-process check.

`--run_dir=DIR` trains through `trainer.train` (the path the experiments
take: checkpoints, mid-epoch backups, resume) with
`distribute.distributed_stream`; give every worker the same DIR (a shared
filesystem).  `--pause_after_step=N` then prints ``PAUSED step=N`` after the
step-N batch (and its backup) and sleeps, so that a test can SIGKILL the
workers there; the same command resumes from the backup.  Without
`--run_dir` it calls `model.fit` directly.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="default",
                   choices=["default", "mirrored", "multi_worker"])
    p.add_argument("--out", required=True, help="where to write the final weights (.npz)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch_images", type=int, default=8,
                   help="images per GLOBAL batch (each with --sample_size captions)")
    p.add_argument("--sample_size", type=int, default=2)
    p.add_argument("--model", default="embedding", choices=["embedding", "similarity"])
    p.add_argument("--cpu_replicas", type=int, default=1,
                   help="logical CPU devices for --strategy=mirrored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run_dir", default="",
                   help="train through trainer.train into this run directory (--steps is then "
                        "the steps per epoch)")
    p.add_argument("--epochs", type=int, default=1, help="epochs (with --run_dir)")
    p.add_argument("--backup_every_steps", type=int, default=0, help="(with --run_dir)")
    p.add_argument("--plain_dataset", action="store_true",
                   help="(with --run_dir) give train() plain tf.data global batches and let it "
                        "split them by replica, instead of distribute.distributed_stream")
    p.add_argument("--pause_after_step", type=int, default=0,
                   help="(with --run_dir) print PAUSED and sleep after this global step")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    # TensorFlow/Keras only after the arguments are parsed: --help and argument errors come fast.
    import keras
    import tensorflow as tf

    from tf_twobranch import distribute
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
    from tf_twobranch.systems.two_branch import sampling
    from tf_twobranch.training import trainer

    if args.cpu_replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.cpu_replicas)
    trainer.make_deterministic(args.seed)   # before the strategy starts TensorFlow: one op at a time
    strategy = distribute.get_strategy(args.strategy)
    rng = np.random.default_rng(args.seed)
    num_images, caps = 40, 5
    image_feats = rng.normal(size=(num_images, 12)).astype(np.float32)
    caption_image = np.repeat(np.arange(num_images), caps)
    text_feats = (image_feats[caption_image] @ rng.normal(size=(12, 10))
                  + 0.3 * rng.normal(size=(len(caption_image), 10))).astype(np.float32)
    config = TwoBranchConfig(kind=args.model, image_dim=12, text_dim=10, image_hidden=(16,),
                             text_hidden=(16,), embed_dim=8, dropout=0.0, top_k=3, margin=0.2,
                             similarity_head=(8,))
    with strategy.scope():
        model = build_model(config)
        model.build_all()
        model.compile(optimizer=keras.optimizers.SGD(0.5), xla_optimizer_update=False)

    if args.model == "embedding":
        def batches(start_step=0):
            return sampling.image_sentence_batches(caption_image, num_images,
                                                   batch_size=args.batch_images,
                                                   sample_size=args.sample_size, seed=args.seed,
                                                   start_step=start_step)
    else:
        def batches(start_step=0):
            return sampling.similarity_pair_batches(caption_image, num_images,
                                                    batch_size=args.batch_images, seed=args.seed,
                                                    start_step=start_step)

    def attach(ds):
        return sampling.attach_features(ds, image_feats, text_feats)

    if args.run_dir:
        stream = ((lambda start_step: attach(batches(start_step))) if args.plain_dataset else
                  distribute.distributed_stream(strategy, batches, attach))
        history = _train_through_trainer(args, model, strategy, stream)
    else:
        dataset = distribute.distribute_global_batches(strategy, batches, attach)
        history = model.fit(dataset, epochs=1, steps_per_epoch=args.steps, verbose=0, shuffle=False)
    weights = {f"{i:03d}_{v.path}": np.asarray(v.numpy()) for i, v in enumerate(model.weights)}
    # num_replicas_in_sync is recorded so that a check can assert how many replicas really
    # ran: equal weights alone would also come from a strategy silently left on one device.
    np.savez(args.out, losses=np.asarray(history.history["loss"]),
             num_replicas_in_sync=np.asarray(strategy.num_replicas_in_sync, np.int64), **weights)
    print(f"replicas={strategy.num_replicas_in_sync} loss={history.history['loss'][-1]:.6f} "
          f"inter_op_threads={tf.config.threading.get_inter_op_parallelism_threads()} -> {args.out}")
    if args.run_dir:
        print(f"resumed_from={json.dumps(history.resumed_from)}")
    return 0


def _train_through_trainer(args, model, strategy, stream):
    # Keras and the trainer (TensorFlow) stay out of the module top: --help comes fast.
    import keras

    from tf_twobranch.training import trainer

    class PauseAfterStep(keras.callbacks.Callback):
        # After the backup callback (train() puts extra callbacks last).
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step == args.pause_after_step:
                print(f"PAUSED step={step}", flush=True)
                time.sleep(3600)

    tcfg = trainer.TrainConfig(epochs=args.epochs, seed=args.seed, verbose=0,
                               backup_every_steps=args.backup_every_steps, deterministic=True)
    trainer.prepare_run_dir(args.run_dir, {"check": vars(args) | {"out": None,
                                                                   "pause_after_step": None}},
                            strategy)
    return trainer.train(model, stream, tcfg, args.run_dir, steps_per_epoch=args.steps,
                         extra_callbacks=[PauseAfterStep()] if args.pause_after_step else ())


if __name__ == "__main__":
    sys.exit(main())
