"""Smoke test of benchmarks/bench_fragments.py: its main at toy sizes.

Not a benchmark: it guards against refactors of the fragment scorer or the
evaluation core silently breaking `python -m benchmarks.bench_fragments`, and
checks that the real-repeat case really shares fragments between captions.
"""
import numpy as np
import pytest

from benchmarks import bench_fragments

HAVE_REAL = (bench_fragments.REAL / "Flickr8k.token.conllu").exists()


def test_main_at_toy_sizes_prints_every_case(capsys):
    report = bench_fragments.main(["--images", "6", "--sentences", "30", "--fragments", "3", "--dim", "4"])
    printed = capsys.readouterr().out
    assert "all distinct" in printed and "machine:" in printed
    assert set(report["cases"]) == ({"real repeats", "all distinct"} if HAVE_REAL else {"all distinct"})
    for case in report["cases"].values():
        assert case["seconds_warm"] > 0 and case["peak_memory_mib"] >= 0 and case["ratio_to_matmul"] > 0
    assert report["sentences"] == 30 and report["matmul_seconds_same_flops"] > 0


@pytest.mark.skipif(not HAVE_REAL, reason="needs ../shared/realdata/flickr8k")
def test_real_fragments_are_the_test_captions_and_repeat():
    lengths, ids, source = bench_fragments.sentence_fragment_ids(5000)
    assert "test captions" in source and len(lengths) == 5000
    assert len(ids) == lengths.sum()
    # The paper's 1 % filter keeps ~8.4 fragments per caption; "a dog" & co. repeat.
    assert 7.5 < lengths.mean() < 9.5
    assert len(np.unique(ids)) < 0.5 * len(ids)
