"""Issue 23 (items 1, 2, 9, 11, 12): text-file inputs that slipped through.

Files with a UTF-8 byte-order mark load the same data as without it; rows
that cannot be parsed consistently, empty caption files, binary word2vec files
whose header disagrees with their records and misnamed settings are one
`UserInputError` naming the file, the line or record, and what was expected.
"""
import codecs
import pathlib

import numpy as np
import pytest

from tests.support.forked_modules import run_python
from tf_twobranch.data.formats.word_vectors import WordVectors, load_word_vectors, save_word_vectors
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError

BOM = codecs.BOM_UTF8


def _with_bom(path, clean):
    """A copy of `clean` that starts with a UTF-8 byte-order mark."""
    path.write_bytes(BOM + clean.read_bytes())
    return path


def _vectors(num_words=3, dim=4, seed=0):
    rng = np.random.default_rng(seed)
    words = ["the", "dog", "café", "runs", "x"][:num_words]
    return WordVectors(words, rng.normal(size=(num_words, dim)).astype(np.float32))


def _write_glove(path, rows):
    path.write_text("".join(f"{word} {' '.join(map(str, values))}\n" for word, values in rows),
                    encoding="utf-8")
    return path


# ------------------------------------------------------------ item 1: BOM in word-vector files

@pytest.mark.parametrize("layout", ["word2vec_text", "glove"])
def test_word_vector_text_file_with_a_bom_loads_the_same_words_and_vectors(tmp_path, layout):
    wv = _vectors()
    clean = tmp_path / "clean.txt"
    if layout == "word2vec_text":
        save_word_vectors(clean, wv, binary=False)
    else:
        _write_glove(clean, [(w, v.tolist()) for w, v in zip(wv.words, wv.vectors)])
    with_bom = _with_bom(tmp_path / "bom.txt", clean)
    expected, loaded = load_word_vectors(clean), load_word_vectors(with_bom)
    assert loaded.words == expected.words == wv.words
    np.testing.assert_array_equal(loaded.vectors, expected.vectors)
    # Restricted to a vocabulary (how the experiments read them), the first word is kept too.
    assert load_word_vectors(with_bom, vocabulary={"the", "runs"}).words == ["the"]


# ------------------------------------------------------------ item 2: rows that do not parse

