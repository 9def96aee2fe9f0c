"""Tests of the embedded digit-scene dataset (tf_twobranch.data.embedded)."""
from __future__ import annotations

import collections
import itertools
import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from tf_twobranch.data import embedded
from tf_twobranch.data import scene_grammar as grammar
from tf_twobranch.data.formats.coco_captions import read_coco_captions
from tf_twobranch.data.formats.flickr30k_entities import (NOTVISUAL_TYPE, read_annotation_file,
                                                          read_entities_dataset, read_sentence_file)
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.data.formats.karpathy_json import read_karpathy_json
from tf_twobranch.data.formats.splits import read_split_file
from tf_twobranch.errors import ConfigError

SMALL = dict(num_images=60, splits=(36, 12, 12), image_size=96, seed=3, with_proposals=False)
TEXT_SUFFIXES = {".txt", ".token", ".json", ".xml"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> pathlib.Path:
    return embedded.generate_embedded_dataset(tmp_path_factory.mktemp("a") / "digits", **SMALL)


@pytest.fixture(scope="module")
def dataset_again(tmp_path_factory) -> pathlib.Path:
    return embedded.generate_embedded_dataset(tmp_path_factory.mktemp("b") / "digits", **SMALL)


@pytest.fixture(scope="module")
def corpus(dataset):
    return read_token_file(dataset / embedded.TOKEN_FILE_NAME)


def _files(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_generation_is_deterministic(dataset, dataset_again):
    names = _files(dataset)
    assert names == _files(dataset_again)
    for name in names:
        first, second = dataset / name, dataset_again / name
        if first.suffix in TEXT_SUFFIXES:
            assert first.read_bytes() == second.read_bytes(), name
        elif first.suffix == ".jpg":
            np.testing.assert_array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(second)))


def test_layout_and_manifest(dataset):
    for name in ("results_20130124.token", "dataset_flickr30k.json", "train.txt", "val.txt", "test.txt",
                 "scenes.json", "README.txt", "MANIFEST.json", "annotations/captions_train.json",
                 "annotations/captions_val.json", "annotations/captions_test.json"):
        assert (dataset / name).is_file(), name
    assert len(list((dataset / "images").glob("*.jpg"))) == 60
    manifest = json.loads((dataset / "MANIFEST.json").read_text())
    assert manifest["format_version"] == embedded.FORMAT_VERSION
    assert manifest["parameters"]["splits"] == [36, 12, 12]
    assert "CC BY 4.0" in (dataset / "README.txt").read_text()
    # No temporary folders are left beside the dataset.
    assert [p.name for p in dataset.parent.iterdir()] == ["digits"]


def test_images_and_ids(dataset, corpus):
    assert corpus.num_images == 60
    for image_id in corpus.image_ids:
        assert len(image_id) == 10 and image_id.isdigit() and image_id[0] != "0"
        with Image.open(dataset / "images" / f"{image_id}.jpg") as image:
            assert image.mode == "RGB" and image.size == (96, 96)


def test_token_file_has_five_captions_per_image(corpus):
    assert corpus.captions_per_image() == 5
    for caption in corpus.captions:
        assert caption.endswith(" .") and caption[0].isupper()


def test_split_files_karpathy_and_coco_agree(dataset, corpus):
    known = set(corpus.image_ids)
    splits = {name: read_split_file(dataset / f"{name}.txt", known) for name in ("train", "val", "test")}
    assert [len(splits[n]) for n in ("train", "val", "test")] == [36, 12, 12]
    assert set(itertools.chain(*splits.values())) == known
    karpathy = read_karpathy_json(dataset / "dataset_flickr30k.json")
    coco = {name: read_coco_captions(dataset / "annotations" / f"captions_{name}.json") for name in splits}
    for name, ids in splits.items():
        expected = corpus.subset(ids)
        assert karpathy[name].image_ids == ids and karpathy[name].captions == expected.captions
        assert coco[name].image_ids == ids and coco[name].captions == expected.captions
        assert all(coco[name].sizes[i] == (96, 96) for i in ids)


