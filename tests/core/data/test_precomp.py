"""The vsepp/SCAN precomp layout: reader, dataset-folder recognition, the
image-sentence experiment and the COCO 1K/5K protocols on it."""
import json
import pathlib

import numpy as np
import pytest

from experiments import common
from tf_twobranch.data.formats import read_precomp_corpus, read_precomp_split
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.retrieval_data import load_caption_splits, load_precomp_splits
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError

COLOURS = ["red", "green", "blue", "yellow", "black", "white", "brown", "pink"]
THINGS = ["dog", "cat", "horse", "bird", "car", "boat", "tree", "house", "ball", "chair"]


def _captions(num_images, cpi=5):
    return [f"a {COLOURS[(i + k) % len(COLOURS)]} {THINGS[i % len(THINGS)]} number {k} "
            f"near the {THINGS[(3 * i + k) % len(THINGS)]}" for i in range(num_images)
            for k in range(cpi)]


def write_split(root, prefix, num_images, *, dim=8, regions=None, repeat=False, seed=0,
                cpi=5):
    """Writes {prefix}_caps.txt and {prefix}_ims.npy; returns the per-image features."""
    rng = np.random.default_rng(seed)
    shape = (num_images, regions, dim) if regions else (num_images, dim)
    feats = rng.normal(size=shape).astype(np.float32)
    stored = np.repeat(feats, cpi, axis=0) if repeat else feats
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{prefix}_caps.txt").write_text("\n".join(_captions(num_images, cpi)) + "\n",
                                             encoding="utf-8")
    np.save(root / f"{prefix}_ims.npy", stored)
    return feats


def make_precomp(root, *, n_train=20, n_test=10, n_dev=0, **kwargs):
    feats = {"train": write_split(root, "train", n_train, seed=1, **kwargs),
             "test": write_split(root, "test", n_test, seed=2, **kwargs)}
    if n_dev:
        feats["dev"] = write_split(root, "dev", n_dev, seed=3, **kwargs)
    return feats


# ------------------------------------------------------------------- reader

def test_reads_global_features(tmp_path):
    feats = make_precomp(tmp_path)
    corpus, image = read_precomp_split(tmp_path, "test")
    assert corpus.num_images == 10 and corpus.num_captions == 50
    assert corpus.image_ids[:2] == ["test_0", "test_1"]
    assert corpus.captions_per_image() == 5
    assert corpus.captions[:5] == _captions(10)[:5]
    assert corpus.source.endswith("test_caps.txt")
    np.testing.assert_array_equal(corpus.caption_image, np.repeat(np.arange(10), 5))
    assert image.dtype == np.float32 and image.shape == (10, 8)
    np.testing.assert_array_equal(image, feats["test"])
    corpus.validate()
    assert read_precomp_corpus(tmp_path, "test") == corpus


def test_region_features_are_averaged_or_kept(tmp_path):
    feats = make_precomp(tmp_path, regions=36)
    corpus, image = read_precomp_split(tmp_path, "train")
    assert image.shape == (20, 8)
    np.testing.assert_allclose(image, feats["train"].mean(axis=1), rtol=1e-6, atol=1e-6)
    _, regions = read_precomp_split(tmp_path, "train", keep_regions=True)
    assert regions.shape == (20, 36, 8)
    np.testing.assert_array_equal(regions, feats["train"])


def test_rows_used_as_stored_are_the_memory_map_of_the_file(tmp_path):
    make_precomp(tmp_path)
    _, image = read_precomp_split(tmp_path, "test")
    assert isinstance(image, np.memmap) and pathlib.Path(image.filename) == tmp_path / "test_ims.npy"
    make_precomp(tmp_path / "regions", regions=36)
    _, regions = read_precomp_split(tmp_path / "regions", "test", keep_regions=True)
    assert isinstance(regions, np.memmap) and pathlib.Path(regions.filename).name == "test_ims.npy"