def test_glove_row_with_one_number_too_many_names_file_line_and_dimension(tmp_path):
    path = _write_glove(tmp_path / "glove.txt", [("man", [0.1, 0.2]), ("woman", [0.1, 0.3, 0.4])])
    with pytest.raises(DataFormatError) as info:
        load_word_vectors(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 2: ")
    assert "expected a word followed by 2 numbers (the dimension of line 1)" in message
    assert "found 3 numbers after 'woman'" in message


def test_glove_words_with_spaces_still_load(tmp_path):
    # glove.840B holds a few words with spaces; none ends in a number.
    rows = [("the", [0.1, 0.2]), (". . .", [0.3, 0.4]), ("at name@domain.com", [0.5, 0.6])]
    loaded = load_word_vectors(_write_glove(tmp_path / "glove.txt", rows))
    assert loaded.words == ["the", ". . .", "at name@domain.com"]
    np.testing.assert_allclose(loaded["at name@domain.com"], [0.5, 0.6])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_word_vector_row_of_nan_names_file_line_and_word(tmp_path, value):
    path = _write_glove(tmp_path / "glove.txt", [("man", [0.1, 0.2]), ("woman", [value, 0.3])])
    with pytest.raises(DataFormatError, match=rf"^{path}, line 2: the vector of word 'woman' holds "
                                              rf"{value} \(expected finite numbers\)"):
        load_word_vectors(path)


def test_binary_word2vec_nan_names_the_record(tmp_path):
    wv = _vectors()
    wv.vectors[1, 2] = np.nan
    path = tmp_path / "v.bin"
    save_word_vectors(path, wv, binary=True)
    with pytest.raises(DataFormatError, match=r"v\.bin, record 1: the vector of word 'dog' holds nan"):
        load_word_vectors(path)


# ------------------------------------------------------------ item 9: binary header dimension

@pytest.mark.parametrize("header_dim", [4, 6])
def test_binary_word2vec_header_dimension_that_disagrees_with_records_is_not_called_truncated(
        tmp_path, header_dim):
    path = tmp_path / "vectors.bin"
    save_word_vectors(path, _vectors(dim=5), binary=True)
    path.write_bytes(path.read_bytes().replace(b"3 5\n", f"3 {header_dim}\n".encode(), 1))
    with pytest.raises(DataFormatError) as info:
        load_word_vectors(path)
    message = str(info.value)
    assert message.startswith(f"{path}, record 0: the header says dimension {header_dim}, but the "
                              "record sizes disagree")
    assert f"first word 'the' is followed by 5 float32 values, not {header_dim}" in message
    assert "truncated" not in message


def test_binary_word2vec_really_truncated_is_still_called_truncated(tmp_path):
    path = tmp_path / "vectors.bin"
    save_word_vectors(path, _vectors(dim=5), binary=True)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(DataFormatError, match=r"vectors\.bin, record 2: file is truncated inside record 2"):
        load_word_vectors(path)


# ------------------------------------------------------------ item 12: BOM in every text reader

ENTITIES_SENTENCES = ("[/EN#18/people A man] in [/EN#19/clothing an orange hat] starring at "
                      "[/EN#0/notvisual something] .\n"
                      "[/EN#18/people A man] wears [/EN#19/clothing an orange hat] .\n")


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_entities_sentence_file_with_a_bom_reads_the_same_sentences(tmp_path, newline):
    from tf_twobranch.data.formats.flickr30k_entities import read_sentence_file

    clean = tmp_path / "clean.txt"
    clean.write_bytes(ENTITIES_SENTENCES.encode("utf-8"))
    with_bom = tmp_path / "1000.txt"
    with_bom.write_bytes(BOM + ENTITIES_SENTENCES.replace("\n", newline).encode("utf-8"))
    expected, loaded = read_sentence_file(clean), read_sentence_file(with_bom)
    assert [s.words for s in loaded] == [s.words for s in expected]
    assert loaded[0].words[:2] == ["A", "man"]
    assert ([(p.text, p.chain_id, p.phrase_types, p.first_word_index) for s in loaded for p in s.phrases]
            == [(p.text, p.chain_id, p.phrase_types, p.first_word_index) for s in expected for p in s.phrases])


def test_text_proposal_file_with_a_bom_reads_the_same_boxes(tmp_path):
    from tf_twobranch.data.formats.proposals import read_proposals

    rows = "0 0 10 12 0.9\n2 3 20 30 0.5\n"
    for folder, data in (("clean", rows.encode()), ("bom", BOM + rows.replace("\n", "\r\n").encode())):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "1000.txt").write_bytes(data)
    expected = read_proposals(tmp_path / "clean", return_scores=True)
    loaded = read_proposals(tmp_path / "bom", return_scores=True)
    np.testing.assert_array_equal(loaded[0]["1000"], expected[0]["1000"])
    np.testing.assert_array_equal(loaded[1]["1000"], expected[1]["1000"])


def _flagfile_fixture(tmp_path, name, lines, *, bom, newline="\n"):
    path = tmp_path / name
    path.write_bytes((BOM if bom else b"") + newline.join(lines).encode("utf-8") + newline.encode())
    return path


