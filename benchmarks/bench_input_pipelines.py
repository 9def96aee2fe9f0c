"""Training-batch pipelines of the fragment and N-pair systems at Flickr30K size: batches/s against the step.

Run from the repository root:

    python -m benchmarks.bench_input_pipelines [--images 29783] [--batches 60] [--warmup 5]
        [--work_dir /tmp/tf_twobranch_bench_pipelines] [--systems fragments,npair] [--keep]

Why: on the first GPU machine (an H100, session 18, `BUILD_NOTES.md`) both systems trained at
~93 ms (fragments) and ~81–99 ms (N-pair) per step with the GPU busy 5 % and 7–13 % of the time:
their `tf.data` pipelines read one batch at a time (``num_parallel_calls=1``), so the step waited
for the CPU. This benchmark times the real pipelines (`fragment_batches.train_dataset`,
`npair_batches.train_dataset`) alone, at the real sizes, memory-mapped float16 storage as at
Flickr30K / COCO scale (random rows written by `benchmarks.scale_data`; fragments
(N, 20, 4096) with 5 sentences per image padded to 30 fragments; N-pair (N, 14, 14, 512) maps with
5 captions of 22 tokens), four ways in the same process: as before (rows widened to float32 by
numpy inside the read, one batch in flight), with the graph cast (`row_gather.gather_op` now reads
float16 rows as they are and casts in TensorFlow) one batch at a time, as now (graph cast,
``AUTOTUNE`` batches in flight, tf.data's autotuning off as the trainer runs every stream:
`distribute.without_autotuning`), and the same with autotuning on (session 18's figures); and checks
that all four give the same batches.

Printed per system: batches/s, image bytes gathered per second, and the ratios to before.
'Keeps up' needs batches/s ≥ steps/s of the step it feeds (the GPU step was ~5–10 ms, so ≥ 100
batches/s there; a 2-core CPU step is far slower than either pipeline).
Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import time

import numpy as np

from tf_twobranch.data.formats import row_arrays
from tf_twobranch.distribute import without_autotuning
from tf_twobranch.systems.fragments import sampling as fragment_batches
from tf_twobranch.systems.npair import sampling as npair_batches

from benchmarks import common, scale_data


def _memmap(path: pathlib.Path, shape, seed: int) -> np.ndarray:
    if not path.exists():
        scale_data.write_random_rows(path, shape, "float16", seed, nonnegative=True, scale=0.05)
    return row_arrays.open_rows(path)


class NumpyWidened:
    """The gather before session 18: float16 rows widened to float32 by numpy inside the read."""

    def __init__(self, rows):
        self.rows, self.shape, self.dtype = rows, rows.shape, np.dtype(np.float32)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return np.asarray(self.rows[index], np.float32)


def fragment_pipeline(work: pathlib.Path, images: int, parallel, old_read=False):
    fragments = _memmap(work / "fragments.npy", (images, 20, 4096), 1)
    fragments = NumpyWidened(fragments) if old_read else fragments
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 31, size=5 * images)
    row_splits = np.concatenate([[0], np.cumsum(lengths)])
    total = int(row_splits[-1])
    sentences = fragment_batches.padded_sentence_arrays(
        rng.integers(0, 15, total), rng.integers(0, 8000, total), rng.integers(0, 8000, total), row_splits)
    caption_image = np.repeat(np.arange(images), 5)
    return fragment_batches.train_dataset(fragments, np.ones((images, 20), bool), sentences, caption_image,
                                          batch_size=100, seed=0, parallel_batches=parallel), 100 * 20 * 4096 * 2


def npair_pipeline(work: pathlib.Path, images: int, parallel, old_read=False):
    maps = _memmap(work / "maps.npy", (images, 14, 14, 512), 2)
    maps = NumpyWidened(maps) if old_read else maps
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 8000, size=(5 * images, 22)).astype(np.int32)
    mask = np.arange(22)[None, :] < rng.integers(5, 23, size=5 * images)[:, None]
    caption_image = np.repeat(np.arange(images), 5)
    return npair_batches.train_dataset(maps, tokens, mask, caption_image, np.ones(5 * images, bool),
                                       batch_size=64, seed=0, parallel_batches=parallel), 64 * 14 * 14 * 512 * 2


PIPELINES = {"fragments": fragment_pipeline, "npair": npair_pipeline}


def time_pipeline(dataset, batches: int, warmup: int):
    iterator = iter(dataset)
    first = [next(iterator) for _ in range(warmup)]
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return time.perf_counter() - start, first


def _paper_size_model(system: str):
    """The family's model at the paper's sizes (random weights, plain SGD), fed by `PIPELINES[system]`."""
    import keras

    if system == "fragments":
        from tf_twobranch.systems.fragments.model import FragmentEmbeddingConfig, build_fragment_model
        model = build_fragment_model(FragmentEmbeddingConfig(image_dim=4096, num_relations=15,
                                                             vocabulary_size=8000))
    else:
        from tf_twobranch.systems.npair.model import NPairLocalizationConfig, build_npair_model
        model = build_npair_model(NPairLocalizationConfig(vocabulary_size=8000, map_channels=512))
    # As the experiments compile it: no XLA unless asked, SGD with momentum.
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), jit_compile=False)
    return model


def _steps_per_second(model, dataset, steps: int, warmup: int) -> float:
    """1 / the median step of the compiled train function reading `dataset` (as `fit` runs it),
    each step timed alone after `warmup` untimed ones (`common.time_train_steps`)."""
    iterator = iter(dataset)
    model.make_train_function()
    timed = common.time_train_steps(model.train_function, lambda: iterator, steps=steps, warmup=warmup)
    return 1.0 / timed["step_seconds_median"]


def fed_child(system: str, images: int, work_dir: str, batches: int = 30, steps: int = 6,
              warmup: int = 2, pipeline_warmup: int = 3) -> dict:
    """Does the family's training stream keep up with its step? (run_all's input rows.)

    In one process, at the paper's batch and row sizes on `images` random float16 memory-mapped
    training images: the pipeline alone (batches/s, as the trainer runs it: `AUTOTUNE` batches,
    autotuning off), the model's step on one batch repeated from memory (steps/s), and the step fed
    by the pipeline as `trainer.train` feeds it (steps/s). It keeps up when its batches/s >= the
    fixed-batch steps/s; the fed step then runs near the fixed-batch rate. The rows are written just
    before they are read, so they come from the page cache (as a data set that fits in RAM would).
    """
    import tensorflow as tf

    work = pathlib.Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    dataset, image_bytes = PIPELINES[system](work, images, None)
    dataset = without_autotuning(dataset)
    seconds, first = time_pipeline(dataset, batches, pipeline_warmup)
    model = _paper_size_model(system)
    fixed = without_autotuning(tf.data.Dataset.from_tensors(first[0]).repeat())
    return {"system": system, "images": images, "batches_per_second": batches / seconds,
            "image_bytes_per_batch": image_bytes,
            "steps_per_second_fixed": _steps_per_second(model, fixed, steps, warmup),
            "steps_per_second_fed": _steps_per_second(model, dataset, steps, warmup),
            "loadavg": os.getloadavg()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=29_783)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--systems", default="fragments,npair")
    parser.add_argument("--work_dir", default="/tmp/tf_twobranch_bench_pipelines")
    parser.add_argument("--keep", action="store_true", help="Keep the memory-mapped files for a later run.")
    args = parser.parse_args(argv)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_input_pipelines: {args.images} training images, float16 memory-mapped storage, "
          f"{args.batches} batches after {args.warmup}; machine: {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    for system in args.systems.split(","):
        rows = {}
        # The last two differ in tf.data's autotuning only: the trainer turns it off
        # (`distribute.without_autotuning`), session 18 measured it on.
        for label, parallel, old_read, stream in (
                ("before: numpy widening, serial", 1, True, without_autotuning),
                ("graph cast, serial", 1, False, without_autotuning),
                ("graph cast, AUTOTUNE (default)", None, False, without_autotuning),
                ("the same, tf.data autotuning on", None, False, lambda ds: ds)):
            start = time.perf_counter()
            dataset, image_bytes = PIPELINES[system](work, args.images, parallel, old_read)
            dataset = stream(dataset)
            built = time.perf_counter() - start
            seconds, first = time_pipeline(dataset, args.batches, args.warmup)
            rate = args.batches / seconds
            rows[label] = {"batches_per_s": rate, "first": first}
            print(f"  {system:9s} {label:30s}: {rate:7.1f} batches/s, {rate * image_bytes / 1e9:5.2f} GB/s of "
                  f"float16 image rows (pipeline built in {built:.1f} s)", flush=True)
        a, b, c, d = rows.values()
        same = all(all(np.array_equal(w[k].numpy(), x[k].numpy()) for x in others for k in w)
                   for w, *others in zip(a["first"], b["first"], c["first"], d["first"]))
        print(f"  {system:9s} default / before: {c['batches_per_s'] / a['batches_per_s']:.2f}x (graph cast alone "
              f"{b['batches_per_s'] / a['batches_per_s']:.2f}x; autotuning off / on "
              f"{c['batches_per_s'] / d['batches_per_s']:.2f}x); the same batches in the same order: {same}",
              flush=True)
        results[system] = {label: row["batches_per_s"] for label, row in rows.items()}
        results[system]["same_batches"] = same
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
