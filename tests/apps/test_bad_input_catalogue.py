"""A catalogue of bad user inputs: each gives one clean error, never a library traceback.

For every item the package must raise a `UserInputError` (in-process cases)
or exit with status 2 and an ``error:`` line on stderr (command-line cases),
and the message must name the file at fault (its base name at least) and the
line or record where that applies.  No error may surface as a raw exception
from numpy, h5py, scipy, PIL or TensorFlow: in-process, the raised exception
is a UserInputError raised by this repository's own code; for subprocesses,
stderr holds no "Traceback".

Every case writes tiny files into ``tmp_path``.  A case is a function
``case(tmp_path) -> Expect``; `Expect.call` is what must fail.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable

import numpy as np
import pytest

from tf_twobranch.errors import DataFormatError, UserInputError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
OWN_CODE = (REPO_ROOT / "tf_twobranch", REPO_ROOT / "experiments")


@dataclasses.dataclass
class Expect:
    """What one catalogue item must raise.

    call: the zero-argument call that must fail.
    names: strings the message must contain (file base names, ids, flags).
    line: the 1-based line the DataFormatError must carry (and the message name).
    record: the record the DataFormatError must carry (and the message name).
    """

    call: Callable[[], object]
    names: tuple[str, ...]
    line: int | None = None
    record: str | None = None


def _truncate(path: pathlib.Path, keep: float = 0.5) -> pathlib.Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


# ---------------------------------------------------------------------------- feature files


def truncated_npy_features(tmp_path):
    from tf_twobranch.data.formats import load_feature_matrix

    path = tmp_path / "image_feats.npy"
    np.save(path, np.ones((20, 8), np.float32))
    _truncate(path)
    return Expect(lambda: load_feature_matrix(path), (path.name, "truncated"))


def truncated_h5_features(tmp_path):
    from tf_twobranch.data.formats import load_feature_matrix, save_feature_matrix

    path = tmp_path / "text_feats.h5"
    save_feature_matrix(path, np.ones((50, 16), np.float32), key="text_features")
    _truncate(path)
    return Expect(lambda: load_feature_matrix(path), (path.name, "truncated"))


def garbage_mat_features(tmp_path):
    from tf_twobranch.data.formats import load_feature_matrix

    path = tmp_path / "image_features.mat"
    path.write_bytes(b"this is not a MATLAB file, just some text\n" * 8)
    return Expect(lambda: load_feature_matrix(path), (path.name, "MATLAB"))


def feature_row_count_mismatch(tmp_path):
    from tf_twobranch.data.formats import load_feature_matrix

    path = tmp_path / "im_test.npy"
    np.save(path, np.ones((4, 3), np.float32))
    return Expect(lambda: load_feature_matrix(path, expected_rows=5),
                  (path.name, "expected 5 rows", "(4, 3)"))


def nan_in_features(tmp_path):
    from tf_twobranch.data.formats import load_feature_matrix

    path = tmp_path / "feats.npy"
    values = np.ones((5, 3), np.float32)
    values[3, 1] = np.nan
    np.save(path, values)
    return Expect(lambda: load_feature_matrix(path), (path.name, "NaN", "first bad row is 3"))


# ---------------------------------------------------------------------------- caption files


def empty_caption_token_file(tmp_path):
    from tf_twobranch.data.formats import read_token_file

    path = tmp_path / "results_20130124.token"
    path.write_text("1000.jpg#0\tA dog runs on the grass.\n1000.jpg#1\t   \n", encoding="utf-8")
    return Expect(lambda: read_token_file(path), (path.name, "empty caption"), line=2)


def empty_caption_karpathy_json(tmp_path):
    from tf_twobranch.data.formats import read_karpathy_json

    path = tmp_path / "dataset_flickr30k.json"
    path.write_text(json.dumps({"images": [
        {"filename": "1.jpg", "split": "train", "sentences": [{"raw": "A dog.", "tokens": ["a", "dog"]}]},
        {"filename": "2.jpg", "split": "test", "sentences": [{"raw": "A cat."}, {"raw": "  ", "tokens": []}]},
    ]}), encoding="utf-8")
    return Expect(lambda: read_karpathy_json(path), (path.name, "sentence 1 is empty"),
                  record="images[1] (2.jpg)")


def empty_caption_coco_json(tmp_path):
    from tf_twobranch.data.formats import read_coco_captions

    path = tmp_path / "captions_val2014.json"
    path.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "COCO_val2014_000000000001.jpg"}],
        "annotations": [{"id": 7, "image_id": 1, "caption": "A cat."},
                        {"id": 8, "image_id": 1, "caption": " "}]}), encoding="utf-8")
    return Expect(lambda: read_coco_captions(path), (path.name, "empty"), record="annotations[1] (id 8)")


def empty_caption_cuhk_pedes_json(tmp_path):
    from tf_twobranch.data.formats import read_cuhk_pedes

    path = tmp_path / "reid_raw.json"
    path.write_text(json.dumps([
        {"split": "train", "captions": ["A woman.", ""], "file_path": "CUHK01/1.png", "id": 3}]),
        encoding="utf-8")
    return Expect(lambda: read_cuhk_pedes(path), (path.name, "non-empty strings"),
                  record="[0] (CUHK01/1.png)")


def non_utf8_token_file(tmp_path):
    from tf_twobranch.data.formats import read_token_file

    path = tmp_path / "Flickr8k.token.txt"
    path.write_bytes(b"1.jpg#0\tA dog.\n1.jpg#1\tA caf\xe9 by the river.\n")
    return Expect(lambda: read_token_file(path), (path.name, "UTF-8"), line=2)


def non_utf8_precomp_captions(tmp_path):
    from tf_twobranch.data.formats.precomp import read_precomp_captions_file

    path = tmp_path / "test_caps.txt"
    path.write_bytes(b"a dog\na cat\n\xff\xfe a bird\n")
    return Expect(lambda: read_precomp_captions_file(path), (path.name, "UTF-8"), line=3)


def non_utf8_entities_sentences(tmp_path):
    from tf_twobranch.data.formats import flickr30k_entities as fe

    path = tmp_path / "1000.txt"
    path.write_bytes(b"[/EN#1/people A man] walks .\n[/EN#2/people A caf\xe9 owner] waves .\n")
    return Expect(lambda: fe.read_sentence_file(path), (path.name, "UTF-8"), line=2)


def non_utf8_entities_split_file(tmp_path):
    from tf_twobranch.data.formats import read_split_file

    path = tmp_path / "test.txt"
    path.write_bytes(b"1000\n1001\n10\xff2\n")
    return Expect(lambda: read_split_file(path), (path.name, "UTF-8"), line=3)


def malformed_karpathy_json(tmp_path):
    from tf_twobranch.data.formats import read_karpathy_json

    path = tmp_path / "dataset_coco.json"
    path.write_text('{"images": [\n  {"filename": "1.jpg", "split": "train",\n', encoding="utf-8")
    return Expect(lambda: read_karpathy_json(path), (path.name, "malformed JSON"), line=3)


def malformed_coco_json(tmp_path):
    from tf_twobranch.data.formats import read_coco_captions

    path = tmp_path / "captions_train2014.json"
    path.write_text('{"images": [],\n "annotations": [{"id": 1,, "caption": "x"}]}\n', encoding="utf-8")
    return Expect(lambda: read_coco_captions(path), (path.name, "malformed JSON"), line=2)


def malformed_cuhk_pedes_json(tmp_path):
    from tf_twobranch.data.formats import read_cuhk_pedes

    path = tmp_path / "reid_raw.json"
    path.write_text('[{"split": "train",\n  "captions": ["A man."]\n', encoding="utf-8")
    return Expect(lambda: read_cuhk_pedes(path), (path.name, "malformed JSON"), line=3)


# ---------------------------------------------------------------------------- Flickr30K Entities


def entities_unclosed_bracket(tmp_path):
    from tf_twobranch.data.formats import flickr30k_entities as fe

    path = tmp_path / "1000092795.txt"
    path.write_text("[/EN#1/people Two guys] look at [/EN#3/people their pals] .\n"
                    "[/EN#6/people A man in [/EN#7/clothing a blue shirt] .\n", encoding="utf-8")
    return Expect(lambda: fe.read_sentence_file(path), (path.name, "nested phrase"), line=2)


def entities_unclosed_bracket_at_line_end(tmp_path):
    from tf_twobranch.data.formats import flickr30k_entities as fe

    path = tmp_path / "1000092795.txt"
    path.write_text("\n[/EN#6/people A man looks at the time .\n", encoding="utf-8")
    return Expect(lambda: fe.read_sentence_file(path), (path.name, "not closed"), line=2)


def entities_malformed_annotation_xml(tmp_path):
    from tf_twobranch.data.formats import flickr30k_entities as fe

    path = tmp_path / "1000092795.xml"
    path.write_text("<annotation>\n\t<size><width>333</width><height>500</height></size>\n"
                    "\t<object><name>1</name>\n</annotation>\n", encoding="utf-8")
    return Expect(lambda: fe.read_annotation_file(path), (path.name, "malformed XML"), line=4)


# ---------------------------------------------------------------------------- proposals


def zero_area_proposal_in_text_file(tmp_path):
    from tf_twobranch.data.formats.proposals import read_proposals

    folder = tmp_path / "proposals"
    folder.mkdir()
    (folder / "4945942737.txt").write_text("1 2 30 40\n10 2 9 40\n", encoding="utf-8")  # x2 = x1 - 1
    return Expect(lambda: read_proposals(folder, ["4945942737"]),
                  ("4945942737.txt", "zero or negative area"), line=2, record="4945942737")


def proposals_outside_the_image(tmp_path):
    from tf_twobranch.data.formats.proposals import fit_proposals_to_images, read_proposals, write_proposals

    path = tmp_path / "proposals.h5"
    write_proposals(path, {"7": np.array([[0, 0, 10, 10], [5, 6, 900, 100]], np.float32)})

    def call():
        boxes = read_proposals(path, ["7"])
        return fit_proposals_to_images(path, boxes, {"7": (256, 128)})

    return Expect(call, (path.name, "box 1 [5, 6, 900, 100]", "256 x 128", "--clip_proposals"), record="7")


def empty_proposals_hdf5_dataset(tmp_path):
    from tf_twobranch.data.formats.proposals import write_proposals
    from tf_twobranch.features.prepare_regions import read_split_proposals

    path = tmp_path / "proposals.h5"
    write_proposals(path, {"7": np.array([[0, 0, 10, 10]], np.float32), "8": np.zeros((0, 4), np.float32)})
    return Expect(lambda: read_split_proposals(path, ["7", "8"], 100), (path.name, "has no proposals"),
                  record="8")


def empty_proposals_text_file(tmp_path):
    from tf_twobranch.features.prepare_regions import read_split_proposals

    folder = tmp_path / "proposal_dir"
    folder.mkdir()
    (folder / "7.txt").write_text("0 0 4 4\n", encoding="utf-8")
    (folder / "8.txt").write_text("# x1 y1 x2 y2 score\n", encoding="utf-8")
    # The error names the proposal folder the user gave and the image id.
    return Expect(lambda: read_split_proposals(folder, ["7", "8"], 100), (folder.name, "has no proposals"),
                  record="8")


def truncated_proposals_hdf5(tmp_path):
    from tf_twobranch.data.formats.proposals import read_proposals, write_proposals

    path = tmp_path / "proposals.h5"
    write_proposals(path, {str(i): np.tile([[0, 0, 9, 9], [1, 2, 3, 4]], (20, 1)).astype(np.float32)
                           for i in range(5)})
    _truncate(path)
    return Expect(lambda: read_proposals(path, ["1"]), (path.name, "HDF5"))


def empty_proposals_hdf5_file(tmp_path):
    from tf_twobranch.data.formats.proposals import read_proposals

    path = tmp_path / "proposals.h5"
    path.write_bytes(b"")
    return Expect(lambda: read_proposals(path, ["1"]), (path.name, "empty (0 bytes)"))


# ---------------------------------------------------------------------------- split files


def unknown_image_id_in_split_file(tmp_path):
    from tf_twobranch.data.formats import read_split_file

    path = tmp_path / "val.txt"
    path.write_text("1000\n1001.jpg\n9999\n", encoding="utf-8")
    return Expect(lambda: read_split_file(path, known_ids={"1000", "1001", "1002"}),
                  (path.name, "unknown image id '9999'"), line=3)


def multi_word_split_line(tmp_path):
    from tf_twobranch.data.formats import read_split_file

    path = tmp_path / "train.txt"
    path.write_text("1000\n1001 1002\n", encoding="utf-8")
    return Expect(lambda: read_split_file(path), (path.name, "one image id per line"), line=2)


def empty_split_file(tmp_path):
    from tf_twobranch.data.retrieval_data import load_caption_splits

    root = tmp_path / "flickr"
    root.mkdir()
    (root / "results_20130124.token").write_text(
        "1.jpg#0\tA dog.\n1.jpg#1\tA brown dog.\n2.jpg#0\tA cat.\n2.jpg#1\tA grey cat.\n", encoding="utf-8")
    (root / "train.txt").write_text("1\n", encoding="utf-8")
    (root / "test.txt").write_text("\n\n", encoding="utf-8")
    return Expect(lambda: load_caption_splits(root), ("test.txt", "lists no image ids"))


# ---------------------------------------------------------------------------- images


def undecodable_jpeg(tmp_path):
    from tf_twobranch.data.formats.images import load_image

    path = tmp_path / "1000092795.jpg"
    path.write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"not really a jpeg" * 20)
    return Expect(lambda: load_image(path), (path.name, "cannot decode image"))


def truncated_jpeg(tmp_path):
    from PIL import Image

    from tf_twobranch.data.formats.images import load_image

    path = tmp_path / "36979.jpg"
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)
    _truncate(path, 0.4)
    return Expect(lambda: load_image(path), (path.name, "cannot decode image"))


# ---------------------------------------------------------------------------- precomp folders


def _write_caps(path: pathlib.Path, count: int) -> None:
    path.write_text("".join(f"a caption number {i}\n" for i in range(count)), encoding="utf-8")


def precomp_caption_count_not_a_multiple(tmp_path):
    from tf_twobranch.data.formats import read_precomp_split

    root = tmp_path / "f30k_precomp"
    root.mkdir()
    _write_caps(root / "test_caps.txt", 7)
    np.save(root / "test_ims.npy", np.ones((2, 4), np.float32))
    return Expect(lambda: read_precomp_split(root, "test"),
                  ("test_caps.txt", "test_ims.npy", "7 captions", "2 image rows"))


def precomp_truncated_ims_npy(tmp_path):
    from tf_twobranch.data.formats import read_precomp_split

    root = tmp_path / "f30k_precomp"
    root.mkdir()
    _write_caps(root / "test_caps.txt", 10)
    np.save(root / "test_ims.npy", np.ones((2, 36, 8), np.float32))
    _truncate(root / "test_ims.npy", 0.7)
    return Expect(lambda: read_precomp_split(root, "test"), ("test_ims.npy", "truncated"))


# ---------------------------------------------------------------------------- flags


def unknown_flag_in_flagfile(tmp_path):
    from experiments import common
    from experiments import two_branch_retrieval as isr

    path = tmp_path / "row.cfg"
    path.write_text("--epochs=2\n--no_such_flag=3\n", encoding="utf-8")
    return Expect(lambda: common.parse_flagfile(isr.define_flags, str(path)), (path.name, "no_such_flag"))


def out_of_range_flag_value(tmp_path):
    from experiments import common
    from experiments import two_branch_retrieval as isr

    path = tmp_path / "row.cfg"
    path.write_text("--epochs=2\n--dropout=1.5\n", encoding="utf-8")
    return Expect(lambda: common.parse_flagfile(isr.define_flags, str(path)), (path.name, "dropout"))


IN_PROCESS_CASES = [
    truncated_npy_features,
    truncated_h5_features,
    garbage_mat_features,
    feature_row_count_mismatch,
    nan_in_features,
    empty_caption_token_file,
    empty_caption_karpathy_json,
    empty_caption_coco_json,
    empty_caption_cuhk_pedes_json,
    non_utf8_token_file,
    non_utf8_precomp_captions,
    non_utf8_entities_sentences,
    non_utf8_entities_split_file,
    malformed_karpathy_json,
    malformed_coco_json,
    malformed_cuhk_pedes_json,
    entities_unclosed_bracket,
    entities_unclosed_bracket_at_line_end,
    entities_malformed_annotation_xml,
    zero_area_proposal_in_text_file,
    proposals_outside_the_image,
    empty_proposals_hdf5_dataset,
    empty_proposals_text_file,
    truncated_proposals_hdf5,
    empty_proposals_hdf5_file,
    unknown_image_id_in_split_file,
    multi_word_split_line,
    empty_split_file,
    undecodable_jpeg,
    truncated_jpeg,
    precomp_caption_count_not_a_multiple,
    precomp_truncated_ims_npy,
    unknown_flag_in_flagfile,
    out_of_range_flag_value,
]


def _innermost_frame(error: BaseException) -> str:
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename


@pytest.mark.parametrize("case", [pytest.param(c, id=c.__name__.replace("_", "-")) for c in IN_PROCESS_CASES])
def test_bad_input_raises_a_user_error_naming_where(case, tmp_path):
    expect = case(tmp_path)
    with pytest.raises(Exception) as info:
        expect.call()
    error = info.value
    # A UserInputError, not an OSError/ValueError/KeyError/... from numpy, h5py, scipy, PIL or TF.
    assert isinstance(error, UserInputError), f"{type(error).__module__}.{type(error).__name__}: {error}"
    raised_in = pathlib.Path(_innermost_frame(error)).resolve()
    assert any(raised_in.is_relative_to(own) for own in OWN_CODE), (
        f"the error was raised in {raised_in}, not by the package's own checks")
    message = str(error)
    assert "Traceback" not in message
    for name in expect.names:
        assert name in message, f"{name!r} not in the message {message!r}"
    if expect.line is not None:
        assert isinstance(error, DataFormatError) and error.line == expect.line, message
        assert f"line {expect.line}" in message, message
    if expect.record is not None:
        assert isinstance(error, DataFormatError) and error.record == expect.record, message
        assert repr(expect.record) in message, message


# ---------------------------------------------------------------------------- command line


def stray_positional_argument(tmp_path):
    return ["--epochs=1", "stray_arg"], ("unexpected arguments", "stray_arg")


def missing_dataset_dir(tmp_path):
    missing = tmp_path / "no_such_flickr30k"
    return [f"--dataset_dir={missing}", "--epochs=1"], ("no_such_flickr30k", "does not exist")


def out_of_range_flag_on_command_line(tmp_path):
    return ["--top_k=0"], ("top_k",)


def unknown_flag_in_flagfile_on_command_line(tmp_path):
    path = tmp_path / "row.cfg"
    path.write_text("--epochs=1\n--no_such_flag=3\n", encoding="utf-8")
    return [f"--flagfile={path}"], ("no_such_flag", "row.cfg")


CLI_CASES = [(stray_positional_argument, ()),
             (missing_dataset_dir, ()),
             (out_of_range_flag_on_command_line, ()),
             (unknown_flag_in_flagfile_on_command_line, ())]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every CLI case as `python -m experiments.two_branch_retrieval <args>` (one TensorFlow start-up)."""
    from tests.support.forked_modules import run_modules
    cases = {c.__name__: c(tmp_path_factory.mktemp(c.__name__)) for c, _ in CLI_CASES}
    runs = run_modules([["experiments.two_branch_retrieval", *args] for args, _ in cases.values()],
                       cwd=REPO_ROOT)
    return {name: (proc, names) for (name, (_, names)), proc in zip(cases.items(), runs)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=m, id=c.__name__.replace("_", "-"))
                                  for c, m in CLI_CASES])
def test_bad_command_line_exits_2_with_one_error_line(case, cli_runs):
    proc, names = cli_runs[case.__name__]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, proc.stderr[-3000:]
    for name in names:
        assert name in error_lines[0], error_lines[0]
