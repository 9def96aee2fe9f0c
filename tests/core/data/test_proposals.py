"""Tests for the proposal file formats and the built-in proposal generator."""
import sys

import numpy as np
import pytest

from tf_twobranch.boxes import iou_matrix
from tf_twobranch.data.formats import proposals as pf
from tf_twobranch.data.proposal_generator import generate_proposals, generate_proposals_for_images
from tf_twobranch.errors import ConfigError, DataFormatError

BOXES = {
    "100": np.array([[0, 0, 9, 9], [5.5, 2, 20, 30]], np.float32),
    "200": np.array([[1, 2, 3, 4]], np.float32),
}
SCORES = {"100": np.array([0.9, 0.1], np.float32)}


@pytest.mark.parametrize("name, kwargs", [("p.h5", {}), ("dir_npy", {}), ("dir_txt", {"directory_format": "txt"}),
                                          ("dir_csv", {"directory_format": "csv"})])
def test_round_trip(tmp_path, name, kwargs):
    path = tmp_path / name
    pf.write_proposals(path, BOXES, SCORES, **kwargs)
    boxes, scores = pf.read_proposals(path, ["200", "100"], return_scores=True)
    assert list(boxes) == ["200", "100"]
    for key in BOXES:
        np.testing.assert_array_equal(boxes[key], BOXES[key])
        assert boxes[key].dtype == np.float32
    np.testing.assert_array_equal(scores["100"], SCORES["100"])
    assert scores["200"] is None
    assert set(pf.read_proposals(path)) == {"100", "200"}  # all images when no ids are given


def test_hdf5_layout(tmp_path):
    import h5py

    path = tmp_path / "p.hdf5"
    pf.write_proposals(path, BOXES, SCORES)
    with h5py.File(path, "r") as handle:
        assert set(handle.keys()) == {"100", "100_scores", "200"}
        assert handle["100"].shape == (2, 4) and handle["100"].dtype == np.float32
        assert handle.attrs["format"] == pf.FORMAT_NAME


def test_text_file_with_comments_and_commas(tmp_path):
    (tmp_path / "7.txt").write_text("# x1 y1 x2 y2\n1, 2, 30, 40\n\n0 0 5 5\n")
    boxes = pf.read_proposals(tmp_path, ["7"])
    np.testing.assert_array_equal(boxes["7"], [[1, 2, 30, 40], [0, 0, 5, 5]])


def test_missing_image_names_file_and_id(tmp_path):
    path = tmp_path / "p.h5"
    pf.write_proposals(path, BOXES)
    with pytest.raises(DataFormatError, match="no proposals for image 300") as info:
        pf.read_proposals(path, ["100", "300"])
    assert "p.h5" in str(info.value) and info.value.record == "300"
    pf.write_proposals(tmp_path / "d", BOXES)
    with pytest.raises(DataFormatError, match="no proposals for image 300"):
        pf.read_proposals(tmp_path / "d", ["300"])


def test_invalid_boxes_reported(tmp_path):
    (tmp_path / "7.txt").write_text("1 2 30 40\n10 2 5 40\n")
    with pytest.raises(DataFormatError, match="zero or negative area") as info:
        pf.read_proposals(tmp_path, ["7"])
    assert info.value.line == 2 and "7.txt" in str(info.value)
    (tmp_path / "8.txt").write_text("1 2 30\n")
    with pytest.raises(DataFormatError, match="x1 y1 x2 y2"):
        pf.read_proposals(tmp_path, ["8"])
    np.save(tmp_path / "9.npy", np.array([[0, 0, np.nan, 3]], np.float32))
    with pytest.raises(DataFormatError, match="NaN"):
        pf.read_proposals(tmp_path, ["9"])
    np.save(tmp_path / "7b.npy", np.zeros((3, 3), np.float32))
    with pytest.raises(DataFormatError, match=r"\(N, 4\)"):
        pf.read_proposals(tmp_path, ["7b"])


def test_ambiguous_and_missing_paths(tmp_path):
    np.save(tmp_path / "5.npy", np.zeros((1, 4), np.float32))
    (tmp_path / "5.txt").write_text("0 0 1 1\n")
    with pytest.raises(DataFormatError, match="several proposal files"):
        pf.read_proposals(tmp_path, ["5"])
    with pytest.raises(DataFormatError, match="not found"):
        pf.read_proposals(tmp_path / "nope.h5", ["5"])
    (tmp_path / "junk.h5").write_text("not hdf5")
    with pytest.raises(DataFormatError, match="HDF5"):
        pf.read_proposals(tmp_path / "junk.h5", ["5"])


