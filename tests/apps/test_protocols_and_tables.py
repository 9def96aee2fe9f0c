"""Issue 23 items 3, 4, 10: protocols checked against their split, split fingerprints,
tables that say what they show."""
from __future__ import annotations

import numpy as np
import pytest

from tf_twobranch.data.corpus import CaptionCorpus, split_fingerprint
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval


def _split(num_images: int, captions_per_image: int = 5, dim: int = 4, seed: int = 0):
    """Random d-dim images and noisy copies as captions: recalls strictly between 0 and 100."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(num_images, dim)).astype(np.float32)
    caption_image = np.repeat(np.arange(num_images, dtype=np.int32), captions_per_image)
    texts = (images[caption_image] + 0.8 * rng.normal(size=(len(caption_image), dim))).astype(np.float32)
    return images, texts, caption_image


# ------------------------------------------------------------------ item 3: protocols


def test_coco_1k_is_the_mean_of_five_1k_folds_with_their_spread():
    images, texts, caption_image = _split(5000)
    got = retrieval.evaluate_protocol(images, texts, caption_image, "coco_1k")
    folds = []
    for f in range(5):
        sel = (caption_image >= 1000 * f) & (caption_image < 1000 * (f + 1))
        folds.append(retrieval.evaluate_protocol(images[1000 * f:1000 * (f + 1)], texts[sel],
                                                 caption_image[sel] - 1000 * f, "full"))
    assert got["num_folds"] == 5
    assert len({m["i2t_r1"] for m in folds}) > 1          # the folds differ, so the spread is > 0
    for key in folds[0]:
        assert got[key] == pytest.approx(np.mean([m[key] for m in folds])), key
        assert got[f"{key}_fold_std"] == pytest.approx(np.std([m[key] for m in folds])), key
    assert got["rsum_fold_std"] > 0
    five_k = retrieval.evaluate_protocol(images, texts, caption_image, "coco_5k")
    assert five_k == retrieval.evaluate_protocol(images, texts, caption_image, "full")
    assert "num_folds" not in five_k
    assert got["i2t_r1"] > five_k["i2t_r1"]               # a 1K gallery is easier than the 5K one


@pytest.mark.parametrize("protocol, size, expected", [
    ("coco_5k", 4999, "exactly 5000"), ("coco_1k", 1000, r"exactly 5000 test images \(5 folds of 1000\)"),
    ("flickr30k_1k", 962, "exactly 1000"), ("folds_100", 99, "at least 100")])
def test_a_protocol_on_a_split_of_the_wrong_size_is_refused(protocol, size, expected):
    images, texts, caption_image = _split(size, captions_per_image=1)
    with pytest.raises(UserInputError, match=f"protocol {protocol} needs {expected}.*has {size}"):
        retrieval.evaluate_protocol(images, texts, caption_image, protocol)
    with pytest.raises(UserInputError, match=f"protocol {protocol}"):
        retrieval.random_baseline_metrics(size, caption_image, protocol=protocol)


def test_protocols_agree_only_when_measured_the_same_way():
    assert retrieval.protocols_agree("coco_5k", 5000, "coco_5k")
    assert retrieval.protocols_agree("full", 5000, "coco_5k")        # one gallery of 5,000
    assert retrieval.protocols_agree("full", 1000, "flickr30k_1k")
    assert not retrieval.protocols_agree("coco_5k", 5000, "coco_1k")
    assert not retrieval.protocols_agree("full", 1000, "coco_1k")    # 1K means five folds
    assert not retrieval.protocols_agree("full", 120, "flickr30k_1k")
    assert not retrieval.protocols_agree("full", 1000, "")           # undeclared


def test_split_fingerprint_changes_with_order_captions_and_assignment():
    corpus = CaptionCorpus.from_pairs([("a", "a dog"), ("a", "a cat"), ("b", "two birds")])
    base = corpus.fingerprint()
    assert base == CaptionCorpus.from_pairs([("a", "a dog"), ("a", "a cat"), ("b", "two birds")]).fingerprint()
    assert base != corpus.subset(["b", "a"]).fingerprint()
    assert base != CaptionCorpus.from_pairs([("a", "a dog"), ("a", "a cat"), ("b", "two bird")]).fingerprint()
    assert base != CaptionCorpus.from_pairs([("a", "a dog"), ("b", "a cat"), ("b", "two birds")]).fingerprint()
    assert base != split_fingerprint(["a", "b"], ["a dog", "a cat"], [0, 0])


def test_a_sized_protocol_on_the_embedded_data_becomes_full_and_says_so():
    from absl import flags

    from experiments import common
    from experiments import two_branch_retrieval as isr
    f = flags.FlagValues()
    isr.define_flags(f)
    f(["row", "--protocol=coco_1k"])
    entries = common.resolve_protocol(f, 1000)                  # the embedded 1,000 test images
    assert entries["protocol"] == "full" == f.protocol and entries["requested_protocol"] == "coco_1k"
    assert "needs exactly 5000 test images" in entries["protocol_note"]
    f(["row", "--protocol=coco_1k", "--dataset_dir=/data/coco"])  # the user's data: refused
    with pytest.raises(UserInputError, match="protocol coco_1k needs exactly 5000 test images.*has 1000"):
        common.resolve_protocol(f, 1000)
    assert common.resolve_protocol(f, 5000) == {"protocol": "coco_1k"}


# ------------------------------------------------------------------ item 10: tables

COCO_1K_PAPER = [53.0, 82.3, 91.6, 41.2, 75.8, 87.7]


def _metrics(value: float, folds: int | None = None) -> dict:
    m = {f"{side}_r{k}": value for side in ("i2t", "t2i") for k in (1, 5, 10)}
    m.update(i2t_medr=3.0, t2i_medr=4.0, rsum=6 * value)
    if folds:
        m.update({f"{k}_fold_std": 0.5 for k in list(m)}, num_folds=folds)
    return m


def _isr_record(protocol: str, num_images: int, **extra) -> dict:
    return {"row": "Embedding: nonlinear, bi-dir.", "protocol": protocol, "num_test_images": num_images,
            "num_test_captions": 5 * num_images, "paper": COCO_1K_PAPER, "paper_dataset": "MSCOCO 1K",
            "paper_protocol": "coco_1k", "metrics": _metrics(33.3, 5 if protocol == "coco_1k" else None),
            "random_baseline": _metrics(0.1), **extra}


def test_image_sentence_table_names_its_protocol_and_shows_the_paper_only_for_the_same_one():
    from experiments import two_branch_retrieval as isr
    five_k = isr.format_record(_isr_record("coco_5k", 5000))
    assert "protocol coco_5k: one gallery of 5000 test images, 25000 captions" in five_k
    assert "(paper)" not in five_k and "53.0" not in five_k
    assert "paper's numbers (MSCOCO 1K, protocol coco_1k) are not shown beside a coco_5k result" in five_k
    assert "chance (random embeddings, same protocol)" in five_k
    one_k = isr.format_record(_isr_record("coco_1k", 5000))
    assert "protocol coco_1k: mean (± std) of 5 folds of 1000 images of the 5000 test images" in one_k
    assert "(paper)" in one_k and "53.0" in one_k and "'(paper)' rows: MSCOCO 1K, protocol coco_1k" in one_k
    assert "± std over 5 folds" in one_k and "chance (random embeddings, same protocol)" in one_k
    embedded = isr.format_record(_isr_record("full", 1000, protocol_note="embedded dataset: ..."))
    assert "(paper)" not in embedded and "note: embedded dataset" in embedded


def test_retrieval_table_groups_rows_by_protocol_and_split():
    from experiments import two_branch_table
    records = [{**_isr_record("coco_1k", 5000), "dataset_dir": "/d", "test_split_fingerprint": "sha256:a"},
               {**_isr_record("coco_5k", 5000), "dataset_dir": "/d", "test_split_fingerprint": "sha256:a"}]
    text = two_branch_table.format_table(records, "3")
    assert text.count("chance (random embeddings, same protocol)") == 2
    assert text.count("  (paper)") == 1                       # beside the coco_1k row only
    assert "Table 3-style" in text and "protocol coco_5k: one gallery of 5000" in text


def test_missing_paper_cells_print_as_a_dash_and_json_holds_null():
    from experiments import common
    from experiments import dual_path
    paper = common.paper_numbers("39.9,nan,79.1,28.2,nan,67.9")
    assert paper[1] is None and paper[4] is None
    stage = {"stage": 2, "metrics": {**_metrics(20.0), "separability_S": 0.5, "random_baseline": _metrics(0.2)}}
    record = {"row": "Ours", "dataset_kind": "retrieval", "stages": [stage], "paper": paper,
              "paper_dataset": "Flickr30K", "paper_protocol": "flickr30k_1k", "protocol": "full",
              "num_eval_images": 1000, "num_eval_captions": 5000}
    text = dual_path.format_record(record)
    paper_line = next(line for line in text.splitlines() if line.startswith("  (paper)"))
    assert "nan" not in text and paper_line.count("–") == 3     # two cells and the rsum
    assert "39.9" in paper_line and "chance (random embeddings, same protocol)" in text
    assert "protocol full: one gallery of 1000 test images" in text


def test_fragment_and_npair_single_rows_print_a_table_with_protocol_chance_and_paper():
    from experiments import fragments, npair
    record = {"row": "Our model", "protocol": "full", "num_eval_images": 1000, "num_eval_captions": 5000,
              "paper": [8.3, 21.6, 30.3, 25, 6.0, 17.5, None, 46], "paper_dataset": "Flickr8K",
              "paper_protocol": "flickr8k_1k", "metrics": _metrics(12.0), "random_baseline": _metrics(0.1)}
    text = fragments.format_record(record)
    assert "protocol full: one gallery of 1000 test images" in text and "(paper)" in text
    assert "chance (random embeddings, same protocol)" in text and "–" in text
    small = fragments.format_record({**record, "num_eval_images": 100, "num_eval_captions": 500})
    assert "(paper)" not in small                             # 100 images are not Flickr8K's 1K
    npair_record = {"row": "N-pair", "dataset": "/d", "protocol": "folds_100", "test_split_fingerprint": "sha256:b",
                    "paper": [47.0, 77.0, 92.9, 27.9, 65.9, 81.0], "paper_protocol": "folds_100", "paper_dataset": "MSCOCO",
                    "recipe": {"parse_mode": "word"},
                    "num_eval_images": 1000, "num_eval_captions": 5000, "metrics": _metrics(30.0, 10),
                    "retrieval": {"folds_100": _metrics(30.0, 10)}, "random_baseline": _metrics(1.0),
                    "pointing_not_computed": "/d has no Flickr30K Entities Sentences/ and Annotations/ folders"}
    text = npair.format_record(npair_record)
    assert "protocol folds_100: mean (± std) of 10 folds of 100 images of the 1000 test images" in text
    assert "(paper: MSCOCO)" in text and "47.0" in text and "chance (random embeddings" in text
    assert "pointing game not computed" in text


# ------------------------------------------------------------------ item 4: Das pointing rows


@pytest.fixture(scope="module")
def no_entities_dataset(tmp_path_factory):
    from tf_twobranch.data.embedded import generate_embedded_dataset
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=30,
                                     splits=(20, 5, 5), with_entities=False, with_proposals=False)


def test_das_pointing_row_without_entities_is_refused_before_training(no_entities_dataset, monkeypatch,
                                                                      tmp_path):
    from experiments import common
    from experiments import npair as exp
    from tf_twobranch.systems.npair import pipeline
    monkeypatch.setattr(pipeline, "load_data", lambda *a, **k: pytest.fail("features computed for a refused row"))
    row = common.parse_flagfile(exp.define_flags, str(common.resolve_config("npair_table2_npair_word")),
                                [f"--dataset_dir={no_entities_dataset}", f"--run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserInputError, match=r"row 'Proposed method - N-pair loss \(word mode\)': its metric, "
                                             r"the pointing accuracy \(Table 2\), needs the Flickr30K Entities "
                                             r"Sentences/ and Annotations/ folders"):
        exp.run(row)


def test_das_table_run_marks_pointing_rows_not_computed(no_entities_dataset, monkeypatch, tmp_path):
    import json

    from absl import flags

    from experiments import npair as exp
    from tf_twobranch.systems.npair import pipeline
    monkeypatch.setattr(pipeline, "load_data", lambda *a, **k: pytest.fail("features computed for a refused row"))
    f = flags.FlagValues()
    exp.define_flags(f)
    argv = ["prog", f"--dataset_dir={no_entities_dataset}", "--rows=npair_table2_random,npair_table2_npair_word",
            f"--runs_dir={tmp_path}", "--noexport"]
    f(argv)
    out = exp.run_rows(f, argv)
    for stem in ("npair_table2_random", "npair_table2_npair_word"):
        assert "Sentences/ and Annotations/" in out["rows"][stem]["not_computed"]
    line = next(x for x in out["table2"].splitlines() if x.startswith("Proposed method - N-pair loss (word"))
    assert "not computed: row 'Proposed method" in line and "51.06" in line
    saved = json.loads((tmp_path / "npair_tables.json").read_text())
    assert saved["rows"]["npair_table2_npair_word"]["not_computed"]
