"""The package's own files install what the README promises (issue 39: a GPU user's install)."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _extras() -> dict:
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def test_gpu_extra_brings_tensorflow_with_cuda_in_the_pinned_range():
    extras = _extras()
    assert any(r.startswith("tensorflow[and-cuda]>=2.18,<2.22") for r in extras["gpu"]), extras.get("gpu")
    assert 'pip install -e ".[gpu]"' in (REPO / "README.md").read_text(encoding="utf-8")


def test_readme_names_where_the_embedded_data_goes():
    head = (REPO / "README.md").read_text(encoding="utf-8").split("\n## ", 1)[0]
    assert "data/generated/digit_scenes" in head and "$TF_TWOBRANCH_DATA" in head