def test_all_missing_images_reported_in_one_error(tmp_path):
    pf.write_proposals(tmp_path / "p.h5", BOXES)
    pf.write_proposals(tmp_path / "d", BOXES)
    for path in (tmp_path / "p.h5", tmp_path / "d"):
        with pytest.raises(DataFormatError, match=r"no proposals for image 300 \(2 of the 4 requested") as info:
            pf.read_proposals(path, ["100", "300", "200", "400"])
        assert info.value.record == "300" and str(path) in str(info.value)


def _truncated_file(tmp_path):
    path = tmp_path / "truncated.h5"
    pf.write_proposals(path, {str(i): np.tile(BOXES["100"], (20, 1)) for i in range(5)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_empty_and_text_hdf5_files_name_the_file(tmp_path):
    truncated = _truncated_file(tmp_path)
    empty = tmp_path / "empty.h5"
    empty.write_bytes(b"")
    text = tmp_path / "text.hdf5"
    text.write_text("1 2 3 4\n")
    for path, message in ((truncated, "not a readable HDF5 file"), (empty, r"empty \(0 bytes\)"),
                          (text, "not a readable HDF5 file")):
        for ids in (["1"], None):
            with pytest.raises(DataFormatError, match=message) as info:
                pf.read_proposals(path, ids)
            assert info.value.path == str(path)


def test_unreadable_dataset_names_file_and_image(tmp_path):
    import h5py

    path = tmp_path / "corrupt.h5"
    pf.write_proposals(path, BOXES, SCORES)
    with h5py.File(path, "r") as handle:
        header = h5py.h5o.get_info(handle["200"].id).addr
    data = bytearray(path.read_bytes())
    data[header:header + 16] = b"\xff" * 16  # the object header of dataset "200"
    path.write_bytes(bytes(data))
    np.testing.assert_array_equal(pf.read_proposals(path, ["100"])["100"], BOXES["100"])
    for ids in (["100", "200"], None):
        with pytest.raises(DataFormatError, match="cannot read the proposals of image 200") as info:
            pf.read_proposals(path, ids)
        assert info.value.record == "200" and "corrupt.h5" in str(info.value)


def test_fit_proposals_to_images_refuses_or_clips(tmp_path, caplog):
    path = tmp_path / "p.h5"
    inside = {"1": np.array([[0, 0, 255, 127], [3, 4, 256, 128]], np.float32)}  # second: within 1 px
    fitted, clipped = pf.fit_proposals_to_images(path, inside, {"1": (256, 128)})
    np.testing.assert_array_equal(fitted["1"], [[0, 0, 255, 127], [3, 4, 255, 127]])
    assert clipped == 1
    outside = {"1": inside["1"], "2": np.array([[0, 0, 10, 10], [5, 6, 900, 100]], np.float32)}
    sizes = {"1": (256, 128), "2": (256, 128)}
    with pytest.raises(DataFormatError) as info:
        pf.fit_proposals_to_images(path, outside, sizes)
    message = str(info.value)
    assert info.value.record == "2" and "p.h5" in message
    for part in ("box 1 [5, 6, 900, 100]", "256 x 128", "wrong scale", "--clip_proposals"):
        assert part in message
    fitted, clipped = pf.fit_proposals_to_images(path, outside, sizes, clip=True)
    np.testing.assert_array_equal(fitted["2"], [[0, 0, 10, 10], [5, 6, 255, 100]])
    assert clipped == 2


# ---------------------------------------------------------------- generator


def _synthetic_image(seed, height=240, width=320, count=4):
    rng = np.random.default_rng(seed)
    image = np.clip(rng.normal(128, 30, (height, width, 3)), 0, 255).astype(np.uint8)
    boxes = []
    while len(boxes) < count:
        box_w, box_h = rng.integers(20, width // 2), rng.integers(20, height // 2)
        x, y = rng.integers(0, width - box_w), rng.integers(0, height - box_h)
        box = [x, y, x + box_w - 1, y + box_h - 1]
        if boxes and iou_matrix([box], boxes).max() > 0:
            continue
        image[y:y + box_h, x:x + box_w] = rng.integers(0, 256, 3)
        boxes.append(box)
    return image, np.asarray(boxes, np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generator_recalls_rectangles(seed):
    image, truth = _synthetic_image(seed)
    proposals = generate_proposals(image, num_proposals=200, seed=0)
    assert proposals.shape == (200, 4) and proposals.dtype == np.float32
    assert (iou_matrix(truth, proposals).max(axis=1) >= 0.5).all()
    np.testing.assert_array_equal(proposals, generate_proposals(image, num_proposals=200, seed=0))


def test_generator_tiny_and_flat_images_return_exact_count():
    flat = np.full((20, 30, 3), 90, np.uint8)
    boxes = generate_proposals(flat, num_proposals=50)
    assert boxes.shape == (50, 4)
    assert (boxes[:, 2] <= 29).all() and (boxes[:, 3] <= 19).all() and (boxes >= 0).all()


def test_generator_on_real_jpeg(realdata, tmp_path):
    image_path = realdata / "flickr30k" / "images" / "4945942737.jpg"
    out = tmp_path / "proposals.h5"
    written = generate_proposals_for_images([image_path], out, num_proposals=100)
    boxes = pf.read_proposals(out, ["4945942737"])["4945942737"]
    np.testing.assert_array_equal(boxes, written["4945942737"])
    from PIL import Image

    with Image.open(image_path) as handle:
        width, height = handle.size
    assert boxes.shape == (100, 4)
    assert (boxes[:, 2] >= boxes[:, 0]).all() and (boxes[:, 3] >= boxes[:, 1]).all()
    assert (boxes[:, 2] <= width - 1).all() and (boxes[:, 3] <= height - 1).all()


def test_generator_bad_image_file(tmp_path):
    bad = tmp_path / "x.jpg"
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(DataFormatError, match="cannot decode"):
        generate_proposals_for_images([bad], tmp_path / "p.h5")


def _write_jpegs(directory, count, size=48):
    from PIL import Image

    paths = []
    for index in range(count):
        image, _ = _synthetic_image(10 + index, height=size, width=size + 8, count=2)
        path = directory / f"img{index}.jpg"
        Image.fromarray(image).save(path, quality=90)
        paths.append(path)
    return paths


@pytest.mark.parametrize("processes", [True, False], ids=["spawn_pool", "threads"])
def test_generator_workers_give_identical_results_in_order(tmp_path, monkeypatch, processes):
    from tf_twobranch.data import proposal_generator

    monkeypatch.setattr(proposal_generator, "_MIN_IMAGES_PER_WORKER", 1)  # use workers even for 6 images
    monkeypatch.setattr(proposal_generator, "spawn_pool_is_safe", lambda: processes)
    paths = _write_jpegs(tmp_path, 6)
    serial = generate_proposals_for_images(paths, tmp_path / "serial.h5", num_proposals=30, num_workers=1)
    parallel = generate_proposals_for_images(paths, tmp_path / "parallel", num_proposals=30, num_workers=2)
    assert list(parallel) == [f"img{i}" for i in range(6)] == list(serial)
    for image_id in serial:
        np.testing.assert_array_equal(parallel[image_id], serial[image_id])
    assert set(pf.read_proposals(tmp_path / "parallel")) == set(serial)


def test_an_unguarded_user_script_runs_once(tmp_path):
    """A plain script (no `if __name__ == "__main__"`) that generates proposals with workers must
    not be re-executed by them: a spawn pool re-imports __main__ in every worker."""
    import subprocess
    import sys

    _write_jpegs(tmp_path, 4)
    script = tmp_path / "plain_script.py"
    script.write_text(
        "import pathlib\n"
        "from tf_twobranch.data import proposal_generator as g\n"
        f"folder = pathlib.Path({str(tmp_path)!r})\n"
        "with open(folder / 'executions.txt', 'a') as f: f.write('run\\n')\n"
        "g._MIN_IMAGES_PER_WORKER = 1\n"
        "g.generate_proposals_for_images(sorted(folder.glob('*.jpg')), folder / 'p.h5', num_proposals=10, num_workers=2)\n"
        "print('done')\n")
    try:
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                                cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script hung; it ran {(tmp_path / 'executions.txt').read_text().count('run')} times")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "executions.txt").read_text().count("run") == 1
    assert "done" in result.stdout


def test_spawn_pool_only_under_this_projects_entry_points(monkeypatch):
    import types

    from tf_twobranch.data import proposal_generator

    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    main.__spec__ = None  # `python script.py`
    assert not proposal_generator.spawn_pool_is_safe()
    main.__spec__ = types.SimpleNamespace(name="experiments.fragments")
    assert proposal_generator.spawn_pool_is_safe()


def test_generator_workers_report_first_bad_image(tmp_path, monkeypatch):
    from tf_twobranch.data import proposal_generator

    monkeypatch.setattr(proposal_generator, "_MIN_IMAGES_PER_WORKER", 1)
    paths = _write_jpegs(tmp_path, 5)
    paths[3].write_bytes(b"not a jpeg")
    paths.append(tmp_path / "missing.jpg")
    with pytest.raises(DataFormatError, match="cannot decode") as info:
        generate_proposals_for_images(paths, tmp_path / "p.h5", num_proposals=10, num_workers=2)
    assert info.value.path.endswith("img3.jpg")
    with pytest.raises(ConfigError, match="num_workers"):
        generate_proposals_for_images(paths, tmp_path / "p.h5", num_workers=0)


def _reference_nms(candidates, scores, threshold, max_output):
    """One box at a time, the textbook way."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    kept = []
    for index in order:
        if len(kept) == max_output:
            break
        if not kept or iou_matrix(candidates[[index]], candidates[kept]).max() <= threshold:
            kept.append(index)
    return kept


@pytest.mark.parametrize("seed", [0, 1])
def test_blockwise_nms_matches_one_at_a_time(seed):
    from tf_twobranch.boxes import non_max_suppression

    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 40, (400, 2)).astype(np.float32)
    candidates = np.concatenate([corners, corners + rng.integers(1, 25, (400, 2))], axis=1).astype(np.float32)
    scores = rng.integers(0, 30, 400).astype(np.float64)  # many ties
    for threshold, max_output in [(0.5, 1000), (0.7, 150), (0.3, 40)]:
        expected = _reference_nms(candidates, scores, threshold, max_output)
        np.testing.assert_array_equal(non_max_suppression(candidates, scores, threshold, max_output), expected)
    # 1,500 near-copies of one box ranked first: NMS must look past the
    # presorted top of the ranking (the first 1,024) to find a second box.
    crowd = np.concatenate([np.tile([[0, 0, 20, 20]], (1500, 1)) + rng.integers(0, 2, (1500, 4)),
                            [[50, 50, 60, 60], [70, 0, 80, 9]]]).astype(np.float32)
    crowd_scores = np.concatenate([np.full(1500, 2.0), [1.0, 0.5]])
    np.testing.assert_array_equal(non_max_suppression(crowd, crowd_scores, 0.5, 3),
                                  _reference_nms(crowd, crowd_scores, 0.5, 3))


def test_descending_order_prefix_matches_stable_argsort():
    from tf_twobranch.boxes import descending_order_prefix

    rng = np.random.default_rng(5)
    scores = rng.integers(0, 6, 500).astype(np.float64)
    for count in (0, 1, 7, 100, 499, 500, 600):
        np.testing.assert_array_equal(descending_order_prefix(scores, count),
                                      np.argsort(-scores, kind="stable")[:count])
    scores[[3, 9]] = np.nan
    np.testing.assert_array_equal(descending_order_prefix(scores, 10), np.argsort(-scores, kind="stable")[:10])


def test_region_components_match_per_code_opening_and_labelling():
    from scipy import ndimage

    from tf_twobranch.data.proposal_generator import _opened_component_boxes

    rng = np.random.default_rng(3)
    codes = ndimage.zoom(rng.integers(0, 4, (2, 9, 11)), (1, 4, 4), order=0) - 1  # blobs; -1 is background
    codes[:, rng.random(codes.shape[1:]) < 0.05] = 2  # speckles
    expected = []
    for layer in codes:
        for code in np.unique(layer[layer >= 0]):
            labels, _ = ndimage.label(ndimage.binary_opening(layer == code))
            for index, (rows, cols) in enumerate(ndimage.find_objects(labels), start=1):
                if (labels == index).sum() >= 5:
                    expected.append([cols.start, rows.start, cols.stop - 1, rows.stop - 1])
    got = _opened_component_boxes(codes, 5)
    assert len(expected) > 5
    np.testing.assert_array_equal(np.unique(got, axis=0), np.unique(np.asarray(expected, np.float64), axis=0))
    binary = np.where(codes >= 1, 0, -1)
    expected_binary = np.unique(np.concatenate([_opened_component_boxes(layer[None], 5) for layer in binary]), axis=0)
    np.testing.assert_array_equal(np.unique(_opened_component_boxes(binary, 5, binary=True), axis=0), expected_binary)
