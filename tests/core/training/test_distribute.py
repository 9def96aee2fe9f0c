"""Distributed training computes what one device computes (issue: scale out).

The end-to-end checks run `tf_twobranch.systems.two_branch.distributed_check` in
subprocesses: TF fixes its device layout at start-up, and two
`MultiWorkerMirroredStrategy` workers must be separate processes.
"""
import json
import os
import socket
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch import distribute
from tf_twobranch.errors import ConfigError

TOLERANCE = 2e-5  # float32 summation order differs between all-reduce and one device
# (measured: 9.5e-7 max abs difference after 8 SGD steps through trainer.train)
TRAIN_ARGS = ("--epochs=2", "--steps=4", "--backup_every_steps=2")


def test_split_global_batch_cuts_tower_rows_and_keeps_masks_global():
    batch = {"image_index": tf.range(4), "text_index": tf.range(8),
             "labels": tf.zeros([8, 4], tf.bool)}
    parts = [distribute.split_global_batch(batch, 2, i) for i in range(2)]
    np.testing.assert_array_equal(parts[0]["image_index"], [0, 1])
    np.testing.assert_array_equal(parts[1]["image_index"], [2, 3])
    np.testing.assert_array_equal(parts[1]["text_index"], [4, 5, 6, 7])
    assert parts[0]["labels"].shape == (8, 4)  # global: the loss runs on gathered rows
    assert distribute.split_global_batch(batch, 1, 0) is batch


def test_split_global_batch_rejects_rows_not_divisible_by_replicas():
    with pytest.raises(ConfigError, match="not divisible by the 3 replicas"):
        distribute.split_global_batch({"image_index": tf.range(4)}, 3, 0)


def test_training_streams_run_without_the_autotuning_thread():
    """Deleting an autotuned iterator waits for its autotuning thread's next wake-up (TF 2.21:
    up to 60 s at the end of every `fit`), so every training stream turns autotuning off; the
    batches are the same."""
    from tf_twobranch.training import trainer

    def batches(start_step):
        return tf.data.Dataset.counter(start_step).map(
            lambda s: s * 2, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    streams = {
        "distributed_stream": distribute.distributed_stream(tf.distribute.get_strategy(), batches)(3),
        "trainer, a factory": trainer._dataset_at(batches, 3),
        "trainer, a dataset": trainer._dataset_at(batches(0), 3),
    }
    for name, stream in streams.items():
        assert stream.options().autotune.enabled is False, name
        assert list(stream.take(3).as_numpy_iterator()) == [6, 8, 10], name


def test_helpers_are_identity_outside_a_strategy():
    x = tf.ones([3, 2])
    assert distribute.cross_replica_concat(x) is x
    assert int(distribute.local_row_offset(3)) == 0
    assert float(distribute.global_count(3)) == 3.0
    assert distribute.num_replicas() == 1


def _run_check(out, *args, env=None, background=False):
    cmd = [sys.executable, "-m", "tf_twobranch.systems.two_branch.distributed_check", f"--out={out}",
           *args]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


META_KEYS = ("num_replicas_in_sync",)  # recorded beside the weights; not a weight


def _weights(path):
    data = np.load(path)
    return {k: data[k] for k in data.files if k not in META_KEYS}


def _replicas(path, proc_output=None):
    """The number of replicas that ran, from the .npz (and the printed line, when given)."""
    with np.load(path) as data:
        assert "num_replicas_in_sync" in data.files, data.files
        recorded = int(data["num_replicas_in_sync"])
    if proc_output is not None:
        assert f"replicas={recorded} " in proc_output, proc_output[-5000:]
    return recorded


def _assert_same_weights(a, b, tol=TOLERANCE):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=tol, rtol=tol, err_msg=key)


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def single_device_weights(tmp_path_factory):
    """An uninterrupted single-process run through trainer.train (2 epochs of 4 steps)."""
    base = tmp_path_factory.mktemp("single")
    proc = _run_check(base / "w.npz", f"--run_dir={base / 'run'}", *TRAIN_ARGS)
    assert _replicas(base / "w.npz", proc.stdout) == 1
    return _weights(base / "w.npz")


