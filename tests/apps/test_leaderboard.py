"""experiments.leaderboard at tiny size: every system, one split, chance, files, reuse."""
import json

import numpy as np
import pytest
from absl import flags

from experiments import leaderboard as exp
from tf_twobranch import json_files
from tf_twobranch import leaderboard as lb
from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import pointing_game, retrieval

# Tiny sizes per experiment (the generated folder is a --dataset_dir: no embedded profile applies).
ROW_FLAGS = [
    "*:--scene_cnn_epochs=1", "*:--word_dim=8",
    *(f"two_branch_retrieval:{a}" for a in ("--hidden_dim=32", "--embed_dim=16", "--batch_size=20",
                                                 "--epochs=2", "--top_k=3", "--cca_components=16")),
    *(f"dual_path:{a}" for a in ("--max_train_images=32", "--stage1_epochs=1", "--stage2_epochs=1",
                                      "--text_width=2", "--text_blocks=1,1,1,1", "--hidden_dim=16",
                                      "--embed_dim=16", "--batch_size=16", "--run_eagerly", "--word_init=random",
                                      "--image_size=32", "--resize_to=36")),
    *(f"fragments:{a}" for a in ("--embed_dim=16", "--epochs=2", "--batch_size=20")),
    *(f"npair:{a}" for a in ("--embed_dim=8", "--epochs=2", "--steps_per_epoch=4",
                                           "--batch_size=16", "--run_eagerly")),
    *(f"two_branch_region_phrase:{a}" for a in ("--hidden_dim=32", "--embed_dim=16", "--batch_size=20", "--epochs=2",
                                           "--constraint_epochs=1", "--top_k=3", "--cca_components=16",
                                           "--negatives_per_phrase=5")),
]


def _flags(*argv):
    fv = flags.FlagValues()
    exp.define_flags(fv)
    fv(["prog", *argv])
    return fv


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 60 images: the proposal generator stays in-process.
    dataset = generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=60,
                                        splits=(40, 5, 15), num_proposals=30)
    runs = tmp_path_factory.mktemp("runs")
    # The dual path on a small image CNN (as on the embedded data, whose rows use the scene CNN
    # stand-in) instead of a ResNet-50 that a --dataset_dir without ImageNet weights would start
    # from random: the same system and code path, ~16 s less (of ~75 s) here.
    from tf_twobranch.features.scene_cnn import build_scene_cnn, save_scene_cnn
    cnn = tmp_path_factory.mktemp("cnn") / "scene_cnn.keras"
    save_scene_cnn(build_scene_cnn(32, 10, feature_dim=16, widths=(4, 4, 8, 8))[1], cnn)
    argv = [f"--dataset_dir={dataset}", "--seeds=1", f"--runs_dir={runs}", "--skip_existing",
            *(f"--row_flag={r}" for r in ROW_FLAGS), "--row_flag=dual_path:--image_backbone=scene_cnn",
            f"--row_flag=dual_path:--image_weights={cnn}"]
    from tf_twobranch.training import trainer
    trained_here, original = [], trainer.train
    trainer.train = lambda *a, **k: trained_here.append(1) or original(*a, **k)
    try:
        result = exp.run_leaderboard(_flags(*argv))
    finally:
        trainer.train = original
    result["trained_in_this_process"] = len(trained_here)
    return argv, result, dataset


def test_every_run_trains_in_a_process_of_its_own(tiny):
    """One process that trained every run kept ~0.3 GB of each (1.5 -> 4.7 GB over one seed's
    fourteen runs): each run now trains in a fresh process, so the leaderboard's memory is one run's."""
    assert tiny[1]["trained_in_this_process"] == 0


