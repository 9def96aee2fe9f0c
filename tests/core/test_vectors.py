"""The one NumPy L2 normalisation and the one JSON writer."""
import json

import numpy as np
import pytest

from tf_twobranch.json_files import write_json
from tf_twobranch.vectors import l2_normalize_rows


def test_rows_have_unit_norm_and_ordinary_rows_keep_the_plain_formulas_bits():
    x = np.random.default_rng(0).standard_normal((50, 7)).astype(np.float32)
    plain = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    np.testing.assert_array_equal(l2_normalize_rows(x), plain)
    np.testing.assert_allclose(np.linalg.norm(l2_normalize_rows(x), axis=1), 1.0, rtol=1e-6)


def test_zero_rows_stay_zero_and_huge_rows_do_not_overflow():
    x = np.zeros((3, 4), np.float32)
    x[1] = 3e30
    with np.errstate(over="raise", invalid="raise"):
        out = l2_normalize_rows(x)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out[1], 0.5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, None])
def test_dtype(dtype):
    x = np.ones((2, 3), np.float16)
    assert l2_normalize_rows(x, dtype=dtype).dtype == (np.float16 if dtype is None else dtype)


def test_write_json_is_whole_and_writes_numpy_values_as_numbers(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"a": np.float32(0.5), "b": np.arange(2),
                                                    "c": np.int64(3)})
    assert json.loads(path.read_text()) == {"a": 0.5, "b": [0, 1], "c": 3}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]   # no temporary left
    write_json(path, ["é"], compact=True)
    assert path.read_text(encoding="utf-8") == '["é"]'
    circular = []
    circular.append(circular)
    with pytest.raises(ValueError, match="Circular"):
        write_json(path, circular)
    assert path.read_text(encoding="utf-8") == '["é"]'                # the old file is intact
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]
