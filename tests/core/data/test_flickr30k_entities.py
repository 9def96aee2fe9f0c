"""Tests for the Flickr30K Entities reader/writer and phrase-localization examples."""
import logging

import numpy as np
import pytest

from tf_twobranch.data.formats import flickr30k_entities as fe
from tf_twobranch.data import phrases as ph
from tf_twobranch.errors import DataFormatError

SENTENCES = (
    "[/EN#1/people Two young guys] with [/EN#2/bodyparts shaggy hair] look at [/EN#3/people/other their pals] "
    "while [/EN#0/notvisual they] hang out in [/EN#8/scene the yard] .\n"
    "\n"
    "[/EN#6/people A man] in [/EN#7/clothing a blue shirt] looks at [/EN#10/other time] .\n"
)

# Tab-indented like the released files; chain 1 is plural (two boxes) and
# shares its second box with chain 6; chain 8 is a scene, 10 has no box.
ANNOTATION = """<annotation>
\t<filename>1000092795.jpg</filename>
\t<size>
\t\t<width>333</width>
\t\t<height>500</height>
\t\t<depth>3</depth>
\t</size>
\t<object>
\t\t<name>1</name>
\t\t<bndbox>
\t\t\t<xmin>159</xmin>
\t\t\t<ymin>125</ymin>
\t\t\t<xmax>219</xmax>
\t\t\t<ymax>335</ymax>
\t\t</bndbox>
\t</object>
\t<object>
\t\t<name>1</name>
\t\t<name>6</name>
\t\t<bndbox>
\t\t\t<xmin>197</xmin>
\t\t\t<ymin>110</ymin>
\t\t\t<xmax>261</xmax>
\t\t\t<ymax>373</ymax>
\t\t</bndbox>
\t</object>
\t<object>
\t\t<name>2</name>
\t\t<bndbox>
\t\t\t<xmin>1</xmin>
\t\t\t<ymin>1</ymin>
\t\t\t<xmax>333</xmax>
\t\t\t<ymax>500</ymax>
\t\t</bndbox>
\t</object>
\t<object>
\t\t<name>3</name>
\t\t<bndbox>
\t\t\t<xmin>10</xmin>
\t\t\t<ymin>20</ymin>
\t\t\t<xmax>30</xmax>
\t\t\t<ymax>40</ymax>
\t\t</bndbox>
\t</object>
\t<object>
\t\t<name>8</name>
\t\t<scene>1</scene>
\t\t<nobndbox>0</nobndbox>
\t</object>
\t<object>
\t\t<name>10</name>
\t\t<scene>0</scene>
\t\t<nobndbox>1</nobndbox>
\t</object>
</annotation>
"""


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _annotation_with_box(tmp_path, xmin, ymin, xmax, ymax, name="5"):
    text = ANNOTATION.replace("<xmin>10</xmin>", f"<xmin>{xmin}</xmin>").replace(
        "<ymin>20</ymin>", f"<ymin>{ymin}</ymin>").replace("<xmax>30</xmax>", f"<xmax>{xmax}</xmax>").replace(
        "<ymax>40</ymax>", f"<ymax>{ymax}</ymax>").replace("<name>3</name>", f"<name>{name}</name>")
    return _write(tmp_path / "bad.xml", text)


# --------------------------------------------------------------- sentences


def test_read_sentence_file_hand_written(tmp_path):
    sentences = fe.read_sentence_file(_write(tmp_path / "1.txt", SENTENCES))
    assert len(sentences) == 2  # the empty line is not a sentence
    first, second = sentences
    assert first.line == 1 and second.line == 3
    assert first.text == ("Two young guys with shaggy hair look at their pals while they hang out in the yard .")
    assert [(p.first_word_index, p.text, p.chain_id, p.phrase_types) for p in first.phrases] == [
        (0, "Two young guys", "1", ["people"]),
        (4, "shaggy hair", "2", ["bodyparts"]),
        (8, "their pals", "3", ["people", "other"]),
        (11, "they", "0", ["notvisual"]),
        (15, "the yard", "8", ["scene"]),
    ]
    assert first.words[8:10] == ["their", "pals"]
    assert [p.chain_id for p in second.phrases] == ["6", "7", "10"]