def test_entities_chains_boxes_and_types(dataset, corpus):
    images = read_entities_dataset(dataset, dataset / "train.txt")
    images += read_entities_dataset(dataset, read_split_file(dataset / "test.txt"))
    seen_types, plural_chains, scene_phrases, nobox_phrases, notvisual_phrases = set(), 0, 0, 0, 0
    for image in images:
        annotation = image.annotation
        assert (annotation.width, annotation.height) == (96, 96)
        assert len(image.sentences) == 5
        assert [s.text for s in image.sentences] == corpus.captions_of(image.image_id)
        box_chains = set(annotation.boxes)
        mentioned_per_caption = []
        for sentence in image.sentences:
            mentioned = set()
            assert sentence.phrases, sentence.text
            for phrase in sentence.phrases:
                seen_types.update(phrase.phrase_types)
                if phrase.chain_id == "0":
                    assert phrase.phrase_types == [NOTVISUAL_TYPE]
                    notvisual_phrases += 1
                elif phrase.chain_id in annotation.scene_chains:
                    assert phrase.phrase_types == ["scene"]
                    scene_phrases += 1
                elif phrase.chain_id in annotation.nobox_chains:
                    nobox_phrases += 1
                else:
                    assert phrase.chain_id in box_chains, (image.image_id, phrase)
                    mentioned.add(phrase.chain_id)
            assert mentioned, f"caption mentions no object: {sentence.text}"
            mentioned_per_caption.append(mentioned)
        # One caption mentions every object; every boxed chain is mentioned.
        assert any(m == box_chains for m in mentioned_per_caption)
        for chain_id, boxes in annotation.boxes.items():
            assert int(chain_id) > 0
            assert boxes.shape[1] == 4 and boxes.shape[0] in (1, 2)
            plural_chains += boxes.shape[0] == 2
            assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
            assert (boxes[:, 2] <= 95).all() and (boxes[:, 3] <= 95).all()
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
    assert plural_chains > 0 and scene_phrases > 0 and nobox_phrases > 0 and notvisual_phrases > 0
    assert set(grammar.ENTITY_TYPE_BY_DIGIT.values()) <= seen_types


def test_chain_ids_are_globally_unique(dataset, corpus):
    owner: dict[str, str] = {}
    for image_id in corpus.image_ids:
        for sentence in read_sentence_file(dataset / "Sentences" / f"{image_id}.txt"):
            for phrase in sentence.phrases:
                if phrase.chain_id != "0":
                    assert owner.setdefault(phrase.chain_id, image_id) == image_id


def test_scenes_json_matches_annotations(dataset):
    scenes = json.loads((dataset / "scenes.json").read_text())["images"]
    assert len(scenes) == 60
    for scene in scenes[:20]:
        annotation = read_annotation_file(dataset / "Annotations" / f"{scene['id']}.xml")
        assert 1 <= len(scene["objects"]) <= 4
        for entity in scene["entities"]:
            boxes = [scene["objects"][i]["box"] for i in entity["object_indices"]]
            np.testing.assert_array_equal(annotation.boxes[entity["chain_id"]], np.asarray(boxes, np.float32))
            assert entity["entity_type"] == grammar.ENTITY_TYPE_BY_DIGIT[entity["digit"]]
        pairs = [(e["digit"], e["colour"]) for e in scene["entities"]]
        assert len(pairs) == len(set(pairs))


def test_objects_are_visible_in_their_boxes(dataset):
    """The glyph's colour dominates inside its box (boxes are exact, not random)."""
    scenes = json.loads((dataset / "scenes.json").read_text())["images"]
    hits = 0
    total = 0
    for scene in scenes[:30]:
        pixels = np.asarray(Image.open(dataset / "images" / f"{scene['id']}.jpg"), dtype=np.float32)
        for obj in scene["objects"]:
            x1, y1, x2, y2 = obj["box"]
            crop = pixels[y1:y2 + 1, x1:x2 + 1].reshape(-1, 3)
            target = np.asarray(grammar.OBJECT_COLOURS[obj["colour"]], np.float32)
            closest = np.linalg.norm(crop - target, axis=1).min()
            total += 1
            hits += closest < 80
    assert hits >= 0.9 * total


