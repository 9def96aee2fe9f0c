"""The scale benchmark's own parts: its memory sampler, its law, and the folders it writes."""
import pathlib
import sys

import numpy as np
import pytest

from benchmarks import bench_scale, scale_data


def test_growth_law_recovers_a_line():
    law = bench_scale.growth_law([1000, 2000, 4000], [500 + 0.02 * n for n in (1000, 2000, 4000)])
    assert law["slope_mb_per_image"] == pytest.approx(0.02)
    assert law["intercept_mb"] == pytest.approx(500)
    assert law["coco_gb"] == pytest.approx((500 + 0.02 * 113_287) / 1024)


def test_sampler_sees_a_child_allocate(tmp_path):
    code = "import numpy as np, time; a = np.ones(300 << 18, np.float32); time.sleep(0.5)"   # 300 MB
    figures = bench_scale.run_measured([sys.executable, "-c", code], tmp_path / "log", timeout=60)
    assert figures["exit_code"] == 0
    assert figures["peak_anon_mb"] > 280
    assert figures["peak_rss_mb"] >= figures["peak_anon_mb"]


def test_a_system_without_a_folder_runs_in_a_fresh_work_dir(tmp_path, monkeypatch):
    # the dual path writes no dataset folder: the work dir holding its log must be made all the same
    child = [sys.executable, "-c", "pass"]
    monkeypatch.setitem(bench_scale.BUILDERS, "dual_path", lambda *args, **kwargs: child)
    work = tmp_path / "not_yet"
    results = bench_scale.main(["--systems=dual_path", "--sizes=10,20", f"--work_dir={work}"])
    runs = results["systems"]["dual_path"]["runs"]
    assert [r["exit_code"] for r in runs] == [0, 0]
    assert (work / "dual_path_10.log").is_file() and (work / "dual_path_20.log").is_file()


@pytest.mark.skipif(not scale_data.FLICKR8K.is_dir(), reason="needs ../shared/realdata/flickr8k")
def test_synthetic_folder_reads_as_a_dataset(tmp_path):
    from tf_twobranch.data.retrieval_data import load_caption_splits
    from tf_twobranch.data.layout import resolve_dataset

    scale_data.write_caption_folder(tmp_path, 12, 3)
    splits = load_caption_splits(resolve_dataset(tmp_path))
    assert len(splits["train"].image_ids) == 12 and len(splits["test"].captions) == 15
    assert splits["train"].image_ids[0] == "s000000"
    rows = scale_data.write_random_rows(tmp_path / "f.npy", (7, 3, 2), "float16", nonnegative=True)
    stored = np.load(rows)
    assert stored.dtype == np.float16 and stored.shape == (7, 3, 2) and stored.min() >= 0


def test_text_features_is_a_named_system_of_five_captions_per_image(tmp_path):
    command = bench_scale.BUILDERS["text_features"](tmp_path / "f", 29_000, 100, "float32", tmp_path / "r")
    assert command[1:3] == ["-m", "benchmarks.bench_text_features"] and "--captions=145000" in command
    assert "text_features" not in bench_scale.SYSTEMS     # minutes per size: run when named


@pytest.mark.skipif(not (scale_data.REALDATA / "flickr30k").is_dir(), reason="needs ../shared/realdata/flickr30k")
def test_text_feature_benchmark_measures_fit_and_encoding_of_real_captions(tmp_path):
    from benchmarks import bench_text_features

    captions = bench_text_features.real_captions(155_075)
    assert len(captions) == 155_075 and captions[-5:] == captions[:5]   # dealt out again from the start
    result = bench_text_features.run(400, pca_dim=16, work_dir=tmp_path, components=3, word_dim=12)
    assert set(result["steps"]) == {"tokens", "fit", "encode"}
    assert result["steps"]["fit"]["output_dim"] == 16 and result["peak_rss_mb"] >= result["peak_anon_mb"] > 0
    assert not list(tmp_path.glob("*.npy"))
