"""A fifth system that lives in this one folder (issue 40): mean word vectors against a linear
image tower, trained with a hinge ranking loss.

`system.SYSTEM` is all the package sees of it; registering it (`tf_twobranch.systems.register`)
is all it takes for `load_run`, `export_run` and the leaderboard to run it. Its files:
``model.py`` (the model over `models.base.SystemModel`), ``experiment.py`` (flags, `run`: one
row), ``export.py`` (the SavedModel with retrieval signatures), ``system.py`` (the registry
entry) and ``smoke.cfg`` (its one flagfile).
"""