def test_second_call_does_not_regenerate(dataset, monkeypatch):
    stamp = (dataset / "MANIFEST.json").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("regenerated")

    monkeypatch.setattr(embedded, "_write_dataset", fail)
    assert embedded.generate_embedded_dataset(dataset, **SMALL) == dataset
    assert embedded.load_embedded_dataset(dataset, **SMALL) == dataset
    assert (dataset / "MANIFEST.json").stat().st_mtime_ns == stamp


def test_changed_parameters_replace_the_dataset(tmp_path):
    out = tmp_path / "d"
    embedded.generate_embedded_dataset(out, num_images=6, splits=(4, 1, 1), seed=1, with_proposals=False,
                                       with_entities=False)
    first_ids = (out / "train.txt").read_text()
    embedded.generate_embedded_dataset(out, num_images=6, splits=(4, 1, 1), seed=2, with_proposals=False,
                                       with_entities=False)
    assert (out / "train.txt").read_text() != first_ids
    assert json.loads((out / "MANIFEST.json").read_text())["parameters"]["seed"] == 2
    assert not (out / "Sentences").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_failure_leaves_no_dataset(tmp_path, monkeypatch):
    calls = {"count": 0}
    original = embedded._write_entities

    def fail_midway(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 5:
            raise RuntimeError("disk full")
        return original(*args, **kwargs)

    monkeypatch.setattr(embedded, "_write_entities", fail_midway)
    with pytest.raises(RuntimeError, match="disk full"):
        embedded.generate_embedded_dataset(tmp_path / "d", num_images=8, splits=(6, 1, 1), with_proposals=False)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_foreign_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(ConfigError, match="refusing"):
        embedded.generate_embedded_dataset(tmp_path, num_images=4, splits=(2, 1, 1), with_proposals=False,
                                           force=True)
    assert (tmp_path / "mine.txt").read_text() == "precious"


def test_bad_parameters_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="add up"):
        embedded.generate_embedded_dataset(tmp_path / "d", num_images=10, splits=(5, 2, 2))
    with pytest.raises(ConfigError, match="num_images"):
        embedded.generate_embedded_dataset(tmp_path / "d", num_images=0)
    assert not (tmp_path / "d").exists()


def test_default_splits_scale_with_num_images():
    assert embedded._resolve_splits(4000, embedded.DEFAULT_SPLITS) == (2500, 500, 1000)
    assert embedded._resolve_splits(80, embedded.DEFAULT_SPLITS) == (50, 10, 20)
    assert embedded._resolve_splits(80, None) == (50, 10, 20)


def test_default_dataset_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TF_TWOBRANCH_DATA", str(tmp_path / "x"))
    assert embedded.default_dataset_dir() == tmp_path / "x"
    monkeypatch.delenv("TF_TWOBRANCH_DATA")
    assert embedded.default_dataset_dir().name == "digit_scenes"


