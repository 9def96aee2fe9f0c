"""Peak memory of the FV-HGLMM text features at Flickr30K size: the fit and the encoding of every caption.

Run from the repository root (issue 39, item 10):

    python -m benchmarks.bench_text_features [--captions 145000] [--pca_dim 6000]
        [--work_dir /tmp/tf_twobranch_bench_text] [--out_json benchmarks/results/text_features.json]

or, sampled from outside as one of `bench_scale`'s systems (N images = 5N captions):

    python -m benchmarks.bench_scale --systems text_features --sizes 29000

The captions are the real Flickr30K ones (``../shared/realdata/flickr30k/captions_multi30k.token``,
155,070 captions; dealt out again from the start when more are asked for), tokenised as the
experiments do. The steps are the user's path (`tf_twobranch.features.prepare`):
`fit_text_encoder` (300-d PPMI-SVD word vectors trained on the captions, as when no
``--word_vectors`` file is given; the 30-component HGLMM on the distinct words; the PCA
18000 -> 6000 on a sample of `FisherVectorEncoder.pca_max_sentences` captions) and
`write_sentence_features` (every caption's FV, PCA-projected, written block by block into a
``.npy`` row array and checked for NaN/inf).

Figures per step and for the whole: peak total RSS (VmHWM, reset between steps) and peak
anonymous RSS (RssAnon, sampled every 20 ms: what the process allocated, without pages of mapped
files). Target (the issue): the whole under 8 GB. Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import threading
import time

import numpy as np

from tf_twobranch import memory
from tf_twobranch.json_files import write_json

REALDATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "realdata"
CAPTIONS = REALDATA / "flickr30k" / "captions_multi30k.token"
FLICKR30K_CAPTIONS = 145_000
PEAK_TARGET_GB = 8.0


def real_captions(count: int, path: pathlib.Path = CAPTIONS) -> list[str]:
    """`count` real Flickr30K captions in file order (cycled when `count` exceeds the file's)."""
    if not path.is_file():
        raise SystemExit(f"bench_text_features needs the real captions {path} (shared/realdata beside the repo)")
    texts = [line.partition("\t")[2] for line in path.read_text(encoding="utf-8").splitlines() if "\t" in line]
    return [texts[i % len(texts)] for i in range(count)]


class PeakSampler:
    """Peak VmHWM and RssAnon (KiB) of this process per step; VmHWM is reset at each step."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.anon, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.anon = max(self.anon, memory.status_kib("self", ("RssAnon",)).get("RssAnon", 0))
            self._stop.wait(self.interval)

    def step(self) -> dict:
        """The peaks since the last step (MB), then resets them."""
        status = memory.status_kib("self")
        anon = max(self.anon, status.get("RssAnon", 0))
        figures = {"peak_rss_mb": max(status.get("VmHWM", 0), status.get("VmRSS", 0)) / 1024,
                   "peak_anon_mb": anon / 1024}
        memory.reset_peak_rss()
        self.anon = 0
        return figures

    def close(self):
        self._stop.set()
        self._thread.join()


def run(captions: int, pca_dim: int, work_dir: pathlib.Path, components: int = 30, word_dim: int = 300) -> dict:
    from tf_twobranch.data.tokenize import tokenize_caption
    from tf_twobranch.features.prepare import FeatureSpec, fit_text_encoder, write_sentence_features

    work_dir.mkdir(parents=True, exist_ok=True)
    sampler, steps, total = PeakSampler(), {}, {"peak_rss_mb": 0.0, "peak_anon_mb": 0.0}

    def done(name: str, started: float, **extra):
        figures = sampler.step()
        steps[name] = {**figures, "seconds": time.perf_counter() - started, **extra}
        for key in total:
            total[key] = max(total[key], figures[key])
        print(f"  {name:8s}: peak RSS {figures['peak_rss_mb']:7.0f} MB, peak anonymous RSS "
              f"{figures['peak_anon_mb']:7.0f} MB  ({steps[name]['seconds']:.0f} s)", flush=True)

    started = time.perf_counter()
    tokens = [tokenize_caption(c) for c in real_captions(captions)]
    done("tokens", started, words=int(sum(map(len, tokens))))
    spec = FeatureSpec(text_encoder="fisher_hglmm", word_dim=word_dim, fisher_components=components,
                       pca_dim=pca_dim)
    started = time.perf_counter()
    encoder = fit_text_encoder(spec, tokens)
    done("fit", started, fv_dim=encoder.fv_dim, output_dim=encoder.output_dim)
    started = time.perf_counter()
    out = work_dir / "text_features_train.npy"
    write_sentence_features(encoder, tokens, out, np.float32)
    done("encode", started, file_mb=out.stat().st_size / 2**20)
    sampler.close()
    out.unlink(missing_ok=True)
    passed = total["peak_rss_mb"] <= PEAK_TARGET_GB * 1024
    print(f"  whole   : peak RSS {total['peak_rss_mb'] / 1024:.2f} GB, peak anonymous RSS "
          f"{total['peak_anon_mb'] / 1024:.2f} GB for {captions} captions  "
          f"[{'PASS' if passed else 'FAIL'}: peak RSS <= {PEAK_TARGET_GB:.0f} GB]", flush=True)
    return {"captions": captions, "pca_dim": pca_dim, "components": components, "word_dim": word_dim,
            "steps": steps, **total, "pass": passed}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--captions", type=int, default=FLICKR30K_CAPTIONS)
    parser.add_argument("--pca_dim", type=int, default=6000)
    parser.add_argument("--components", type=int, default=30)
    parser.add_argument("--word_dim", type=int, default=300)
    parser.add_argument("--work_dir", default="/tmp/tf_twobranch_bench_text")
    parser.add_argument("--out_json", default="")
    args = parser.parse_args(argv)
    print(f"bench_text_features: {args.captions} real Flickr30K captions, {args.components}-component HGLMM on "
          f"{args.word_dim}-d word vectors, PCA to {args.pca_dim}; {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results = run(args.captions, args.pca_dim, pathlib.Path(args.work_dir), args.components, args.word_dim)
    if args.out_json:
        write_json(args.out_json, results)
    return results


if __name__ == "__main__":
    main()