def test_averaged_regions_are_written_once_into_a_memory_mapped_cache(tmp_path):
    feats = make_precomp(tmp_path / "data", regions=36)
    cache = tmp_path / "cache"
    _, image = read_precomp_split(tmp_path / "data", "train", cache_dir=cache)
    assert isinstance(image, np.memmap) and pathlib.Path(image.filename).parent == cache
    np.testing.assert_array_equal(image, feats["train"].mean(axis=1))  # same float32 means as before
    written = pathlib.Path(image.filename).stat().st_mtime_ns
    _, again = read_precomp_split(tmp_path / "data", "train", cache_dir=cache)
    assert again.filename == image.filename and pathlib.Path(again.filename).stat().st_mtime_ns == written
    _, half = read_precomp_split(tmp_path / "data", "train", cache_dir=cache, dtype="float16")
    assert half.dtype == np.float16 and half.filename != image.filename
    np.testing.assert_array_equal(half, feats["train"].mean(axis=1).astype(np.float16))


def test_keep_regions_on_global_features_gives_one_region(tmp_path):
    feats = make_precomp(tmp_path)
    _, regions = read_precomp_split(tmp_path, "test", keep_regions=True)
    assert regions.shape == (10, 1, 8)
    np.testing.assert_array_equal(regions[:, 0], feats["test"])


@pytest.mark.parametrize("regions", [None, 36])
def test_one_row_per_caption_uses_every_fifth_row(tmp_path, regions):
    """Releases that repeat each image once per caption (vsepp's im_div = 1)."""
    feats = make_precomp(tmp_path, regions=regions, repeat=True)
    corpus, image = read_precomp_split(tmp_path, "test", keep_regions=bool(regions))
    assert corpus.num_images == 10 and corpus.num_captions == 50
    np.testing.assert_array_equal(image, feats["test"])
    corpus, image = read_precomp_split(tmp_path, "train")
    assert image.shape == (20, 8)


def test_rows_per_caption_that_differ_still_use_the_first_of_each_group(tmp_path):
    write_split(tmp_path, "test", 4)
    stored = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)  # 20 distinct rows
    np.save(tmp_path / "test_ims.npy", stored)
    corpus, image = read_precomp_split(tmp_path, "test")
    np.testing.assert_array_equal(image, stored[::5])


def test_split_names(tmp_path):
    make_precomp(tmp_path, n_dev=4)
    write_split(tmp_path, "testall", 6)
    corpus, _ = read_precomp_split(tmp_path, "val")
    assert corpus.image_ids[0] == "dev_0" and corpus.num_images == 4
    assert read_precomp_split(tmp_path, "dev")[0] == corpus
    assert read_precomp_split(tmp_path, "testall")[0].num_images == 6
    with pytest.raises(ConfigError, match="validation"):
        read_precomp_split(tmp_path, "validation")


def test_val_split_may_be_named_val(tmp_path):
    write_split(tmp_path, "val", 3)
    assert read_precomp_split(tmp_path, "val")[0].image_ids[0] == "val_0"


def test_trailing_blank_lines_and_crlf_are_accepted(tmp_path):
    write_split(tmp_path, "test", 2)
    path = tmp_path / "test_caps.txt"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n") + b"\r\n\n")
    corpus, _ = read_precomp_split(tmp_path, "test")
    assert corpus.captions == _captions(2)


# --------------------------------------------------------------- bad input

def test_missing_captions_file(tmp_path):
    make_precomp(tmp_path)
    (tmp_path / "test_caps.txt").unlink()
    with pytest.raises(DataFormatError, match=r"test_caps\.txt.*does not exist"):
        read_precomp_split(tmp_path, "test")


def test_missing_image_file(tmp_path):
    make_precomp(tmp_path)
    (tmp_path / "test_ims.npy").unlink()
    with pytest.raises(DataFormatError, match=r"test_ims\.npy.*does not exist"):
        read_precomp_split(tmp_path, "test")


