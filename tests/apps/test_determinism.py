"""--deterministic fixes TensorFlow's op schedule (one inter-op thread) before the run's first op.

Why (BUILD_NOTES, session 21): with op determinism on and independent ops side by side, the dual
path's graph-mode step differed in the last bits in about half of repeated runs from the same
weights and batches; `benchmarks/bench_repeatability.py` shows it on the real model. Each check
runs in a fresh process: the schedule is fixed when TensorFlow's runtime starts.
"""
from __future__ import annotations

import textwrap

import pytest

from tests.support.forked_modules import run_python


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


_SIDE_BY_SIDE = """
    import time
    import numpy as np
    import tensorflow as tf
    {setup}
    spans = []
    def wait(x):
        start = time.perf_counter(); time.sleep(0.3); spans.append((start, time.perf_counter()))
        return x
    @tf.function
    def two_independent_ops(x):
        return (tf.numpy_function(wait, [x], tf.float32, stateful=False)
                + tf.numpy_function(wait, [x + 1], tf.float32, stateful=False))
    two_independent_ops(tf.constant(1.0))
    (a0, a1), (b0, b1) = sorted(spans)
    print("overlap", b0 < a1)
"""


def test_deterministic_runs_independent_ops_one_after_the_other():
    # The control shows that the probe sees ops side by side when TensorFlow schedules them so.
    free = _python(_SIDE_BY_SIDE.format(setup=""))
    serial = _python(_SIDE_BY_SIDE.format(
        setup="from tf_twobranch.training import trainer; trainer.make_deterministic(0)"))
    assert "overlap True" in free.stdout
    assert "overlap False" in serial.stdout


def test_one_inter_op_thread_from_the_environment_counts_as_serial(monkeypatch):
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "1")
    result = _python("""
        import tensorflow as tf
        from tf_twobranch.training import trainer
        tf.reduce_sum(tf.ones([4]))
        print("serialized", trainer.serialize_op_scheduling())
    """)
    assert "serialized True" in result.stdout
    assert "side by side" not in result.stderr


def test_deterministic_requested_reads_the_tool_flag_or_a_runners_row_flags(tmp_path):
    from absl import flags

    from tf_twobranch.cli import deterministic_requested

    defined = flags.FlagValues()
    flags.DEFINE_bool("deterministic", False, "", flag_values=defined)
    defined(["tool", "--deterministic"])
    assert deterministic_requested(defined, ["--nodeterministic"])    # the parsed value wins
    defined(["tool", "--nodeterministic"])
    assert not deterministic_requested(defined, ["--deterministic"])

    runner = flags.FlagValues()                                        # passes row flags on
    flagfile = tmp_path / "rows.cfg"
    flagfile.write_text("--rows=a\n--deterministic\n")
    assert deterministic_requested(runner, ["--deterministic"])
    assert deterministic_requested(runner, ["--deterministic=true", "--epochs=1"])
    assert deterministic_requested(runner, [f"--flagfile={flagfile}"])
    assert not deterministic_requested(runner, [f"--flagfile={flagfile}", "--nodeterministic"])
    assert not deterministic_requested(runner, ["--deterministic=false"])
    assert not deterministic_requested(runner, ["--epochs=1"])
    assert not deterministic_requested(runner, ["--", "--deterministic"])
    assert not deterministic_requested(runner, [f"--flagfile={tmp_path / 'missing.cfg'}"])


def test_a_table_runner_passing_deterministic_to_its_rows_fixes_the_schedule():
    code = """
        import sys
        import tensorflow as tf
        from absl import app, flags
        from tf_twobranch.cli import absl_main
        def run():
            tf.reduce_sum(tf.ones([2]))
            print("inter-op", tf.config.threading.get_inter_op_parallelism_threads())
        # a runner defines no --deterministic; its parser keeps only its own flags
        app.run(absl_main(run), argv=[sys.argv[0]], flags_parser=lambda argv: flags.FLAGS(argv[:1]))
    """
    result = run_python(["-c", textwrap.dedent(code), "--deterministic", "--epochs=1"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "inter-op 1" in result.stdout


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


@pytest.mark.slow
def test_the_repeatability_benchmark_repeats_the_real_row_from_the_same_state(tmp_path):
    result = run_python(["-m", "benchmarks.bench_repeatability", "--repeats=2", "--steps=2",
                         f"--run_dir={tmp_path / 'run'}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "repeat 0: reference" in result.stdout
    assert "repeat 1: same" in result.stdout
    assert "op schedule serial (inter-op threads 1), optimizer in_place: 0 of 1 repeats differ" in result.stdout