def test_row_flagfile_with_a_bom_parses_the_same_flags(tmp_path):
    from experiments import common, dual_path

    nested = ["// the Stage II length", "--stage2_epochs=2"]
    values = []
    for bom, newline in ((False, "\n"), (True, "\n"), (True, "\r\n")):
        inner = _flagfile_fixture(tmp_path, f"inner_{bom}_{len(newline)}.cfg", nested, bom=bom, newline=newline)
        outer = _flagfile_fixture(tmp_path, f"outer_{bom}_{len(newline)}.cfg",
                                  ["--stage1_epochs=3", "# a comment", f"--flagfile={inner}", "--seed=7"],
                                  bom=bom, newline=newline)
        fv = common.parse_flagfile(dual_path.define_flags, str(outer))
        values.append((fv.stage1_epochs, fv.stage2_epochs, fv.seed))
    assert values == [(3, 2, 7)] * 3
    # A line that is no flag would otherwise be dropped without a word.
    stray = _flagfile_fixture(tmp_path, "stray.cfg", ["--seed=7", "stage1_epochs=3"], bom=True)
    with pytest.raises(UserInputError, match=rf"{stray}: 'stage1_epochs=3' is not a flag \(in {stray}, "
                                             r"line 2\); expected --name=value"):
        common.parse_flagfile(dual_path.define_flags, str(stray))


def test_flag_errors_name_the_flagfile_line_where_the_flag_was_written(tmp_path):
    from experiments import common, dual_path

    inner = _flagfile_fixture(tmp_path, "inner.cfg", ["--seed=1", "--epochs=2"], bom=True)
    outer = _flagfile_fixture(tmp_path, "outer.cfg", ["--stage1_epochs=3", f"--flagfile={inner}"], bom=True)
    with pytest.raises(UserInputError) as info:
        common.parse_flagfile(dual_path.define_flags, str(outer))
    assert str(info.value) == (f"{outer}: Unknown command line flag 'epochs' (in {inner}, line 2); "
                               "did you mean --stage1_epochs or --stage2_epochs?")
    # A flag passed to every row is not blamed on the row's flagfile lines.
    with pytest.raises(UserInputError, match=r"'epochs' \(among the flags passed to every row\)"):
        common.parse_flagfile(dual_path.define_flags, str(outer), ["--epochs=1"])
    missing = tmp_path / "missing.cfg"
    with pytest.raises(UserInputError, match=rf"{missing}: file does not exist"):
        common.parse_flagfile(dual_path.define_flags, str(missing))


def _run_experiment(module, *args):
    from experiments import common

    return run_python(["-m", f"experiments.{module}", *args],
                      cwd=common.REPO_ROOT, timeout=180)


def _error_line(proc):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_retrieval_table_reads_rows_from_a_flagfile_with_a_bom(tmp_path):
    # --rows in the runner's flagfile reaches the runner: the unknown row is named, no other
    # flagfile is blamed for an unknown flag 'rows'.
    runner = _flagfile_fixture(tmp_path, "runner.cfg", ["# runner", "--rows=no_such_row", "--epochs=1"],
                               bom=True, newline="\r\n")
    assert _error_line(_run_experiment("two_branch_table", f"--flagfile={runner}")) == (
        "error: flagfile 'no_such_row' not found (looked in "
        f"{pathlib.Path(__file__).resolve().parents[2] / 'experiments' / 'configs'})")


def test_unknown_flag_suggests_the_flags_that_replaced_it():
    assert _error_line(_run_experiment("dual_path", "--epochs=1")) == (
        "error: Unknown command line flag 'epochs' (on the command line); "
        "did you mean --stage1_epochs or --stage2_epochs?")


# ------------------------------------------------------------ item 9: empty caption files