def test_caption_count_not_a_multiple_names_both_files_and_counts(tmp_path):
    write_split(tmp_path, "test", 10)
    path = tmp_path / "test_caps.txt"
    path.write_text("\n".join(_captions(10)[:-2]) + "\n", encoding="utf-8")  # 48 captions
    with pytest.raises(DataFormatError) as e:
        read_precomp_split(tmp_path, "test")
    message = str(e.value)
    assert "test_caps.txt" in message and "test_ims.npy" in message
    assert "48 captions" in message and "10 image rows" in message and "multiple" in message


def test_wrong_number_of_captions_per_image(tmp_path):
    write_split(tmp_path, "test", 10, cpi=3)  # 30 captions for 10 rows
    with pytest.raises(DataFormatError, match=r"test_caps\.txt.*30 captions is 3 per image "
                                              r"row, not 5 in .*test_ims\.npy"):
        read_precomp_split(tmp_path, "test")
    corpus, _ = read_precomp_split(tmp_path, "test", captions_per_image=3)
    assert corpus.captions_per_image() == 3


def test_empty_caption_line_gives_its_line_number(tmp_path):
    write_split(tmp_path, "test", 3)
    path = tmp_path / "test_caps.txt"
    lines = path.read_text(encoding="utf-8").split("\n")
    lines[6] = "   "
    path.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"test_caps\.txt, line 7: empty caption"):
        read_precomp_split(tmp_path, "test")


def test_non_utf8_captions_give_the_line(tmp_path):
    write_split(tmp_path, "test", 3)
    path = tmp_path / "test_caps.txt"
    lines = path.read_bytes().split(b"\n")
    lines[3] = b"a caf\xe9 with a dog"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(DataFormatError, match=r"test_caps\.txt, line 4: .*UTF-8"):
        read_precomp_split(tmp_path, "test")


