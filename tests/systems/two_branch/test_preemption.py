"""A training process SIGKILLed mid-epoch and started again ends with the
uninterrupted run's weights (deterministic ops, CPU: exactly; tolerance 1e-6)."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tf_twobranch.systems.two_branch import preemption_check as pc

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
TOLERANCE = 1e-6


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_sigkill_mid_epoch_then_same_command_matches_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    kwargs = dict(epochs=3, steps_per_epoch=8, backup_every_steps=2)
    # The uninterrupted run runs beside the one that gets killed (2 cores).
    reference = subprocess.Popen(pc.training_command(straight, **kwargs), env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    command = pc.training_command(resumed, step_delay=0.15, **kwargs)
    epoch, batch = pc.start_and_kill(command, resumed, kill_epoch=1, env=_env())
    assert epoch == 1 and 0 < batch < 8  # a mid-epoch backup of the 2nd epoch existed
    assert not (resumed / pc.WEIGHTS_FILE).exists()
    restart = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert restart.returncode == 0, restart.stderr[-3000:]
    # It resumed from a mid-epoch backup of epoch 2 (at or after the one seen at the kill).
    line = next(l for l in restart.stdout.splitlines() if l.startswith("resumed_from="))
    assert '"epoch": 1' in line and '"batch": 0' not in line, line
    out, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-3000:]

    a = pc.load_weights_file(straight / pc.WEIGHTS_FILE)
    b = pc.load_weights_file(resumed / pc.WEIGHTS_FILE)
    assert set(a) == set(b)
    assert int(b["optimizer_iterations"]) == 24
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=TOLERANCE, err_msg=name)
    # A finished run leaves no backup and no temp files.
    assert not (resumed / "backup").exists()
    assert not list(resumed.rglob(".tmp_*"))


def test_command_line_reports_a_missing_run_dir():
    proc = subprocess.run([sys.executable, "-m", "tf_twobranch.systems.two_branch.preemption_check"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--run_dir is required" in proc.stderr