def _start_workers(tmp_path, run_dir, *args, tag=""):
    """Two MultiWorkerMirroredStrategy processes on fresh local ports, sharing `run_dir`."""
    ports = _free_ports(2)
    workers = []
    for index in range(2):
        tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                     "task": {"type": "worker", "index": index}}
        private_tmp = tmp_path / f"tmp{index}"  # where a non-chief writes its copies
        private_tmp.mkdir(exist_ok=True)
        workers.append(_run_check(tmp_path / f"w{index}.npz", "--strategy=multi_worker",
                                  f"--run_dir={run_dir}", *TRAIN_ARGS, *args,
                                  env={"TF_CONFIG": json.dumps(tf_config),
                                       "TMPDIR": str(private_tmp)},
                                  background=True))
    return workers


def _finish(workers, timeout=300):
    outputs = []
    for proc in workers:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in workers:
                p.kill()
            raise
        assert proc.returncode == 0, output[-5000:]
        assert "replicas=2" in output, output[-5000:]
        assert "inter_op_threads=1 " in output, output[-5000:]      # one op at a time (make_deterministic)
        outputs.append(output)
    return outputs


def _assert_only_chief_wrote(tmp_path, run_dir: pathlib.Path, non_chief_pids, killed_runs=0):
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "epoch_0001.weights.h5", "epoch_0002.weights.h5", "latest.weights.h5"]
    assert not (run_dir / "backup").exists()  # a finished run deletes its backup
    assert not list(run_dir.rglob(".tmp_*"))
    events = [e.name for e in (run_dir / "logs").rglob("events.out.tfevents.*")]
    assert events and not [e for e in events for pid in non_chief_pids if f".{pid}." in e]
    # The non-chief's private directory is gone (a SIGKILLed one cannot clean up).
    assert len(list((tmp_path / "tmp1").glob("tf_twobranch_*"))) == killed_runs
    assert not list((tmp_path / "tmp0").glob("tf_twobranch_*"))


@pytest.mark.slow
def test_two_worker_processes_match_single_process_run(tmp_path, single_device_weights):
    run_dir = tmp_path / "run"
    workers = _start_workers(tmp_path, run_dir)
    outputs = _finish(workers)
    assert all("resumed_from=null" in out for out in outputs)
    assert [_replicas(tmp_path / f"w{i}.npz", outputs[i]) for i in range(2)] == [2, 2]
    w0, w1 = _weights(tmp_path / "w0.npz"), _weights(tmp_path / "w1.npz")
    _assert_same_weights(w0, w1, tol=0.0)  # workers stay in lock-step
    _assert_same_weights(w0, single_device_weights)
    _assert_only_chief_wrote(tmp_path, run_dir, [workers[1].pid])


def _wait_for_pause(workers, timeout=120):
    """Waits until every worker printed PAUSED (after its step-6 backup)."""
    deadline = time.monotonic() + timeout
    lines = [[] for _ in workers]
    for proc, seen in zip(workers, lines):
        while True:
            assert time.monotonic() < deadline, "workers did not pause: " + repr(lines)
            line = proc.stdout.readline()
            assert line, "worker exited before pausing: " + "".join(seen)[-5000:]
            seen.append(line)
            if line.startswith("PAUSED"):
                break
    return lines


