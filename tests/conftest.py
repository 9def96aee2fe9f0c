"""Shared pytest fixtures."""
import os
import pathlib

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# pytest-xdist runs one worker per core: TensorFlow's default pools (a thread per core each for
# intra- and inter-op work, and oneDNN's) then put several busy threads on two cores. One thread
# per worker (and per subprocess it starts): 8 % less time on four heavy files, and full runs of
# 814-830 s against 865-868 s (BUILD_NOTES "Suite time (session 15)"). A value already set wins.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1) > 1:
    for _name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_name, "1")
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