def test_real_sentence_files_match_official_parser(realdata):
    folder = realdata / "flickr30k_entities" / "Sentences"
    girl = fe.read_sentence_file(folder / "4945942737.txt")
    football = fe.read_sentence_file(folder / "6338542128.txt")
    assert len(girl) == 5 and len(football) == 5
    assert sum(len(s.phrases) for s in girl) == 18
    assert sum(len(s.phrases) for s in football) == 24
    # Checked by hand against the file and get_sentence_data's rules.
    assert girl[0].text == "A girl with brown hair sits on the edge of a cement area overlooking water ."
    p = girl[0].phrases[2]
    assert (p.first_word_index, p.text, p.chain_id, p.phrase_types) == (
        7, "the edge of a cement area", "221799", ["scene"])
    assert girl[0].phrases[3].first_word_index == 13
    assert {ph_.chain_id for s in girl for ph_ in s.phrases} == {
        "221796", "221797", "221798", "221799", "221800", "221802", "221804"}
    him = football[1].phrases[3]
    assert (him.first_word_index, him.text, him.chain_id, him.phrase_types) == (14, "him", "0", ["notvisual"])
    assert sum(p.chain_id == "0" for s in football for p in s.phrases) == 3
    # The same chain may occur twice in one sentence.
    assert [p.chain_id for p in football[2].phrases].count("253069") == 2
    assert football[4].phrases[0].text == "# 8"


def test_sentence_round_trip_is_byte_identical(tmp_path, realdata):
    source = realdata / "flickr30k_entities" / "Sentences" / "6338542128.txt"
    sentences = fe.read_sentence_file(source)
    out = tmp_path / "out.txt"
    fe.write_sentence_file(out, sentences)
    assert out.read_bytes() == source.read_bytes()
    assert fe.read_sentence_file(out) == sentences


def test_sentence_writer_round_trip_hand_written(tmp_path):
    sentences = fe.read_sentence_file(_write(tmp_path / "1.txt", SENTENCES))
    out = tmp_path / "2.txt"
    fe.write_sentence_file(out, sentences)
    assert fe.read_sentence_file(out) == sentences
    assert out.read_text().splitlines()[0] == SENTENCES.splitlines()[0]


def test_inner_open_bracket_is_a_word_like_official_parser():
    sentence = fe.parse_sentence_line("[/EN#4/other a [ b] c")
    assert sentence.words == ["a", "[", "b", "c"]
    assert sentence.phrases[0].text == "a [ b"


