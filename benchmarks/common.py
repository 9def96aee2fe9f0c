"""Shared helpers for the benchmarks: machine description, float32 matmul
throughput, fresh-subprocess runs with peak-memory measurement, tables.

Benchmarks print figures; they are not tests. Every measurement that needs a
clean process (peak memory, thread settings, XLA caches) runs in a fresh
`multiprocessing` *spawn* subprocess, so the parent never imports TensorFlow
state that would bias the next figure.
"""
from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from importlib.metadata import version
from typing import Any, Callable, Sequence

from tf_twobranch import memory
from tf_twobranch.json_files import write_json

# Matmul shapes (m, k, n, transpose_a) measured for the machine's throughput:
# square sizes plus the shapes of the paper-size training step (forward
# x·W and backward xᵀ·dy of the first layers, which dominate its FLOPs).
DEFAULT_MATMUL_SHAPES: tuple[tuple[int, int, int, bool], ...] = (
    (2048, 2048, 2048, False),
    (4096, 4096, 4096, False),
    (1000, 6000, 2048, False),   # text fc1 forward
    (6000, 1000, 2048, True),    # text fc1 dW = xᵀ·dy
    (500, 4096, 2048, False),    # image fc1 forward
    (4096, 500, 2048, True),     # image fc1 dW
    (1000, 2048, 512, False),    # text fc2 forward
)

MiB = 1024 * 1024


# --- machine ---------------------------------------------------------------

def machine_description() -> dict:
    """CPU model, cores, relevant SIMD flags, memory, Python/TF/Keras versions."""
    cpu_model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and cpu_model in ("unknown", "x86_64", ""):
                    cpu_model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    desc = {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "simd_flags": sorted(f for f in flags if f in {
            "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
            "avx512_vnni", "amx_tile", "amx_bf16"}),
        "avx512": "avx512f" in flags,
        "mem_total_gib": round(mem_total / 2**30, 1) if mem_total else None,
        "python": platform.python_version(),
    }
    try:  # versions without importing TF into the parent process
        desc["tensorflow"] = version("tensorflow")
        desc["keras"] = version("keras")
        desc["numpy"] = version("numpy")
    except Exception:  # pragma: no cover - metadata missing
        pass
    return desc


# --- subprocess runs -------------------------------------------------------

class PeakRssMeter:
    """Peak RSS increase of this process over a baseline taken at `start()`.

    Uses VmHWM reset through /proc/self/clear_refs when available (exact);
    otherwise `ru_maxrss`, whose delta is only a lower bound when the
    process had peaked above its baseline before `start()`.
    """

    def __init__(self):
        self.method = "VmHWM" if memory.reset_peak_rss() else "ru_maxrss"

    def start(self):
        if self.method == "VmHWM":
            memory.reset_peak_rss()
            self.baseline_kib = memory.status_kib()["VmRSS"]
        else:
            self.baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def peak_increase_bytes(self) -> int:
        if self.method == "VmHWM":
            peak = memory.status_kib()["VmHWM"]
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, peak - self.baseline_kib) * 1024


def run_in_subprocess(fn: Callable, *args, timeout: float | None = 1800, **kwargs) -> Any:
    """Runs a module-level `fn(*args, **kwargs)` in a fresh spawn subprocess
    (`tf_twobranch.memory.call_in_fresh_process`) and returns its picklable result."""
    return memory.call_in_fresh_process(fn, *args, timeout=timeout, **kwargs)


def _peak_memory_child(setup, run, setup_args, repeats):
    state = setup(*setup_args)          # imports + input creation: the baseline
    meter = PeakRssMeter()
    runs = []
    for i in range(repeats):
        meter.start()
        t0 = time.perf_counter()
        result = run(state)
        seconds = time.perf_counter() - t0
        runs.append({"seconds": seconds, "peak_increase_bytes": meter.peak_increase_bytes()})
    return {"method": meter.method, "runs": runs, "result": result}


def measure_peak_memory(setup: Callable, run: Callable, setup_args: Sequence = (), *,
                        repeats: int = 2) -> dict:
    """Peak RSS increase of `run(setup(*setup_args))` in a fresh spawn subprocess.

    The baseline is the RSS after `setup` (imports, input creation). The run
    is repeated: the first (``cold``) includes one-off costs such as tracing
    and XLA compilation, later ones (``warm``) are the steady state.
    Returns dict(method, cold_peak_bytes, warm_peak_bytes, cold_seconds,
    warm_seconds, result).
    """
    out = run_in_subprocess(_peak_memory_child, setup, run, tuple(setup_args), repeats)
    runs = out["runs"]
    warm = runs[1:] or runs
    return {
        "method": out["method"],
        "cold_peak_bytes": runs[0]["peak_increase_bytes"],
        "warm_peak_bytes": max(r["peak_increase_bytes"] for r in warm),
        "cold_seconds": runs[0]["seconds"],
        "warm_seconds": min(r["seconds"] for r in warm),
        "result": out["result"],
    }


# --- timing ----------------------------------------------------------------

