"""The README's first command (`python -m experiments.two_branch_table`) end to end, at tiny size."""
import json

import pytest

from tests.support.forked_modules import run_python
from experiments import common
from tf_twobranch.data.embedded import generate_embedded_dataset

TINY_ROWS = ["--hidden_dim=32", "--embed_dim=16", "--batch_size=20", "--epochs=2", "--top_k=3",
             "--scene_cnn_epochs=1", "--word_dim=8", "--verbose=0", "--cca_components=8"]


@pytest.mark.slow
def test_readme_first_command_runs_at_tiny_size(tmp_path):
    dataset = generate_embedded_dataset(tmp_path / "scenes", num_images=120, splits=(60, 20, 40),
                                        with_proposals=False)
    proc = run_python(
        ["-m", "experiments.two_branch_table", f"--runs_dir={tmp_path / 'runs'}",
         f"--dataset_dir={dataset}", *TINY_ROWS],
        cwd=common.REPO_ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "estimated time" in out.lower()
    table = out[out.rindex("Table 2-style"):]
    for row in ("CCA (FV HGLMM)", "Embedding: linear, bi-dir.", "Embedding: nonlinear, bi-dir.",
                "nbr. sampling", "nbr. sampling + constr.", "Similarity network",
                "chance (random embeddings"):
        assert row in table, row
    # 40 test images are not the paper's 1,000-image protocol: its numbers are not printed beside them
    # (issue 23 item 10; tests/apps/test_protocols_and_tables.py shows them beside a same-protocol result).
    assert sum(line.startswith("  (paper)") for line in table.splitlines()) == 0
    results = json.loads((tmp_path / "runs" / "two_branch_table2.json").read_text())
    assert len(results["rows"]) == 6
    exported = [r for r in results["rows"] if r.get("export_dir")]
    assert len(exported) == 1 and "b6" in exported[0]["export_dir"]
    assert (tmp_path / "runs" / "two_branch_table2_b6_nonlinear_bidir_nbr_constraints" / "export"
            / "saved_model.pb").exists()


def test_help_prints_the_runners_flags_and_runs_nothing():
    done = run_python(["-m", "experiments.two_branch_table", "--help"],
                      timeout=120, cwd=common.REPO_ROOT)
    # absl exits with 1 after printing the usage; the job itself would take ~30 minutes.
    assert done.returncode in (0, 1) and "--table" in done.stdout and "--export_row" in done.stdout
    assert "Table 2" not in done.stderr