@pytest.mark.slow
def test_both_workers_sigkilled_mid_epoch_resume_to_the_uninterrupted_weights(
        tmp_path, single_device_weights):
    run_dir = tmp_path / "run"
    # Step 6 = batch 2 of epoch 2: a mid-epoch backup (every 2 steps) exists.
    workers = _start_workers(tmp_path, run_dir, "--pause_after_step=6")
    try:
        _wait_for_pause(workers)
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    state = json.loads(next((run_dir / "backup").glob("*/state.json")).read_text())
    assert (state["epoch"], state["batch"], state["call_step"]) == (1, 2, 6)
    assert not (tmp_path / "w0.npz").exists()
    # The same commands (new ports: the killed workers' may still be held).
    restarted = _start_workers(tmp_path, run_dir, "--pause_after_step=6")
    outputs = _finish(restarted)
    for out in outputs:
        assert 'resumed_from={"epoch": 1, "batch": 2, "call_step": 6}' in out, out[-3000:]
    w0, w1 = _weights(tmp_path / "w0.npz"), _weights(tmp_path / "w1.npz")
    _assert_same_weights(w0, w1, tol=0.0)
    _assert_same_weights(w0, single_device_weights)
    _assert_only_chief_wrote(tmp_path, run_dir, [workers[1].pid, restarted[1].pid],
                             killed_runs=1)


def test_two_mirrored_replicas_match_single_device(tmp_path):
    single = _run_check(tmp_path / "s.npz", "--steps=3")
    mirrored = _run_check(tmp_path / "m.npz", "--strategy=mirrored", "--cpu_replicas=2",
                          "--steps=3")
    # Equal weights alone would also pass if the strategy silently ran on one replica.
    assert _replicas(tmp_path / "s.npz", single.stdout) == 1
    assert _replicas(tmp_path / "m.npz", mirrored.stdout) == 2
    assert "inter_op_threads=1 " in mirrored.stdout and "inter_op_threads=1 " in single.stdout
    _assert_same_weights(_weights(tmp_path / "m.npz"), _weights(tmp_path / "s.npz"))


def test_chief_is_task_chief_or_worker_zero(monkeypatch):
    cluster = {"worker": ["a:1", "b:2"]}
    for task, chief in (({"type": "worker", "index": 0}, True),
                        ({"type": "worker", "index": 1}, False)):
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": task}))
        assert distribute.is_chief() is chief
    with_chief = {"chief": ["c:0"], **cluster}
    for task, chief in (({"type": "chief", "index": 0}, True),
                        ({"type": "worker", "index": 0}, False)):
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": with_chief, "task": task}))
        assert distribute.is_chief() is chief
    monkeypatch.delenv("TF_CONFIG")
    assert distribute.is_chief() and distribute.is_chief(tf.distribute.get_strategy())
    monkeypatch.setenv("TF_CONFIG", "not json")
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        distribute.is_chief()


@pytest.mark.slow
def test_similarity_network_two_replicas_match_single_device(tmp_path):
    single = _run_check(tmp_path / "s1.npz", "--model=similarity", "--steps=3")
    mirrored = _run_check(tmp_path / "s2.npz", "--model=similarity", "--strategy=mirrored",
                          "--cpu_replicas=2", "--steps=3")
    assert _replicas(tmp_path / "s1.npz", single.stdout) == 1
    assert _replicas(tmp_path / "s2.npz", mirrored.stdout) == 2
    _assert_same_weights(_weights(tmp_path / "s1.npz"), _weights(tmp_path / "s2.npz"))


def test_prepare_run_dir_writes_nothing_on_a_non_chief_worker(tmp_path, monkeypatch):
    from tf_twobranch.training import trainer
    (tmp_path / "backup").mkdir()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                                "task": {"type": "worker", "index": 1}}))
    trainer.prepare_run_dir(tmp_path, {"x": 1})
    assert not (tmp_path / "run_config.json").exists()
    assert (tmp_path / "backup").exists()  # only the chief discards a stale backup
    monkeypatch.delenv("TF_CONFIG")
    trainer.prepare_run_dir(tmp_path, {"x": 1})
    assert (tmp_path / "run_config.json").exists() and not (tmp_path / "backup").exists()
