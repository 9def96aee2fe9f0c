"""Smoke test of benchmarks/bench_npair.py: its main at toy sizes, in this process.

Not a benchmark: it guards against refactors of the N-pair model, the loss
or the localization scorer silently breaking `python -m benchmarks.bench_npair`,
and checks the FLOP counts the ratios rest on against a hand transcription.
"""
import json

import pytest

from benchmarks import bench_npair
from tf_twobranch.errors import ConfigError

TOY_SIZES = ["--batch", "4", "--map", "3", "--channels", "8", "--dim", "8", "--tokens", "5",
             "--word_dim", "6", "--gallery_images", "20", "--gallery_captions", "50",
             "--matmul_repeats", "1", "--in_process"]


def test_main_at_toy_sizes_prints_and_writes_positive_figures(tmp_path, capsys):
    out = tmp_path / "npair.json"
    report = bench_npair.main(TOY_SIZES + ["--scale", "1", "--steps", "2", "--out_json", str(out)])
    printed = capsys.readouterr().out
    for text in ("1. Training step", "step / matmuls", "2. S_MaxImage gallery scoring",
                 "peak RSS growth", "machine:"):
        assert text in printed
    assert printed.count("PASS") + printed.count("FAIL") == 3   # step ratio, gallery time, memory
    written = json.loads(out.read_text())
    for record in (report, written):
        step, s = record["step"], record["step_summary"]
        assert step["step_seconds_median"] > 0 and step["warmup_seconds"] > 0
        assert step["loss_block_seconds"] > 0 and step["warmup_peak_bytes"] >= 0
        assert s["ratio_to_matmuls"] > 0 and s["gflops_step"] > 0 and s["matmul_seconds"] > 0
        assert set(s["parts"]) == {"volume", "conv", "lstm"}
        assert all(p["seconds"] > 0 and p["flops"] > 0 for p in s["parts"].values())
        # The toy volume: (4·3·3) locations x (4·5) tokens, float32.
        assert s["volume_bytes"] == 36 * 20 * 4
        g, gs = record["gallery"], record["gallery_summary"]
        assert g["captions_scored"] == 50 and g["seconds"] > 0 and g["peak_bytes"] >= 0
        assert g["flops"] == 2 * 20 * 9 * 50 * 5 * 8
        assert gs["ratio_to_matmul"] > 0 and gs["matmul_seconds_same_flops"] > 0
        assert gs["extrapolation_factor"] == 1


def test_scaled_gallery_is_extrapolated_and_says_so(capsys):
    report = bench_npair.main(TOY_SIZES + ["--scale", "0.2", "--steps", "1"])
    assert report["gallery"]["captions_scored"] == 10
    assert report["gallery_summary"]["extrapolation_factor"] == pytest.approx(5.0)
    assert "extrapolated linearly" in capsys.readouterr().out


def test_step_flops_at_paper_size_match_a_hand_count():
    flops = {}
    for row in bench_npair.step_matmuls(dict(bench_npair.PAPER_SIZES)):
        flops[row["part"]] = flops.get(row["part"], 0) + 2 * row["m"] * row["k"] * row["n"] * row["count"]
    p, q = 64 * 14 * 14, 64 * 22
    assert flops["volume"] == 3 * 2 * p * q * 1024             # forward + 2 gradients
    assert flops["conv"] == 2 * 2 * p * (9 * 512) * 1024       # forward + kernel gradient
    # Per time step: x W and h U forward; dW, dU, dh backward (frozen word vectors: no dx).
    assert flops["lstm"] == 22 * 2 * 64 * 4096 * (2 * 300 + 3 * 1024)


@pytest.mark.parametrize("flags", [["--scale", "0"], ["--scale", "1.5"], ["--batch", "0"],
                                   ["--steps", "0"]])
def test_bad_flags_raise_config_error(flags):
    with pytest.raises(ConfigError):
        bench_npair.main(flags + ["--in_process"])
