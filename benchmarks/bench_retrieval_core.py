"""The evaluation core's cost at COCO 5K, as a ratio to one matmul pass of the same shape.

Run from the repository root:

    python -m benchmarks.bench_retrieval_core [--images 5000 --captions_per_image 5 --dim 512]
        [--repeats 5] [--out_json benchmarks/results/retrieval_core.json]

`ranks_from_embeddings` (the one evaluation core: image→text and text→image
ranks of every query) on random unit vectors, against one pass of float32
`tf.matmul` over the same caption windows (every image × 2,048 captions, the
scores copied out), timed alternately in one process (best of each per
round; the ratio is the median of the rounds, so a loaded machine slows both
sides alike). Also the old two-pass core (`group_ranks` once per
direction) for comparison. Target (issue 22): core / one matmul pass ≤ 1.25.
Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from tf_twobranch.json_files import write_json


def _unit_rows(rng, rows: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _best_seconds(fn, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions_per_image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="rounds (the ratio is their median)")
    parser.add_argument("--skip_two_pass", action="store_true")
    parser.add_argument("--out_json", default="")
    args = parser.parse_args(argv)

    import tensorflow as tf

    from tf_twobranch.evaluation import retrieval

    rng = np.random.default_rng(0)
    images = _unit_rows(rng, args.images, args.dim)
    texts = _unit_rows(rng, args.images * args.captions_per_image, args.dim)
    caption_image = np.repeat(np.arange(args.images), args.captions_per_image).astype(np.int32)
    window = retrieval.DEFAULT_CHUNK
    images_t = tf.constant(images)

    @tf.function
    def scores(a, b):
        return tf.matmul(a, b, transpose_b=True)

    def matmul_pass():
        for start in range(0, len(texts), window):
            scores(images_t, tf.constant(texts[start:start + window])).numpy()

    def core():
        return retrieval.ranks_from_embeddings(images, texts, caption_image)

    def two_pass():
        retrieval.group_ranks(images, texts, np.arange(args.images), caption_image)
        retrieval.group_ranks(texts, images, caption_image, np.arange(args.images))

    flops = 2.0 * len(images) * len(texts) * args.dim
    print(f"bench_retrieval_core: {len(images)} images x {len(texts)} captions, d={args.dim}, "
          f"windows of {window} captions; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    matmul_pass(), core()            # tracing and XLA compilation, not timed
    if not args.skip_two_pass:
        two_pass()
    rounds = []
    for k in range(args.repeats):
        row = {"matmul_s": _best_seconds(matmul_pass), "core_s": _best_seconds(core)}
        if not args.skip_two_pass:
            row["two_pass_s"] = _best_seconds(two_pass, 1)
        row["core_ratio"] = row["core_s"] / row["matmul_s"]
        if "two_pass_s" in row:
            row["two_pass_ratio"] = row["two_pass_s"] / row["matmul_s"]
        rounds.append(row)
        extra = (f", old two-pass core {row['two_pass_s']:.3f} s ({row['two_pass_ratio']:.2f}x)"
                 if "two_pass_s" in row else "")
        print(f"  round {k + 1}: one matmul pass {row['matmul_s']:.3f} s ({flops / row['matmul_s'] / 1e9:.0f} "
              f"GFLOP/s), core {row['core_s']:.3f} s ({row['core_ratio']:.2f}x){extra}", flush=True)
    ratio = float(np.median([r["core_ratio"] for r in rounds]))
    result = {"images": len(images), "captions": len(texts), "dim": args.dim, "rounds": rounds,
              "core_ratio_median": ratio, "pass": ratio <= 1.25}
    if not args.skip_two_pass:
        result["two_pass_ratio_median"] = float(np.median([r["two_pass_ratio"] for r in rounds]))
    print(f"  core / one matmul pass: median {ratio:.2f}x  [{'PASS' if ratio <= 1.25 else 'FAIL'}: <= 1.25]"
          + (f"; old two-pass core {result['two_pass_ratio_median']:.2f}x" if "two_pass_ratio_median" in result
             else ""), flush=True)
    if args.out_json:
        write_json(args.out_json, result)
    return result


if __name__ == "__main__":
    main()
