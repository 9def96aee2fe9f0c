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


# The longest test files first (per-file times of a full run, BUILD_NOTES "Suite time (session 15)").
# Under `--dist loadfile --no-loadscope-reorder` (pytest.ini) each file is one unit of work, handed to
# the workers in collection order: a long file handed out last leaves the other worker idle at the
# end (xdist's default order, by number of tests, sent the long few-test files such as the
# leaderboard's last). Only the order changes; tests within a file keep theirs.
_LONGEST_FIRST = ("test_export_run_tool", "test_leaderboard", "test_export_two_branch_raw", "test_serving_requests",
                  "test_distribute", "test_experiment_image_sentence", "test_experiment_instance_loss",
                  "test_export_retrieval_fragment_npair", "test_readme_sequences", "test_export_fragments",
                  "test_export", "test_experiment_phrase_localization", "test_main_job", "test_experiment_fragments",
                  "test_dual_path")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
