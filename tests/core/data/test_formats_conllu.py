"""CoNLL-U reader/writer: round trip, the bad inputs the issue lists, the real Flickr8K parses."""
import pathlib

import pytest

from tf_twobranch.data.formats.conllu import DependencyTree, caption_key, read_conllu, write_conllu
from tf_twobranch.errors import DataFormatError

REAL = pathlib.Path(__file__).resolve().parents[4] / "shared" / "realdata" / "flickr8k"

GOOD = """# sent_id = 1000268201_693b08cb0e.jpg#0
# text = A girl going into a wooden building .
1\tA\ta\tDET\tDT\t_\t2\tdet\t_\t_
2\tgirl\tgirl\tNOUN\tNN\t_\t0\troot\t_\t_
3\tgoing\tgo\tVERB\tVBG\t_\t2\tacl\t_\t_
4\tinto\tinto\tADP\tIN\t_\t3\tprep\t_\t_
5\ta\ta\tDET\tDT\t_\t7\tdet\t_\t_
6\twooden\twooden\tADJ\tJJ\t_\t7\tamod\t_\t_
7\tbuilding\tbuilding\tNOUN\tNN\t_\t4\tpobj\t_\t_
8\t.\t.\tPUNCT\t.\t_\t2\tpunct\t_\t_

"""


def _write(tmp_path, text, name="parses.conllu"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_a_sentence_keyed_by_caption_id(tmp_path):
    trees = read_conllu(_write(tmp_path, GOOD))
    tree = trees["1000268201_693b08cb0e#0"]
    assert tree.words[1] == "girl" and tree.heads[1] == 0 and tree.relations[6] == "pobj"
    assert tree.text == "A girl going into a wooden building ." and len(tree) == 8


def test_round_trip(tmp_path):
    trees = read_conllu(_write(tmp_path, GOOD))
    write_conllu(tmp_path / "again.conllu", trees)
    assert read_conllu(tmp_path / "again.conllu") == trees


def test_multiword_tokens_and_empty_nodes_are_skipped(tmp_path):
    text = GOOD.replace("1\tA\t", "1-2\tAgirl\t_\t_\t_\t_\t_\t_\t_\t_\n1\tA\t", 1)
    text = text.replace("3\tgoing", "2.1\tghost\t_\t_\t_\t_\t_\t_\t_\t_\n3\tgoing", 1)
    assert read_conllu(_write(tmp_path, text))["1000268201_693b08cb0e#0"].words[:3] == ("A", "girl", "going")


def test_two_roots_are_allowed():
    tree = DependencyTree("x#0", ("a", "b"), (0, 0), ("root", "root"))
    assert len(tree) == 2


@pytest.mark.parametrize("edit,match,line", [
    (lambda t: t.replace("2\tgirl\tgirl\tNOUN\tNN\t_\t0\troot\t_\t_", "2\tgirl\tgirl\tNOUN\t0\troot"),
     "10 tab-separated columns", 4),
    (lambda t: t.replace("\t3\tprep", "\t9\tprep"), "head 9, outside 0..8", 6),
    (lambda t: t.replace("\t2\tdet", "\tX\tdet", 1), "must be integers", 3),
    (lambda t: t.replace("3\tgoing", "4\tgoing", 1), "out of order", 5),
    (lambda t: t.replace("\t0\troot", "\t3\troot"), "no root", 3),
    (lambda t: t.replace("# sent_id = 1000268201_693b08cb0e.jpg#0\n", ""), "sent_id", 1),
])
def test_bad_input_names_file_line_and_sentence(tmp_path, edit, match, line):
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(DataFormatError, match=match) as err:
        read_conllu(path)
    assert str(path) in str(err.value) and f"line {line}" in str(err.value)


def test_cycle_is_reported(tmp_path):
    text = GOOD.replace("\t2\tacl", "\t4\tacl")      # going -> into -> going
    with pytest.raises(DataFormatError, match="cycle") as err:
        read_conllu(_write(tmp_path, text))
    assert "1000268201_693b08cb0e.jpg#0" in str(err.value)


def test_repeated_sentence_id_and_empty_file(tmp_path):
    with pytest.raises(DataFormatError, match="repeated"):
        read_conllu(_write(tmp_path, GOOD + GOOD))
    with pytest.raises(DataFormatError, match="no sentence"):
        read_conllu(_write(tmp_path, "# just a comment\n", "empty.conllu"))


def test_caption_key_strips_the_image_extension():
    assert caption_key("1000268201_693b08cb0e.jpg#3") == "1000268201_693b08cb0e#3"
    assert caption_key("plain") == "plain"


@pytest.mark.skipif(not (REAL / "Flickr8k.token.conllu").exists(), reason="needs ../shared/realdata")
def test_real_flickr8k_parses():
    trees = read_conllu(REAL / "Flickr8k.token.conllu")
    assert len(trees) == 40460
    assert sum(1 for t in trees.values() if t.heads.count(0) == 2) == 18   # spaCy split 18 captions
