import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file, write_token_file
from tf_twobranch.errors import DataFormatError


def test_round_trip(tmp_path):
    corpus = CaptionCorpus.from_pairs([("1000092795", "Two young guys."), ("1000092795", "Two men."),
                                       ("10002456", "Several men in hard hats.")])
    path = tmp_path / "results.token"
    write_token_file(path, corpus)
    assert path.read_text().splitlines()[1] == "1000092795.jpg#1\tTwo men."
    read = read_token_file(path)
    assert read.source == str(path)
    assert read.image_ids == corpus.image_ids
    assert read.captions == corpus.captions
    assert read.caption_image.tolist() == corpus.caption_image.tolist()


def test_skips_blank_lines_and_groups_non_adjacent_lines(tmp_path):
    path = tmp_path / "f.token"
    path.write_text("a.jpg#0\tfirst a\n\nb.jpg#0\tfirst b\r\na.jpg#1\tsecond a\n")
    corpus = read_token_file(path)
    assert corpus.image_ids == ["a", "b"]
    assert corpus.captions == ["first a", "second a", "first b"]


@pytest.mark.parametrize("content, line, pattern", [
    ("a.jpg#0\tok\na.jpg#1 no tab here\n", 2, "no tab"),
    ("a.jpg#0\tok\n\na.jpg\tno number\n", 3, "#<k>"),
    ("a.jpg#x\tbad number\n", 1, "non-negative integer"),
    ("a.jpg#0\tok\na.jpg#1\t   \n", 2, "empty caption"),
    ("a.jpg#0\tok\na.jpg#0\tagain\n", 2, "occurs twice"),
])
def test_errors_name_file_and_line(tmp_path, content, line, pattern):
    path = tmp_path / "bad.token"
    path.write_text(content)
    with pytest.raises(DataFormatError, match=pattern) as info:
        read_token_file(path)
    assert f"bad.token, line {line}" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataFormatError, match="does not exist"):
        read_token_file(tmp_path / "absent.token")


def test_real_flickr30k_token_file(realdata):
    # Its reading speed is a benchmark figure, not a test: a loaded machine would fail it.
    corpus = read_token_file(realdata / "flickr30k" / "captions_multi30k.token")
    assert corpus.num_captions == 155_070
    assert corpus.num_images == 31_014
    assert corpus.captions_per_image() == 5
    assert corpus.image_ids[0] == "1000092795"
    assert corpus.captions_of("1000092795")[0].startswith("Two young guys with shaggy hair")
    corpus.validate()


def test_real_flickr8k_token_file(realdata):
    corpus = read_token_file(realdata / "flickr8k" / "Flickr8k.token.txt")
    assert corpus.num_captions == 40_460
    assert corpus.image_ids[0] == "1000268201_693b08cb0e"
    corpus.validate()
