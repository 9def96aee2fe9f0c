"""--deterministic fixes TensorFlow's op schedule (one inter-op thread) before the run's first op.

Why (BUILD_NOTES, session 21): with op determinism on and independent ops side by side, the dual
path's graph-mode step differed in the last bits in about half of repeated runs from the same
weights and batches; `benchmarks/bench_repeatability.py` shows it on the real model. Each check
runs in a fresh process: the schedule is fixed when TensorFlow's runtime starts.
"""
from __future__ import annotations

import textwrap

from tests.forked_modules import run_python


def _python(code: str):
    result = run_python(["-c", textwrap.dedent(code)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_make_deterministic_before_the_first_op_runs_one_op_at_a_time():
    result = _python("""
        import tensorflow as tf
        from tf_twobranch.training import trainer
        trainer.make_deterministic(3)
        print("inter-op", tf.config.threading.get_inter_op_parallelism_threads())
        print("sum", float(tf.reduce_sum(tf.ones([4]))))
    """)
    assert "inter-op 1" in result.stdout
    assert "sum 4.0" in result.stdout
    assert "side by side" not in result.stderr


def test_make_deterministic_after_the_first_op_says_what_to_do():
    result = _python("""
        import tensorflow as tf
        from tf_twobranch.training import trainer
        tf.reduce_sum(tf.ones([4]))          # the runtime has started
        print("serialized", trainer.serialize_op_scheduling())
        trainer.make_deterministic(3)        # still seeds and turns on deterministic kernels
        print("inter-op", tf.config.threading.get_inter_op_parallelism_threads())
    """)
    assert "serialized False" in result.stdout
    assert "inter-op 0" in result.stdout
    assert "TF_NUM_INTEROP_THREADS=1" in result.stderr


def test_a_tool_with_deterministic_fixes_the_schedule_before_its_run():
    code = """
        import sys
        import tensorflow as tf
        from absl import app, flags
        from tf_twobranch.cli import absl_main
        flags.DEFINE_bool("deterministic", False, "")
        def run():
            tf.reduce_sum(tf.ones([2]))
            print("inter-op", tf.config.threading.get_inter_op_parallelism_threads())
        app.run(absl_main(run), argv=[sys.argv[0], *sys.argv[1:]])
    """
    with_flag = run_python(["-c", textwrap.dedent(code), "--deterministic"], timeout=120)
    without = run_python(["-c", textwrap.dedent(code)], timeout=120)
    assert with_flag.returncode == 0 and without.returncode == 0, with_flag.stderr[-2000:] + without.stderr[-2000:]
    assert "inter-op 1" in with_flag.stdout
    assert "inter-op 0" in without.stdout


def test_a_tool_without_the_flag_never_imports_the_trainer_for_it():
    result = _python("""
        import sys
        from absl import app, flags
        from tf_twobranch.cli import absl_main
        def run():
            print("trainer imported", "tf_twobranch.training.trainer" in sys.modules)
        app.run(absl_main(run), argv=[sys.argv[0]])
    """)
    assert "trainer imported False" in result.stdout


def test_the_repeatability_benchmark_repeats_the_real_row_from_the_same_state(tmp_path):
    result = run_python(["-m", "benchmarks.bench_repeatability", "--repeats=2", "--steps=2",
                         f"--run_dir={tmp_path / 'run'}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "repeat 0: reference" in result.stdout
    assert "repeat 1: same" in result.stdout
    assert "op schedule serial (inter-op threads 1), optimizer in_place: 0 of 1 repeats differ" in result.stdout
