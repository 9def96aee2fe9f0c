"""This process's (or another's) memory as Linux reports it, and calls in a fresh process.

One reader of ``/proc/<pid>/status`` for the benchmarks (peak RSS of a measured call, a sampled
subprocess), `bench_scale` and the leaderboard (each run's peak); `call_in_fresh_process`, which the
leaderboard and the benchmarks run a measured or memory-hungry call through. Fields are in KiB,
as the kernel writes them; a field the kernel does not report (another OS, a finished process) is
missing from the answer rather than zero.
"""
from __future__ import annotations

import multiprocessing
import traceback
from typing import Any, Callable

STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status_kib(pid: int | str = "self", fields=STATUS_FIELDS) -> dict[str, int]:
    """The `fields` of /proc/<pid>/status in KiB ({} where /proc is missing or the process ended)."""
    wanted, out = set(fields), {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in wanted:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return out


def resident_gb(pid: int | str = "self") -> float:
    """Resident set size in GB (1e9 bytes); NaN where it cannot be read."""
    kib = status_kib(pid, ("VmRSS",)).get("VmRSS")
    return float("nan") if kib is None else kib * 1024 / 1e9


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0: "5" written to clear_refs); True if it did."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    now = status_kib("self", ("VmHWM", "VmRSS"))
    return len(now) == 2 and now["VmHWM"] <= now["VmRSS"] + 1024


def _fresh_process_entry(conn, fn, args, kwargs):
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # report, never hang the parent
        conn.send(("error", (e, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        conn.close()


def call_in_fresh_process(fn: Callable, *args, timeout: float | None = None, **kwargs) -> Any:
    """`fn(*args, **kwargs)` (a module-level function) in a fresh *spawn* process; its result.

    The one way this package bounds a sequence of runs by the largest of them: TensorFlow and
    Keras keep memory that `keras.backend.clear_session` does not give back (a one-process
    leaderboard grew by ~0.3 GB a run), and an exiting process returns all of it. The caller's `__main__` must be
    guarded by ``if __name__ == "__main__"`` (the child imports it). An exception in the child is
    raised again here when it pickles (a `UserInputError` stays one), else as RuntimeError with
    the child's traceback.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_fresh_process_entry, args=(child, fn, args, kwargs))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"{fn.__name__} did not finish within {timeout} s")
        status, payload = parent.recv()
    except EOFError:
        status, payload = "error", (None, f"the process died (exit code {proc.join(5) or proc.exitcode})")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
    if status == "ok":
        return payload
    error, text = payload
    if isinstance(error, Exception) and not isinstance(error, RuntimeError):
        raise error
    raise RuntimeError(f"{fn.__name__} failed in its process:\n{text}")
