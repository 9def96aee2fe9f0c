"""N-pair localization model (Das et al.) at paper size: one training step and S_MaxImage gallery scoring.

Run from the repository root:

    python -m benchmarks.bench_npair [--batch 64 --map 14 --channels 512 --dim 1024 --tokens 22]
        [--word_dim 300 --steps 3 --jit_compile] [--gallery_images 1000 --gallery_captions 5000]
        [--scale 0.04 --image_chunk 100 --caption_chunk 100 --matmul_repeats 3] [--in_process]
        [--out_json benchmarks/results/npair.json]

Prints, in one run (3–5 minutes on this shared 2-core machine at the defaults):

1. One training step at the paper's size (§4.1; the authors' code): batch
   64 of precomputed frozen VGG-19 ``block5_conv4`` maps (random
   (64, 14, 14, 512)), the model's 3×3 conv 512→1024 + batch norm + ReLU,
   an LSTM 300→1024 over 22 tokens, S_MaxImage (eq. 1) over the 64×64 score
   matrix, the N-pair loss (eqs. 5–7) and a plain SGD update —
   `build_npair_model`, ``model.compile`` and ``train_on_batch`` (graph
   mode, XLA off unless ``--jit_compile``), median of ``--steps`` steps after
   one warm-up step (tracing; timed and reported apart).
   In the same process, the step's matmul-bound parts are timed alone as
   float32 ``tf.matmul`` at the shapes the step needs, once after each timed
   step (the machine is shared: a step and the matmuls timed right after it
   see the same load; the ratio is the median of the per-step ratios),
   with P = B·h·w locations, Q = B·T tokens, K = 9·C conv patch length,
   E word size, d = embed dim:

   * (a) the localization volume (P, d)·(Q, d)ᵀ and its two gradients
     (P, Q)·(Q, d) and (P, Q)ᵀ·(P, d): 3× the forward FLOPs;
   * (b) the conv as a matmul (P, K)·(K, d) and its kernel gradient
     (P, K)ᵀ·(P, d): 2× — no input gradient, the backbone maps are inputs;
   * (c) the LSTM's per-time-step matmuls, T of each: x_t·W (B, E)·(E, 4d) and
     h·U (B, d)·(d, 4d) forward; xᵀ·dz, hᵀ·dz and dz·Uᵀ backward — 3× the
     recurrent and 2× the input FLOPs (the word vectors are frozen).

   Target: the step is dominated by its matmuls — step time / sum of those
   matmul times ≤ 2.0 (PASS/FAIL printed). Also printed: achieved GFLOP/s
   (counted matmul FLOPs / step time); the loss block alone (volume,
   S_MaxImage, N-pair loss and the gradients to maps and tokens of
   `localization_batch_loss`, one tf.function) against its matmuls (a), to
   tell where a shortfall comes from; and the peak RSS growth of the process
   during the warm-up step and during the timed steps (`common.PeakRssMeter`:
   VmHWM reset where Linux allows it, else ``resource.getrusage`` ru_maxrss)
   next to the analytic size of the largest tensor of the step, the (P × Q)
   float32 volume.

2. S_MaxImage scoring of a 1,000-image × 5,000-caption gallery of random
   L2-normalised vectors — image maps (1000, 14, 14, 1024), caption token
   vectors (5000, 22, 1024) with random lengths — through
   `localization_score_fn` (image chunks × packed blocks of the real tokens)
   over the evaluation core's caption windows, once in float32 and once in
   the opt-in bfloat16, two passes each (the first traces the block
   functions, a constant per evaluation; the second is timed): time, per-pair time, peak RSS
   growth, and the ratio to one matmul (same dtype, same process, timed
   before and after) of the counted multiply-adds — H·W·d per *real* token
   per image, what eq. 1 needs. ``--scale`` scores a fraction of the
   captions (time extrapolated linearly); the per-pair time gives the
   predicted time of COCO 5K (5,000 × 25,000 pairs).
   Targets (float32): time ratio ≤ 1.5 and peak memory growth ≤ 4 GB.

The ratios carry across machines; the seconds do not (this VM: 2 cores, no
AVX-512, ~35–65 GFLOP/s float32, shared with other processes: the load
average is printed). Each part runs in a fresh spawn subprocess
(`benchmarks.common`); ``--in_process`` runs both here (the smoke test).
Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks import common
from tf_twobranch.errors import ConfigError
from tf_twobranch.json_files import write_json

__all__ = ["PAPER_SIZES", "STEP_RATIO_TARGET", "GALLERY_RATIO_TARGET", "GALLERY_MEMORY_TARGET_BYTES",
           "step_matmuls", "step_child", "gallery_child", "report_lines", "main"]

PAPER_SIZES = dict(batch=64, map=14, channels=512, dim=1024, tokens=22, word_dim=300,
                   gallery_images=1000, gallery_captions=5000)
STEP_RATIO_TARGET = 2.0
GALLERY_RATIO_TARGET = 1.5
GALLERY_MEMORY_TARGET_BYTES = 4e9
# The projection's 3×3 kernel (the authors' code) and a vocabulary whose size
# does not matter: the word-vector lookup is no part of the measured cost.
KERNEL = 3
VOCABULARY = 1000
FLOAT_BYTES = 4


def _quiet_tf() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# --- the step's matmuls ------------------------------------------------------------

def step_matmuls(sizes: dict) -> list[dict]:
    """The matmuls one training step needs, as (part, what, m, k, n, transpose flags, count).

    ``count`` is how often the step runs that matmul (T for the LSTM's
    per-time-step products); FLOPs = 2·m·k·n·count.
    """
    b, hw, c, d = sizes["batch"], sizes["map"] ** 2, sizes["channels"], sizes["dim"]
    t, e = sizes["tokens"], sizes["word_dim"]
    p, q, k = b * hw, b * t, KERNEL * KERNEL * c

    def mm(part, what, m, inner, n, transpose_a=False, transpose_b=False, count=1):
        return dict(part=part, what=what, m=m, k=inner, n=n, transpose_a=transpose_a,
                    transpose_b=transpose_b, count=count)

    return [
        mm("volume", "forward (P,d)(Q,d)^T", p, d, q, transpose_b=True),
        mm("volume", "d maps (P,Q)(Q,d)", p, q, d),
        mm("volume", "d tokens (P,Q)^T(P,d)", q, p, d, transpose_a=True),
        mm("conv", "forward (P,K)(K,d)", p, k, d),
        mm("conv", "d kernel (P,K)^T(P,d)", k, p, d, transpose_a=True),
        mm("lstm", "forward x_t W (B,E)(E,4d)", b, e, 4 * d, count=t),
        mm("lstm", "forward h U (B,d)(d,4d)", b, d, 4 * d, count=t),
        mm("lstm", "d W x_t^T dz (B,E)^T(B,4d)", e, b, 4 * d, transpose_a=True, count=t),
        mm("lstm", "d U h^T dz (B,d)^T(B,4d)", d, b, 4 * d, transpose_a=True, count=t),
        mm("lstm", "d h dz U^T (B,4d)(d,4d)^T", b, 4 * d, d, transpose_b=True, count=t),
    ]


def _flops(row: dict) -> float:
    return 2.0 * row["m"] * row["k"] * row["n"] * row["count"]


def _matmul_call(row: dict, dtype: str = "float32"):
    """A zero-argument function running one matmul of `row`'s shape (random `dtype` operands)."""
    import tensorflow as tf
    rng = tf.random.Generator.from_seed(0)
    a = tf.cast(rng.normal([row["k"], row["m"]] if row["transpose_a"] else [row["m"], row["k"]]), dtype)
    b = tf.cast(rng.normal([row["n"], row["k"]] if row["transpose_b"] else [row["k"], row["n"]]), dtype)

    def once():
        # Eager CPU ops run synchronously: the call returns when the product is done.
        return tf.matmul(a, b, transpose_a=row["transpose_a"], transpose_b=row["transpose_b"]).shape

    return once


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- 1. the training step ----------------------------------------------------------

