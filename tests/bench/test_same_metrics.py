"""benchmarks.same_metrics: what counts as "the same metrics" between two runs of a row."""
from benchmarks import same_metrics as sm


def _results(**changes):
    out = {"metrics": {"i2t_r1": 10.7, "rsum": 123.36, "random_baseline": {"rsum": 8.0}},
           "final_loss": 0.1098, "test_split_fingerprint": "sha256:ab", "stages": [{"metrics": {"rsum": 39.48}}],
           "seconds": 12.0, "run_dir": "/a", "flags": {"epochs": 1}, "row": "b2",
           "evaluation": {"dataset_dir": "/x"}, "stage_times": {"train": 3.0}}
    out.update(changes)
    return out


def test_identical_runs_are_the_same_and_records_of_how_they_ran_are_not_compared():
    before = _results()
    after = _results(seconds=99.0, run_dir="/b", flags={"epochs": 2}, stage_times={"train": 7.0},
                     evaluation={"dataset_dir": "/y"}, recipe={"new": 1})
    numbers, differ, examples = sm.compare(before, after)
    assert (differ, examples) == (0, [])
    assert numbers == len(sm.flat_metrics(before)) == 6


def test_a_changed_number_a_changed_fingerprint_and_a_lost_figure_differ():
    before = _results()
    changed = _results(metrics={"i2t_r1": 10.8, "rsum": 123.36, "random_baseline": {"rsum": 8.0}})
    assert sm.compare(before, changed)[1:] == (1, ["metrics.i2t_r1: 10.7 -> 10.8"])
    assert sm.compare(before, _results(test_split_fingerprint="sha256:cd"))[1] == 1
    lost = _results(stages=[{}])
    numbers, differ, examples = sm.compare(before, lost)
    assert differ == 1 and examples == ["stages[0].metrics.rsum: 39.48 -> (missing)"]
    assert sm.compare(before, _results(final_loss=float("nan")))[1] == 1
    nan = _results(final_loss=float("nan"))
    assert sm.compare(nan, nan)[1] == 0


def test_every_flagfile_has_an_experiment():
    stems = sorted(p.stem for p in (sm.REPO / "experiments" / "configs").glob("*.cfg"))
    assert len(stems) >= 84
    for stem in stems:
        experiment, short = sm.experiment_of(stem)
        assert (sm.REPO / "experiments" / f"{experiment}.py").exists(), stem
