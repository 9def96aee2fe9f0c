"""Latency and memory of the `retrieve_*` signatures on a COCO-5K-size gallery (issue 25).

Run from the repository root:

    python -m benchmarks.bench_retrieve [--images 5000 --captions_per_image 5 --dim 512]
        [--queries 200 --batch 256] [--out_json benchmarks/results/retrieve.json]

A two-branch embedding model on features (the paper's 4096-d image and
6000-d text features by default, 2048-wide hidden layers, `--dim` embedding)
is exported with a gallery of `--images` images and `--images ×
--captions_per_image` captions and loaded back as TF Serving would load it.
Printed:

* single-query latency, p50 and p99 over `--queries` requests, for
  ``retrieve_captions`` (an image query against the caption gallery) and
  ``retrieve_images`` (a caption query against the image gallery), k = 10;
* the gallery scoring's cost: a batch of `--batch` queries through
  ``retrieve_*`` minus the same batch through ``embed_*`` (the query's own
  tower), as a ratio to one float32 `tf.matmul` of the same multiply-adds
  (target: ≤ 1.5), each the best of 5 runs, taken alternately;
* the process's peak RSS growth over the export and the serving.

Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import pathlib
import resource
import tempfile
import time

import numpy as np

from tf_twobranch.json_files import write_json


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _best(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _latencies(fn, queries) -> np.ndarray:
    seconds = []
    for q in queries:
        start = time.perf_counter()
        fn(q)
        seconds.append(time.perf_counter() - start)
    return np.array(seconds)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions_per_image", type=int, default=5)
    parser.add_argument("--image_dim", type=int, default=4096)
    parser.add_argument("--text_dim", type=int, default=6000)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--out_json", default="")
    args = parser.parse_args(argv)

    import tensorflow as tf

    from tf_twobranch.systems.two_branch.export import export_saved_model
    from tf_twobranch.export.retrieval_signatures import RetrievalGallery
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

    start_rss = _peak_rss_mib()
    rng = np.random.default_rng(0)
    num_captions = args.images * args.captions_per_image
    model = build_model(TwoBranchConfig(image_dim=args.image_dim, text_dim=args.text_dim,
                                        image_hidden=(args.hidden,), text_hidden=(args.hidden,),
                                        embed_dim=args.dim, dropout=0.0))
    # Gallery embeddings as the towers give them (unit rows), without embedding
    # 25,000 random feature rows first.
    def unit(rows):
        x = rng.standard_normal((rows, args.dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)
    gallery = RetrievalGallery([str(i) for i in range(args.images)], unit(args.images),
                               [str(c) for c in range(num_captions)], unit(num_captions))
    with tempfile.TemporaryDirectory() as tmp:
        path = export_saved_model(model, pathlib.Path(tmp) / "export", gallery=gallery)
        loaded = tf.saved_model.load(str(path))
    retrieve_captions = loaded.signatures["retrieve_captions"]
    retrieve_images = loaded.signatures["retrieve_images"]
    embed_images = loaded.signatures["embed_images"]
    embed_texts = loaded.signatures["embed_texts"]
    k = tf.constant(args.k, tf.int32)

    image_queries = rng.standard_normal((args.queries, 1, args.image_dim)).astype(np.float32)
    text_queries = rng.standard_normal((args.queries, 1, args.text_dim)).astype(np.float32)
    for q in image_queries[:5]:
        retrieve_captions(image_features=tf.constant(q), k=k)
    for q in text_queries[:5]:
        retrieve_images(text_features=tf.constant(q), k=k)
    i2t = _latencies(lambda q: retrieve_captions(image_features=tf.constant(q), k=k), image_queries)
    t2i = _latencies(lambda q: retrieve_images(text_features=tf.constant(q), k=k), text_queries)

    batch_images = tf.constant(rng.standard_normal((args.batch, args.image_dim)).astype(np.float32))
    batch_texts = tf.constant(rng.standard_normal((args.batch, args.text_dim)).astype(np.float32))
    query = tf.constant(unit(args.batch))
    captions = tf.constant(gallery.caption_embeddings)
    images = tf.constant(gallery.image_embeddings)
    matmul = tf.function(lambda a, b: tf.matmul(a, b, transpose_b=True))
    sides = {}
    for name, retrieve, embed, inputs, gallery_rows in (
            ("retrieve_captions", retrieve_captions, embed_images, {"image_features": batch_images}, captions),
            ("retrieve_images", retrieve_images, embed_texts, {"text_features": batch_texts}, images)):
        retrieve(**inputs, k=k), embed(**inputs), matmul(query, gallery_rows).numpy()
        times = {"retrieve": [], "embed": [], "matmul": []}
        for _ in range(5):   # alternately, so a load change slows all three alike
            times["retrieve"].append(_best(lambda: retrieve(**inputs, k=k)["scores"].numpy(), 1))
            times["embed"].append(_best(lambda: list(embed(**inputs).values())[0].numpy(), 1))
            times["matmul"].append(_best(lambda: matmul(query, gallery_rows).numpy(), 1))
        best = {key: min(v) for key, v in times.items()}
        scoring = max(best["retrieve"] - best["embed"], 0.0)
        sides[name] = {"batch_seconds": best["retrieve"], "query_tower_seconds": best["embed"],
                       "scoring_seconds": scoring, "matmul_seconds": best["matmul"],
                       "scoring_over_matmul": scoring / best["matmul"],
                       "gallery_rows": int(gallery_rows.shape[0])}
    report = {
        "gallery": {"images": args.images, "captions": num_captions, "dim": args.dim},
        "k": args.k, "queries": args.queries, "batch": args.batch,
        "single_query_ms": {
            "retrieve_captions": {"p50": 1e3 * float(np.percentile(i2t, 50)), "p99": 1e3 * float(np.percentile(i2t, 99))},
            "retrieve_images": {"p50": 1e3 * float(np.percentile(t2i, 50)), "p99": 1e3 * float(np.percentile(t2i, 99))}},
        "batch_scoring": sides,
        "peak_rss_growth_mib": _peak_rss_mib() - start_rss,
    }
    print(f"gallery: {args.images} images, {num_captions} captions, d={args.dim}; k={args.k}")
    for name, q in report["single_query_ms"].items():
        print(f"  {name:18s} one query: p50 {q['p50']:.2f} ms, p99 {q['p99']:.2f} ms")
    for name, s in sides.items():
        print(f"  {name:18s} {args.batch} queries: scoring {1e3 * s['scoring_seconds']:.1f} ms vs one matmul "
              f"{1e3 * s['matmul_seconds']:.1f} ms = {s['scoring_over_matmul']:.2f}x (target <= 1.5); "
              f"query tower {1e3 * s['query_tower_seconds']:.1f} ms")
    print(f"  peak RSS growth: {report['peak_rss_growth_mib']:.0f} MiB")
    if args.out_json:
        write_json(args.out_json, report)
    return report


if __name__ == "__main__":
    main()
