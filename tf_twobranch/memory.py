"""This process's (or another's) memory as Linux reports it, and dropping what a finished run left.

One reader of ``/proc/<pid>/status`` for the benchmarks (peak RSS of a measured call, a sampled
subprocess), `bench_scale` and the leaderboard (resident size after each run). Fields are in KiB,
as the kernel writes them; a field the kernel does not report (another OS, a finished process) is
missing from the answer rather than zero.
"""
from __future__ import annotations

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


def release_run_memory() -> None:
    """Drops what a finished run left in this process (Keras' global state, unreachable objects).

    A process that runs many rows one after another (the leaderboard) otherwise keeps every run's
    models, datasets and traced functions: seven systems x three seeds grew past 17 GB.
    """
    import keras

    # free_memory (Keras >= 3.6, the pinned floor, has it) runs gc.collect: a second one would cost
    # another ~0.35 s per run for nothing.
    keras.backend.clear_session(free_memory=True)