@pytest.mark.parametrize("line, message", [
    ("[/EN#1/people A man sits .", "not closed"),
    ("A man] sits .", "never opened"),
    ("[EN#1/people A man] sits .", "bad phrase opener"),
    ("[/EN#x1/people A man] sits .", "bad chain id"),
    ("[/EN#1 A man] sits .", "types"),
    ("[/EN#1/people [/EN#2/other A man] sits]", "nested"),
    ("[/EN#1/people] man", "no words"),
])
def test_malformed_markup_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.txt", "[/EN#1/people A man] sits .\n" + line + "\n")
    with pytest.raises(DataFormatError, match=message) as info:
        fe.read_sentence_file(path)
    assert info.value.line == 2 and "bad.txt" in str(info.value)


def test_missing_sentence_file(tmp_path):
    with pytest.raises(DataFormatError, match="not found"):
        fe.read_sentence_file(tmp_path / "nope.txt")


# --------------------------------------------------------------- annotations


def test_read_annotation_file(tmp_path):
    annotation = fe.read_annotation_file(_write(tmp_path / "a.xml", ANNOTATION))
    assert (annotation.width, annotation.height, annotation.depth) == (333, 500, 3)
    # XML is 1-based: every coordinate minus 1, as in get_annotations.
    np.testing.assert_array_equal(annotation.boxes["1"], [[158, 124, 218, 334], [196, 109, 260, 372]])
    np.testing.assert_array_equal(annotation.boxes["6"], [[196, 109, 260, 372]])
    np.testing.assert_array_equal(annotation.boxes["2"], [[0, 0, 332, 499]])  # full image is valid
    assert annotation.boxes["1"].dtype == np.float32
    assert annotation.scene_chains == ["8"] and annotation.nobox_chains == ["10"]


def test_annotation_round_trip(tmp_path):
    original = fe.read_annotation_file(_write(tmp_path / "a.xml", ANNOTATION))
    out = tmp_path / "b.xml"
    fe.write_annotation_file(out, original, "1000092795.jpg")
    assert fe.read_annotation_file(out) == original
    assert out.read_text() == ANNOTATION  # shared boxes are written as one object with two names


@pytest.mark.parametrize("box, message", [
    ((10, 20, 334, 40), "outside the image"),
    ((0, 20, 30, 40), "negative coordinate"),
    ((30, 20, 20, 40), "zero or negative area"),
])
def test_bad_boxes_name_file_and_chain(tmp_path, box, message):
    path = _annotation_with_box(tmp_path, *box, name="77")
    with pytest.raises(DataFormatError, match=message) as info:
        fe.read_annotation_file(path)
    assert "bad.xml" in str(info.value) and "chain 77" in str(info.value)


def test_clip_option_clips_boxes_outside_image(tmp_path):
    path = _annotation_with_box(tmp_path, 10, 20, 340, 40, name="77")
    annotation = fe.read_annotation_file(path, clip=True)
    np.testing.assert_array_equal(annotation.boxes["77"], [[9, 19, 332, 39]])


@pytest.mark.parametrize("text, message", [
    ("<annotation><size><width>3</width>", "malformed XML"),
    ("<annotation><object><name>1</name></object></annotation>", "<size>"),
    (ANNOTATION.replace("<xmax>30</xmax>", "<xmax>abc</xmax>"), "expected an integer"),
    (ANNOTATION.replace("\t\t<scene>0</scene>\n", ""), "neither <bndbox>"),
])
def test_malformed_xml(tmp_path, text, message):
    with pytest.raises(DataFormatError, match=message):
        fe.read_annotation_file(_write(tmp_path / "m.xml", text))


# --------------------------------------------------------------- phrase examples


def _entities_root(tmp_path, sentences=SENTENCES, annotation=ANNOTATION):
    (tmp_path / "Sentences").mkdir()
    (tmp_path / "Annotations").mkdir()
    _write(tmp_path / "Sentences" / "1000092795.txt", sentences)
    _write(tmp_path / "Annotations" / "1000092795.xml", annotation)
    _write(tmp_path / "test.txt", "1000092795\n")
    return tmp_path


def test_build_phrase_examples(tmp_path):
    root = _entities_root(tmp_path)
    examples, summary = ph.collect_phrase_examples(root, root / "test.txt")
    got = [(e.sentence_index, e.phrase_index, e.phrase, e.chain_id) for e in examples]
    assert got == [(0, 0, "Two young guys", "1"), (0, 1, "shaggy hair", "2"), (0, 2, "their pals", "3"),
                   (1, 0, "A man", "6")]
    plural = examples[0]
    np.testing.assert_array_equal(plural.gt_box, [158, 109, 260, 372])  # encloses both boxes of chain 1
    assert plural.gt_boxes.shape == (2, 4)
    assert examples[2].phrase_types == ["people", "other"]
    assert summary.excluded_not_visual == 1       # "they" (chain 0)
    assert summary.excluded_no_box == 2           # scene chain 8, no-box chain 10
    assert summary.skipped_missing_chain == 1     # chain 7 is absent from the XML
    assert summary.num_plural == 1 and summary.num_phrases == 8
    assert summary.examples_per_type["people"] == 3


def test_missing_chain_strict_and_logged(tmp_path, caplog):
    root = _entities_root(tmp_path)
    with pytest.raises(DataFormatError) as info:
        ph.build_phrase_examples(root, ["1000092795"], strict=True)
    error = info.value
    assert error.line == 3 and error.record == "7" and error.path.endswith("1000092795.txt")
    with caplog.at_level(logging.WARNING):
        examples = ph.build_phrase_examples(root, ["1000092795"])
    assert len(examples) == 4 and "absent from the annotation" in caplog.text


def test_exclude_types(tmp_path):
    root = _entities_root(tmp_path)
    examples, summary = ph.collect_phrase_examples(root, ["1000092795"],
                                                   exclude_types=("notvisual", "bodyparts"))
    assert [e.chain_id for e in examples] == ["1", "3", "6"] and summary.excluded_by_type == 1


def test_dataset_missing_folder(tmp_path):
    with pytest.raises(DataFormatError, match="Annotations"):
        fe.read_entities_dataset(tmp_path, ["1"])
