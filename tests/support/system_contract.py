"""The contract every registered system keeps (issue 40), checked the same way for each: a test
calls `check_system_contract(system, dataset, folder)` and a system gets it by registering."""
import importlib
import json
import math

import numpy as np
import pytest
import tensorflow as tf

from experiments import common
from tf_twobranch import systems
from tf_twobranch.errors import UserInputError
from tf_twobranch.export import serving
from tf_twobranch.run_export import export_run
from tf_twobranch.runs import load_run


def run_smoke_row(system, dataset, run_dir) -> dict:
    """The system's `smoke_row` through its experiment's own entry (`define_flags`, `run`)."""
    row = system.smoke_row
    module = importlib.import_module(systems.tasks()[row.task].experiment)
    fv = common.parse_flagfile(module.define_flags, str(common.resolve_config(row.flagfile)),
                               [*row.flags, f"--dataset_dir={dataset}", f"--run_dir={run_dir}"])
    return module.run(fv)


def _assert_close(got: dict, want: dict):
    """Every metric `evaluate` gives is results.json's (which may add others: chance, separability)."""
    assert {"i2t_r1", "t2i_r1", "rsum"} <= set(got) <= set(want), (sorted(got), sorted(want))
    for key, value in got.items():
        assert math.isclose(value, want[key], rel_tol=1e-6, abs_tol=1e-6), (key, value, want[key])


def _bad_value(spec: tf.TensorSpec):
    return 1.5 if spec.dtype == tf.string else ["not a number"]


def check_system_contract(system, dataset, folder) -> None:
    """(1) a smoke row runs and writes results.json with its task and its system's name; (2) the model's configuration
    round-trips through the one writer/reader; (3) `load_run(...).model.evaluate` of the run's split
    gives results.json's metrics; (4) `export_run` writes a SavedModel that reloads and answers its
    own warm-up requests, as TF Serving replays them; (5) a request without an input, or with an input
    of the wrong type, is refused with a message naming the signature and the input."""
    run_dir = folder / "run"
    record = run_smoke_row(system, dataset, run_dir)
    assert record["task"] in {t.name for t in system.tasks}
    saved = json.loads((run_dir / "results.json").read_text())
    assert systems.for_task(saved["task"]) is system and saved["system"] == system.name

    run = load_run(run_dir)
    model = run.model
    model.save_config(folder / "config.json", note="round trip")
    config, extra = type(model).load_config(folder / "config.json")
    assert config == model.config and extra == {"note": "round trip"}

    _assert_close(model.evaluate(run.evaluation_split()), saved["metrics"])

    export_dir = export_run(run_dir, folder / "export")
    loaded = tf.saved_model.load(str(export_dir))
    assert serving.replay_warmup_file(export_dir, loaded)
    requests = serving.read_warmup_requests(export_dir)

    # serving_default (every export has one): a request without its inputs, then every input but
    # one as a warm-up request with the same inputs gives it (zeros where none does) and that one
    # of the wrong type; each message names the signature and the input.
    specs = serving.signature_input_specs(loaded.signatures["serving_default"])
    with pytest.raises(UserInputError, match="signature 'serving_default'.*missing"):
        serving.call_signature(loaded, "serving_default")
    good = next((inputs for _, inputs in requests if set(inputs) == set(specs)), {})
    for name, spec in sorted(specs.items()):
        inputs = {n: good.get(n, np.zeros((1,), s.dtype.as_numpy_dtype) if s.dtype != tf.string else [b"x"])
                  for n, s in specs.items()}
        inputs[name] = _bad_value(spec)
        with pytest.raises(UserInputError, match=f"signature 'serving_default', input '{name}'"):
            serving.call_signature(loaded, "serving_default", **inputs)
