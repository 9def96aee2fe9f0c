import json

import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.karpathy_json import read_karpathy_json, write_karpathy_json
from tf_twobranch.errors import DataFormatError


def corpora(ids_by_split):
    return {split: CaptionCorpus.from_pairs([(i, f"Caption {k} of {i}.") for i in ids for k in range(2)])
            for split, ids in ids_by_split.items()}


def test_round_trip_flickr30k(tmp_path):
    original = corpora({"train": ["1000092795", "10002456"], "val": ["1001"], "test": ["1002"]})
    path = tmp_path / "dataset_flickr30k.json"
    write_karpathy_json(path, original, "flickr30k")
    data = json.loads(path.read_text())
    assert data["dataset"] == "flickr30k"
    first = data["images"][0]
    assert first["filename"] == "1000092795.jpg" and first["split"] == "train"
    assert first["sentids"] == [0, 1] and data["images"][1]["sentids"] == [2, 3]
    assert first["sentences"][0]["tokens"] == ["caption", "0", "of", "1000092795"]
    assert "cocoid" not in first and "filepath" not in first
    read = read_karpathy_json(path)
    assert list(read) == ["train", "val", "test"]
    for split in original:
        assert read[split].image_ids == original[split].image_ids
        assert read[split].captions == original[split].captions
        assert read[split].source == str(path)


def test_round_trip_coco_and_restval_merge(tmp_path):
    original = corpora({"train": ["9"], "restval": ["391895"], "val": ["12"], "test": ["13"]})
    path = tmp_path / "dataset_coco.json"
    write_karpathy_json(path, original, "coco")
    records = json.loads(path.read_text())["images"]
    assert records[1]["filepath"] == "val2014"
    assert records[1]["filename"] == "COCO_val2014_000000391895.jpg"
    assert records[1]["cocoid"] == 391895
    separate = read_karpathy_json(path)
    assert separate["restval"].image_ids == ["391895"]
    merged = read_karpathy_json(path, restval_into_train=True)
    assert "restval" not in merged
    assert merged["train"].image_ids == ["9", "391895"]
    assert merged["train"].num_captions == 4


def test_coco_requires_integer_ids(tmp_path):
    with pytest.raises(DataFormatError, match="integers"):
        write_karpathy_json(tmp_path / "x.json", corpora({"train": ["abc"]}), "coco")


def write_images(path, images):
    path.write_text(json.dumps({"images": images, "dataset": "flickr30k"}, indent=1))


@pytest.mark.parametrize("image, pattern", [
    ({"filename": "1.jpg", "split": "train"}, r"images\[1\].*missing key.*'sentences'"),
    ({"filename": "1.jpg", "split": "dev", "sentences": []}, r"images\[1\] \(1\.jpg\).*unknown split 'dev'"),
    ({"filename": "1.jpg", "split": "train", "sentences": [{"raw": "  "}]}, r"images\[1\] \(1\.jpg\).*sentence 0 is empty"),
    ({"filename": "1.jpg", "split": "train", "sentences": [{"imgid": 1}]}, r"images\[1\].*neither 'raw' nor 'tokens'"),
    ({"filename": "0.jpg", "split": "val", "sentences": [{"raw": "x"}]}, r"images\[1\].*'0' occurs twice"),
])
def test_record_errors(tmp_path, image, pattern):
    good = {"filename": "0.jpg", "split": "train", "sentences": [{"raw": "a dog", "tokens": ["a", "dog"]}]}
    path = tmp_path / "dataset_flickr30k.json"
    write_images(path, [good, image])
    with pytest.raises(DataFormatError, match=pattern) as info:
        read_karpathy_json(path)
    assert "dataset_flickr30k.json" in str(info.value)


def test_tokens_used_when_raw_missing(tmp_path):
    path = tmp_path / "d.json"
    write_images(path, [{"filename": "5.jpg", "split": "test", "sentences": [{"tokens": ["a", "cat"]}]}])
    assert read_karpathy_json(path)["test"].captions == ["a cat"]


def test_malformed_json_reports_line_and_column(tmp_path):
    path = tmp_path / "dataset_flickr30k.json"
    path.write_text('{"images": [\n  {"filename": "1.jpg",\n   "split": "train" "sentences": []}\n]}')
    with pytest.raises(DataFormatError, match=r"dataset_flickr30k\.json, line 3: malformed JSON at column \d+"):
        read_karpathy_json(path)
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(DataFormatError, match="expected a JSON object"):
        read_karpathy_json(tmp_path / "list.json")
