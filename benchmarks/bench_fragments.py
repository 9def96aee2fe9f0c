"""S_kl evaluation of the fragment model (Karpathy et al. 2014, eq. 6) at paper size.

    python -m benchmarks.bench_fragments [--images=1000] [--sentences=5000] [--repeats=2]
        [--cases="real repeats,all distinct"]

At COCO 5K size (issue 22: S_kl ≤ 5 min, ≤ 8 GB): ``--images=5000
--sentences=25000 --repeats=1`` (the 5,000 Flickr8K test captions, then
20,000 training captions).

1,000 test images × 5,000 sentences, 20 image fragments per image, h = 1000,
and the real sentence fragments of the 5,000 Flickr8K test captions: the kept
triplets (1 % relation filter, prepositions collapsed) of the spaCy parses in
../shared/realdata, each distinct triplet one random h-d vector (a sentence
fragment is a function of its triplet alone, so repeated triplets embed to
identical rows, as with a trained model). Times the whole evaluation
(`evaluate_fragment_retrieval`: S_kl through the evaluation core, ranks both
ways) and its peak memory, twice: with the real repeats, and with every
fragment distinct (the worst case: nothing to share). The machine-independent
figure is the ratio to one float32 matmul with the multiply-adds of the
undeduplicated double sum, measured in the same run.

Targets (issue 10): ≤ 10 s and ≤ 1 GB. Without ../shared/realdata the
lengths are a fixed Poisson(8.4) + 1 draw and only the worst case is run.
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np

from benchmarks import common

REAL = pathlib.Path(__file__).resolve().parents[2] / "shared" / "realdata" / "flickr8k"


def sentence_fragment_ids(num_sentences: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(fragments per caption, triplet id of each fragment or None, source) of the test captions."""
    conllu, tokens = REAL / "Flickr8k.token.conllu", REAL / "Flickr8k.token.txt"
    test_list = REAL / "Flickr_8k.testImages.txt"
    if conllu.exists() and tokens.exists() and test_list.exists():
        from tf_twobranch.data.formats import read_token_file
        from tf_twobranch.data.formats.conllu import read_conllu
        from tf_twobranch.systems.fragments.sentence_fragments import (caption_trees, frequent_relations,
                                                          relation_counts, tree_triplets)
        corpus = read_token_file(tokens)
        trees = caption_trees(read_conllu(conllu), corpus, conllu)
        fragments = [tree_triplets(t, collapse_prepositions=True) for t in trees]
        kept = set(frequent_relations(relation_counts(fragments)))
        test = {line.strip().rsplit(".", 1)[0] for line in test_list.read_text().split()}
        chosen = [i for i, k in enumerate(corpus.caption_image) if corpus.image_ids[k] in test]
        in_test = set(chosen)
        chosen += [i for i in range(len(fragments)) if i not in in_test]
        triplets = [[t for t in fragments[i] if t.relation in kept] for i in chosen[:num_sentences]]
        index: dict = {}
        ids = np.array([index.setdefault(t, len(index)) for caption in triplets for t in caption], np.int64)
        return (np.array([len(c) for c in triplets]), ids,
                "Flickr8K test captions' spaCy parses, 1 % filter, collapsed prepositions")
    rng = np.random.default_rng(seed)
    return rng.poisson(8.4, num_sentences) + 1, None, "Poisson(8.4) + 1 (no ../shared/realdata)"


def _setup(num_images, fragments, h, seed, lengths, ids):
    # TensorFlow comes in here, in the measuring process, before the memory
    # baseline is taken; the inputs are the embedded fragments, as the
    # experiment holds them before it evaluates. `ids` None: every fragment distinct.
    import tf_twobranch.systems.fragments.retrieval  # noqa: F401
    rng = np.random.default_rng(seed)
    if ids is None:
        ids = np.arange(int(lengths.sum()))
    splits = np.concatenate([[0], np.cumsum(lengths)])
    v = (rng.normal(size=(num_images, fragments, h)) / np.sqrt(h)).astype(np.float32)
    mask = np.ones((num_images, fragments), bool)
    s = rng.normal(size=(int(ids.max(initial=-1)) + 1, h)).astype(np.float32)[ids]
    caption_image = np.arange(len(lengths)) * num_images // len(lengths)
    return v, mask, s, splits, caption_image


