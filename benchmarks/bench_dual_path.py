"""Benchmark of the dual-path CNN (Zheng et al. 2020): tower throughput and train steps.

Run from the repository root:

    python -m benchmarks.bench_dual_path [--quick] [--out_json benchmarks/results/dual_path.json]

Prints, at paper sizes (ResNet-50 at 224x224; text CNN "paper" layout,
width 64, max_len 32, word_dim 300; embed 2048; vocabulary 20,074; 29,783
classes = Flickr30K training images; batch 32):

1. forward (inference) throughput of the image CNN (images/s) and of the text
   CNN (sentences/s), float32 and mixed_bfloat16, next to the paper's ~119 ms
   per image batch and ~117 ms per sentence batch on a GTX 1080Ti;
2. the full training step (SGD momentum 0.9 through Keras' compiled train
   function): Stage II (everything trainable, ranking + both instance losses)
   and Stage I (image backbone frozen, instance losses only), float32 and
   mixed_bfloat16;
3. the `tf_twobranch.systems.dual_path.sampling.train_dataset` pipeline (real JPEGs
   of the embedded dataset, resize 256, random 224 crop, flip, position
   shift) in batches/s against the steps/s it has to feed.

Weights are random (no ImageNet file is needed for timing). Every figure is
the median of several timed calls after warm-up calls (tracing, oneDNN
primitive creation), each in a fresh spawn subprocess (`benchmarks.common`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from PIL import Image

from benchmarks import common
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.data.layout import resolve_dataset

# Zheng et al. §3, §5, §6.2 and Table 1 (Flickr30K: 29,783 training images,
# dictionary of 20,074 words).
PAPER_SIZES = dict(vocabulary_size=20074, num_classes=29783, image_size=224, text_width=64,
                   text_blocks=None, max_len=32, word_dim=300, hidden_dim=2048, embed_dim=2048,
                   batch_size=32)
# Smallest sizes that exercise the same code (smoke tests).
TOY_SIZES = dict(vocabulary_size=50, num_classes=10, image_size=32, text_width=4,
                 text_blocks=(1, 1, 1, 1), max_len=32, word_dim=8, hidden_dim=16, embed_dim=16,
                 batch_size=4)
# The paper's timings on one GTX 1080Ti (batch 32): ms per batch.
PAPER_MS_PER_BATCH = {"image": 119.0, "text": 117.0}
PRECISIONS = ("float32", "mixed_bfloat16")


def _quiet_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def dual_path_config(sizes: dict, stage: int = 2):
    """The `DualPathConfig` of `sizes` (PAPER_SIZES or TOY_SIZES) at `stage`."""
    # TensorFlow modules only inside the functions that run (in the spawn children, after
    # _quiet_tf): the parent that selects and reports benchmarks never imports TensorFlow.
    from tf_twobranch.systems.dual_path.model import DualPathConfig
    kw = {k: v for k, v in sizes.items() if k != "batch_size"}
    return DualPathConfig(stage=stage, **kw)


def _random_batch(sizes: dict, seed: int = 0) -> dict:
    import tensorflow as tf  # in the measuring child only (see dual_path_config)
    rng = np.random.default_rng(seed)
    b, s, length = sizes["batch_size"], sizes["image_size"], sizes["max_len"]
    lengths = rng.integers(8, min(length, 24) + 1, size=b)   # captions of 8-24 words
    ids = np.zeros((b, length), np.int32)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, sizes["vocabulary_size"], size=n)
    return {"image": tf.constant(rng.uniform(0, 255, (b, s, s, 3)).astype(np.float32)),
            "token_ids": tf.constant(ids),
            # distinct classes: every row is a different training image
            "label": tf.constant(rng.choice(sizes["num_classes"], size=b, replace=False)
                                 .astype(np.int32))}


# --- 1. forward throughput ---------------------------------------------------------

def forward_child(tower: str, precision: str = "float32", sizes: dict = PAPER_SIZES,
                  repeats: int = 5, warmup: int = 2) -> dict:
    """Inference time of one batch through the image CNN or the text CNN.

    Runs in the calling process (use `common.run_in_subprocess` for a clean
    one). Returns seconds per batch (median, all) and items/s.
    """
    _quiet_tf()
    # TensorFlow after _quiet_tf, in the measuring child only (see dual_path_config).
    import keras
    import tensorflow as tf
    from tf_twobranch.systems.dual_path import model as dual_path
    from tf_twobranch.speed import precision_scope

    keras.utils.set_random_seed(0)
    config = dual_path_config(sizes)
    batch = _random_batch(sizes)
    t0 = time.perf_counter()
    with precision_scope(precision):
        model = (dual_path.build_image_cnn(config) if tower == "image"
                 else dual_path.build_text_cnn(config))
    build_seconds = time.perf_counter() - t0
    x = batch["image"] if tower == "image" else batch["token_ids"]

    @tf.function
    def forward(inputs):
        return tf.cast(model(inputs, training=False), tf.float32)

    t0 = time.perf_counter()
    forward(x).numpy()
    first_seconds = time.perf_counter() - t0
    t = common.time_repeats(lambda: forward(x).numpy(), repeats=repeats, warmup=max(0, warmup - 1))
    return {"tower": tower, "precision": precision, "batch_size": sizes["batch_size"],
            "seconds_median": t["median"], "seconds_all": t["all"],
            "items_per_second": sizes["batch_size"] / t["median"],
            "first_call_seconds": first_seconds, "build_seconds": build_seconds,
            "parameters": int(model.count_params()), "loadavg": os.getloadavg()[0]}


# --- 2. training step ----------------------------------------------------------------

def step_child(stage: int, precision: str = "float32", sizes: dict = PAPER_SIZES,
               steps: int = 3, warmup: int = 1, learning_rate: float = 0.01) -> dict:
    """One `DualPathModel` training step (SGD momentum 0.9) on a fixed batch.

    Stage II: everything trainable, loss = rank + image instance + text
    instance. Stage I: the image backbone frozen (inference-mode BN), loss =
    the two instance losses.
    """
    _quiet_tf()
    # TensorFlow after _quiet_tf, in the measuring child only (see dual_path_config).
    import keras
    from tf_twobranch.systems.dual_path.model import DualPathModel
    from tf_twobranch.speed import precision_scope
    from tf_twobranch.training.in_place_sgd import InPlaceSGD

    keras.utils.set_random_seed(0)
    batch = _random_batch(sizes)
    t0 = time.perf_counter()
    with precision_scope(precision):
        model = DualPathModel(dual_path_config(sizes, stage=stage)).build_all()
    # XLA off as in the experiments (Keras' 'auto' would turn it on wherever a GPU is visible)
    # the experiment's optimizer (Keras' SGD values, the momentum update in place)
    model.compile(optimizer=InPlaceSGD(learning_rate, momentum=0.9), jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    model.make_train_function()
    build_seconds = time.perf_counter() - t0
    r = common.time_train_steps(model.train_function, lambda: iter([batch]), steps=steps,
                                warmup=warmup)
    # from the shapes: a .numpy() copy of W_share (0.9 GB at COCO) would be part of the peak measured
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return {"stage": stage, "precision": precision, "batch_size": sizes["batch_size"],
            **r, "examples_per_second": sizes["batch_size"] / r["step_seconds_median"],
            "build_seconds": build_seconds, "trainable_parameters": trainable,
            "parameters": int(model.count_params()), "loadavg": os.getloadavg()[0]}


# --- 3. input pipeline ----------------------------------------------------------------

def pipeline_child(sizes: dict = PAPER_SIZES, batches: int = 20, warmup: int = 3,
                   max_images: int | None = None, resize_to: int = 256) -> dict:
    """Batches/s of `train_dataset` on the embedded dataset's real JPEGs.

    Batches of `sizes["batch_size"]` images cropped to `sizes["image_size"]`
    (resize shorter side to `resize_to`, random crop, flip) with
    position-shifted captions, as the training stream of the experiments.
    """
    _quiet_tf()
    # These import TensorFlow: after _quiet_tf, in the measuring child only (see dual_path_config).
    from tf_twobranch.systems.dual_path.data import dual_path_data_from_retrieval
    from tf_twobranch.systems.dual_path import sampling

    t0 = time.perf_counter()
    dataset_dir = load_embedded_dataset()
    data = dual_path_data_from_retrieval(resolve_dataset(dataset_dir), split="train",
                                         max_len=sizes["max_len"], long_captions="clip",
                                         max_images=max_images, validate="header")
    train = sampling.train_dataset(data, batch_size=sizes["batch_size"], resize_to=resize_to,
                                   crop_size=sizes["image_size"], seed=0)
    load_seconds = time.perf_counter() - t0
    iterator = iter(train.dataset)
    t0 = time.perf_counter()
    first = next(iterator)
    first_seconds = time.perf_counter() - t0
    for _ in range(warmup):
        next(iterator)
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
    seconds = time.perf_counter() - t0
    shapes = {k: list(v.shape) for k, v in batch.items()}
    return {"dataset_dir": str(dataset_dir), "train_images": data.num_images,
            "source_image_size": _jpeg_size(data.image_paths[0]), "batch_shapes": shapes,
            "batch_bytes": int(sum(v.numpy().nbytes for v in first.values())),
            "batches": batches, "seconds": seconds, "batches_per_second": batches / seconds,
            "images_per_second": batches * sizes["batch_size"] / seconds,
            "first_batch_seconds": first_seconds, "load_seconds": load_seconds,
            "loadavg": os.getloadavg()[0]}


def _jpeg_size(path) -> list:
    with Image.open(path) as image:
        return list(image.size)


# --- orchestration -------------------------------------------------------------------------

def measure(quick: bool = False, sizes: dict = PAPER_SIZES, subprocess: bool = True) -> dict:
    """Every dual-path figure (forward, steps, pipeline) as one dict.

    `quick`: fewer repetitions, float32 only.
    `subprocess=False` runs in this process (smoke tests with TOY_SIZES).
    """
    run = common.run_in_subprocess if subprocess else (lambda fn, *a, **k: fn(*a, **k))
    precisions = PRECISIONS[:1] if quick else PRECISIONS
    out = {"sizes": dict(sizes), "forward": [], "steps": []}
    for precision in precisions:
        for tower in ("image", "text"):
            print(f"  dual path forward: {tower}, {precision} ...", file=sys.stderr, flush=True)
            out["forward"].append(run(forward_child, tower, precision, sizes, 3 if quick else 5,
                                      1 if quick else 2))
    for precision in precisions:
        for stage in (2, 1):
            print(f"  dual path step: Stage {stage}, {precision} ...", file=sys.stderr, flush=True)
            steps = (1 if stage == 2 else 2) if quick else 3
            out["steps"].append(run(step_child, stage, precision, sizes, steps, 1))
    print("  dual path input pipeline ...", file=sys.stderr, flush=True)
    out["pipeline"] = run(pipeline_child, sizes, 8 if quick else 20, 3)
    return out


def report_lines(result: dict) -> list[str]:
    """The dual-path tables (forward, steps + pipeline)."""
    sizes = result["sizes"]
    lines, rows = [], []
    for r in result["forward"]:
        paper_ms = PAPER_MS_PER_BATCH[r["tower"]]
        ms = 1000 * r["seconds_median"]
        rows.append([f"{r['tower']} CNN", r["precision"], ms, r["items_per_second"],
                     paper_ms, sizes["batch_size"] / paper_ms * 1000, f"{ms / paper_ms:.1f}x",
                     f"{r['parameters'] / 1e6:.2f}M"])
    lines.append(common.format_table(
        ["tower", "precision", "ms / batch", "items/s", "paper ms (1080Ti)", "paper items/s",
         "ours / paper", "params"], rows,
        title=f"Dual-path forward (inference), batch {sizes['batch_size']}: image CNN = ResNet-50 "
              f"at {sizes['image_size']}x{sizes['image_size']} + head; text CNN = paper layout, "
              f"width {sizes['text_width']}, max_len {sizes['max_len']}, word_dim "
              f"{sizes['word_dim']}; embed {sizes['embed_dim']}"))
    lines.append("")
    pipe = result.get("pipeline")
    rows = []
    for r in result["steps"]:
        steps_per_s = 1.0 / r["step_seconds_median"]
        keeps = ("yes" if pipe["batches_per_second"] >= steps_per_s else "NO") if pipe else ""
        rows.append([f"Stage {'I' if r['stage'] == 1 else 'II'}", r["precision"],
                     r["step_seconds_median"], r["step_seconds_min"], r["examples_per_second"],
                     steps_per_s, f"{r['trainable_parameters'] / 1e6:.1f}M", r["warmup_seconds"],
                     keeps])
    lines.append(common.format_table(
        ["step", "precision", "s/step", "min s", "pairs/s", "steps/s", "trainable",
         "warm-up s", "pipeline keeps up"], rows,
        title=f"Dual-path training step (SGD momentum 0.9, fixed batch of {sizes['batch_size']}, "
              f"{sizes['num_classes']:,} classes, vocabulary {sizes['vocabulary_size']:,}), "
              f"median after warm-up"))
    lines.append("  Stage II: all trainable, loss = ranking + image instance + text instance; "
                 "Stage I: ResNet-50 frozen (inference BN), loss = the two instance losses.")
    if pipe:
        lines.append(f"  train_dataset on the embedded dataset ({pipe['train_images']:,} real "
                     f"{pipe['source_image_size'][0]}x{pipe['source_image_size'][1]} JPEGs -> "
                     f"resize 256, random {sizes['image_size']} crop, flip; position-shifted "
                     f"captions): {pipe['batches_per_second']:.2f} batches/s "
                     f"({pipe['images_per_second']:.0f} images/s) alone, mean over "
                     f"{pipe['batches']} batches after 3 warm-up")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_json", default="benchmarks/results/dual_path.json")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    report, lines, started = common.start_report()
    report["dual_path"] = measure(quick=args.quick)
    lines.extend(report_lines(report["dual_path"]))
    common.finish_report(report, lines, started, args.out_json)


if __name__ == "__main__":
    # Subprocess targets must be importable by name, not as __main__.
    from benchmarks import bench_dual_path
    bench_dual_path.main()