@pytest.mark.parametrize("content", [b"", b"\n  \n", BOM + b"\r\n"])
def test_empty_token_file_is_named_as_empty_not_as_unknown_split_ids(tmp_path, content):
    from tf_twobranch.data.retrieval_data import load_caption_splits

    token = tmp_path / "results_20130124.token"
    token.write_bytes(content)
    (tmp_path / "train.txt").write_text("1000\n1001\n")
    (tmp_path / "test.txt").write_text("1002\n")
    with pytest.raises(DataFormatError) as info:
        load_caption_splits(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{token}: the caption file is empty (expected one "
                              "'<image>.jpg#<k><TAB><caption>' line per caption)")
    assert "train.txt" not in message


def test_empty_caption_json_files_are_named_as_empty(tmp_path):
    from tf_twobranch.data.formats import read_coco_captions, read_karpathy_json

    karpathy = tmp_path / "dataset_flickr30k.json"
    karpathy.write_text('{"images": []}')
    with pytest.raises(DataFormatError, match=rf"^{karpathy}, record 'images': the caption file is empty"):
        read_karpathy_json(karpathy)
    coco = tmp_path / "captions_train2014.json"
    coco.write_text('{"images": [{"id": 1}], "annotations": []}')
    with pytest.raises(DataFormatError, match=rf"^{coco}, record 'annotations': the caption file is empty"):
        read_coco_captions(coco)


# ------------------------------------------------------------ item 11: errors that name real flags

def test_fisher_pca_larger_than_the_training_captions_names_the_pca_dim_flag(tmp_path):
    from tf_twobranch.features.prepare import FeatureSpec, fit_text_encoder

    words = ["a", "dog", "runs", "cat", "sits", "red", "ball"]
    glove = _write_glove(tmp_path / "glove.txt",
                         [(w, _vectors(1, 4, seed=i).vectors[0].tolist()) for i, w in enumerate(words)])
    captions = [["a", "dog", "runs"], ["a", "cat", "sits"], ["a", "red", "ball"], ["dog", "sits"],
                ["cat", "runs"]]
    spec = FeatureSpec(text_encoder="fisher_hglmm", word_vectors=str(glove), fisher_components=2, pca_dim=8)
    with pytest.raises(ConfigError) as info:
        fit_text_encoder(spec, captions)  # 2 x 2 x 4 = 16-d Fisher vectors: PCA to 8 applies
    message = str(info.value)
    assert message.startswith("--pca_dim=8 is larger than the 5 training sentences the PCA of the "
                              "Fisher vectors is fitted on")
    assert "lower --pca_dim to at most 5" in message
    assert "pca_max_sentences" not in message  # not a flag, and not what limits it here


def test_run_folder_json_with_a_bom_reads_the_same_and_bad_bytes_name_the_line(tmp_path):
    from tf_twobranch.json_files import read_json_object

    clean, with_bom, latin1 = tmp_path / "clean.json", tmp_path / "bom.json", tmp_path / "latin1.json"
    clean.write_text('{"task": "two_branch",\n "row": "café"}\n', encoding="utf-8")
    with_bom.write_bytes(BOM + clean.read_bytes().replace(b"\n", b"\r\n"))
    assert read_json_object(with_bom, "run configuration") == read_json_object(clean, "run configuration")
    latin1.write_bytes('{"task": "two_branch",\n "row": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataFormatError, match=rf"^{latin1}, line 2: is not valid UTF-8 text"):
        read_json_object(latin1, "run configuration")
    with pytest.raises(DataFormatError, match=rf"^{tmp_path / 'none.json'}: run configuration file does not exist"):
        read_json_object(tmp_path / "none.json", "run configuration")


def test_tool_reads_a_flagfile_with_a_bom(tmp_path):
    # Only the stray argument is left over: the flagfile's lines (comment first) were all read
    # as flags, none as a positional argument starting with the byte-order mark.
    tool_flags = _flagfile_fixture(tmp_path, "tool.cfg", ["# comment", f"--out_dir={tmp_path}"],
                                   bom=True, newline="\r\n")
    proc = run_python(["-m", "tf_twobranch.tools.extract_text_features",
                       f"--flagfile={tool_flags}", "stray_arg"],
                      cwd=pathlib.Path(__file__).resolve().parents[2], timeout=180)
    assert _error_line(proc) == "error: unexpected arguments ['stray_arg']"
