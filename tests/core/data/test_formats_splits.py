import pytest

from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.data.formats.splits import read_split_file, write_split_file
from tf_twobranch.errors import DataFormatError


def test_round_trip_and_extension_stripping(tmp_path):
    path = tmp_path / "test_images.txt"
    write_split_file(path, ["1007129816", "101362133"], extension=".jpg")
    assert path.read_text() == "1007129816.jpg\n101362133.jpg\n"
    assert read_split_file(path) == ["1007129816", "101362133"]
    plain = tmp_path / "test.txt"
    write_split_file(plain, ["7", "8"])
    assert read_split_file(plain, known_ids={"7", "8", "9"}) == ["7", "8"]


def test_blank_lines_skipped(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("\n1\n\n 2 \n\n")
    assert read_split_file(path) == ["1", "2"]


def test_duplicate_is_an_error_with_line(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("1\n2\n1.jpg\n")
    with pytest.raises(DataFormatError, match=r"s\.txt, line 3.*repeated \(first on line 1\)"):
        read_split_file(path)


def test_multi_word_line_is_an_error_with_line(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("1\n\n2.jpg 0\n3\n")
    with pytest.raises(DataFormatError, match=r"s\.txt, line 3: expected one image id per line, got 2 "
                                              r"words: '2\.jpg 0'") as info:
        read_split_file(path)
    assert info.value.line == 3
    path.write_text("1\n2\t3\n")
    with pytest.raises(DataFormatError, match=r"line 2: expected one image id per line"):
        read_split_file(path)


def test_unknown_id_is_an_error_with_line_or_dropped(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("1\n\n5\n2\n")
    with pytest.raises(DataFormatError, match=r"s\.txt, line 3.*unknown image id '5'"):
        read_split_file(path, known_ids=["1", "2"])
    assert read_split_file(path, known_ids=["1", "2"], drop_unknown=True) == ["1", "2"]


def test_real_entities_and_multi30k_splits(realdata):
    entities = realdata / "flickr30k_entities"
    sizes = [len(read_split_file(entities / f"{name}.txt")) for name in ("train", "val", "test")]
    assert sizes == [29_783, 1_000, 1_000]
    corpus = read_token_file(realdata / "flickr30k" / "captions_multi30k.token")
    known = set(corpus.image_ids)
    test_path = realdata / "multi30k" / "test_2016_images.txt"
    test_ids = read_split_file(test_path, known_ids=known)
    assert len(test_ids) == 1_000 and not test_ids[0].endswith(".jpg")
    sizes = [len(read_split_file(realdata / "multi30k" / f"{n}_images.txt", known_ids=known))
             for n in ("train", "val")]
    assert sizes == [29_000, 1_014]
    test_corpus = corpus.subset(test_ids, source=str(test_path))
    assert test_corpus.num_images == 1_000 and test_corpus.num_captions == 5_000
    assert test_corpus.captions_per_image() == 5
    assert test_corpus.captions_of(test_ids[0]) == corpus.captions_of(test_ids[0])
    # The caption file lacks some Entities test images (962 of 1,000 are covered).
    with pytest.raises(DataFormatError, match=r"test\.txt, line \d+: unknown image id"):
        read_split_file(entities / "test.txt", known_ids=known)
    assert len(read_split_file(entities / "test.txt", known_ids=known, drop_unknown=True)) == 962


def test_real_flickr8k_splits(realdata):
    corpus = read_token_file(realdata / "flickr8k" / "Flickr8k.token.txt")
    sizes = [len(read_split_file(realdata / "flickr8k" / f"Flickr_8k.{n}Images.txt",
                                 known_ids=corpus.image_ids)) for n in ("train", "dev", "test")]
    assert sizes == [6_000, 1_000, 1_000]
