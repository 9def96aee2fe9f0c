"""oneDNN's pooled CPU allocator against the system allocator: time and memory of the same work.

Run from the repository root:

    python -m benchmarks.bench_cpu_allocator [--pairs 2] [--out_json benchmarks/results/cpu_allocator.json]

With oneDNN on (the package's default, `tf_twobranch/__init__.py`), TensorFlow hands every CPU
tensor above 4 KB to a BFC pool that never gives memory back: a process keeps the high-water
mark of its largest tensors for the rest of its life (one 5,000 × 25,000 evaluation leaves
0.5 GB held), and in a process that runs many jobs one after another (a test worker, a notebook,
a server loading several runs) the marks add up. ``TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1`` sends
those tensors to malloc instead, which returns them on free.

Each setting runs the same three jobs in a fresh process, in turns (A B A B ...): the scene CNN
(convolutions, the main job's slowest part) for 2 epochs on 1,000 images at 64 px, an embedding
network's training (two dense layers, 20,000 × 4,096 features) for 2 epochs, and the evaluation
core at COCO 5K size (5,000 images × 25,000 captions, D = 512). Prints each job's seconds (the
minimum over the pairs), the ratio system / pooled, and each process's peak RSS and its
anonymous memory after the jobs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import common

SETTINGS = {"pooled (oneDNN BFC)": "0", "system malloc": "1"}

_CHILD = r"""
import json, resource, sys, time
import numpy as np
import tf_twobranch  # noqa: F401  oneDNN on, as in a run
import keras
from tf_twobranch.evaluation.retrieval import evaluate_protocol
from tf_twobranch.features.scene_cnn import train_scene_cnn
from tf_twobranch.memory import status_kib

rng = np.random.default_rng(0)
out = {}
images = rng.integers(0, 256, (1000, 64, 64, 3), dtype=np.uint8)
words = [[[f"w{(i * 7 + k) % 50}", f"w{(i + k) % 30}", "digit"] for k in range(5)] for i in range(1000)]
t = time.perf_counter()
train_scene_cnn(images, words, epochs=2, batch_size=32, vocab_size=60, seed=0)
out["scene_cnn"] = time.perf_counter() - t

features = rng.standard_normal((20000, 4096)).astype(np.float32)
targets = rng.standard_normal((20000, 512)).astype(np.float32)
model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(2048, activation="relu"),
                          keras.layers.Dense(512)])
model.compile(optimizer="adam", loss="mse")
t = time.perf_counter()
model.fit(features, targets, batch_size=500, epochs=2, verbose=0, shuffle=False)
out["embedding_network"] = time.perf_counter() - t
del model, features, targets

image = rng.standard_normal((5000, 512)).astype(np.float32)
caption_image = np.repeat(np.arange(5000), 5)
text = image[caption_image] + 4 * rng.standard_normal((25000, 512)).astype(np.float32)
t = time.perf_counter()
evaluate_protocol(image, text, caption_image, "coco_5k")
out["evaluation_5k"] = time.perf_counter() - t
del image, text

out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out["anonymous_after_bytes"] = status_kib("self", ("RssAnon",))["RssAnon"] * 1024
print("RESULT " + json.dumps(out))
"""

JOBS = ("scene_cnn", "embedding_network", "evaluation_5k")


def _run(value: str) -> dict:
    env = dict(os.environ, TF_ONEDNN_USE_SYSTEM_ALLOCATOR=value, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out_json", default="benchmarks/results/cpu_allocator.json")
    args = parser.parse_args(argv)
    report, lines, started = common.start_report(**vars(args))
    runs = {name: [] for name in SETTINGS}
    for _ in range(args.pairs):
        for name, value in SETTINGS.items():
            t = time.perf_counter()
            runs[name].append(_run(value))
            print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
    best = {name: {job: min(r[job] for r in rs) for job in JOBS} for name, rs in runs.items()}
    memory = {name: {key: max(r[key] for r in rs) for key in ("peak_rss_bytes", "anonymous_after_bytes")}
              for name, rs in runs.items()}
    pooled, system = SETTINGS
    rows = [[job, f"{best[pooled][job]:.1f}", f"{best[system][job]:.1f}",
             f"{best[system][job] / best[pooled][job]:.2f}"] for job in JOBS]
    rows += [[what, common.fmt_bytes(memory[pooled][key]), common.fmt_bytes(memory[system][key]), ""]
             for what, key in (("peak RSS", "peak_rss_bytes"), ("anonymous after", "anonymous_after_bytes"))]
    lines.append(common.format_table(["job (s, min of pairs)", pooled, system, "system / pooled"], rows,
                                     title=f"{args.pairs} pairs, each setting in a fresh process"))
    report.update(runs=runs, best_seconds=best, memory=memory)
    common.finish_report(report, lines, started, args.out_json)


if __name__ == "__main__":
    main()
