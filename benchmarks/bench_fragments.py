"""S_kl evaluation of the fragment model (Karpathy et al. 2014, eq. 6) at paper size.

    python -m benchmarks.bench_fragments [--images=1000] [--sentences=5000]

1,000 test images × 5,000 sentences, 20 image fragments per image, h = 1000,
and the real number of sentence fragments per caption: the kept fragments
(1 % relation filter, prepositions collapsed) of the spaCy parses of
Flickr8K in ../shared/realdata (a fixed Poisson(8.4) + 1 draw when absent).
Prints the time and peak memory of the blocked S_kl computation
(`fragment_score_fn` under the evaluation core's caption windows) and, as
the machine-independent figure, its ratio to the time of one float32 matmul
with the same multiply-adds, measured in the same process.

Targets (issue 10): ≤ 10 s and ≤ 1 GB. The ratio is what carries across
machines; this 2-core VM without AVX-512 has ~50 GFLOP/s (BUILD_NOTES.md).
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np

from benchmarks import common

REAL = pathlib.Path(__file__).resolve().parents[2] / "shared" / "realdata" / "flickr8k"


def sentence_lengths(num_sentences: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """Kept fragments per caption: from the real Flickr8K parses when present."""
    conllu, tokens = REAL / "Flickr8k.token.conllu", REAL / "Flickr8k.token.txt"
    if conllu.exists() and tokens.exists():
        from tf_twobranch.data.formats import read_token_file
        from tf_twobranch.data.formats.conllu import read_conllu
        from tf_twobranch.data.sentence_fragments import (caption_trees, frequent_relations,
                                                          relation_counts, tree_triplets)
        trees = caption_trees(read_conllu(conllu), read_token_file(tokens), conllu)
        fragments = [tree_triplets(t, collapse_prepositions=True) for t in trees]
        kept = set(frequent_relations(relation_counts(fragments)))
        lengths = np.array([sum(t.relation in kept for t in f) for f in fragments])
        return lengths[:num_sentences], "Flickr8K spaCy parses, 1 % filter, collapsed prepositions"
    rng = np.random.default_rng(seed)
    return rng.poisson(8.4, num_sentences) + 1, "Poisson(8.4) + 1 (no ../shared/realdata)"


def _setup(num_images, num_sentences, fragments, h, seed):
    # TensorFlow comes in here, in the measuring process, before the memory
    # baseline is taken.
    from tf_twobranch.evaluation.fragment_retrieval import fragment_score_fn
    rng = np.random.default_rng(seed)
    lengths, _ = sentence_lengths(num_sentences, seed)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    v = (rng.normal(size=(num_images, fragments, h)) / np.sqrt(h)).astype(np.float32)
    mask = np.ones((num_images, fragments), bool)
    s = rng.normal(size=(int(splits[-1]), h)).astype(np.float32)
    return fragment_score_fn(v, mask, s, splits), num_sentences


def _run(state):
    from tf_twobranch.evaluation.retrieval import DEFAULT_CHUNK
    score, num_sentences = state
    total = 0.0
    for start in range(0, num_sentences, DEFAULT_CHUNK):
        total += float(score(start, min(num_sentences, start + DEFAULT_CHUNK)).sum())
    return total


def _matmul_seconds(rows, inner, cols):
    import time

    import tensorflow as tf
    a = tf.random.normal((rows, inner))
    b = tf.random.normal((inner, cols))
    tf.matmul(a, b).numpy()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        tf.matmul(a, b).numpy()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--sentences", type=int, default=5000)
    parser.add_argument("--fragments", type=int, default=20)
    parser.add_argument("--dim", type=int, default=1000)
    args = parser.parse_args(argv)
    lengths, source = sentence_lengths(args.sentences)
    total_fragments = int(lengths.sum())
    measured = common.measure_peak_memory(_setup, _run, (args.images, args.sentences, args.fragments,
                                                         args.dim, 0), repeats=2)
    matmul = common.run_in_subprocess(_matmul_seconds, args.images * args.fragments, args.dim,
                                      total_fragments)
    flops = 2.0 * args.images * args.fragments * args.dim * total_fragments
    report = {
        "images": args.images, "sentences": args.sentences, "image_fragments": args.fragments,
        "h": args.dim, "sentence_fragments": total_fragments,
        "fragments_per_sentence": total_fragments / args.sentences, "lengths_from": source,
        "empty_sentences": int((lengths == 0).sum()),
        "seconds_warm": measured["warm_seconds"], "seconds_cold": measured["cold_seconds"],
        "peak_memory_mib": measured["warm_peak_bytes"] / common.MiB,
        "matmul_seconds_same_flops": matmul,
        "ratio_to_matmul": measured["warm_seconds"] / matmul,
        "gflops_matmul": flops / matmul / 1e9,
    }
    print(f"S_kl evaluation: {args.images} images x {args.sentences} sentences, "
          f"{args.fragments} image fragments, h = {args.dim}, "
          f"{report['fragments_per_sentence']:.2f} fragments per sentence ({source})")
    print(f"  time {report['seconds_warm']:.2f} s warm ({report['seconds_cold']:.2f} s cold), "
          f"peak memory +{report['peak_memory_mib']:.0f} MiB")
    print(f"  one float32 matmul of the same multiply-adds: {matmul:.2f} s "
          f"({report['gflops_matmul']:.0f} GFLOP/s); ratio {report['ratio_to_matmul']:.2f}x")
    print(f"  machine: {common.machine_description().get('cpu_model', '?')}")
    return report


if __name__ == "__main__":
    main()
