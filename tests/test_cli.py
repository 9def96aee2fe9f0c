"""Every experiment entry point rejects stray positional arguments before doing any work."""
import subprocess
import sys

import pytest

from experiments import common

EXPERIMENTS = ["image_sentence_retrieval", "retrieval_table", "phrase_localization",
               "instance_loss", "combined_retrieval", "draw_localization",
               "sentence_retrieval_baselines"]


@pytest.mark.parametrize("module", EXPERIMENTS)
def test_stray_positional_arguments_are_refused(module):
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", "stray_arg"],
                          capture_output=True, text=True, cwd=common.REPO_ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "unexpected arguments ['stray_arg']" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_retrieval_table_passes_row_flags_but_refuses_positionals():
    proc = subprocess.run([sys.executable, "-m", "experiments.retrieval_table", "--epochs=1",
                           "stray_arg"], capture_output=True, text=True,
                          cwd=common.REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert "unexpected arguments ['stray_arg']" in proc.stderr
