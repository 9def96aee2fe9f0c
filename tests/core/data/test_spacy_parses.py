"""The optional spaCy parser path: Docs built by hand (no spaCy model anywhere),
converted as the CoNLL-U reader reads spaCy's own Flickr8K parses."""
import subprocess
import sys

import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.conllu import read_conllu
from tf_twobranch.systems.fragments.sentence_fragments import Triplet, caption_keys, caption_trees, tree_triplets
from tf_twobranch.data.spacy_parses import (doc_to_trees, load_spacy_model, parse_captions,
                                            write_caption_parses)
from tf_twobranch.errors import ConfigError, UserInputError

# A caption spaCy 3.8 en_core_web_sm split into two sentences, as it stands in
# Flickr8k.token.conllu: two roots, heads counted over the whole caption.
TWO_SENTENCES = """# sent_id = 1079274291_9aaf896cc1.jpg#0
# text = A little boy sticks his tongue out for the camera . Another boy looks on .
1\tA\ta\tDET\tDT\t_\t3\tdet\t_\t_
2\tlittle\tlittle\tADJ\tJJ\t_\t3\tamod\t_\t_
3\tboy\tboy\tNOUN\tNN\t_\t4\tnsubj\t_\t_
4\tsticks\tstick\tVERB\tVBZ\t_\t0\troot\t_\t_
5\this\this\tPRON\tPRP$\t_\t6\tposs\t_\t_
6\ttongue\ttongue\tNOUN\tNN\t_\t4\tdobj\t_\t_
7\tout\tout\tADP\tRP\t_\t4\tprt\t_\t_
8\tfor\tfor\tADP\tIN\t_\t4\tprep\t_\t_
9\tthe\tthe\tDET\tDT\t_\t10\tdet\t_\t_
10\tcamera\tcamera\tNOUN\tNN\t_\t8\tpobj\t_\t_
11\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_
12\tAnother\tanother\tDET\tDT\t_\t13\tdet\t_\t_
13\tboy\tboy\tNOUN\tNN\t_\t14\tnsubj\t_\t_
14\tlooks\tlook\tVERB\tVBZ\t_\t0\troot\t_\t_
15\ton\ton\tADP\tRP\t_\t14\tprt\t_\t_
16\t.\t.\tPUNCT\t.\t_\t14\tpunct\t_\t_

"""


def _rows(conllu):
    return [line.split("\t") for line in conllu.splitlines() if line and not line.startswith("#")]


def _doc(words, heads, deps, spaces=None):
    """A parsed Doc as spaCy's parser leaves it (`heads`: absolute 0-based indices, root = itself)."""
    spacy = pytest.importorskip("spacy")
    return spacy.tokens.Doc(spacy.vocab.Vocab(), words=words, heads=heads, deps=deps, spaces=spaces)


def _two_sentence_doc():
    rows = _rows(TWO_SENTENCES)
    heads = [int(r[6]) - 1 if r[6] != "0" else i for i, r in enumerate(rows)]
    deps = ["ROOT" if r[7] == "root" else r[7] for r in rows]
    return _doc([r[1] for r in rows], heads, deps)


