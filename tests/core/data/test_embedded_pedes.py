"""Tests of the digit person-search dataset (tf_twobranch.data.embedded_pedes)."""
import collections
import json

import numpy as np
import pytest

from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.data.embedded_pedes import generate_embedded_pedes, load_embedded_pedes
from tf_twobranch.data.formats import read_cuhk_pedes
from tf_twobranch.errors import ConfigError


@pytest.fixture(scope="module")
def source():
    return load_embedded_dataset()


@pytest.fixture(scope="module")
def pedes_json(source, tmp_path_factory):
    return load_embedded_pedes(tmp_path_factory.mktemp("pedes") / "digit_pedes", source_dir=source)


def _scene_content(source):
    scenes = json.loads((source / "scenes.json").read_text())["images"]
    return {s["id"]: collections.Counter((o["digit"], o["colour"]) for o in s["objects"])
            for s in scenes}


def test_identities_group_images_of_the_same_content(source, pedes_json):
    splits = read_cuhk_pedes(pedes_json)
    assert set(splits) == {"train", "val", "test"}
    content = _scene_content(source)
    by_identity = collections.defaultdict(list)
    for split in splits.values():
        for file_path, identity in zip(split.corpus.image_ids, split.identity.tolist()):
            by_identity[identity].append(file_path)
    keys_seen = set()
    for identity, paths in by_identity.items():
        assert 2 <= len(paths) <= 4
        contents = [content[p.split("/")[-1][:-4]] for p in paths]
        assert all(c == contents[0] for c in contents)
        key = tuple(sorted(contents[0].elements()))
        assert key not in keys_seen  # one identity per content
        keys_seen.add(key)
    for split in splits.values():
        counts = np.bincount(split.corpus.caption_image)
        assert np.all(counts == 2)  # two captions per image, as CUHK-PEDES


def test_splits_are_by_identity_last_identities_test(pedes_json):
    splits = read_cuhk_pedes(pedes_json)
    ids = {name: set(split.identity.tolist()) for name, split in splits.items()}
    assert not ids["train"] & ids["val"] and not ids["train"] & ids["test"] and not ids["val"] & ids["test"]
    assert max(ids["train"]) < min(ids["val"]) and max(ids["val"]) < min(ids["test"])
    assert len(ids["test"]) == round(0.2 * sum(len(v) for v in ids.values()))


def test_files_resolve_and_load_with_the_pipeline(pedes_json):
    from tf_twobranch.systems.dual_path.data import check_num_classes, dual_path_data_from_pedes
    from tf_twobranch.data.layout import resolve_dataset

    splits = read_cuhk_pedes(pedes_json)
    for split in splits.values():
        for file_path in split.corpus.image_ids:
            assert (pedes_json.parent / "imgs" / file_path).is_file()
    layout = resolve_dataset(pedes_json.parent)
    data = dual_path_data_from_pedes(layout, split="train")
    check_num_classes(data, len(set(splits["train"].identity.tolist())))
    assert data.num_images == splits["train"].corpus.num_images
    test = dual_path_data_from_pedes(layout, split="test")
    assert test.vocabulary == data.vocabulary


def test_deterministic_cached_and_validated(source, pedes_json, tmp_path):
    before = pedes_json.stat().st_mtime_ns
    assert load_embedded_pedes(pedes_json.parent, source_dir=source) == pedes_json
    assert pedes_json.stat().st_mtime_ns == before  # cached, not rebuilt
    other = load_embedded_pedes(tmp_path / "again", source_dir=source)
    assert other.read_bytes() == pedes_json.read_bytes()
    manifest = json.loads((tmp_path / "again" / "MANIFEST.json").read_text())
    assert manifest["parameters"]["max_images_per_identity"] == 4
    changed = generate_embedded_pedes(tmp_path / "again", source_dir=source, max_images_per_identity=2)
    counts = collections.Counter(i for s in read_cuhk_pedes(changed / "reid_raw.json").values()
                                 for i in s.identity.tolist())
    assert set(counts.values()) == {2}
    with pytest.raises(ConfigError):
        generate_embedded_pedes(tmp_path / "x", source_dir=source, min_images_per_identity=5,
                                max_images_per_identity=4)
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "mine.txt").write_text("user data")
    with pytest.raises(ConfigError, match="refusing"):
        generate_embedded_pedes(tmp_path / "occupied", source_dir=source)