def _run(state):
    from tf_twobranch.systems.fragments.retrieval import evaluate_fragment_retrieval
    return evaluate_fragment_retrieval(*state)["rsum"]


# The reference matmul is timed on a slab of at most this many rows x columns and scaled by
# its multiply-adds: at COCO 5K the whole product (100,000 x 210,544 floats) would need 78 GiB.
_MATMUL_SLAB = (20_000, 50_000)


def _matmul_seconds(rows, inner, cols):
    # TensorFlow only in the spawned child.
    from tf_twobranch.speed import best_matmul_seconds
    slab_rows, slab_cols = min(rows, _MATMUL_SLAB[0]), min(cols, _MATMUL_SLAB[1])
    return best_matmul_seconds(slab_rows, inner, slab_cols) * (rows / slab_rows) * (cols / slab_cols)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--sentences", type=int, default=5000)
    parser.add_argument("--fragments", type=int, default=20)
    parser.add_argument("--dim", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per case (the first cold; 1 at COCO 5K size, where tracing is noise)")
    parser.add_argument("--cases", default="real repeats,all distinct",
                        help="comma-separated: 'real repeats' (a trained model's repeated triplets), "
                             "'all distinct' (the worst case)")
    args = parser.parse_args(argv)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    lengths, ids, source = sentence_fragment_ids(args.sentences)
    total_fragments = int(lengths.sum())
    # The parses are read once, here; each measuring process gets the ids.
    cases = {"real repeats": ids, "all distinct": None} if ids is not None else {"all distinct": None}
    cases = {name: case_ids for name, case_ids in cases.items() if name in wanted}
    matmul = common.run_in_subprocess(_matmul_seconds, args.images * args.fragments, args.dim,
                                      total_fragments)
    measured = {}
    for name, case_ids in cases.items():
        measured[name] = m = common.measure_peak_memory(
            _setup, _run, (args.images, args.fragments, args.dim, 0, lengths, case_ids), repeats=args.repeats)
        print(f"  measured {name}: {m['warm_seconds']:.2f} s, peak +{m['cold_peak_bytes'] / common.MiB:.0f} MiB",
              flush=True)
    flops = 2.0 * args.images * args.fragments * args.dim * total_fragments
    report = {
        "images": args.images, "sentences": args.sentences, "image_fragments": args.fragments,
        "h": args.dim, "sentence_fragments": total_fragments,
        "distinct_sentence_fragments": int(len(np.unique(ids))) if ids is not None else total_fragments,
        "fragments_per_sentence": total_fragments / args.sentences, "lengths_from": source,
        "empty_sentences": int((lengths == 0).sum()),
        "matmul_seconds_same_flops": matmul, "gflops_matmul": flops / matmul / 1e9,
        "cases": {name: {"seconds_warm": m["warm_seconds"], "seconds_cold": m["cold_seconds"],
                         # The first run's peak: later runs reuse what the allocator kept.
                         "peak_memory_mib": max(m["cold_peak_bytes"], m["warm_peak_bytes"]) / common.MiB,
                         "ratio_to_matmul": m["warm_seconds"] / matmul}
                  for name, m in measured.items()},
    }
    print(f"S_kl evaluation (evaluate_fragment_retrieval, ranks both ways): {args.images} images x "
          f"{args.sentences} sentences, {args.fragments} image fragments, h = {args.dim}, "
          f"{report['fragments_per_sentence']:.2f} fragments per sentence, "
          f"{report['distinct_sentence_fragments']} of {total_fragments} distinct ({source})")
    for name, case in report["cases"].items():
        print(f"  {name:13s}: time {case['seconds_warm']:.2f} s warm ({case['seconds_cold']:.2f} s cold), "
              f"peak memory +{case['peak_memory_mib']:.0f} MiB; "
              f"ratio to the matmul below {case['ratio_to_matmul']:.2f}x")
    print(f"  one float32 matmul of the double sum's multiply-adds: {matmul:.2f} s "
          f"({report['gflops_matmul']:.0f} GFLOP/s)")
    print(f"  machine: {common.machine_description().get('cpu_model', '?')}")
    return report


if __name__ == "__main__":
    main()