def test_empty_captions_file(tmp_path):
    write_split(tmp_path, "test", 3)
    (tmp_path / "test_caps.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"test_caps\.txt: holds no captions"):
        read_precomp_split(tmp_path, "test")


@pytest.mark.parametrize("array, expected", [
    (np.ones(15, np.float32), r"shape \(15,\); expected a 2-D"),
    (np.ones((3, 2, 2, 2), np.float32), r"shape \(3, 2, 2, 2\); expected a 2-D"),
    (np.array([["a", "b"]] * 3), r"dtype <U1; expected a float array"),
    (np.ones((3, 0), np.float32), r"shape \(3, 0\); expected at least one"),
])
def test_image_array_must_be_2d_or_3d_float(tmp_path, array, expected):
    write_split(tmp_path, "test", 3)
    np.save(tmp_path / "test_ims.npy", array)
    with pytest.raises(DataFormatError, match=r"test_ims\.npy: .*" + expected):
        read_precomp_split(tmp_path, "test")


def test_pickled_object_array_is_reported(tmp_path):
    write_split(tmp_path, "test", 3)
    np.save(tmp_path / "test_ims.npy", np.array([{"a": 1}] * 3, dtype=object), allow_pickle=True)
    with pytest.raises(DataFormatError, match=r"test_ims\.npy: array has dtype object"):
        read_precomp_split(tmp_path, "test")


@pytest.mark.parametrize("regions", [None, 36])
def test_nan_rows_are_reported_with_the_row(tmp_path, regions):
    feats = write_split(tmp_path, "test", 4, regions=regions)
    feats[2, ..., 1] = np.nan
    np.save(tmp_path / "test_ims.npy", feats)
    with pytest.raises(DataFormatError, match=r"test_ims\.npy, record 'row 2': NaN/inf values "
                                              r"in image row 2 \(image 2, 'test_2'\)"):
        read_precomp_split(tmp_path, "test", keep_regions=bool(regions))


def test_inf_in_repeated_rows_names_the_stored_row(tmp_path):
    feats = write_split(tmp_path, "test", 4, repeat=True)
    stored = np.repeat(feats, 5, axis=0)
    stored[15:20, 0] = np.inf  # image 3
    np.save(tmp_path / "test_ims.npy", stored)
    with pytest.raises(DataFormatError, match=r"row 15 \(image 3"):
        read_precomp_split(tmp_path, "test")


@pytest.mark.parametrize("keep", [100, 30, 3])
def test_truncated_npy_names_the_file(tmp_path, keep):
    write_split(tmp_path, "test", 4, regions=36)
    path = tmp_path / "test_ims.npy"
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(DataFormatError, match=r"test_ims\.npy: is truncated") as e:
        read_precomp_split(tmp_path, "test")
    assert "Traceback" not in str(e.value)


def test_file_that_is_not_npy(tmp_path):
    write_split(tmp_path, "test", 2)
    (tmp_path / "test_ims.npy").write_text("image features\n1 2 3\n")
    with pytest.raises(DataFormatError, match=r"test_ims\.npy: is truncated or not a NumPy"):
        read_precomp_split(tmp_path, "test")


# ------------------------------------------------------ dataset recognition

def test_precomp_folder_is_recognised(tmp_path):
    feats = make_precomp(tmp_path, n_dev=4)
    assert resolve_dataset(tmp_path).caption_format == "precomp"
    splits = load_caption_splits(tmp_path)
    assert sorted(splits) == ["test", "train", "val"]
    assert splits["train"].num_images == 20 and splits["val"].image_ids[0] == "dev_0"
    assert load_caption_splits(resolve_dataset(tmp_path, caption_format="precomp"))["test"] == splits["test"]
    corpora, images = load_precomp_splits(tmp_path)
    assert corpora["test"] == splits["test"]
    np.testing.assert_array_equal(images["train"], feats["train"])


def test_testall_is_preferred_as_the_test_split(tmp_path):
    make_precomp(tmp_path, n_test=5)
    write_split(tmp_path, "testall", 25)
    splits = load_caption_splits(tmp_path)
    assert splits["test"].num_images == 25 and splits["test"].image_ids[0] == "testall_0"
    (tmp_path / "test_caps.txt").unlink()
    assert load_caption_splits(tmp_path)["test"].num_images == 25


def test_folder_without_test_captions_is_not_precomp(tmp_path):
    write_split(tmp_path, "train", 3)
    with pytest.raises(DataFormatError, match="no caption files found.*precomp"):
        load_caption_splits(tmp_path)


def test_precomp_format_on_a_folder_without_it(tmp_path):
    with pytest.raises(DataFormatError, match=r"train_caps\.txt.*does not exist"):
        load_caption_splits(resolve_dataset(tmp_path, caption_format="precomp"))


def test_caption_count_error_reaches_load_caption_splits(tmp_path):
    make_precomp(tmp_path)
    np.save(tmp_path / "train_ims.npy", np.ones((19, 8), np.float32))
    with pytest.raises(DataFormatError, match=r"train_caps\.txt: 100 captions .*19 image rows"):
        load_caption_splits(tmp_path)


# --------------------------------------------- item 7a: empty split file

def _token_dataset(root, test_ids):
    root.mkdir(parents=True, exist_ok=True)
    ids = [str(1000 + i) for i in range(6)]
    lines = [f"{i}.jpg#{k}\ta {COLOURS[k]} dog number {i}" for i in ids for k in range(5)]
    (root / "results_20130124.token").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "train.txt").write_text("\n".join(ids[:4]) + "\n", encoding="utf-8")
    (root / "test.txt").write_text("".join(f"{i}\n" for i in test_ids), encoding="utf-8")
    return root


