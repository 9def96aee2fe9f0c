"""Command-line tools that are not paper experiments.

Each module runs as ``python -m tf_twobranch.tools.<module> ...`` and says in
its docstring what it does (e.g. `saved_model_cli`: TensorFlow's
``saved_model_cli`` with the tensorflow-text ops registered).
"""