def test_module_imports_without_spacy():
    code = ("import sys; sys.modules['spacy'] = None; "
            "import tf_twobranch.data.spacy_parses as m; assert 'spacy' not in dir(m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spacy_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "spacy", None)     # `import spacy` now raises ImportError
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[parse\]"'):
        load_spacy_model("en_core_web_sm")


def test_missing_model_says_what_to_install_and_downloads_nothing():
    pytest.importorskip("spacy")
    with pytest.raises(ConfigError, match="no_such_model_xyz") as err:
        load_spacy_model("no_such_model_xyz")
    assert "python -m spacy download en_core_web_sm" in str(err.value)
    assert "folder" in str(err.value)


def test_folder_that_is_not_a_pipeline_or_has_no_parser(tmp_path):
    spacy = pytest.importorskip("spacy")
    with pytest.raises(ConfigError, match="not a saved spaCy pipeline"):
        load_spacy_model(tmp_path)
    spacy.blank("en").to_disk(tmp_path / "blank")
    with pytest.raises(ConfigError, match="no dependency parser"):
        load_spacy_model(tmp_path / "blank")


def test_two_sentences_convert_as_the_reader_reads_spacy_output(tmp_path):
    tree = doc_to_trees(_two_sentence_doc(), "1079274291_9aaf896cc1.jpg#0")
    (tmp_path / "real.conllu").write_text(TWO_SENTENCES, encoding="utf-8")
    real = read_conllu(tmp_path / "real.conllu")["1079274291_9aaf896cc1#0"]
    assert (tree.sent_id, tree.words, tree.heads, tree.relations, tree.text) == \
        (real.sent_id, real.words, real.heads, real.relations, real.text)
    assert tree.heads.count(0) == 2 and tree.relations[3] == tree.relations[13] == "root"
    assert tree.lemmas == tree.words             # no lemmatizer ran: LEMMA repeats the word
    assert tree_triplets(tree) == tree_triplets(real)
    assert tree_triplets(tree, collapse_prepositions=True)[6] == Triplet("prep_for", "sticks", "camera")
    assert Triplet("nsubj", "looks", "boy") in tree_triplets(tree)


def test_whitespace_tokens_are_dropped_and_heads_renumbered():
    # "A dog  runs ." tokenized by spaCy: the extra space is a token hanging from "dog".
    doc = _doc(["A", "dog", " ", "runs", "."], [1, 3, 1, 3, 3], ["det", "nsubj", "dep", "ROOT", "punct"],
               spaces=[True, True, False, True, False])
    tree = doc_to_trees(doc, "img#1")
    assert tree.words == ("A", "dog", "runs", ".")
    assert tree.heads == (2, 3, 0, 3)
    assert tree.relations == ("det", "nsubj", "root", "punct")
    assert tree.text == "A dog runs ."                # one line, whitespace collapsed
    assert tree_triplets(tree) == [Triplet("det", "dog", "a"), Triplet("nsubj", "runs", "dog"),
                                   Triplet("punct", "runs", ".")]


def test_word_under_a_whitespace_token_takes_its_head():
    doc = _doc(["runs", "\n", "."], [0, 0, 1], ["ROOT", "dep", "punct"])
    assert doc_to_trees(doc, "img#0").heads == (0, 1)


def test_doc_without_parse_or_words_is_a_clear_error():
    spacy = pytest.importorskip("spacy")
    with pytest.raises(UserInputError, match="no dependency parse"):
        doc_to_trees(spacy.tokens.Doc(spacy.vocab.Vocab(), words=["a", "dog"]), "img#0")
    with pytest.raises(UserInputError, match="'img#0' has no word"):
        doc_to_trees(_doc([" "], [0], ["ROOT"]), "img#0")


class _HandParser:
    """Stands in for a spaCy pipeline: `pipe` returns prepared Docs by caption text."""

    def __init__(self, docs):
        self.docs = docs
        self.batch_sizes = []

    def pipe(self, texts, batch_size):
        self.batch_sizes.append(batch_size)
        return (self.docs[text] for text in texts)


def test_parse_captions_write_and_read_back_like_any_parser_output(tmp_path):
    two = _two_sentence_doc()
    short = _doc(["A", "dog", "runs", "."], [1, 2, 2, 2], ["det", "nsubj", "ROOT", "punct"],
                 spaces=[True, True, True, False])
    corpus = CaptionCorpus.from_pairs([("1079274291_9aaf896cc1", two.text.strip()),
                                       ("1079274291_9aaf896cc1", short.text), ("42", short.text)],
                                      source="captions.txt")
    keys = caption_keys(corpus)
    nlp = _HandParser({two.text.strip(): two, short.text: short})
    trees = parse_captions(nlp, corpus.captions, keys, batch_size=7)
    assert nlp.batch_sizes == [7] and list(trees) == keys
    assert trees["42#0"].sent_id == "42.jpg#0" and trees["42#0"].text == "A dog runs ."
    path = write_caption_parses(tmp_path / "out" / "captions.conllu", trees)
    assert read_conllu(path) == trees
    assert "# sent_id = 1079274291_9aaf896cc1.jpg#1\n" in path.read_text(encoding="utf-8")
    assert [t.heads.count(0) for t in caption_trees(read_conllu(path), corpus, path)] == [2, 1, 1]
    assert [p.name for p in path.parent.iterdir()] == ["captions.conllu"]   # no temporary left


def test_parse_captions_bad_keys():
    nlp = _HandParser({})
    with pytest.raises(UserInputError, match="2 captions but 1 keys"):
        parse_captions(nlp, ["a", "b"], ["x#0"])
    with pytest.raises(UserInputError, match="'x#0' repeated"):
        parse_captions(nlp, ["a", "b"], ["x#0", "x#0"])


def _chain_parser(doc):
    """Each word hangs from the next, the last is the root; spaces hang from the previous token."""
    spacy = sys.modules["spacy"]
    words = [i for i, t in enumerate(doc) if not t.is_space]
    heads, deps = [], []
    for i, token in enumerate(doc):
        later = [w for w in words if w > i]
        if token.is_space:
            heads.append(i - 1)
            deps.append("dep")
        else:
            heads.append(later[0] if later else i)
            deps.append("dep" if later else "ROOT")
    return spacy.tokens.Doc(doc.vocab, words=[t.text for t in doc], spaces=[bool(t.whitespace_) for t in doc],
                            heads=heads, deps=deps)


def saved_chain_parser_pipeline(folder):
    """A blank English pipeline with `_chain_parser` as its parser, saved to `folder` (no model needed)."""
    spacy = sys.modules["spacy"]
    if not spacy.language.Language.has_factory("test_chain_parser"):
        spacy.language.Language.component("test_chain_parser", assigns=["token.dep", "token.head"],
                                           func=_chain_parser)
    pipeline = spacy.blank("en")
    pipeline.add_pipe("test_chain_parser")
    pipeline.to_disk(folder)
    return folder


def test_saved_pipeline_folder_loads_and_parses(tmp_path):
    pytest.importorskip("spacy")
    saved_chain_parser_pipeline(tmp_path / "pipeline")
    nlp = load_spacy_model(tmp_path / "pipeline")
    trees = parse_captions(nlp, ["A dog  runs .", "Two cats"], ["7#0", "7#1"])
    assert trees["7#0"].words == ("A", "dog", "runs", ".") and trees["7#0"].heads == (2, 3, 4, 0)
    assert trees["7#0"].text == "A dog runs ." and trees["7#1"].relations == ("dep", "root")
