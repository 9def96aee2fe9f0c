import json

import numpy as np
import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.cuhk_pedes import PedesSplit, read_cuhk_pedes, write_cuhk_pedes
from tf_twobranch.errors import DataFormatError

RECORDS = [
    {"split": "train", "captions": ["A woman in a red coat.", "She wears black boots."],
     "file_path": "CUHK01/0363004.png", "processed_tokens": [["a"], ["she"]], "id": 7},
    {"split": "test", "captions": ["A man with a backpack."], "file_path": "test_query/p1_s1.jpg", "id": 12},
    {"split": "train", "captions": ["The woman carries a bag."], "file_path": "CUHK01/0363003.png", "id": 7},
    {"split": "train", "captions": ["A boy on a bike."], "file_path": "Market/0001.jpg", "id": 3},
]


def write(tmp_path, records, name="reid_raw.json"):
    path = tmp_path / name
    path.write_text(json.dumps(records))
    return path


def test_read_splits_and_identities(tmp_path):
    splits = read_cuhk_pedes(write(tmp_path, RECORDS))
    assert list(splits) == ["train", "test"]
    train = splits["train"]
    assert train.corpus.image_ids == ["CUHK01/0363004.png", "CUHK01/0363003.png", "Market/0001.jpg"]
    assert train.corpus.captions[:2] == ["A woman in a red coat.", "She wears black boots."]
    assert train.identity.tolist() == [7, 7, 3]
    assert train.caption_identity.tolist() == [7, 7, 7, 3]
    labels, identities = train.identity_labels()
    assert labels.tolist() == [1, 1, 0] and identities.tolist() == [3, 7]
    assert splits["test"].identity.tolist() == [12]


def test_round_trip(tmp_path):
    splits = read_cuhk_pedes(write(tmp_path, RECORDS))
    out = tmp_path / "written.json"
    write_cuhk_pedes(out, splits)
    records = json.loads(out.read_text())
    assert records[0]["processed_tokens"] == [["a", "woman", "in", "a", "red", "coat"],
                                             ["she", "wears", "black", "boots"]]
    assert read_cuhk_pedes(out) == splits
    made = {"val": PedesSplit(CaptionCorpus.from_pairs([("x.png", "a"), ("y.png", "b")]), [1, 2])}
    write_cuhk_pedes(out, made)
    again = read_cuhk_pedes(out)["val"]
    assert again.corpus.captions == ["a", "b"] and again.identity.tolist() == [1, 2]


def test_repeated_file_path_merges_or_conflicts(tmp_path):
    records = RECORDS + [{"split": "train", "captions": ["More."], "file_path": "Market/0001.jpg", "id": 3}]
    train = read_cuhk_pedes(write(tmp_path, records))["train"]
    assert train.corpus.captions_of("Market/0001.jpg") == ["A boy on a bike.", "More."]
    records[-1]["id"] = 4
    with pytest.raises(DataFormatError, match=r"record '\[4\] \(Market/0001\.jpg\)'.*id 4, earlier with id 3"):
        read_cuhk_pedes(write(tmp_path, records))


@pytest.mark.parametrize("change, pattern", [
    ({"split": "dev"}, r"\[1\] \(test_query/p1_s1\.jpg\).*unknown split 'dev'"),
    ({"id": "12"}, r"\[1\].*id must be an integer"),
    ({"captions": []}, r"\[1\].*non-empty list"),
    ({"captions": ["ok", " "]}, r"\[1\].*non-empty strings"),
    ({"file_path": None}, r"\[1\].*file_path must be"),
])
def test_record_errors(tmp_path, change, pattern):
    records = json.loads(json.dumps(RECORDS))
    records[1].update(change)
    with pytest.raises(DataFormatError, match=pattern) as info:
        read_cuhk_pedes(write(tmp_path, records))
    assert "reid_raw.json" in str(info.value)


def test_structure_errors(tmp_path):
    records = json.loads(json.dumps(RECORDS))
    del records[2]["captions"]
    with pytest.raises(DataFormatError, match=r"record '\[2\]'.*missing key.*'captions'"):
        read_cuhk_pedes(write(tmp_path, records))
    with pytest.raises(DataFormatError, match="expected a JSON list"):
        read_cuhk_pedes(write(tmp_path, {"images": []}))
    path = tmp_path / "reid_raw.json"
    path.write_text('[{"split": "train",\n  "id": 1,,}]')
    with pytest.raises(DataFormatError, match=r"reid_raw\.json, line 2: malformed JSON"):
        read_cuhk_pedes(path)
    with pytest.raises(DataFormatError, match="2 identities for 1 images"):
        PedesSplit(CaptionCorpus.from_pairs([("x", "a")]), np.array([1, 2]))
