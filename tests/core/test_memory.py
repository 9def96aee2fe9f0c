"""tf_twobranch.memory: the one /proc reader of the benchmarks, bench_scale and the leaderboard."""
import subprocess
import sys

import numpy as np
import pytest

from tf_twobranch import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_status_of_this_process_names_every_field_in_kib():
    status = memory.status_kib()
    assert set(status) == set(memory.STATUS_FIELDS)
    assert 0 < status["RssAnon"] <= status["VmRSS"] <= status["VmHWM"]
    assert memory.status_kib("self", ("VmRSS",)).keys() == {"VmRSS"}


def test_resident_size_follows_an_allocation():
    before = memory.resident_gb()
    block = np.ones(64 * 2**20 // 8)           # 64 MiB, touched
    after = memory.resident_gb()
    assert after - before > 0.05
    del block


def test_peak_reset_forgets_a_freed_allocation():
    if not memory.reset_peak_rss():
        pytest.skip("this kernel does not reset VmHWM")
    block = np.ones(128 * 2**20 // 8)
    del block
    assert memory.status_kib()["VmHWM"] - memory.status_kib()["VmRSS"] > 100 * 1024
    assert memory.reset_peak_rss()
    assert memory.status_kib()["VmHWM"] <= memory.status_kib()["VmRSS"] + 1024


def test_a_finished_process_has_no_status():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert memory.status_kib(int(proc.stdout)) == {}
    assert np.isnan(memory.resident_gb(int(proc.stdout)))


def _pid_and_allocation(megabytes):
    import os
    block = np.ones(megabytes * 2**20 // 8)
    return os.getpid(), memory.status_kib("self", ("VmHWM",))["VmHWM"], float(block[0])


def _raise(kind):
    from tf_twobranch.errors import UserInputError
    if kind == "user":
        raise UserInputError("bad flag")
    import os
    os._exit(3)


def test_a_call_in_a_fresh_process_returns_its_result_and_leaves_nothing_here():
    import os
    before = memory.status_kib("self", ("VmRSS",))["VmRSS"]
    pid, child_peak_kib, value = memory.call_in_fresh_process(_pid_and_allocation, 200)
    assert pid != os.getpid() and value == 1.0 and child_peak_kib > 200 * 1024
    assert memory.status_kib("self", ("VmRSS",))["VmRSS"] - before < 50 * 1024


def test_a_fresh_process_raises_a_users_error_as_itself_and_a_crash_as_runtime_error():
    from tf_twobranch.errors import UserInputError
    with pytest.raises(UserInputError, match="bad flag"):
        memory.call_in_fresh_process(_raise, "user")
    with pytest.raises(RuntimeError, match="died"):
        memory.call_in_fresh_process(_raise, "crash")
