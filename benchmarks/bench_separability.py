"""The dual path's evaluation at COCO 5K size: retrieval ranks + separability S over every pair.

Run from the repository root:

    python -m benchmarks.bench_separability [--images 5000 --captions_per_image 5 --dim 512]
        [--out_json benchmarks/results/separability.json]

In a fresh subprocess: random embeddings (the baseline RSS), then what
`pipelines.dual_path.evaluate` does with them — the evaluation core's ranks
(`ranks_from_embeddings`), the P/Q histograms over all images × captions
pairs (`separability.pair_similarity_histograms`, scored block by block) and
the Fig. 5 PNG. Prints the peak RSS growth over the baseline (target, issue 39:
≤ 1 GB at 5,000 × 25,000) and the histogram pass's time as a ratio to one
float32 numpy matmul pass over the same pairs, timed in the same process.
The former code gathered a 2,000,000-pair sample as two 2M × D float64
arrays: 2 × 2M × 512 × 8 B = 16.4 GB at D = 512.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from benchmarks import common


def _setup(images, captions_per_image, dim):
    import numpy as np

    from tf_twobranch.evaluation import retrieval

    # TensorFlow's import and first kernels belong to the baseline, not to the evaluation.
    retrieval.ranks_from_embeddings(np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32), np.arange(4))
    rng = np.random.default_rng(0)
    image_embeds = rng.standard_normal((images, dim)).astype(np.float32)
    caption_image = np.repeat(np.arange(images), captions_per_image)
    text_embeds = image_embeds[caption_image] + rng.standard_normal(
        (len(caption_image), dim)).astype(np.float32) * 4
    return image_embeds, text_embeds, caption_image


def _evaluate(state):
    import numpy as np

    from tf_twobranch.evaluation import retrieval
    from tf_twobranch.systems.dual_path import separability

    image_embeds, text_embeds, caption_image = state
    t0 = time.perf_counter()
    i2t, t2i = retrieval.ranks_from_embeddings(image_embeds, text_embeds, caption_image)
    t1 = time.perf_counter()
    histograms = separability.pair_similarity_histograms(image_embeds, text_embeds, caption_image)
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        s = separability.plot_similarity_histograms(histograms, f"{out}/h.png", title="benchmark")
    t3 = time.perf_counter()
    step = separability.DEFAULT_BLOCK_ELEMENTS // len(image_embeds)
    for start in range(0, len(text_embeds), step):  # one plain matmul pass over the same blocks
        np.matmul(text_embeds[start:start + step], image_embeds.T)
    t4 = time.perf_counter()
    metrics = retrieval.retrieval_metrics_from_ranks(i2t, t2i)
    return {"S": s, "rsum": metrics["rsum"], "negatives": histograms.num_negatives,
            "ranks_seconds": t1 - t0, "histogram_seconds": t2 - t1, "plot_seconds": t3 - t2,
            "matmul_pass_seconds": t4 - t3}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions_per_image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--out_json", default="benchmarks/results/separability.json")
    args = parser.parse_args(argv)
    report, lines, started = common.start_report(**vars(args))
    m = common.measure_peak_memory(_setup, _evaluate, (args.images, args.captions_per_image, args.dim),
                                   repeats=1)
    r = m["result"]
    report.update(peak_increase_bytes=m["cold_peak_bytes"], method=m["method"], **r)
    captions = args.images * args.captions_per_image
    lines += [f"{args.images:,} images x {captions:,} captions, D = {args.dim}: "
              f"{r['negatives']:,} negative pairs, S = {r['S']:.4f}, rsum {r['rsum']:.1f}",
              f"peak RSS growth over the embeddings: {common.fmt_bytes(m['cold_peak_bytes'])} "
              f"({m['method']}; target <= 1 GB)",
              f"ranks {r['ranks_seconds']:.1f} s, histograms {r['histogram_seconds']:.1f} s "
              f"({r['histogram_seconds'] / r['matmul_pass_seconds']:.2f}x one numpy matmul pass of "
              f"{r['matmul_pass_seconds']:.1f} s), PNG {r['plot_seconds']:.1f} s"]
    common.finish_report(report, lines, started, args.out_json)


if __name__ == "__main__":
    main()
