"""Shared pytest fixtures."""
import os
import pathlib

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
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
