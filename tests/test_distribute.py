"""Distributed training computes what one device computes (issue: scale out).

The end-to-end checks run `tf_twobranch.training.distributed_check` in
subprocesses: TF fixes its device layout at start-up, and two
`MultiWorkerMirroredStrategy` workers must be separate processes.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch import distribute
from tf_twobranch.errors import ConfigError

TOLERANCE = 2e-5  # float32 summation order differs between all-reduce and one device


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


def test_helpers_are_identity_outside_a_strategy():
    x = tf.ones([3, 2])
    assert distribute.cross_replica_concat(x) is x
    assert int(distribute.local_row_offset(3)) == 0
    assert float(distribute.global_count(3)) == 3.0
    assert distribute.num_replicas() == 1


def _run_check(out, *args, env=None, background=False):
    cmd = [sys.executable, "-m", "tf_twobranch.training.distributed_check", f"--out={out}",
           *args]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _weights(path):
    data = np.load(path)
    return {k: data[k] for k in data.files}


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
    out = tmp_path_factory.mktemp("single") / "w.npz"
    _run_check(out, "--steps=3")
    return _weights(out)


@pytest.mark.slow
def test_two_worker_processes_match_single_process_run(tmp_path, single_device_weights):
    ports = _free_ports(2)
    workers = []
    for index in range(2):
        tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                     "task": {"type": "worker", "index": index}}
        workers.append(_run_check(tmp_path / f"w{index}.npz", "--strategy=multi_worker",
                                  "--steps=3", env={"TF_CONFIG": json.dumps(tf_config)},
                                  background=True))
    for proc in workers:
        try:
            output, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in workers:
                p.kill()
            raise
        assert proc.returncode == 0, output
        assert "replicas=2" in output, output
    w0, w1 = _weights(tmp_path / "w0.npz"), _weights(tmp_path / "w1.npz")
    _assert_same_weights(w0, w1, tol=0.0)  # workers stay in lock-step
    _assert_same_weights(w0, single_device_weights)


def test_two_mirrored_replicas_match_single_device(tmp_path, single_device_weights):
    _run_check(tmp_path / "m.npz", "--strategy=mirrored", "--cpu_replicas=2", "--steps=3")
    _assert_same_weights(_weights(tmp_path / "m.npz"), single_device_weights)


@pytest.mark.slow
def test_similarity_network_two_replicas_match_single_device(tmp_path):
    _run_check(tmp_path / "s1.npz", "--model=similarity", "--steps=3")
    _run_check(tmp_path / "s2.npz", "--model=similarity", "--strategy=mirrored",
               "--cpu_replicas=2", "--steps=3")
    _assert_same_weights(_weights(tmp_path / "s1.npz"), _weights(tmp_path / "s2.npz"))
