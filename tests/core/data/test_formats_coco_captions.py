import json

import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.coco_captions import (CocoCaptionCorpus, read_coco_captions,
                                                     write_coco_captions)
from tf_twobranch.errors import DataFormatError

COCO = {
    "info": {"description": "tiny"}, "licenses": [],
    "images": [{"id": 391895, "file_name": "COCO_val2014_000000391895.jpg", "height": 360, "width": 640},
               {"id": 522418, "file_name": "COCO_val2014_000000522418.jpg", "height": 480, "width": 640}],
    "annotations": [{"id": 1, "image_id": 522418, "caption": "A woman cutting a cake. "},
                    {"id": 2, "image_id": 391895, "caption": "A man riding a bike."},
                    {"id": 3, "image_id": 522418, "caption": "Cake on a counter."}],
}


def test_read_groups_annotations_by_image_order(tmp_path):
    path = tmp_path / "captions_val2014.json"
    path.write_text(json.dumps(COCO))
    corpus = read_coco_captions(path)
    assert isinstance(corpus, CocoCaptionCorpus) and isinstance(corpus, CaptionCorpus)
    assert corpus.image_ids == ["391895", "522418"]
    assert corpus.captions == ["A man riding a bike.", "A woman cutting a cake.", "Cake on a counter."]
    assert corpus.caption_image.tolist() == [0, 1, 1]
    assert corpus.file_names["522418"] == "COCO_val2014_000000522418.jpg"
    assert corpus.sizes["391895"] == (360, 640)
    sub = corpus.subset(["522418"])
    assert isinstance(sub, CocoCaptionCorpus) and sub.file_names["522418"].endswith("522418.jpg")


def test_round_trip(tmp_path):
    path = tmp_path / "captions_val2014.json"
    path.write_text(json.dumps(COCO))
    corpus = read_coco_captions(path)
    out = tmp_path / "written.json"
    write_coco_captions(out, corpus)
    again = read_coco_captions(out)
    assert again.image_ids == corpus.image_ids and again.captions == corpus.captions
    assert again.file_names == corpus.file_names and again.sizes == corpus.sizes
    plain = CaptionCorpus.from_pairs([("7", "a"), ("8", "b")])
    write_coco_captions(out, plain, file_names={"7": "seven.jpg"}, sizes={"8": (10, 20)})
    again = read_coco_captions(out)
    assert again.file_names == {"7": "seven.jpg", "8": "8.jpg"} and again.sizes == {"8": (10, 20)}
    with pytest.raises(DataFormatError, match="integers"):
        write_coco_captions(out, CaptionCorpus.from_pairs([("x", "a")]))


def test_unknown_image_id_names_annotation(tmp_path):
    data = json.loads(json.dumps(COCO))
    data["annotations"][2]["image_id"] = 42
    path = tmp_path / "captions_train2014.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataFormatError, match=r"captions_train2014\.json, record 'annotations\[2\] \(id 3\)'.*image_id 42"):
        read_coco_captions(path)


@pytest.mark.parametrize("mutate, pattern", [
    (lambda d: d.pop("annotations"), r"top level.*missing key.*'annotations'"),
    (lambda d: d["images"][1].pop("id"), r"images\[1\].*missing key.*'id'"),
    (lambda d: d["annotations"][0].pop("caption"), r"annotations\[0\].*missing key.*'caption'"),
    (lambda d: d["annotations"][1].update(caption=" "), r"annotations\[1\] \(id 2\).*empty"),
    (lambda d: d["images"].append({"id": 391895}), r"images\[2\].*occurs twice"),
])
def test_record_errors(tmp_path, mutate, pattern):
    data = json.loads(json.dumps(COCO))
    mutate(data)
    path = tmp_path / "captions.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataFormatError, match=pattern) as info:
        read_coco_captions(path)
    assert "captions.json" in str(info.value)


def test_malformed_json(tmp_path):
    path = tmp_path / "captions.json"
    path.write_text('{"images": [],\n"annotations": [,]}')
    with pytest.raises(DataFormatError, match=r"captions\.json, line 2: malformed JSON at column 17"):
        read_coco_captions(path)
