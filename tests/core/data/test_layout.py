"""The one dataset-layout resolver (tf_twobranch.data.layout) and the readers that use it."""
import numpy as np
import pytest
from PIL import Image

from experiments import common
from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats import (write_coco_captions, write_cuhk_pedes, write_karpathy_json,
                                       write_split_file, write_token_file)
from tf_twobranch.data.formats.cuhk_pedes import PedesSplit
from tf_twobranch.data.formats.flickr30k_entities import (ImageAnnotation, parse_sentence_line,
                                                          write_annotation_file, write_sentence_file)
from tf_twobranch.data.layout import DatasetLayout, resolve_dataset
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.errors import DataFormatError, UserInputError

IDS = ["1000", "1001", "1002", "1003", "1004", "1005"]
TRAIN, VAL, TEST = IDS[:3], IDS[3:4], IDS[4:]
COLOURS = ["red", "green", "blue", "black", "white", "brown"]


def _corpus(ids=IDS):
    return CaptionCorpus.from_pairs((i, f"A {COLOURS[n % 6]} dog number {n} runs on grass {k} .")
                                    for n, i in enumerate(ids) for k in range(2))


def _image(path, size=(24, 32), seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def _write_splits(root):
    for name, ids in (("train", TRAIN), ("val", VAL), ("test", TEST)):
        write_split_file(root / f"{name}.txt", ids)


def _write_entities(root, ids=IDS):
    """Flickr30K Entities files: one dog (chain 1, with a box) per image, the grass a scene chain."""
    (root / "Sentences").mkdir(parents=True, exist_ok=True)
    (root / "Annotations").mkdir(exist_ok=True)
    for n, image_id in enumerate(ids):
        write_sentence_file(root / "Sentences" / f"{image_id}.txt", [
            parse_sentence_line(f"[/EN#1/animals A {COLOURS[n % 6]} dog] runs on [/EN#2/scene the grass] ."),
            parse_sentence_line("[/EN#1/animals The dog] is fast .")])
        annotation = ImageAnnotation(32, 24, 3, {"1": np.array([[2, 3, 20, 18]], np.float32)}, ["2"], [])
        write_annotation_file(root / "Annotations" / f"{image_id}.xml", annotation, f"{image_id}.jpg")


def _flickr_folder(root, images="flickr30k-images", entities=True, splits=True):
    """A Flickr30K-layout folder: token file, split lists, Entities and JPEG/PNG images."""
    root.mkdir(parents=True, exist_ok=True)
    write_token_file(root / "results_20130124.token", _corpus())
    if splits:
        _write_splits(root)
    if entities:
        _write_entities(root)
    for n, image_id in enumerate(IDS):
        _image(root / images / f"{image_id}{'.png' if n == 1 else '.jpg'}", seed=n)
    return root


# ---------------------------------------------------------------- each layout resolves


def test_token_folder(tmp_path):
    root = _flickr_folder(tmp_path / "f30k", images="images")
    layout = resolve_dataset(root)
    assert isinstance(layout, DatasetLayout)
    assert layout.caption_format == "token" and layout.caption_file == root / "results_20130124.token"
    assert layout.split_files == {s: root / f"{s}.txt" for s in ("train", "val", "test")}
    assert layout.images_dir == root / "images" and layout.entities_dir == root
    assert layout.proposals is None and not layout.embedded
    assert layout.split_ids("train") == TRAIN
    splits = load_caption_splits(layout)
    assert [splits[s].image_ids for s in ("train", "val", "test")] == [TRAIN, VAL, TEST]
    assert layout.image_path("1001") == (root / "images" / "1001.png").absolute()
    layout.require("captions", "train", "val", "test", "images", "entities", purpose="everything")


def test_karpathy_folder(tmp_path):
    corpus = _corpus()
    write_karpathy_json(tmp_path / "dataset_flickr30k.json",
                        {"train": corpus.subset(TRAIN), "val": corpus.subset(VAL), "test": corpus.subset(TEST)},
                        dataset="flickr30k")
    layout = resolve_dataset(tmp_path)
    assert layout.caption_format == "karpathy"
    assert layout.caption_file == tmp_path / "dataset_flickr30k.json"
    assert layout.images_dir == tmp_path  # no images/ folder: the folder itself
    assert load_caption_splits(layout)["test"].image_ids == TEST


def test_coco_folder(tmp_path):
    corpus = _corpus()
    for split, ids in (("train", TRAIN), ("val", VAL)):
        write_coco_captions(tmp_path / "annotations" / f"captions_{split}2014.json", corpus.subset(ids))
    write_coco_captions(tmp_path / "annotations" / "captions_test2014.json", corpus.subset(TEST),
                        file_names={"1004": "photo_1004.jpg"})
    layout = resolve_dataset(tmp_path)
    assert layout.caption_format == "coco" and layout.caption_file is None
    assert sorted(layout.split_caption_files) == ["test", "train", "val"]
    test = load_caption_splits(layout)["test"]
    assert test.image_ids == TEST and test.file_names["1004"] == "photo_1004.jpg"
    _image(tmp_path / "photo_1004.jpg")
    assert layout.image_path("1004", file_name=test.file_names["1004"]) == (tmp_path / "photo_1004.jpg").absolute()


def test_precomp_folder(tmp_path):
    for prefix, num_images in (("train", 4), ("dev", 2), ("test", 2), ("testall", 3)):
        (tmp_path / f"{prefix}_caps.txt").write_text(
            "".join(f"a dog {i} caption {k}\n" for i in range(num_images) for k in range(5)))
        np.save(tmp_path / f"{prefix}_ims.npy", np.ones((num_images, 4), np.float32))
    layout = resolve_dataset(tmp_path)
    assert layout.caption_format == "precomp"
    assert layout.precomp_splits == {"train": "train", "val": "val", "test": "testall"}
    assert layout.split_caption_files["test"] == tmp_path / "testall_caps.txt"
    assert load_caption_splits(layout)["test"].num_images == 3
    with pytest.raises(UserInputError, match="do not apply to the precomp layout"):
        resolve_dataset(tmp_path, caption_format="precomp", split_files={"train": tmp_path / "x.txt"})


def test_cuhk_pedes_folder(tmp_path):
    pairs = [(f"cam/{i}.jpg", f"A person {i} in red") for i in range(4)]
    write_cuhk_pedes(tmp_path / "reid_raw.json",
                     {"train": PedesSplit(CaptionCorpus.from_pairs(pairs[:3]), [7, 7, 8]),
                      "test": PedesSplit(CaptionCorpus.from_pairs(pairs[3:]), [9])})
    for i in range(4):
        _image(tmp_path / "imgs" / "cam" / f"{i}.jpg", seed=i)
    layout = resolve_dataset(tmp_path)
    assert layout.caption_format == "cuhk_pedes" and layout.caption_file == tmp_path / "reid_raw.json"
    assert layout.images_dir == tmp_path / "imgs"
    assert layout.image_path("cam/2.jpg") == (tmp_path / "imgs" / "cam" / "2.jpg").absolute()
    assert resolve_dataset(tmp_path, caption_format="cuhk_pedes",
                           captions_path=tmp_path / "reid_raw.json") == layout
    assert load_caption_splits(layout)["train"].num_images == 3


def test_entities_folder_without_captions(tmp_path):
    _write_entities(tmp_path)
    _write_splits(tmp_path)
    layout = resolve_dataset(tmp_path)
    assert layout.caption_format is None and layout.entities_dir == tmp_path
    layout.require("entities", "train", "test", purpose="phrase localization")
    with pytest.raises(DataFormatError, match="no caption files found"):
        load_caption_splits(layout)


def test_embedded_dataset():
    from tf_twobranch.data.embedded import load_embedded_dataset
    root = load_embedded_dataset(with_proposals=False)
    layout = resolve_dataset(root)
    assert layout.embedded and layout.caption_format == "karpathy"
    assert layout.images_dir == root / "images" and layout.entities_dir == root
    assert set(layout.split_files) == {"train", "val", "test"}
    first = layout.split_ids("test")[0]
    assert layout.image_path(first) == (root / "images" / f"{first}.jpg").absolute()
    assert not resolve_dataset(root.parent).embedded


def test_bad_arguments(tmp_path):
    with pytest.raises(UserInputError, match="caption format"):
        resolve_dataset(tmp_path, caption_format="flickr")
    with pytest.raises(DataFormatError, match="missing.*does not exist"):
        resolve_dataset(tmp_path / "missing")


# ---------------------------------------------------- one folder, three experiments


class _Stop(Exception):
    """Raised by the hooks below once the paths an experiment reads are known."""


def _isr_flags(tmp_path, root):
    from experiments import two_branch_retrieval as isr
    cfg = tmp_path / "isr.cfg"
    cfg.write_text("--row_name=layout\n")
    return common.parse_flagfile(isr.define_flags, str(cfg), [
        f"--dataset_dir={root}", f"--features_cache={tmp_path / 'isr_cache'}", "--text_encoder=tfidf"])


def _pl_flags(tmp_path, root):
    from experiments import two_branch_region_phrase as pl
    cfg = tmp_path / "pl.cfg"
    cfg.write_text("--row_name=layout\n")
    return common.parse_flagfile(pl.define_flags, str(cfg), [
        f"--dataset_dir={root}", f"--features_cache={tmp_path / 'pl_cache'}", "--text_encoder=tfidf",
        "--max_proposals=5"])


def test_one_folder_resolves_identically_for_the_three_experiments(tmp_path, monkeypatch):
    from experiments import two_branch_retrieval as isr
    from experiments import two_branch_region_phrase as pl
    from tf_twobranch.systems.dual_path.data import dual_path_data_from_retrieval
    from tf_twobranch.features import prepare, prepare_regions

    root = _flickr_folder(tmp_path / "flickr30k")   # images in flickr30k-images/, one PNG
    layout = resolve_dataset(root)
    expected = {i: layout.image_path(i) for i in IDS}
    assert expected["1001"].name == "1001.png" and expected["1000"].parent.name == "flickr30k-images"
    assert all(p.is_file() and p.is_absolute() for p in expected.values())

    # Image-sentence retrieval: the training images the scene CNN is trained on.
    read = {}

    def stop_loading(paths, *args, **kwargs):
        read["image_sentence"] = [str(p) for p in paths]
        raise _Stop

    monkeypatch.setattr(prepare, "load_images_at_size", stop_loading)  # the name prepare imported
    with pytest.raises(_Stop):
        isr.load_data(_isr_flags(tmp_path, root))
    assert read["image_sentence"] == [str(expected[i]) for i in TRAIN]

    # Phrase localization: the images proposals are generated for (every split).
    def stop_proposals(image_paths, out_path, *args, image_ids=None, **kwargs):
        read["two_branch_region_phrase"] = dict(zip(image_ids, (str(p) for p in image_paths)))
        raise _Stop

    monkeypatch.setattr(prepare_regions, "generate_proposals_for_images", stop_proposals)  # its imported name
    with pytest.raises(_Stop):
        pl.load_data(_pl_flags(tmp_path, root))
    assert read["two_branch_region_phrase"] == {i: str(expected[i]) for i in IDS}

    # Dual path: the image files of every split.
    for split, ids in (("train", TRAIN), ("val", VAL), ("test", TEST)):
        data = dual_path_data_from_retrieval(layout, split, validate="header")
        assert data.image_paths == [str(expected[i]) for i in ids]


# ---------------------------------------------------------------- missing pieces


def test_missing_split_files_are_one_error_listing_found_and_missing(tmp_path):
    from tf_twobranch.systems.dual_path.data import dual_path_data_from_retrieval
    from tf_twobranch.features.prepare_regions import RegionFeatureSpec, prepare_phrase_localization

    root = _flickr_folder(tmp_path / "f30k", images="images", entities=False, splits=False)
    layout = resolve_dataset(root)
    for call in (lambda: load_caption_splits(layout),
                 lambda: dual_path_data_from_retrieval(layout)):
        with pytest.raises(DataFormatError) as info:
            call()
        message = str(info.value)
        assert str(root) in message
        assert "found results_20130124.token, images/ (6 files)" in message
        assert "missing: train.txt, test.txt" in message
    with pytest.raises(DataFormatError) as info:
        prepare_phrase_localization(layout, tmp_path / "cache", RegionFeatureSpec())
    message = str(info.value)
    assert "for phrase localization: found results_20130124.token, images/ (6 files)" in message
    assert "missing: train.txt, test.txt, Annotations/, Sentences/" in message


def test_missing_val_split_is_optional_for_the_token_format(tmp_path):
    root = _flickr_folder(tmp_path / "f30k", images="images")
    (root / "val.txt").unlink()
    assert sorted(load_caption_splits(root)) == ["test", "train"]


# ---------------------------------------------------------------- the one image rule


def test_image_folders_in_order_and_explicit(tmp_path):
    _image(tmp_path / "7.jpg")
    assert resolve_dataset(tmp_path).images_dir == tmp_path
    _image(tmp_path / "flickr30k-images" / "7.jpg")
    assert resolve_dataset(tmp_path).images_dir == tmp_path / "flickr30k-images"
    _image(tmp_path / "images" / "7.jpg")
    assert resolve_dataset(tmp_path).images_dir == tmp_path / "images"
    other = tmp_path / "elsewhere"
    _image(other / "7.jpeg")
    layout = resolve_dataset(tmp_path, images_dir=other)
    assert layout.images_dir == other and layout.image_path("7") == (other / "7.jpeg").absolute()


def test_flickr30k_images_and_coco_names_resolve(tmp_path):
    _image(tmp_path / "flickr30k-images" / "1000092795.jpg")
    _image(tmp_path / "flickr30k-images" / "train2014" / "COCO_train2014_000000000042.jpg")
    _image(tmp_path / "flickr30k-images" / "COCO_val2014_000000391895.jpg")
    _image(tmp_path / "flickr30k-images" / "val2017" / "000000000139.jpg")
    layout = resolve_dataset(tmp_path)
    folder = (tmp_path / "flickr30k-images").absolute()
    assert layout.image_path("1000092795") == folder / "1000092795.jpg"
    assert layout.image_path("42") == folder / "train2014" / "COCO_train2014_000000000042.jpg"
    assert layout.image_path("391895") == folder / "COCO_val2014_000000391895.jpg"
    assert layout.image_paths(["139", "42"]) == [folder / "val2017" / "000000000139.jpg",
                                                 folder / "train2014" / "COCO_train2014_000000000042.jpg"]
    with pytest.raises(DataFormatError, match=r"listing\.txt, record 'image 555': image file not found: "
                                              r"looked for 555\.jpg"):
        layout.image_path("555", source="listing.txt")


def test_real_flickr8k_folder_resolves_with_its_split_lists_and_parses(realdata):
    layout = resolve_dataset(realdata / "flickr8k")
    assert layout.caption_format == "token" and layout.caption_file.name == "Flickr8k.token.txt"
    assert {s: p.name for s, p in layout.split_files.items()} == {
        "train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt", "test": "Flickr_8k.testImages.txt"}
    assert layout.parses.name == "Flickr8k.token.conllu"
    splits = load_caption_splits(layout)
    assert {s: (c.num_images, c.num_captions) for s, c in splits.items()} == {
        "train": (6000, 30000), "val": (1000, 5000), "test": (1000, 5000)}


def test_embedded_parses_are_found_beside_the_captions(tmp_path):
    (tmp_path / "results_20130124.token").write_text("1000.jpg#0\ta red seven\n")
    assert resolve_dataset(tmp_path).parses is None
    (tmp_path / "captions.conllu").write_text("")
    assert resolve_dataset(tmp_path).parses == tmp_path / "captions.conllu"