def time_repeats(fn: Callable[[], Any], *, repeats: int = 3, warmup: int = 1) -> dict:
    """Median / min / all wall times of `fn()` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "all": times}


def time_train_steps(train_function: Callable, next_input: Callable[[], Any], *, steps: int = 3,
                     warmup: int = 1) -> dict:
    """Seconds per call of a Keras ``model.train_function`` (``make_train_function``).

    `next_input()` returns what the function takes: ``iter([batch])`` for a
    fixed in-memory batch, or a `tf.data` iterator (as ``fit`` feeds it).
    ``float(loss)`` waits for each step. The `warmup` calls (tracing, oneDNN
    primitive creation, first-touch allocations) are timed separately.
    """
    t0 = time.perf_counter()
    for _ in range(warmup):
        float(train_function(next_input())["loss"])
    warmup_seconds = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        float(train_function(next_input())["loss"])
        times.append(time.perf_counter() - t0)
    return {"step_seconds_median": statistics.median(times), "step_seconds_min": min(times),
            "step_seconds_all": times, "warmup_seconds": warmup_seconds}


def _matmul_child(shapes, repeats, min_seconds, threads):
    # TensorFlow only in the spawned child: the parent process never imports it.
    import tensorflow as tf
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    rng = tf.random.Generator.from_seed(0)
    rows = []
    for m, k, n, transpose_a in shapes:
        a = rng.normal([k, m] if transpose_a else [m, k], dtype=tf.float32)
        b = rng.normal([k, n], dtype=tf.float32)
        flops = 2.0 * m * k * n

        def once():
            return tf.matmul(a, b, transpose_a=transpose_a)

        once()  # warm-up (oneDNN primitive creation, page faults)
        t0 = time.perf_counter()
        once()
        single = max(time.perf_counter() - t0, 1e-6)
        inner = max(1, int(min_seconds / single))
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                c = once()
            _ = c.shape  # eager CPU ops run synchronously; keep the last result alive
            rates.append(flops * inner / (time.perf_counter() - t0) / 1e9)
        rows.append({"m": m, "k": k, "n": n, "transpose_a": transpose_a,
                     "gflops_median": statistics.median(rates), "gflops_max": max(rates)})
    return rows


def measure_matmul_gflops(shapes: Sequence[tuple[int, int, int, bool]] = DEFAULT_MATMUL_SHAPES,
                          *, repeats: int = 5, min_seconds: float = 0.3,
                          threads: int | None = None) -> dict:
    """float32 `tf.matmul` throughput of this machine (fresh subprocess).

    For each (m, k, n, transpose_a) the matmul is warmed up, then timed in
    `repeats` blocks of at least `min_seconds`; a shape's figure is the
    median over blocks. ``best_gflops`` is the best of those medians — the
    sustained float32 matmul throughput the benchmarks compare against.
    """
    rows = run_in_subprocess(_matmul_child, tuple(shapes), repeats, min_seconds, threads)
    best = max(rows, key=lambda r: r["gflops_median"])
    return {"shapes": rows, "best_gflops": best["gflops_median"],
            "best_shape": f"{best['m']}x{best['k']}x{best['n']}"
                          + (" (Aᵀ)" if best["transpose_a"] else "")}


# --- output ----------------------------------------------------------------

def fmt_bytes(b: float) -> str:
    """Bytes as MiB with thousands separators."""
    return f"{b / MiB:,.0f} MiB"


def start_report(**extra) -> tuple[dict, list, float]:
    """(report dict with machine and load average, first output lines, start time)."""
    started = time.time()
    report = {"machine": machine_description(), "loadavg_start": os.getloadavg(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}
    m = report["machine"]
    lines = [f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, AVX-512: {m['avx512']} "
             f"({', '.join(m['simd_flags'])}), {m['mem_total_gib']} GiB, Python {m['python']}, "
             f"TF {m.get('tensorflow')}, Keras {m.get('keras')}; load average at start "
             f"{report['loadavg_start'][0]:.2f} (1 min), {report['loadavg_start'][1]:.2f} (5 min)",
             ""]
    return report, lines, started


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """A plain-text table with right-aligned numbers."""
    def cell(v):
        if isinstance(v, float):
            if v == 0 or 0.01 <= abs(v) < 1e5:
                return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
            return f"{v:.3g}"
        return str(v)
    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in body)) if body else len(str(h))
              for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = []
    if title:
        out += [title, "=" * len(title)]
    out.append("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    out.append(line)
    for r in body:
        out.append("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w)
                             for v, w in zip(r, widths)))
    return "\n".join(out)


def _numeric(s: str) -> bool:
    try:
        float(s.rstrip("%x"))
        return True
    except ValueError:
        return False


def finish_report(report: dict, lines: list, started: float, out_json) -> None:
    """Appends the closing line, prints the table and writes the JSON report."""
    report["loadavg_end"] = os.getloadavg()
    report["wall_seconds"] = time.time() - started
    lines.append("")
    lines.append(f"Load average at end {report['loadavg_end'][0]:.2f}; "
                 f"total {report['wall_seconds']:.0f} s")
    text = "\n".join(lines)
    report["printed"] = text
    print(text)
    path = write_json(out_json, report)
    print(f"\nwrote {path}")
