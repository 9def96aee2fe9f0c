"""Smoke test of benchmarks/: every measuring function runs at toy sizes.

Not a benchmark: it only guards against refactors of the package silently
breaking `python -m benchmarks.run_all` (imports, signatures, batch keys).
Everything runs in this process (no spawn subprocesses) to stay fast.
"""
import pytest

from benchmarks import bench_dual_path, bench_embedding, bench_phrase_localization, common, run_all


@pytest.fixture(scope="module")
def two_branch_rows():
    return run_all.measure_two_branch(quick=True, sizes=bench_embedding.TOY_SIZES,
                                      subprocess=False, steps=1, warmup=1,
                                      precisions=("float32",))


def test_two_branch_steps_at_toy_sizes(two_branch_rows):
    kinds = {(r["kind"], r["precision"]) for r in two_branch_rows}
    assert kinds == {("embedding", "float32"), ("similarity", "float32"), ("lstm", "float32")}
    for r in two_branch_rows:
        assert r["step_seconds_median"] > 0 and r["examples_per_second"] > 0


def test_dual_path_and_table(two_branch_rows):
    toy = bench_dual_path.TOY_SIZES
    forward = bench_dual_path.forward_child("text", "float32", toy, repeats=1, warmup=1)
    assert forward["items_per_second"] > 0
    step = bench_dual_path.step_child(1, "float32", toy, steps=1, warmup=1)
    assert step["trainable_parameters"] < step["parameters"]   # Stage I freezes the backbone
    pipeline = {"train_images": 8, "batches_per_second": 10.0, "images_per_second": 40.0,
                "source_image_size": [96, 96], "batches": 2}
    evals = [{"images": n, "captions": 5 * n, "chunk_size": 64, "warm_seconds": 0.01 * n,
              "cold_seconds": 0.02 * n, "warm_peak_bytes": 1000, "cold_peak_bytes": 2000,
              "full_matrix_bytes": 20 * n * n,
              "chunk_bound_bytes": 320 * n} for n in (10, 5000)]
    report = {"matmul": {"best_gflops": 100.0, "best_shape": "64x64x64"},
              "two_branch": two_branch_rows,
              "dual_path": {"sizes": toy, "forward": [forward, dict(forward, tower="image")],
                            "steps": [step, dict(step, stage=2)], "pipeline": pipeline},
              "evaluation": evals,
              "pipelines": {"image_sentence": bench_embedding.pipeline_child(
                  batches=2, warmup=1, num_images=30, sizes=bench_embedding.TOY_SIZES)}}
    rows, notes = run_all.build_rows(report)
    assert all(len(r) == len(run_all.HEADERS) for r in rows)
    assert any("keeps up" in r[5] for r in rows)
    assert run_all.markdown_table(run_all.HEADERS, rows).count("\n") == len(rows) + 1
    assert bench_dual_path.report_lines({**report["dual_path"], "sizes": dict(toy)})


def test_evaluation_phrase_and_matmul_helpers():
    state = bench_embedding._eval_setup(40, 64)
    metrics = bench_embedding._eval_run(state)
    assert 0 <= metrics["i2t_r1"] <= 100
    ev = bench_phrase_localization._eval_child(150, 200, 1)
    assert ev["phrases"] == 150
    rows = common._matmul_child(((32, 48, 16, False), (48, 32, 16, True)), 1, 0.01, None)
    assert all(r["gflops_median"] > 0 for r in rows)
    assert bench_embedding.step_flops()["total"] > 7e10


@pytest.mark.slow
def test_fragment_and_npair_streams_against_their_steps(tmp_path):
    fed = run_all.measure_fed_pipeline("fragments", quick=True, subprocess=False, images=120,
                                       work_dir=str(tmp_path))
    assert fed["batches_per_second"] > 0 and fed["steps_per_second_fixed"] > 0 and fed["steps_per_second_fed"] > 0
    assert list(tmp_path.iterdir()) == []                          # its folder of random rows is removed
    slow_stream = dict(fed, system="npair", batches_per_second=0.5 * fed["steps_per_second_fixed"])
    rows, _ = run_all.build_rows({"matmul": {"best_gflops": 100.0, "best_shape": "64x64x64"},
                                  "two_branch": [], "pipelines": {"fragments": fed, "npair": slow_stream}})
    inputs = {r[1].split(" ")[0]: r[5] for r in rows if r[0] == "input"}
    assert inputs["fragment_batches.train_dataset"].startswith("keeps up: paper-size fragments step")
    assert inputs["npair_batches.train_dataset"].startswith("DOES NOT keep up: paper-size npair step")
    assert all(len(r) == len(run_all.HEADERS) for r in rows)
