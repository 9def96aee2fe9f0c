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
