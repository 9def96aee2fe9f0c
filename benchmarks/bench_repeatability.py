"""Is a graph-mode training step repeatable under ``--deterministic``?

Session 21 found that op determinism alone did not make the dual path's graph-mode training
repeatable: with TensorFlow running independent ops side by side, the text CNN's gradients
sometimes differed in the last bits, and the run drifted from there. This benchmark shows it on
the real model: it runs the reference-code row's own pipeline (embedded data, scene CNN, model,
optimizer) up to training, takes ``--steps`` batches of its training stream, and then repeats
from the same weights and optimizer state: the compiled train function over the same batches,
every trainable and optimizer variable compared after each step with the first repeat's.

    python -m benchmarks.bench_repeatability [--repeats=10] [--steps=15]
        [--op_schedule=serial|parallel] [--optimizer=in_place|keras]

``serial`` is what ``--deterministic`` does (one inter-op thread); ``parallel`` leaves TensorFlow's
default schedule. ``keras`` swaps `InPlaceSGD` for Keras' SGD (the same values when repeatable).
Prints, per repeat, ``same`` or the first step and variables that differ, then the count.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

ROW = "experiments/configs/dual_path_reference_code_flickr30k.cfg"


class _Done(Exception):
    pass


def _repeat(args, result: dict):
    import tensorflow as tf

    def train(model, dataset, cfg, run_dir, *, steps_per_epoch, **_):
        iterator = iter(dataset(0))
        batches = [next(iterator) for _ in range(args.steps)]
        variables = model.trainable_variables
        model.make_train_function()
        model.optimizer.build(variables)
        tracked = list(variables) + list(model.optimizer.variables)
        state = list(model.variables) + list(model.optimizer.variables)
        start = [v.numpy() for v in state]
        names = [v.path for v in tracked]
        stream = tf.data.Dataset.from_tensors(batches[0])
        for b in batches[1:]:
            stream = stream.concatenate(tf.data.Dataset.from_tensors(b))
        first, differing = None, 0
        began = time.perf_counter()
        for repeat in range(args.repeats):
            for v, value in zip(state, start):
                v.assign(value)
            it = iter(stream)
            trace = []
            for _ in batches:
                model.train_function(it)
                trace.append([hashlib.sha1(v.numpy().tobytes()).digest() for v in tracked])
            if first is None:
                first = trace
                print(f"repeat 0: reference ({len(tracked)} variables, {args.steps} steps)", flush=True)
                continue
            where = next(((k, [n for n, a, b in zip(names, ra, rb) if a != b])
                          for k, (ra, rb) in enumerate(zip(first, trace)) if ra != rb), None)
            if where is None:
                print(f"repeat {repeat}: same", flush=True)
            else:
                differing += 1
                step, changed = where
                print(f"repeat {repeat}: differs from step {step} on: {len(changed)} variables, "
                      f"first {changed[:3]}", flush=True)
        result.update(differing=differing, compared=args.repeats - 1,
                      seconds=time.perf_counter() - began,
                      inter_op_threads=tf.config.threading.get_inter_op_parallelism_threads())
        raise _Done

    return train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--op_schedule", choices=["serial", "parallel"], default="serial")
    parser.add_argument("--optimizer", choices=["in_place", "keras"], default="in_place")
    parser.add_argument("--run_dir", default="/tmp/bench_repeatability")
    args = parser.parse_args(argv)

    from absl import app

    from experiments import dual_path
    from tf_twobranch.cli import parse_flags
    from tf_twobranch.systems.dual_path import pipeline
    from tf_twobranch.training import trainer

    result: dict = {}
    trainer.train = _repeat(args, result)
    if args.op_schedule == "parallel":
        trainer.serialize_op_scheduling = lambda: False
    if args.optimizer == "keras":
        import keras
        pipeline.InPlaceSGD = keras.optimizers.SGD
    dual_path.define_flags()
    flag_argv = [sys.argv[0], f"--flagfile={ROW}", "--optimizer=sgd", "--stages=1", "--deterministic",
                 "--verbose=0", "--noexport", f"--run_dir={args.run_dir}"]
    try:
        app.run(dual_path.main, argv=flag_argv, flags_parser=parse_flags)
    except _Done:
        pass
    if not result:
        print("the row ended before training (see its log above)")
        return 1
    print(f"op schedule {args.op_schedule} (inter-op threads {result['inter_op_threads'] or 'default'}), "
          f"optimizer {args.optimizer}: {result['differing']} of {result['compared']} repeats differ "
          f"from the first ({args.steps} steps each, {result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