def test_empty_test_split_file_is_named(tmp_path):
    root = _token_dataset(tmp_path / "f30k", [])
    with pytest.raises(DataFormatError, match=r"test\.txt: split file for 'test' lists no "
                                              r"image ids"):
        load_caption_splits(root)
    (root / "test.txt").write_text("\n  \n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"test\.txt: .*lists no image ids"):
        load_caption_splits(root)


def test_empty_test_split_file_with_feature_flags(tmp_path):
    """The issue: this used to be reported as 'im_test.npy ... expected 0 rows'."""
    from experiments import two_branch_retrieval as isr
    root = _token_dataset(tmp_path / "f30k", [])
    flag_paths = []
    for kind, rows in (("image", {"train": 4, "test": 0}), ("text", {"train": 20, "test": 0})):
        for split, n in rows.items():
            path = tmp_path / f"{kind}_{split}.npy"
            np.save(path, np.ones((n, 4), np.float32))
            flag_paths.append(f"--{kind}_features_{split}={path}")
    fv = _flags(tmp_path, root, *flag_paths)
    with pytest.raises(DataFormatError) as e:
        isr.load_data(fv)
    assert "test.txt" in str(e.value) and "lists no image ids" in str(e.value)
    assert "0 rows" not in str(e.value)


# ------------------------------------------------------ the experiment on it

def _flags(tmp_path, dataset, *extra):
    from experiments import two_branch_retrieval as isr
    cfg = tmp_path / "row.cfg"
    cfg.write_text("--row_name=precomp_row\n")
    return common.parse_flagfile(isr.define_flags, str(cfg),
                                 [f"--dataset_dir={dataset}", "--epochs=1", "--batch_size=8",
                                  "--text_encoder=mean_vector", "--word_dim=8",
                                  "--hidden_dim=16", "--embed_dim=8", "--export=false",
                                  "--verbose=0", "--top_k=3", f"--run_dir={tmp_path / 'run'}",
                                  *extra])


def test_load_data_takes_images_from_ims_and_encodes_the_captions(tmp_path):
    from experiments import two_branch_retrieval as isr
    feats = make_precomp(tmp_path / "data", regions=36)
    dataset_dir, splits, image, text, extras = isr.load_data(_flags(tmp_path, tmp_path / "data"))
    assert splits["train"].num_images == 20 and splits["test"].num_captions == 50
    np.testing.assert_allclose(image["test"], feats["test"].mean(axis=1), atol=1e-6)
    assert text["train"].shape[0] == 100 and text["test"].shape[0] == 50
    assert text["train"].dtype == np.float32 and np.isfinite(text["test"]).all()
    # Text features, the fitted encoder and the region means are cached in
    # --features_cache (default <dataset_dir>/features), all memory-mapped.
    cache = tmp_path / "data" / "features"
    assert list(cache.glob("text_mean_vector_*/text_features_test.npy"))
    assert list(cache.glob("text_encoders/mean_vector_*.npz"))
    assert isinstance(image["train"], np.memmap) and isinstance(text["train"], np.memmap)
    assert extras["feature_files"]["test"]["text"]["file"].startswith(str(cache))


def test_load_data_with_given_text_features(tmp_path):
    from experiments import two_branch_retrieval as isr
    make_precomp(tmp_path / "data")
    for split, n in (("train", 100), ("test", 50)):
        np.save(tmp_path / f"tx_{split}.npy", np.full((n, 3), 0.5, np.float32))
    fv = _flags(tmp_path, tmp_path / "data", "--caption_format=precomp",
                f"--text_features_train={tmp_path / 'tx_train.npy'}",
                f"--text_features_test={tmp_path / 'tx_test.npy'}")
    _, _, image, text, _ = isr.load_data(fv)
    assert image["train"].shape == (20, 8) and text["test"].shape == (50, 3)
    fv = _flags(tmp_path, tmp_path / "data", f"--text_features_train={tmp_path / 'tx_train.npy'}")
    with pytest.raises(UserInputError, match="text_features_test"):
        isr.load_data(fv)


@pytest.mark.slow
def test_image_sentence_experiment_runs_on_a_precomp_folder(tmp_path):
    from experiments import two_branch_retrieval as isr
    make_precomp(tmp_path / "data", regions=36)
    record = isr.run(_flags(tmp_path, tmp_path / "data"))
    m = record["metrics"]
    recalls = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
    for key in recalls:
        assert 0.0 <= m[key] <= 100.0
    assert m["rsum"] == pytest.approx(sum(m[k] for k in recalls))
    assert record["num_test_images"] == 10 and record["num_test_captions"] == 50
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["metrics"] == m


# ------------------------------------------- COCO protocols on a precomp test set

def _reference_metrics(image, text, caption_image, ks=(1, 5, 10), block=1000):
    """vsepp's i2t/t2i ranks by brute force (numpy), in blocks of queries."""
    t2i = np.empty(len(text), np.int64)
    for lo in range(0, len(text), block):
        s = text[lo:lo + block] @ image.T  # (captions, images)
        pos = s[np.arange(len(s)), caption_image[lo:lo + block]]
        t2i[lo:lo + block] = (s > pos[:, None]).sum(axis=1) + 1
    i2t = np.empty(len(image), np.int64)
    for lo in range(0, len(image), block):
        s = image[lo:lo + block] @ text.T  # (images, captions)
        positive = caption_image[None, :] == np.arange(lo, lo + len(s))[:, None]
        best = np.where(positive, s, -np.inf).max(axis=1)
        i2t[lo:lo + block] = ((s > best[:, None]) & ~positive).sum(axis=1) + 1
    out = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in ks:
            out[f"{name}_r{k}"] = 100.0 * np.mean(ranks <= k)
        out[f"{name}_medr"] = np.floor(np.median(ranks - 1)) + 1
    return out


@pytest.mark.slow
def test_coco_1k_and_5k_protocols_on_a_precomp_test_set(tmp_path):
    from tf_twobranch.evaluation.retrieval import evaluate_protocol
    rng = np.random.default_rng(0)
    dim = 8
    image = rng.normal(size=(5000, dim)).astype(np.float32)
    np.save(tmp_path / "testall_ims.npy", image)
    (tmp_path / "testall_caps.txt").write_text(
        "".join(f"caption {k} of image {i}\n" for i in range(5000) for k in range(5)),
        encoding="utf-8")
    corpus, read_image = read_precomp_split(tmp_path, "testall")
    assert corpus.num_images == 5000 and corpus.num_captions == 25000
    np.testing.assert_array_equal(read_image, image)
    # Sentence "embeddings": a noisy copy of their image, so recalls are in (0, 100).
    text = (read_image[corpus.caption_image]
            + 1.5 * rng.normal(size=(25000, dim))).astype(np.float32)
    caption_image = corpus.caption_image

    five_k = evaluate_protocol(read_image, text, caption_image, "coco_5k")  # the whole set
    reference = _reference_metrics(read_image.astype(np.float64), text.astype(np.float64),
                                   caption_image)
    # float64 brute force vs the core's float32 blocks: allow a rare near-tie flip.
    for key, value in reference.items():
        assert five_k[key] == pytest.approx(value, abs=0.05), key
    assert 0 < five_k["i2t_r1"] < 100 and 0 < five_k["t2i_r10"] < 100

    one_k = evaluate_protocol(read_image, text, caption_image, "coco_1k")
    folds = []
    for f in range(5):
        images = read_image[1000 * f:1000 * (f + 1)]
        rows = slice(5000 * f, 5000 * (f + 1))  # captions grouped by image, 5 per image
        fold_captions = caption_image[rows] - 1000 * f
        fold = evaluate_protocol(images, text[rows], fold_captions, "full")
        folds.append(fold)
    reference = _reference_metrics(read_image[:1000].astype(np.float64),
                                   text[:5000].astype(np.float64), caption_image[:5000])
    for key, value in reference.items():
        assert folds[0][key] == pytest.approx(value, abs=0.05), key
    for key in folds[0]:
        assert one_k[key] == pytest.approx(np.mean([m[key] for m in folds])), key
    assert one_k["i2t_r1"] > five_k["i2t_r1"]  # a 1K gallery is easier than 5K
