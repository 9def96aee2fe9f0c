"""Row arrays on disk: memory-mapped reads, block writes, sharded caches that resume."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.data.formats import row_arrays as R
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.sampling.row_gather import gather_op


def test_row_writer_writes_blocks_and_renames_into_place(tmp_path):
    data = np.random.default_rng(0).normal(size=(37, 3, 4)).astype(np.float32)
    path = tmp_path / "a.npy"
    with R.RowWriter(path, data.shape, np.float16) as out:
        for start in range(0, 37, 10):
            out[start:start + 10] = data[start:start + 10]
        assert not path.exists()                     # only complete files appear
    back = R.open_rows(path)
    assert isinstance(back, np.memmap) and back.dtype == np.float16
    np.testing.assert_allclose(back, data.astype(np.float16))


def test_row_writer_leaves_nothing_when_the_build_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with R.RowWriter(tmp_path / "a.npy", (4, 2)) as out:
            out[0:2] = 1
            raise RuntimeError("backbone failed")
    assert list(tmp_path.iterdir()) == []


def test_write_rows_blocks_equal_the_array(tmp_path):
    data = np.arange(600, dtype=np.float32).reshape(100, 6)
    R.write_rows(tmp_path / "b.npy", data, block_bytes=7 * 24)
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), data)


def test_sharded_rows_index_like_the_array_and_resume(tmp_path):
    data = np.random.default_rng(1).normal(size=(23, 2, 3)).astype(np.float32)
    folder = tmp_path / "maps"
    writer = R.ShardedRowWriter(folder, (2, 3), np.float32, shard_bytes=5 * 24)   # 5 rows a shard
    writer.append(data[:7])
    writer.append(data[7:12])
    assert writer.rows_done == 10           # two whole shards on disk, 2 rows pending are lost on a crash
    with pytest.raises(DataFormatError, match="rows.json"):
        R.open_rows(folder)
    resumed = R.ShardedRowWriter(folder, (2, 3), np.float32, shard_bytes=5 * 24)
    assert resumed.rows_done == 10
    resumed.append(data[10:])
    rows = resumed.finish()
    assert rows.shape == data.shape and len(rows) == 23
    again = R.open_rows(folder)
    np.testing.assert_array_equal(again[3:21], data[3:21])
    np.testing.assert_array_equal(again[[22, 0, 9, 10, -1]], data[[22, 0, 9, 10, -1]])
    np.testing.assert_array_equal(again[11], data[11])
    np.testing.assert_array_equal(np.asarray(again), data)
    assert json.loads((folder / "rows.json").read_text())["shards"] == [5, 5, 5, 5, 3]


def test_sharded_writer_refuses_a_folder_of_other_rows(tmp_path):
    w = R.ShardedRowWriter(tmp_path, (3,), np.float32, shard_bytes=12)
    w.append(np.zeros((2, 3), np.float32))
    with pytest.raises(DataFormatError, match="remove the folder"):
        R.ShardedRowWriter(tmp_path, (4,), np.float32)


def test_finite_check_names_the_file_and_first_bad_row(tmp_path):
    data = np.ones((50, 4), np.float32)
    data[31, 2] = np.nan
    data[40, 0] = np.inf
    with pytest.raises(DataFormatError, match=r"x\.npy.*2 rows; the first is row 31"):
        R.check_finite_rows(data, tmp_path / "x.npy", block_bytes=64)
    R.check_finite_rows(np.ones((5, 2)), "ok.npy")


def test_truncated_npy_is_a_format_error(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.ones((100, 10), np.float32))
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(DataFormatError, match="truncated"):
        R.open_rows(path)


def test_storage_dtype_names_the_choices():
    assert R.storage_dtype("float16") == np.float16
    with pytest.raises(ConfigError, match="float32"):
        R.storage_dtype("int8")


def test_gather_op_reads_rows_of_a_memmap_and_widens_half(tmp_path):
    data = np.random.default_rng(2).normal(size=(30, 5)).astype(np.float16)
    np.save(tmp_path / "h.npy", data)
    mapped = R.open_rows(tmp_path / "h.npy")
    ds = tf.data.Dataset.from_tensor_slices([[3, 1, 29], [0, 0, 7]]).map(lambda i: gather_op(mapped, i))
    got = [b.numpy() for b in ds]
    assert got[0].dtype == np.float32 and ds.element_spec.shape.as_list() == [3, 5]
    np.testing.assert_array_equal(got[0], data[[3, 1, 29]].astype(np.float32))
    ids = np.arange(12, dtype=np.int32).reshape(6, 2)
    out = gather_op(ids, tf.constant([5, 2]))
    assert out.dtype == tf.int32 and out.numpy().tolist() == [[10, 11], [4, 5]]


def test_two_processes_filling_the_same_cache_at_once_both_finish(tmp_path):
    # Two runs on one dataset folder may build the same feature cache side by side: each writes
    # its own temporary file and renames it into place (the last rename wins; the rows are equal).
    path = tmp_path / "features.npy"
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    opened, release = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with R.RowWriter(path, rows.shape) as out:
                out[:] = rows
                os.write(opened[1], b"x")
                os.read(release[0], 1)       # the parent has its own writer open
            code = 0
        finally:
            os._exit(code)
    os.read(opened[0], 1)
    with R.RowWriter(path, rows.shape) as out:
        out[:] = rows
        os.write(release[1], b"x")
        _, status = os.waitpid(pid, 0)      # the child renames its file first
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(np.load(path), rows)
    assert [p.name for p in tmp_path.iterdir()] == ["features.npy"]


def test_a_killed_builds_temporary_file_is_removed_and_a_running_ones_kept(tmp_path):
    path = tmp_path / "maps.npy"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)                          # a process that has exited
    left = tmp_path / f".tmp_{dead_pid}_maps.npy"        # what a killed build leaves
    running = tmp_path / f".tmp_{os.getppid()}_maps.npy"  # a live process's work in progress
    other = tmp_path / f".tmp_{dead_pid}_other.npy"      # another file's
    for p in (left, running, other):
        p.write_bytes(b"partial")
    with R.RowWriter(path, (2, 2)) as out:
        out[:] = 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["maps.npy", running.name, other.name])
    assert R.temp_beside(path) == tmp_path / f".tmp_{os.getpid()}_maps.npy"


# ---------------------------------------------------------------- issue 39, item 10: RSS and scans once

def _rss_file_kib() -> int:
    from tf_twobranch import memory
    return memory.status_kib("self", ("RssFile",)).get("RssFile", 0)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status")
def test_writing_and_checking_rows_maps_no_pages_into_the_process(tmp_path):
    # Written through the map, every page of the output counted in the process's RSS (13.6 GB of
    # COCO sentence features); written with pwrite and read back with pread, none does.
    rows, dim = 4096, 4096                                   # 64 MB of float32
    block = np.ones((256, dim), np.float32)
    path = tmp_path / "big.npy"
    before = _rss_file_kib()
    with R.RowWriter(path, (rows, dim), np.float32) as out:
        for start in range(0, rows, 256):
            out[start:start + 256] = block
        written = _rss_file_kib() - before
        R.check_finite_rows(out.array, path)
        checked = _rss_file_kib() - before
    assert written < 16 << 10, f"writing mapped {written >> 10} MB"
    assert checked < 16 << 10, f"the finite check mapped {checked >> 10} MB"
    stored = np.load(path, mmap_mode="r")
    assert stored.shape == (rows, dim) and float(stored[-1, -1]) == 1.0 and float(stored[0, 0]) == 1.0


def test_read_rows_equals_slicing_for_maps_views_and_shards(tmp_path):
    data = np.arange(7 * 3 * 2, dtype=np.float16).reshape(7, 3, 2)
    np.save(tmp_path / "a.npy", data)
    mapped = R.open_rows(tmp_path / "a.npy")
    for start, stop in ((0, 7), (2, 5), (6, 9), (4, 4)):
        np.testing.assert_array_equal(R.read_rows(mapped, start, stop), data[start:stop])
        np.testing.assert_array_equal(R.read_rows(mapped[1:], start, stop), data[1:][start:stop])
    writer = R.ShardedRowWriter(tmp_path / "s", (3, 2), np.float16, shard_bytes=2 * 3 * 2 * 2)
    writer.append(data)
    sharded = writer.finish()
    np.testing.assert_array_equal(R.read_rows(sharded, 1, 6), data[1:6])
    # a broadcast row and a scalar are written as the map would have written them
    with R.RowWriter(tmp_path / "b.npy", (4, 2), np.float32) as out:
        out[0:2] = np.array([1.0, 2.0])
        out[2:4] = 3
        out[1] = np.array([5.0, 6.0])
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), [[1, 2], [5, 6], [3, 3], [3, 3]])


def test_a_file_is_scanned_once_per_version(tmp_path, monkeypatch):
    from tf_twobranch.data.formats import load_feature_matrix
    from tf_twobranch.data.formats import features as F

    calls = []
    real = F._check_finite
    monkeypatch.setattr(F, "_check_finite", lambda *a: calls.append(a[0]) or real(*a))
    path = tmp_path / "f.npy"
    np.save(path, np.ones((50, 8), np.float32))
    load_feature_matrix(path, expected_rows=50)
    load_feature_matrix(path, expected_rows=50)
    assert len(calls) == 1                                   # the second load read the record
    assert (tmp_path / "f.npy.checked.json").is_file()
    # An edit that keeps the size and (restored) time is noticed by the sampled bytes
    stat = os.stat(path)
    bad = np.ones((50, 8), np.float32)
    bad[0, 3] = np.nan
    np.save(path, bad)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DataFormatError, match="NaN/inf"):
        load_feature_matrix(path, expected_rows=50)
    assert len(calls) == 2
    np.save(path, np.ones((50, 8), np.float32) * 2)
    load_feature_matrix(path, expected_rows=50)
    assert len(calls) == 3


def test_backbone_maps_and_fragments_are_scanned_once(tmp_path, monkeypatch):
    from tf_twobranch.systems.fragments import image_fragments
    from tf_twobranch.systems.npair.features import load_backbone_maps

    scans = []
    real_check = R.check_finite_rows
    monkeypatch.setattr(R, "check_finite_rows", lambda *a, **k: scans.append("maps") or real_check(*a, **k))
    np.save(tmp_path / "maps.npy", np.ones((4, 2, 2, 3), np.float16))
    for _ in range(3):
        load_backbone_maps(tmp_path / "maps.npy", expected_images=4)
    assert scans == ["maps"]

    real_mask = image_fragments._padding_mask
    monkeypatch.setattr(image_fragments, "_padding_mask", lambda *a, **k: scans.append("mask") or real_mask(*a, **k))
    fragments = np.ones((5, 4, 3), np.float32)
    fragments[2, 1:] = 0
    np.save(tmp_path / "frag.npy", fragments)
    masks = [image_fragments.load_fragment_features(tmp_path / "frag.npy", expected_images=5)[1] for _ in range(3)]
    assert scans == ["maps", "mask"]
    for mask in masks:
        np.testing.assert_array_equal(mask, np.abs(fragments).sum(axis=2) > 0)
    fragments[0, 0, 0] = np.inf
    np.save(tmp_path / "frag.npy", fragments)
    with pytest.raises(DataFormatError, match="NaN or inf"):
        image_fragments.load_fragment_features(tmp_path / "frag.npy", expected_images=5)


def test_a_read_only_folder_keeps_its_record_in_the_user_cache(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    np.save(folder / "f.npy", np.ones((3, 2), np.float32))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(R.os, "access", lambda path, mode: False)
    record = R.scan_record_path(folder / "f.npy")
    assert str(record).startswith(str(tmp_path / "home" / ".cache" / "tf_twobranch"))
    calls = []
    R.checked_once(folder / "f.npy", "x", lambda: calls.append(1) or {"ok": 1})
    assert R.checked_once(folder / "f.npy", "x", lambda: calls.append(1) or {"ok": 1}) == {"ok": 1}
    assert calls == [1] and record.is_file()
