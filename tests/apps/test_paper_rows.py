"""'(paper)' rows only beside a result of the same protocol and test-split size, never beside a
--smoke run; smoke tables say "smoke run: not a result"; the person-search table's columns align."""
from tf_twobranch import tables
from tf_twobranch.systems.dual_path import pipeline as dual_path
from tf_twobranch.systems.two_branch import region_phrase_pipeline as pl

PAPER = [44.4, 66.3, 75.1, None, None, None]


def _pedes(num_images, smoke=False, row="Ours (ResNet-50) Stage II"):
    metrics = {"t2i_r1": 10.0, "t2i_r5": 20.0, "t2i_r10": 30.0, "t2i_medr": 12.0, "separability_S": 0.5,
               "random_baseline": {"t2i_r1": 0.1, "t2i_r5": 0.5, "t2i_r10": 1.0, "t2i_medr": 500.0}}
    return {"row": row, "dataset_kind": "pedes", "paper": PAPER, "paper_protocol": "full",
            "paper_dataset": "CUHK-PEDES", "protocol": "full", "num_eval_images": num_images,
            "num_eval_captions": 6 * num_images, "flags": {"smoke": smoke},
            "stages": [{"stage": 1, "metrics": metrics}, {"stage": 2, "metrics": metrics}]}


def test_person_search_paper_row_only_beside_its_test_split_size_and_never_beside_smoke():
    full = dual_path.format_record(_pedes(1000))
    assert "  (paper)" in full and "44.4" in full and tables.SMOKE_LINE not in full
    small = dual_path.format_record(_pedes(50))                 # a 50-image gallery is not CUHK-PEDES's
    assert "  (paper)" not in small and "44.4" not in small
    smoke = dual_path.format_record(_pedes(1000, smoke=True))
    assert "  (paper)" not in smoke and tables.SMOKE_LINE in smoke.splitlines()


def test_person_search_chance_line_is_aligned():
    text = dual_path.format_record(_pedes(1000, row="A rather long row name for the person search table"))
    rows = [line for line in text.splitlines() if " | " in line]
    assert len({line.index("|") for line in rows}) == 1, rows   # every row's first bar in one column


def test_phrase_localization_paper_columns_only_on_the_whole_test_split_and_not_for_smoke():
    metrics = {"r1": 55.88, "r5": 70.0, "r10": 75.0, "upper_bound": 80.0}
    record = {"row": "b6", "metrics": metrics, "paper": [50.69, 61.1, 65.0], "marks": {},
              "num_test_images": 1000, "flags": {"smoke": False}}
    assert "50.69" in pl.format_localization_table("t", [pl.table_row(record)])
    smoke = pl.format_localization_table("t", [pl.table_row({**record, "flags": {"smoke": True}})])
    assert "50.69" not in smoke and tables.SMOKE_LINE in smoke
    assert "50.69" not in pl.format_localization_table("t", [pl.table_row({**record, "num_test_images": 20})])


def test_retrieval_titles_of_smoke_runs():
    title = tables.table_title("x", protocol="full", num_images=1000, num_captions=5000, paper=PAPER,
                               paper_dataset="Flickr30K", paper_protocol="flickr30k_1k", smoke=True)
    assert title.endswith("\n" + tables.SMOKE_LINE) and "not shown beside a --smoke run" in title
    assert tables.paper_beside(PAPER, "flickr30k_1k", "full", 1000) == PAPER
    assert tables.paper_beside(PAPER, "flickr30k_1k", "full", 1000, smoke=True) is None