def _token_mask(captions: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """(captions, tokens) bool: right-padded captions of random lengths between tokens/3 and tokens."""
    lengths = rng.integers(max(1, tokens // 3), tokens + 1, size=captions)
    return np.arange(tokens)[None, :] < lengths[:, None]


def _step_batch(sizes: dict, rng: np.random.Generator) -> dict:
    b, h, t = sizes["batch"], sizes["map"], sizes["tokens"]
    # VGG maps come out of a ReLU: non-negative.
    maps = np.abs(rng.standard_normal((b, h, h, sizes["channels"]), dtype=np.float32))
    return {"backbone_map": maps,
            "token_ids": rng.integers(1, VOCABULARY, size=(b, t)).astype(np.int32),
            "token_mask": _token_mask(b, t, rng)}


def _loss_block_call(sizes: dict):
    """A zero-argument function: the model's normalisation, `localization_batch_loss` and the
    gradients to the maps and tokens, as one tf.function."""
    import tensorflow as tf

    from tf_twobranch.systems.npair.losses import localization_batch_loss
    from tf_twobranch.systems.npair.heat_map_volume import normalise_localization_inputs
    rng = np.random.default_rng(1)
    b, h, t, d = sizes["batch"], sizes["map"], sizes["tokens"], sizes["dim"]
    maps = tf.constant(rng.standard_normal((b, h, h, d), dtype=np.float32))
    tokens = tf.constant(rng.standard_normal((b, t, d), dtype=np.float32))
    mask = tf.constant(_token_mask(b, t, rng))

    @tf.function
    def loss_and_gradients(maps, tokens):
        with tf.GradientTape() as tape:
            tape.watch([maps, tokens])
            unit_maps, unit_tokens = normalise_localization_inputs(maps, tokens, mask)
            loss = localization_batch_loss(unit_maps, unit_tokens, mask)
        return loss, tape.gradient(loss, [maps, tokens])

    def once():
        loss, _ = loss_and_gradients(maps, tokens)
        return float(loss)   # waits for the gradients too: one graph, one call

    return once


def step_child(sizes: dict, steps: int = 3, jit_compile: bool = False, seed: int = 0) -> dict:
    """Training step of `build_npair_model` at `sizes` and its matmuls, timed in this process."""
    _quiet_tf()
    import keras

    from tf_twobranch.systems.npair.model import build_npair_model
    rng = np.random.default_rng(seed)
    model = build_npair_model(dict(vocabulary_size=VOCABULARY, map_channels=sizes["channels"],
                                   map_size=sizes["map"], word_dim=sizes["word_dim"],
                                   embed_dim=sizes["dim"], max_tokens=sizes["tokens"],
                                   projection_kernel=KERNEL, loss="npair", aggregator="max_image"))
    model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=jit_compile)
    batch = _step_batch(sizes, rng)
    matmuls = step_matmuls(sizes)
    matmul_calls = [_matmul_call(row) for row in matmuls]
    loss_block = _loss_block_call(sizes)
    meter = common.PeakRssMeter()

    meter.start()
    t0 = time.perf_counter()
    first_loss = float(model.train_on_batch(batch, return_dict=True)["loss"])
    warmup_seconds = time.perf_counter() - t0
    warmup_peak = meter.peak_increase_bytes()
    for once in matmul_calls + [loss_block]:   # warm-up: tracing, oneDNN primitives, first touch
        once()

    # Steps and matmuls alternate so that both see the same load from other
    # processes (the machine is shared); the memory meter watches the steps only.
    step_times, steps_peak, rounds = [], 0, []
    for _ in range(steps):
        meter.start()
        # train_on_batch returns the logs as numbers: the step has finished.
        step_times.append(_seconds(lambda: model.train_on_batch(batch)))
        steps_peak = max(steps_peak, meter.peak_increase_bytes())
        rounds.append({"matmul_seconds_each": [_seconds(once) for once in matmul_calls],
                       "loss_block_seconds": _seconds(loss_block)})
    for i, row in enumerate(matmuls):
        row["seconds_each"] = statistics.median(r["matmul_seconds_each"][i] for r in rounds)
        row["seconds"] = row["seconds_each"] * row["count"]
        row["flops"] = _flops(row)
    round_matmul_seconds = [sum(s * row["count"] for s, row in zip(r["matmul_seconds_each"], matmuls))
                            for r in rounds]
    return {"sizes": dict(sizes), "jit_compile": jit_compile, "steps": steps,
            "step_seconds_median": statistics.median(step_times), "step_seconds_all": step_times,
            "round_matmul_seconds": round_matmul_seconds,
            "ratio_per_round": [s / m for s, m in zip(step_times, round_matmul_seconds)],
            "warmup_seconds": warmup_seconds, "first_loss": first_loss,
            "peak_method": meter.method, "warmup_peak_bytes": warmup_peak,
            "steps_peak_bytes": steps_peak, "matmuls": matmuls,
            "loss_block_seconds": statistics.median(r["loss_block_seconds"] for r in rounds),
            "loadavg": os.getloadavg()}


def _step_summary(r: dict) -> dict:
    """Ratios and rates of a `step_child` record."""
    sizes = r["sizes"]
    parts = {}
    for row in r["matmuls"]:
        part = parts.setdefault(row["part"], {"seconds": 0.0, "flops": 0.0})
        part["seconds"] += row["seconds"]
        part["flops"] += row["flops"]
    matmul_seconds = sum(p["seconds"] for p in parts.values())
    flops = sum(p["flops"] for p in parts.values())
    step = r["step_seconds_median"]
    p, q = sizes["batch"] * sizes["map"] ** 2, sizes["batch"] * sizes["tokens"]
    # The median of the per-round ratios: each step against the matmuls timed right after it.
    ratio = statistics.median(r["ratio_per_round"])
    return {"parts": parts, "matmul_seconds": matmul_seconds, "matmul_flops": flops,
            "ratio_to_matmuls": ratio, "pass": ratio <= STEP_RATIO_TARGET,
            "gflops_step": flops / step / 1e9, "gflops_matmuls": flops / matmul_seconds / 1e9,
            "loss_block_ratio": r["loss_block_seconds"] / parts["volume"]["seconds"],
            "volume_bytes": p * q * FLOAT_BYTES}


# --- 2. gallery scoring ------------------------------------------------------------

def _unit(values: np.ndarray) -> np.ndarray:
    values /= np.linalg.norm(values, axis=-1, keepdims=True)
    return values


# COCO 5K test set: 5,000 images and 25,000 captions, the size the prediction is for.
COCO_5K_PAIRS = 5000 * 25000
GALLERY_DTYPES = ("float32", "bfloat16")


def gallery_child(sizes: dict, scale: float = 0.04, image_chunk: int = 100, caption_chunk: int = 100,
                  matmul_repeats: int = 3, seed: int = 0) -> dict:
    """S_MaxImage scoring of the (scaled) gallery through `localization_score_fn`, in this process,
    once per score dtype (float32, then the opt-in bfloat16)."""
    _quiet_tf()
    from tf_twobranch.systems.npair.retrieval import localization_score_fn, token_slots
    from tf_twobranch.evaluation.retrieval import DEFAULT_CHUNK
    rng = np.random.default_rng(seed)
    images, h, d, t = sizes["gallery_images"], sizes["map"], sizes["dim"], sizes["tokens"]
    captions = max(1, round(sizes["gallery_captions"] * scale))
    # Inputs (the baseline of the memory figure) at full dimensions, float32.
    maps = _unit(rng.standard_normal((images, h, h, d), dtype=np.float32))
    tokens = _unit(rng.standard_normal((captions, t, d), dtype=np.float32))
    mask = _token_mask(captions, t, rng)
    real_tokens = int(mask.sum())
    # The reference: one packed block's matmul (image chunk locations x the block's token slots),
    # in the scoring dtype, timed before and after the scoring so that it sees the same load.
    block_images = min(image_chunk, images)
    slots = token_slots(mask.sum(axis=1), caption_chunk)
    block = dict(m=block_images * h * h, k=d, n=slots, transpose_a=False, transpose_b=True, count=1)
    window = min(DEFAULT_CHUNK, captions)
    record = {"sizes": dict(sizes), "scale": scale, "captions_scored": captions,
              "image_chunk": block_images, "caption_chunk": min(caption_chunk, captions),
              "token_slots": slots, "real_tokens": real_tokens, "window": window,
              "flops": 2.0 * images * h * h * captions * t * d,
              "counted_flops": 2.0 * images * h * h * real_tokens * d,
              "block_flops": _flops(block), "input_bytes": (maps.nbytes + tokens.nbytes + mask.nbytes),
              "full_caption_bytes": sizes["gallery_captions"] * t * d * FLOAT_BYTES, "dtypes": {}}
    for dtype in GALLERY_DTYPES:
        block_call = _matmul_call(block, dtype)
        block_call()   # warm-up
        block_times = [_seconds(block_call) for _ in range((matmul_repeats + 1) // 2)]
        meter = common.PeakRssMeter()
        meter.start()
        score = localization_score_fn(maps, tokens, mask, aggregator="max_image",
                                      image_chunk=image_chunk, caption_chunk=caption_chunk,
                                      score_dtype=dtype)

        def gallery_pass():
            t0, total = time.perf_counter(), 0.0
            for start in range(0, captions, window):
                total += float(score(start, min(captions, start + window)).sum())
            return time.perf_counter() - t0, total

        # The first pass traces and compiles the block functions (a constant per evaluation, not
        # per pair); the second is the steady state the per-pair figure and the ratio use.
        first_seconds, checksum = gallery_pass()
        seconds, checksum_again = gallery_pass()
        if checksum_again != checksum:
            raise RuntimeError(f"S_MaxImage is not deterministic: {checksum} then {checksum_again}")
        peak = meter.peak_increase_bytes()
        block_times += [_seconds(block_call) for _ in range(matmul_repeats // 2)]
        record["dtypes"][dtype] = {"seconds": seconds, "first_pass_seconds": first_seconds,
                                   "peak_method": meter.method, "peak_bytes": peak,
                                   "block_matmul_seconds": statistics.median(block_times),
                                   "block_matmul_seconds_all": block_times, "checksum": checksum,
                                   "loadavg": os.getloadavg()}
    # The float32 figures stay at the top level (the record's earlier layout).
    record.update(record["dtypes"]["float32"])
    return record


def _dtype_summary(r: dict, m: dict) -> dict:
    pairs = r["sizes"]["gallery_images"] * r["captions_scored"]
    matmul_seconds = m["block_matmul_seconds"] * r["counted_flops"] / r["block_flops"]
    per_pair = m["seconds"] / pairs
    return {"matmul_seconds_same_flops": matmul_seconds, "ratio_to_matmul": m["seconds"] / matmul_seconds,
            "gflops": r["counted_flops"] / m["seconds"] / 1e9, "seconds_per_pair": per_pair,
            "coco_5k_seconds_predicted": per_pair * COCO_5K_PAIRS}


def _gallery_summary(r: dict) -> dict:
    full = r["sizes"]["gallery_captions"] / r["captions_scored"]
    per_dtype = {dtype: _dtype_summary(r, m) for dtype, m in r["dtypes"].items()}
    out = dict(per_dtype["float32"])
    out.update({"dtypes": per_dtype, "extrapolation_factor": full,
                "full_gallery_seconds_extrapolated": r["seconds"] * full,
                "pass_time": out["ratio_to_matmul"] <= GALLERY_RATIO_TARGET,
                "pass_memory": r["peak_bytes"] <= GALLERY_MEMORY_TARGET_BYTES})
    return out


# --- output ------------------------------------------------------------------------

def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report_lines(report: dict) -> list[str]:
    """The printed report of a `main` result."""
    lines = []
    step, s = report["step"], report["step_summary"]
    z = step["sizes"]
    p, q = z["batch"] * z["map"] ** 2, z["batch"] * z["tokens"]
    lines.append(f"1. Training step: batch {z['batch']}, maps {z['map']}x{z['map']}x{z['channels']} "
                 f"(frozen backbone, precomputed), {KERNEL}x{KERNEL} conv {z['channels']}->{z['dim']} "
                 f"+ BN + ReLU, LSTM {z['word_dim']}->{z['dim']} over {z['tokens']} tokens, "
                 f"S_MaxImage {z['batch']}x{z['batch']}, N-pair loss, SGD "
                 f"(train_on_batch, graph mode, jit_compile={step['jit_compile']})")
    lines.append(f"   step {step['step_seconds_median']:.3f} s (median of {step['steps']}; warm-up step "
                 f"{step['warmup_seconds']:.2f} s excluded), load {step['loadavg'][0]:.1f}")
    for name, part in s["parts"].items():
        lines.append(f"   matmuls {name:6s} {part['seconds']:.3f} s  {part['flops'] / 1e9:8.1f} GFLOP  "
                     f"{part['flops'] / part['seconds'] / 1e9:5.1f} GFLOP/s")
    lines.append(f"   sum of the matmuls {s['matmul_seconds']:.3f} s ({s['matmul_flops'] / 1e9:.1f} GFLOP, "
                 f"{s['gflops_matmuls']:.1f} GFLOP/s); step achieves {s['gflops_step']:.1f} GFLOP/s")
    lines.append(f"   step / matmuls = {s['ratio_to_matmuls']:.2f}x (median over the steps of each step "
                 f"against the matmuls timed right after it; target <= {STEP_RATIO_TARGET}): "
                 f"{_verdict(s['pass'])}")
    lines.append(f"   loss block alone (volume + S_MaxImage + N-pair + gradients to maps and tokens): "
                 f"{step['loss_block_seconds']:.3f} s = {s['loss_block_ratio']:.2f}x its volume matmuls")
    lines.append(f"   peak RSS growth ({step['peak_method']}): warm-up step "
                 f"{common.fmt_bytes(step['warmup_peak_bytes'])}, timed steps "
                 f"{common.fmt_bytes(step['steps_peak_bytes'])}; largest tensor, the ({p} x {q}) "
                 f"float32 volume: {common.fmt_bytes(s['volume_bytes'])}")
    g, gs = report["gallery"], report["gallery_summary"]
    z = g["sizes"]
    lines.append(f"2. S_MaxImage gallery scoring: {z['gallery_images']} images x {z['gallery_captions']} "
                 f"captions, maps {z['map']}x{z['map']}x{z['dim']}, {z['tokens']} tokens, "
                 f"localization_score_fn chunks {g['image_chunk']} x {g['caption_chunk']}, "
                 f"windows of {g['window']} captions")
    if g["captions_scored"] < z["gallery_captions"]:
        lines.append(f"   measured on {g['captions_scored']} captions (--scale {g['scale']:g}) x all "
                     f"images; full-gallery time extrapolated linearly x{gs['extrapolation_factor']:.1f}: "
                     f"{gs['full_gallery_seconds_extrapolated']:.0f} s")
    lines.append(f"   {g['real_tokens']} real of {g['captions_scored'] * z['tokens']} token positions scored, "
                 f"packed {g['token_slots']} slots per block; float32 time {g['seconds']:.2f} s "
                 f"({g['counted_flops'] / 1e12:.2f} TFLOP counted, {gs['gflops']:.1f} GFLOP/s, "
                 f"second pass; the first, tracing included, {g['first_pass_seconds']:.2f} s), "
                 f"load {g['loadavg'][0]:.1f}")
    lines.append(f"   float32 matmul of the same multiply-adds {gs['matmul_seconds_same_flops']:.2f} s; ratio "
                 f"{gs['ratio_to_matmul']:.2f}x (target <= {GALLERY_RATIO_TARGET}): "
                 f"{_verdict(gs['pass_time'])}")
    for dtype, d in gs["dtypes"].items():
        lines.append(f"   {dtype:8s}: {d['seconds_per_pair'] * 1e6:.2f} us per pair, "
                     f"{d['ratio_to_matmul']:.2f}x one {dtype} matmul of its multiply-adds, "
                     f"peak RSS growth {common.fmt_bytes(g['dtypes'][dtype]['peak_bytes'])}; predicted "
                     f"5,000 x 25,000: {d['coco_5k_seconds_predicted'] / 60:.1f} min")
    lines.append(f"   peak RSS growth ({g['peak_method']}) {common.fmt_bytes(g['peak_bytes'])} "
                 f"(target <= {GALLERY_MEMORY_TARGET_BYTES / 1e9:.0f} GB; bounded by the chunks, "
                 f"not the gallery): {_verdict(gs['pass_memory'])}; inputs "
                 f"{common.fmt_bytes(g['input_bytes'])} (full-gallery captions "
                 f"{common.fmt_bytes(g['full_caption_bytes'])})")
    m = report["machine"]
    lines.append(f"machine: {m['cpu_model']}, {m['cpu_count']} cores ({', '.join(m['simd_flags'])}), "
                 f"TF {m.get('tensorflow')}, Keras {m.get('keras')}")
    return lines


def _positive(name: str, value, kind=int):
    if not value > 0:
        raise ConfigError(f"--{name} must be positive, got {value}")
    return kind(value)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in PAPER_SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (median)")
    parser.add_argument("--matmul_repeats", type=int, default=3,
                        help="timings (median) of the gallery's reference block matmul")
    parser.add_argument("--scale", type=float, default=0.04,
                        help="fraction of the gallery captions scored (time extrapolated linearly)")
    parser.add_argument("--image_chunk", type=int, default=100)
    parser.add_argument("--caption_chunk", type=int, default=100)
    parser.add_argument("--jit_compile", action="store_true", help="XLA-compile the training step")
    parser.add_argument("--in_process", action="store_true",
                        help="measure in this process (no spawn subprocesses; the smoke test)")
    parser.add_argument("--out_json", default=None)
    args = parser.parse_args(argv)
    sizes = {name: _positive(name, getattr(args, name)) for name in PAPER_SIZES}
    for name in ("steps", "matmul_repeats", "image_chunk", "caption_chunk"):
        _positive(name, getattr(args, name))
    if not 0 < args.scale <= 1:
        raise ConfigError(f"--scale must be in (0, 1], got {args.scale}")
    _quiet_tf()   # inherited by the spawn children
    run = ((lambda fn, *a, **k: fn(*a, **k)) if args.in_process else common.run_in_subprocess)
    report = {"machine": common.machine_description(), "loadavg_start": os.getloadavg(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    started = time.time()
    report["step"] = run(step_child, sizes, args.steps, args.jit_compile)
    report["step_summary"] = _step_summary(report["step"])
    report["gallery"] = run(gallery_child, sizes, args.scale, args.image_chunk, args.caption_chunk,
                            args.matmul_repeats)
    report["gallery_summary"] = _gallery_summary(report["gallery"])
    report["wall_seconds"] = time.time() - started
    report["printed"] = "\n".join(report_lines(report))
    print(report["printed"])
    print(f"total {report['wall_seconds']:.0f} s")
    if args.out_json:
        print(f"wrote {write_json(args.out_json, report)}")
    return report


if __name__ == "__main__":
    # Subprocess targets must be importable by name, not as __main__.
    from benchmarks import bench_npair
    bench_npair.main()