def test_proposals_file(tmp_path):
    from tf_twobranch.data.formats.proposals import read_proposals

    out = embedded.generate_embedded_dataset(tmp_path / "d", num_images=4, splits=(2, 1, 1), with_entities=False,
                                             num_proposals=12)
    ids = read_split_file(out / "train.txt") + read_split_file(out / "val.txt") + read_split_file(out / "test.txt")
    proposals = read_proposals(out / "proposals.h5")
    assert sorted(proposals) == sorted(ids)
    for boxes in proposals.values():
        assert boxes.shape == (12, 4)
        assert boxes.min() >= 0 and boxes[:, 2:].max() <= 95


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert embedded.main(["--out_dir", str(out), "--num_images", "5", "--splits", "3", "1", "1",
                          "--no_proposals"]) == 0
    assert "generated" in capsys.readouterr().out
    assert embedded.main(["--out_dir", str(out), "--num_images", "5", "--splits", "3", "1", "1",
                          "--no_proposals"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert embedded.main(["--out_dir", str(out), "--num_images", "5", "--splits", "3", "1", "2"]) == 2


def test_captions_are_confusable_but_images_distinguishable():
    """Identical captions recur across images (retrieval is not trivial), yet
    the sets of (class, colour) objects differ for almost every image pair."""
    glyphs = embedded._load_glyphs(0)
    next_chain_id = 1
    object_sets, captions = [], collections.Counter()
    for index in range(250):
        scene, _, next_chain_id = embedded._make_scene(index, str(index), 0, glyphs, 96, 0, next_chain_id)
        object_sets.append(frozenset((o.digit, o.colour) for o in scene.objects))
        for caption in {c.text for c in scene.captions}:
            captions[caption] += 1
    assert sum(count > 1 for count in captions.values()) >= 3
    pairs = list(itertools.combinations(object_sets, 2))
    assert sum(a != b for a, b in pairs) >= 0.97 * len(pairs)


def test_grammar_phrases_match_words():
    rng = np.random.default_rng(0)
    objects = [grammar.SceneObject(7, "red", "small", 0, 16, (5, 5, 20, 25)),
               grammar.SceneObject(7, "red", "large", 1, 36, (50, 40, 85, 90)),
               grammar.SceneObject(8, "orange", "medium", 2, 24, (30, 60, 45, 80))]
    entities, next_id = grammar.group_entities(objects, [(0, 1)], 10)
    assert next_id == 12 and entities[0].is_plural and entities[0].size is None
    for _ in range(50):
        for caption in grammar.describe_scene(entities, objects, grammar.SceneBackground("grey", "noisy"), rng,
                                              image_size=96, scene_chain_id="12", writer_chain_id="13"):
            assert caption.words[-1] == "."
            for phrase in caption.phrases:
                span = caption.words[phrase.first_word_index:phrase.first_word_index + len(phrase.words)]
                assert tuple(span) == phrase.words
            assert " an one " not in f" {caption.text.lower()} " and " a eight " not in f" {caption.text.lower()} "
            assert " a orange " not in f" {caption.text.lower()} "


def test_proposals_are_added_to_a_dataset_generated_without_them(tmp_path):
    import h5py

    from tf_twobranch.data import embedded
    out = tmp_path / "scenes"
    embedded.generate_embedded_dataset(out, num_images=12, splits=(6, 2, 4), with_proposals=False,
                                       num_proposals=10)
    assert not (out / "proposals.h5").exists()
    images_before = (out / "images").stat().st_mtime_ns
    # Asking for proposals adds them in place (nothing else is regenerated).
    embedded.generate_embedded_dataset(out, num_images=12, splits=(6, 2, 4), num_proposals=10)
    assert embedded.last_generation_timings.keys() == {"proposals"}
    assert (out / "images").stat().st_mtime_ns == images_before
    with h5py.File(out / "proposals.h5", "r") as handle:
        assert len([k for k in handle if not k.endswith("_scores")]) == 12
    # A dataset with proposals serves a request without them as it is.
    embedded.generate_embedded_dataset(out, num_images=12, splits=(6, 2, 4), with_proposals=False)
    assert embedded.last_generation_timings == {}
    # The proposals equal those of a dataset generated with them from the start.
    fresh = tmp_path / "fresh"
    embedded.generate_embedded_dataset(fresh, num_images=12, splits=(6, 2, 4), num_proposals=10)
    with h5py.File(out / "proposals.h5", "r") as a, h5py.File(fresh / "proposals.h5", "r") as b:
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key][()], b[key][()])


def test_generation_names_its_folder_and_the_variable_that_moves_it(tmp_path, caplog):
    import logging

    out = tmp_path / "where"
    with caplog.at_level(logging.WARNING):
        embedded.generate_embedded_dataset(out, num_images=6, splits=(4, 1, 1), with_proposals=False,
                                           with_entities=False)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert str(out) in said and "TF_TWOBRANCH_DATA" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # up to date: nothing to say
        embedded.generate_embedded_dataset(out, num_images=6, splits=(4, 1, 1), with_proposals=False,
                                           with_entities=False)
    assert "generating" not in " ".join(r.getMessage() for r in caplog.records)