def test_every_system_on_one_split_with_grounding_and_files(tiny):
    _, result, dataset = tiny
    board, table = result["board"], result["table"]
    rows = {r["key"]: r for r in board["rows"]}
    assert list(rows) == list(lb.line_keys())
    for key, row in rows.items():
        assert "unavailable" not in row, (key, row.get("unavailable"))
        assert row["cells"]["rsum"] is not None and row["name"] in table
        assert row["protocol"] == "full"
    assert len({r["test_split_fingerprint"] for r in rows.values()}) == 1
    assert board["split"]["test_split_fingerprint"].startswith("sha256:") and not board["apart"]
    assert board["split"]["num_test_images"] == 15
    # Grounding: every localizing system has a pointing cell, on the same phrases (one phrase
    # fingerprint: every Entities test phrase with a box); the box rankers also have box R@1.
    localizers = [s.key for s in lb.lines() if s.localizes]
    assert localizers == ["cca", "embedding", "similarity", "fragments", "npair"]
    for key in localizers:
        assert rows[key]["cells"]["pointing"] is not None, (key, rows[key].get("grounding_unavailable"))
    for key in ("cca", "embedding", "similarity", "fragments"):
        assert rows[key]["cells"]["box_r1"] is not None, key
    assert rows["npair"]["cells"]["box_r1"] is None
    assert rows["fragments"]["grounding_rule"] == "best_fragment" and rows["cca"]["grounding_rule"] == "top_proposal"
    phrases = board["phrases"]
    assert {rows[k]["grounding_fingerprint"] for k in localizers} == {phrases["phrase_fingerprint"]}
    assert phrases["num_phrases"] == len(pointing_game.pointing_queries(dataset, dataset / "test.txt"))
    assert not board["grounding_apart"]
    for key in ("random", "dual_path"):
        assert rows[key]["grounding_unavailable"] and rows[key]["cells"]["pointing"] is None
    assert rows["embedding"]["cells"]["params"]["mean"] > 0 and rows["embedding"]["cells"]["train_s"]["mean"] > 0
    assert rows["cca"]["cells"]["params"]["mean"] > 0
    # Files.
    files = result["files"]
    saved = json.loads(open(files["json"], encoding="utf-8").read())
    assert {r["key"] for r in saved["rows"]} == set(lb.line_keys())
    csv_lines = open(files["csv"], encoding="utf-8").read().splitlines()
    assert len(csv_lines) == 1 + len(lb.line_keys()) and "test_split_fingerprint" in csv_lines[0]
    with open(files["png"], "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    assert lb.GROUNDING_RULE in table and "protocol full" in table
    # Paper orderings: every ordering is checked on this one seed, sibling rows on the same split
    # and phrases (nothing set aside as measured elsewhere).
    orderings = {o["claim"]: o for o in board["orderings"]}
    assert set(orderings) == {o.claim for o in lb.orderings()}
    for claim, o in orderings.items():
        assert len(o["seeds"]) == 1 and not o["notes"], (claim, o["notes"])
        assert o["verdict"] == lb.ONE_SEED_VERDICT and "holds" not in o["verdict"]
    assert "Paper orderings on this data" in table and lb.ORDERING_RULE in table
    assert saved["orderings"] == board["orderings"]
    assert f"grounding phrases: {phrases['num_phrases']} (phrase fingerprint {phrases['phrase_fingerprint']})" in table


def test_random_ranking_sits_at_chance(tiny):
    _, result, _ = tiny
    row = next(r for r in result["board"]["rows"] if r["key"] == "random")
    n_images, n_captions = 15, 75
    caption_image = np.repeat(np.arange(n_images), n_captions // n_images)
    # The spread of random rankings on a gallery of this size.
    rsums = [retrieval.random_baseline_metrics(n_images, caption_image, seed=s)["rsum"] for s in range(40)]
    assert abs(row["cells"]["rsum"]["mean"] - np.mean(rsums)) <= 4 * np.std(rsums)
    # t2i R@K of random scores is K / gallery size in expectation.
    assert abs(row["cells"]["t2i_r10"]["mean"] - 100 * 10 / n_images) <= 4 * 100 * np.sqrt(
        (10 / n_images) * (1 - 10 / n_images) / n_captions)


def test_second_invocation_reuses_every_run(tiny, monkeypatch, tmp_path, capsys):
    from tf_twobranch.systems.two_branch.cca import CCABaseline
    from tf_twobranch.training import trainer

    argv, first, _ = tiny
    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")
    monkeypatch.setattr(trainer, "train", no_training)
    monkeypatch.setattr(CCABaseline, "fit", no_training)
    capsys.readouterr()
    second = exp.run_leaderboard(_flags(*argv))
    assert all(r["reused"] for r in second["board"]["rows"])
    # The estimate up front knows it too (it had checked the runs without the flags they were
    # trained with, and promised 193-251 minutes for a leaderboard it then reused in seconds).
    assert "every one reused or skipped" in capsys.readouterr().out
    # --reuse_only trains nothing either, and names what is not run yet instead.
    only = exp.run_leaderboard(_flags(*[a for a in argv if not a.startswith("--runs_dir")],
                                      f"--runs_dir={tmp_path}", "--reuse_only", "--systems=cca"))
    assert "not run yet (--reuse_only)" in only["board"]["rows"][0]["unavailable"]
    for a, b in zip(first["board"]["rows"], second["board"]["rows"]):
        assert a["cells"]["rsum"] == b["cells"]["rsum"] and a["cells"]["params"] == b["cells"]["params"]


def _record(fingerprint, rsum, protocol="full"):
    metrics = {k: rsum / 6 for k in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")}
    return {"protocol": protocol, "test_split_fingerprint": fingerprint, "num_test_images": 10,
            "num_test_captions": 50, "metrics": {**metrics, "rsum": rsum, "i2t_medr": 3.0, "t2i_medr": 4.0}}


def _run(record):
    return {"retrieval": {"record": record, "cost": {"params": 10, "train_s": 1.0, "eval_s": 0.5},
                          "reused": False}}


def test_seeds_give_mean_and_std_and_other_splits_are_listed_apart():
    board = lb.assemble({"cca": [_run(_record("sha256:a", 60.0)), _run(_record("sha256:a", 90.0))],
                         "embedding": [_run(_record("sha256:a", 120.0))],
                         "similarity": [_run(_record("sha256:b", 300.0))],
                         "npair": [{"retrieval": {"error": "no Entities here"}}]})
    rows = {r["key"]: r for r in board["rows"]}
    assert rows["cca"]["cells"]["rsum"]["mean"] == 75.0
    assert rows["cca"]["cells"]["rsum"]["std"] == pytest.approx(np.std([60, 90], ddof=1))
    assert board["split"]["test_split_fingerprint"] == "sha256:a"
    assert [a["key"] for a in board["apart"]] == ["similarity"]
    assert rows["similarity"]["cells"]["rsum"] is None and "another split" in rows["similarity"]["unavailable"]
    assert rows["npair"]["unavailable"] == "no Entities here"
    table = lb.format_table(board, dataset="d", seeds=[0, 1])
    assert "75.0±21.2" in table and "NOT COMPARABLE" in table and "no Entities here" in table


def test_bad_row_flags_and_systems_are_clear_errors(tmp_path):
    with pytest.raises(UserInputError, match="TARGET"):
        lb.row_flags(["no_colon"], "cca", "two_branch_retrieval", set())
    with pytest.raises(UserInputError, match="unknown target"):
        lb.row_flags(["nope:--epochs=1"], "cca", "two_branch_retrieval", set())
    with pytest.raises(UserInputError, match="unknown"):
        exp.run_leaderboard(_flags("--systems=cca,nope", f"--runs_dir={tmp_path}"))
    with pytest.raises(UserInputError, match="does not exist"):
        exp.run_leaderboard(_flags(f"--dataset_dir={tmp_path / 'missing'}"))


def _grounded(fingerprint, pointing, box_r1=None, phrases=10):
    summary = {"phrase_fingerprint": fingerprint, "num_phrases": phrases, "rule": "heat_map",
               "pointing_accuracy": pointing, "pointing": {"accuracy": pointing}}
    return summary if box_r1 is None else {**summary, "box_r1": box_r1}


def test_grounding_on_other_phrases_is_listed_apart_and_the_rule_is_stated():
    record = _record("sha256:a", 60.0)
    cost = {"params": 10, "train_s": 1.0, "eval_s": 0.5}
    board = lb.assemble({
        "cca": [{**_run(record), "grounding": {"record": {"grounding": _grounded("sha256:p", 40.0, 50.0)},
                                               "cost": cost, "reused": False}}],
        "similarity": [{**_run(record), "grounding": {"record": {"metrics": {"r1": 30.0}}, "cost": cost,
                                                      "reused": False}}],
        "fragments": [_run({**record, "grounding": _grounded("sha256:p", 20.0, 10.0)})],
        "npair": [_run({**record, "grounding": _grounded("sha256:q", 15.0, phrases=12)})],
        "dual_path": [_run(record)]})
    rows = {r["key"]: r for r in board["rows"]}
    assert board["phrases"] == {"phrase_fingerprint": "sha256:p", "num_phrases": 10}
    assert rows["cca"]["cells"]["box_r1"]["mean"] == 50.0 and rows["fragments"]["cells"]["pointing"]["mean"] == 20.0
    assert [a["key"] for a in board["grounding_apart"]] == ["npair"]
    assert rows["npair"]["cells"]["pointing"] is None and "other phrases" in rows["npair"]["grounding_unavailable"]
    # A record without a grounding summary (an older run) says so; a system that cannot localize says why.
    assert rows["similarity"]["cells"]["box_r1"] is None and "no grounding summary" in rows["similarity"][
        "grounding_unavailable"]
    assert rows["dual_path"]["grounding_unavailable"] == next(s for s in lb.lines() if s.key == "dual_path").no_grounding
    table = lb.format_table(board, dataset="d", seeds=[0])
    assert lb.GROUNDING_RULE in table and "grounding phrases: 10 (phrase fingerprint sha256:p)" in table
    assert "NOT COMPARABLE (grounding on other phrases, not in the table): N-pair" in table


def test_a_finished_run_without_its_grounding_is_not_reused(tmp_path):
    lb.mark_finished(tmp_path, ["--seed=0"], lb.RowCost(params=1, train_s=1.0, eval_s=1.0))
    json_files.write_json(tmp_path / "results.json", _record("sha256:a", 60.0))
    assert lb.finished_run(tmp_path, ["--seed=0"]) is not None
    assert lb.finished_run(tmp_path, ["--seed=0"], needs_grounding=True) is None
    json_files.write_json(tmp_path / "results.json", {**_record("sha256:a", 60.0), "grounding": _grounded("p", 1.0)})
    assert lb.finished_run(tmp_path, ["--seed=0"], needs_grounding=True) is not None


def _entry(rsum=None, stage1=None, pointing=None, split="sha256:a", phrases="sha256:p"):
    record = _record(split, rsum) if rsum is not None else {"protocol": None, "test_split_fingerprint": None}
    if stage1 is not None:
        record["stages"] = [{"stage": 1, "metrics": {"rsum": stage1}}, {"stage": 2, "metrics": record["metrics"]}]
    if pointing is not None:
        record["grounding"] = {"phrase_fingerprint": phrases, "num_phrases": 7, "pointing_accuracy": pointing}
    return _run(record)


def test_orderings_are_paired_by_seed_and_judged_against_the_spread():
    npair = lb.Ordering("n", "p", lb.Side("N-pair", "npair", "pointing"), lb.Side("t", "triplet", "pointing"))
    stages = lb.Ordering("s", "p", lb.Side("II", "dual_path"), lb.Side("I", "dual_path", "stage1_rsum"))
    emb = lb.Ordering("e", "p", lb.Side("b6", "embedding"), lb.Side("b5", "b5"))
    entries = {"npair": [_entry(10, pointing=p) for p in (50, 52, 54)],
               "triplet": [_entry(pointing=p) for p in (40, 41, 42)],
               "dual_path": [_entry(30, stage1=s) for s in (29, 31, 20)],
               "embedding": [_entry(100), _entry(110), _entry(120, split="sha256:other")],
               "b5": [_entry(90), _entry(111), _entry(100)]}
    rows = {r["claim"]: r for r in lb.check_orderings(entries, [npair, stages, emb])}
    # N-pair: +10, +11, +12 -> positive on every seed, mean 11 > 2 x std 1.
    assert [d["difference"] for d in rows["n"]["seeds"]] == [10, 11, 12]
    assert rows["n"]["verdict"] == "yes" and rows["n"]["beyond_spread"]
    # Stage II - Stage I: +1, -1, +10 -> the sign changes with the seed.
    assert rows["s"]["verdict"] == "no: the sign changes with the seed" and not rows["s"]["beyond_spread"]
    # A seed measured on another split is not compared, and says so.
    assert [d["seed"] for d in rows["e"]["seeds"]] == [0, 1]
    assert "seed 2: measured on different splits" in rows["e"]["notes"][0]
    assert rows["e"]["verdict"] == "no: the sign changes with the seed"
    within = lb.check_orderings({"npair": [_entry(1, pointing=p) for p in (50, 60)],
                                 "triplet": [_entry(pointing=p) for p in (49, 40)]}, [npair])[0]
    assert within["verdict"] == "no: holds on every seed, within the spread"
    # Grounding on other phrases is not compared.
    other = lb.check_orderings({"npair": [_entry(1, pointing=50)],
                                "triplet": [_entry(pointing=40, phrases="sha256:q")]}, [npair])[0]
    assert other["difference"] is None and other["verdict"].startswith("not measured")
    assert "n" in lb.format_orderings([rows["n"]]) and "+10.0, +11.0, +12.0" in lb.format_orderings([rows["n"]])


def test_siblings_are_run_only_for_the_selected_systems():
    assert lb.siblings_needed(lb.line_keys()) == ["b5", "fragment_global", "triplet", "centre",
                                                   "channel_mean"]
    assert lb.siblings_needed(["cca", "embedding"]) == ["b5"]
    assert lb.siblings_needed(["random", "dual_path"]) == []


# ---------------------------------------------------------------------------- issue 39 item 8


def test_reuse_only_labels_a_system_that_never_ran_as_missing():
    reused = {"retrieval": {"record": _record("sha256:a", 90.0), "cost": {"params": 1, "train_s": 1.0,
                                                                        "eval_s": 1.0}, "reused": True}}
    board = lb.assemble({"cca": [{"retrieval": {"error": "not run yet (--reuse_only): two_branch_table2_a1, seed 0"},
                                  "grounding": {"error": "not run yet (--reuse_only): two_branch_table1_a_cca, seed 0"}}],
                         "embedding": [reused]})
    rows = {r["key"]: r for r in board["rows"]}
    assert rows["cca"]["missing"] and not rows["cca"]["reused"]
    assert rows["embedding"]["reused"] and not rows["embedding"]["missing"]
    table = lb.format_table(board, dataset="d", seeds=[0])
    assert "CCA (FV HGLMM) (missing)" in table and "CCA (FV HGLMM) (reused)" not in table
    assert "Two-branch embedding network (full model) (reused)" in table
    assert lb.run_counts(board) == "1 of 2 systems reused, 1 missing (never ran)"
    trained = lb.assemble({"cca": [_run(_record("sha256:a", 90.0))], "embedding": [reused]})
    assert lb.run_counts(trained) == "1 of 2 systems reused, 1 trained"


def test_every_leaderboard_run_keeps_its_experiments_schedule():
    # The leaderboard's budget is each experiment's embedded profile: at 60 + 15 epochs (the
    # shortening it had) the dual path's Stage I had not converged and Stage II > Stage I stayed
    # within the seed spread (+19.6 +- 10.2).
    runs = [r for s in lb.lines() for r in (s.retrieval, s.grounding) if r] + list(lb.siblings().values())
    assert not [f for r in runs for f in r.flags if "epochs" in f]


def test_one_seed_never_says_an_ordering_holds():
    o = lb.Ordering("e", "p", lb.Side("b6", "embedding"), lb.Side("b5", "b5"))
    row = lb.check_orderings({"embedding": [_entry(100.8)], "b5": [_entry(100.0)]}, [o])[0]
    assert row["verdict"] == lb.ONE_SEED_VERDICT and "holds" not in row["verdict"] and not row["beyond_spread"]
    assert "holds" not in lb.format_orderings([row]).splitlines()[1]   # the line of the ordering


def _board_of_1000_images():
    record = {**_record("sha256:a", 60.0), "num_test_images": 1000, "num_test_captions": 5000}
    return lb.assemble({"random": [_run(record)], "cca": [_run(record)], "npair": [{"retrieval": {"error": "x"}}]})


def test_the_chance_row_is_the_expected_value_of_random_ranking():
    board = _board_of_1000_images()
    chance = board["chance"]
    assert round(chance["i2t_r5"], 1) == 0.5 and round(chance["i2t_r10"], 1) == 1.0     # not one draw
    assert chance["t2i_r1"] == pytest.approx(0.1) and chance["t2i_medr"] == 500
    table = lb.format_table(board, dataset="d", seeds=[0])
    chance_row = next(line for line in table.splitlines() if line.startswith(lb.CHANCE_NAME + " "))
    assert " 0.5 " in chance_row and " 1.0 " in chance_row and " 500 " in chance_row
    assert "expected value of random ranking" in table


def _queries():
    from tf_twobranch.evaluation.pointing_game import PointingQuery
    return [PointingQuery(image_id=str(i), sentence_index=0, phrase_index=0, caption_words=["x"], word_span=(0, 1),
                          phrase="x", boxes=np.array([[0, 0, 9, 9]], np.float32), image_width=20, image_height=20)
            for i in range(4)]


def test_grounding_has_a_chance_row_and_a_centre_baseline_row():
    from tf_twobranch.data.phrases import phrase_fingerprint

    queries = _queries()
    phrases = {"phrase_fingerprint": phrase_fingerprint(queries), "num_phrases": 4}
    proposals = {str(i): np.array([[0, 0, 9, 9], [10, 10, 19, 19]], np.float32) for i in range(4)}
    baselines = lb.grounding_baselines(queries, phrases, proposals, max_proposals=2)
    assert baselines["random_point"] == pytest.approx(25.0) and baselines["centre_point"] == 100.0
    assert baselines["random_box_r1"] == pytest.approx(50.0)
    other = lb.grounding_baselines(queries[:3], phrases)
    assert "not the table's" in other["not_computed"]
    board = _board_of_1000_images()
    board["grounding_baselines"] = baselines
    table = lb.format_table(board, dataset="d", seeds=[0])
    chance_row = next(line for line in table.splitlines() if line.startswith(lb.CHANCE_NAME + " "))
    centre_row = next(line for line in table.splitlines() if line.startswith(lb.CENTRE_NAME))
    assert "25.0" in chance_row and "50.0" in chance_row and "100.0" in centre_row


def _figure(board, tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    lb.write_figure(tmp_path / "leaderboard.png", board, "title")
    return figures[-1]


def test_the_png_one_seed_no_error_bars_na_marked_axis_labels_legend_beside(tmp_path, monkeypatch):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.container import ErrorbarContainer

    board = _board_of_1000_images()
    fig = _figure(board, tmp_path, monkeypatch)
    renderer = FigureCanvasAgg(fig).get_renderer()
    for ax in fig.axes:
        assert ax.get_ylabel()
        assert not any(isinstance(c, ErrorbarContainer) for c in ax.containers)   # one seed: no error bars
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.x0 >= ax.get_window_extent(renderer).x1 - 1     # beside the bars, not on them
    na = [t for ax in fig.axes for t in ax.texts if t.get_text() == "n/a"]
    assert len(na) == 1 + 3 + 3      # npair's rsum (unavailable); pointing and box R@1 of all three
    assert any(p.get_hatch() for ax in fig.axes for p in ax.patches)
    # Two seeds: error bars.
    two = lb.assemble({"cca": [_run(_record("sha256:a", 60.0)), _run(_record("sha256:a", 70.0))]})
    fig = _figure(two, tmp_path, monkeypatch)
    assert any(isinstance(c, ErrorbarContainer) for c in fig.axes[0].containers)


def test_the_estimate_is_printed_up_front(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lb, "estimate_seconds", lambda runs: 60.0 * len(runs))
    exp.print_estimate(_flags("--systems=cca,dual_path", "--seeds=2", f"--runs_dir={tmp_path}"), tmp_path)
    out = capsys.readouterr().out
    # cca: retrieval + grounding, dual path: retrieval (no ordering has both sides here); two seeds.
    assert "Estimated time on this machine: 6–8 min for 6 runs to train (0 reused" in out


def test_orderings_and_their_sibling_rows_are_the_systems_own():
    import dataclasses

    from tf_twobranch import systems
    from tf_twobranch.errors import ConfigError
    from tf_twobranch.systems.registry import LeaderboardRun, LeaderboardSibling, Ordering, Side
    declared = [o for s in systems.all() for o in s.orderings]
    beats_random = [o for o in lb.orderings() if o.paper == "every paper"]
    assert list(lb.orderings()) == declared + beats_random
    assert [o.better.source for o in beats_random] == [k for k in lb.line_keys() if k != lb.RANDOM_KEY]
    assert lb.siblings() == {x.key: x.run for s in systems.all() for x in s.siblings}
    # Every side names a line or a sibling, and every run the leaderboard trains says what it costs.
    keys = set(lb.line_keys()) | set(lb.siblings())
    assert all({o.better.source, o.worse.source} <= keys for o in lb.orderings())
    runs = [r for s in lb.lines() for r in (s.retrieval, s.grounding) if r] + list(lb.siblings().values())
    assert all(r.reference_seconds for r in runs)
    # A system registered beside them brings its own; a key another system holds is refused.
    base = systems.get("npair")
    extra = dataclasses.replace(
        base, name="extra_npair", tasks=(dataclasses.replace(base.tasks[0], name="extra_task", aliases=()),), leaderboard=(),
        siblings=(LeaderboardSibling("extra_centre", LeaderboardRun("extra_task", "npair_table2_centre")),),
        orderings=(Ordering("N-pair beats another centre", "p", Side("N-pair", "npair", "pointing"),
                            Side("centre", "extra_centre", "pointing")),))
    systems.register(extra)
    try:
        assert "extra_centre" in lb.siblings() and extra.orderings[0] in lb.orderings()
        assert "extra_centre" in lb.siblings_needed(["npair"])
    finally:
        systems.unregister("extra_npair")
    clash = dataclasses.replace(extra, siblings=(LeaderboardSibling("b5", LeaderboardRun("extra_task", "x")),))
    with pytest.raises(ConfigError, match="'b5' belongs to another system"):
        systems.register(clash)
    assert "extra_npair" not in [s.name for s in systems.all()]
