"""Shared pytest fixtures."""
import os
import pathlib

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# A test worker runs hundreds of jobs in one process. With oneDNN on, TensorFlow keeps every CPU
# tensor above 4 KB in a pool that never shrinks, so each worker held the high-water mark of
# everything it had run (3.3 GB each, 8.5-8.9 GB for the suite's tree against the 8 GB line);
# malloc gives the memory back at no cost in suite time (benchmarks/bench_cpu_allocator.py,
# BUILD_NOTES "Test suite"). Set here, before any worker starts: the workers and the processes
# they start inherit it.
os.environ.setdefault("TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "1")
# Before any test module imports TensorFlow: the package's TensorFlow defaults
# (tf_twobranch/__init__.py) hold in every test process whatever the import order.
import tf_twobranch  # noqa: E402,F401

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
REALDATA = REPO_ROOT.parent / "shared" / "realdata"


@pytest.fixture(scope="session")
def realdata():
    """Path to ../shared/realdata; skips the test when it is absent."""
    if not REALDATA.is_dir():
        pytest.skip(f"real data folder {REALDATA} is absent (it is only beside CI/dev clones)")
    return REALDATA
