"""Experiment entry points: stray positional arguments are refused before any work; output files land where asked."""

import json

import pytest

from tests.support.forked_modules import run_python
from tests.support.records import assert_comparable_record
from experiments import common

EXPERIMENTS = ["two_branch_retrieval", "two_branch_table", "two_branch_region_phrase",
               "dual_path", "two_branch_combined_distance", "two_branch_draw",
               "two_branch_sentence_baselines"]


@pytest.fixture(scope="module")
def stray_argument_runs():
    """Each experiment run as `python -m experiments.<module> stray_arg` (one TensorFlow import for all)."""
    from tests.support.forked_modules import run_modules
    runs = run_modules([[f"experiments.{m}", "stray_arg"] for m in EXPERIMENTS], cwd=common.REPO_ROOT)
    return dict(zip(EXPERIMENTS, runs))


@pytest.mark.parametrize("module", EXPERIMENTS)
def test_stray_positional_arguments_are_refused(module, stray_argument_runs):
    proc = stray_argument_runs[module]
    assert proc.returncode == 2, proc.stderr
    assert "unexpected arguments ['stray_arg']" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_retrieval_table_passes_row_flags_but_refuses_positionals():
    proc = run_python(["-m", "experiments.two_branch_table", "--epochs=1",
                       "stray_arg"],
                      cwd=common.REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert "unexpected arguments ['stray_arg']" in proc.stderr


def test_sentence_baselines_write_results_into_a_new_folder(tmp_path):
    words = ["red", "blue", "green", "seven", "five", "two", "big", "small"]
    lines, ids = [], [f"{1000 + i}" for i in range(6)]
    for i, image_id in enumerate(ids):
        for k in range(5):
            lines.append(f"{image_id}.jpg#{k}\ta {words[i % 3]} {words[3 + i % 3]} and a {words[6 + k % 2]} one")
    (tmp_path / "captions.token").write_text("\n".join(lines) + "\n")
    (tmp_path / "train.txt").write_text("\n".join(ids[:3]) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(ids[3:]) + "\n")
    out = tmp_path / "new" / "folder" / "results.json"
    done = run_python(["-m", "experiments.two_branch_sentence_baselines",
                       f"--captions={tmp_path / 'captions.token'}", f"--train_split={tmp_path / 'train.txt'}",
                       f"--test_split={tmp_path / 'test.txt'}", "--encoders=tfidf", f"--out_json={out}"],
                      timeout=300, cwd=common.REPO_ROOT)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "tfidf" in json.loads(out.read_text())["results"]
    assert_comparable_record(json.loads(out.read_text()))
