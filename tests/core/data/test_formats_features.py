import os
import pathlib

import h5py
import numpy as np
import pytest
import scipy.io

from tf_twobranch.data.formats.features import (load_feature_matrix, load_paired_features,
                                                save_feature_matrix)
from tf_twobranch.errors import ConfigError, DataFormatError

SUFFIXES = [".npy", ".npz", ".h5", ".hdf5", ".mat"]


def features(rows=6, dims=4, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, dims)).astype(np.float32)


def write_matlab_v73(path, name, matlab_matrix):
    """Writes `matlab_matrix` (N, D) as MATLAB -v7.3 does: HDF5 with a 512-byte
    MATLAB header and the column-major data seen as (D, N) by h5py."""
    with h5py.File(path, "w", userblock_size=512) as handle:
        dataset = handle.create_dataset(name, data=np.ascontiguousarray(matlab_matrix.T).astype(np.float64))
        dataset.attrs["MATLAB_class"] = np.bytes_("double")
    header = b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: Mon Jan  1 00:00:00 2018 HDF5 schema 1.00 ."
    with open(path, "r+b") as f:
        f.write(header.ljust(116) + b"\x00" * 8 + b"\x00\x02IM")


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_round_trip(tmp_path, suffix, layout):
    array = features()
    path = tmp_path / f"feats{suffix}"
    save_feature_matrix(path, array, "image_features", layout=layout)
    loaded = load_feature_matrix(path, layout=layout)
    assert loaded.dtype == np.float32 and loaded.flags.c_contiguous
    np.testing.assert_array_equal(loaded, array)


def test_key_selection(tmp_path):
    path = tmp_path / "many.npz"
    np.savez(path, image_features=features(), other=features(seed=1))
    np.testing.assert_array_equal(load_feature_matrix(path), features())
    np.testing.assert_array_equal(load_feature_matrix(path, "other"), features(seed=1))
    with pytest.raises(DataFormatError, match=r"many\.npz.*no array named 'x'.*'other'"):
        load_feature_matrix(path, "x")
    np.savez(path, a=features(), b=features())
    with pytest.raises(DataFormatError, match=r"several arrays \['a', 'b'\]"):
        load_feature_matrix(path)
    mat = tmp_path / "f.mat"
    scipy.io.savemat(mat, {"text_features": features(), "names": np.array(["x"])})
    np.testing.assert_array_equal(load_feature_matrix(mat), features())


def test_hdf5_nested_key(tmp_path):
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as handle:
        handle.create_group("group").create_dataset("features", data=features())
    np.testing.assert_array_equal(load_feature_matrix(path), features())
    np.testing.assert_array_equal(load_feature_matrix(path, "group/features"), features())


def test_auto_layout_transposes_hdf5_only_when_expected_rows_say_so(tmp_path):
    path = tmp_path / "text.h5"
    save_feature_matrix(path, features(6, 4), "text_features", layout="columns")  # stored (4, 6)
    assert load_feature_matrix(path).shape == (4, 6)
    np.testing.assert_array_equal(load_feature_matrix(path, expected_rows=6), features(6, 4))
    npy = tmp_path / "text.npy"
    save_feature_matrix(npy, features(6, 4), layout="columns")
    with pytest.raises(DataFormatError, match=r"text\.npy.*expected 6 rows, found shape \(4, 6\)"):
        load_feature_matrix(npy, expected_rows=6)


def test_matlab_v73_file(tmp_path):
    path = tmp_path / "image_features.mat"
    write_matlab_v73(path, "image_features", features(5, 3))
    assert h5py.is_hdf5(path)
    np.testing.assert_allclose(load_feature_matrix(path, expected_rows=5), features(5, 3))
    np.testing.assert_allclose(load_feature_matrix(path, layout="columns"), features(5, 3))


def test_paired_features_with_matlab_style_transposed_text(tmp_path):
    image_path, text_path = tmp_path / "image_features.mat", tmp_path / "text_features.h5"
    images, texts = features(4, 3), features(20, 7, seed=2)
    scipy.io.savemat(image_path, {"image_features": images})
    with h5py.File(text_path, "w") as handle:  # as MATLAB writes an (N, D) matrix: h5py sees (D, N)
        handle.create_dataset("text_features", data=texts.T.copy())
    for num_captions in (None, 20):
        image_feats, text_feats, caption_image = load_paired_features(
            image_path, text_path, num_captions=num_captions)
        np.testing.assert_array_equal(image_feats, images)
        np.testing.assert_array_equal(text_feats, texts)
        assert caption_image.dtype == np.int32
        assert caption_image.tolist() == [i // 5 for i in range(20)]


def test_paired_features_errors_name_both_files(tmp_path):
    image_path, text_path = tmp_path / "im.npy", tmp_path / "txt.npy"
    np.save(image_path, features(4, 3))
    np.save(text_path, features(10, 3))
    with pytest.raises(DataFormatError, match=r"txt\.npy.*10 sentence feature rows.*not a positive "
                                              r"multiple of the 4 image feature rows in .*im\.npy"):
        load_paired_features(image_path, text_path)
    np.save(text_path, features(8, 3))
    assert load_paired_features(image_path, text_path)[2].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(DataFormatError, match=r"txt\.npy.*expected 12 sentence feature rows.*im\.npy"):
        load_paired_features(image_path, text_path, num_captions=12)
    ambiguous = tmp_path / "txt.h5"
    save_feature_matrix(ambiguous, features(8, 4))
    with pytest.raises(DataFormatError, match="pass num_captions"):
        load_paired_features(image_path, ambiguous)
    assert load_paired_features(image_path, ambiguous, num_captions=8)[1].shape == (8, 4)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataFormatError, match=r"absent\.npy: file does not exist"):
        load_feature_matrix(tmp_path / "absent.npy")
    (tmp_path / "f.csv").write_text("1,2")
    with pytest.raises(DataFormatError, match="unsupported feature file type '.csv'"):
        load_feature_matrix(tmp_path / "f.csv")
    with pytest.raises(ConfigError):
        load_feature_matrix(tmp_path / "f.csv", layout="sideways")


@pytest.mark.parametrize("suffix, kind", [(".npy", "NumPy .npy"), (".npz", "NumPy .npz"),
                                          (".h5", "HDF5"), (".mat", "MATLAB .mat")])
def test_truncated_files(tmp_path, suffix, kind):
    path = tmp_path / f"feats{suffix}"
    save_feature_matrix(path, features(50, 20), "features")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError, match=f"looks truncated or is not a valid {kind} file") as info:
        load_feature_matrix(path)
    assert f"feats{suffix}" in str(info.value)


def test_truncated_matlab_v73(tmp_path):
    path = tmp_path / "v73.mat"
    write_matlab_v73(path, "image_features", features(200, 30))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError, match=r"v73\.mat.*truncated"):
        load_feature_matrix(path)


def test_content_errors(tmp_path):
    path = tmp_path / "f.npy"
    np.save(path, np.zeros((2, 3, 4), np.float32))
    with pytest.raises(DataFormatError, match=r"f\.npy.*2-D.*\(2, 3, 4\)"):
        load_feature_matrix(path)
    np.save(path, np.array([["a", "b"]]))
    with pytest.raises(DataFormatError, match="non-numeric dtype"):
        load_feature_matrix(path)
    bad = features(6, 4)
    bad[3, 1] = np.nan
    bad[5, 0] = np.inf
    bad[5, 2] = -np.inf
    np.save(path, bad)
    with pytest.raises(DataFormatError, match=r"f\.npy.*3 NaN/inf values in 2 rows; first bad row is 3"):
        load_feature_matrix(path)
    np.save(path, features(6, 4))
    with pytest.raises(DataFormatError, match=r"expected 7 rows, found shape \(6, 4\)"):
        load_feature_matrix(path, expected_rows=7)
    h5 = tmp_path / "f.h5"
    with h5py.File(h5, "w") as handle:
        handle.create_dataset("features", data=np.arange(12, dtype=np.int16).reshape(3, 4))
    assert load_feature_matrix(h5).dtype == np.float32


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(DataFormatError, match="2-D numeric"):
        save_feature_matrix(tmp_path / "x.npy", np.zeros(3))
    with pytest.raises(ConfigError):
        save_feature_matrix(tmp_path / "x.npy", features(), layout="auto")


# ------------------------------------------------- memory maps and row-major conversion

def test_row_major_float_npy_is_memory_mapped_not_copied(tmp_path):
    path = tmp_path / "f.npy"
    np.save(path, features(6, 4))
    loaded = load_feature_matrix(path)
    assert isinstance(loaded, np.memmap) and not loaded.flags.writeable
    assert pathlib.Path(loaded.filename) == path
    half = tmp_path / "half.npy"
    np.save(half, features(6, 4).astype(np.float16))
    kept = load_feature_matrix(half)  # float16 storage used as it is
    assert isinstance(kept, np.memmap) and kept.dtype == np.float16
    widened = load_feature_matrix(half, dtype="float32", cache_dir=tmp_path / "conv")
    assert isinstance(widened, np.memmap) and widened.dtype == np.float32
    np.testing.assert_array_equal(widened, features(6, 4).astype(np.float16).astype(np.float32))
    with pytest.raises(ConfigError, match="feature_dtype"):
        load_feature_matrix(path, dtype="float64")


@pytest.fixture
def small_blocks(monkeypatch):
    """Conversion blocks of a few rows, so that several blocks are written."""
    import tf_twobranch.data.formats.features as module
    monkeypatch.setattr(module, "BLOCK_BYTES", 64)


def test_column_major_hdf5_is_converted_block_by_block_into_a_memory_mapped_cache(tmp_path, small_blocks):
    texts = features(50, 7, seed=3)
    path = tmp_path / "text_features.h5"
    with h5py.File(path, "w") as handle:  # MATLAB's (D, N), chunked as MATLAB writes it
        handle.create_dataset("text_features", data=texts.T.astype(np.float64), chunks=(7, 3))
    cache = tmp_path / "conv"
    loaded = load_feature_matrix(path, expected_rows=50, cache_dir=cache)
    assert isinstance(loaded, np.memmap) and loaded.flags.c_contiguous and loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, texts)
    converted = pathlib.Path(loaded.filename)
    assert converted.parent == cache and converted.suffix == ".npy"
    written = converted.stat().st_mtime_ns
    again = load_feature_matrix(path, expected_rows=50, cache_dir=cache)  # reused, not rewritten
    assert pathlib.Path(again.filename) == converted and converted.stat().st_mtime_ns == written
    half = load_feature_matrix(path, expected_rows=50, cache_dir=cache, dtype="float16")
    assert half.dtype == np.float16 and pathlib.Path(half.filename) != converted
    # A changed source gets a new conversion.
    with h5py.File(path, "w") as handle:
        handle.create_dataset("text_features", data=(2 * texts).T)
    os.utime(path, ns=(written + 10**9, written + 10**9))
    np.testing.assert_array_equal(load_feature_matrix(path, expected_rows=50, cache_dir=cache), 2 * texts)
    # Default folder: beside the source.
    default = load_feature_matrix(path, expected_rows=50)
    assert pathlib.Path(default.filename).parent == tmp_path / ".row_major"


def test_conversion_errors_name_the_file_and_first_bad_row_and_leave_no_cache(tmp_path, small_blocks):
    texts = features(40, 5)
    texts[23, 1] = np.nan
    texts[31, 0] = np.inf
    path = tmp_path / "t.h5"
    save_feature_matrix(path, texts, "text_features", layout="columns")
    cache = tmp_path / "conv"
    with pytest.raises(DataFormatError, match=r"t\.h5.*'text_features'.*2 NaN/inf values in 2 rows; "
                                              r"first bad row is 23"):
        load_feature_matrix(path, expected_rows=40, cache_dir=cache)
    assert not list(cache.glob("*"))


def test_fortran_order_and_other_dtype_npy_are_converted(tmp_path, small_blocks):
    array = features(30, 6)
    fortran = tmp_path / "fortran.npy"
    np.save(fortran, np.asfortranarray(array))
    loaded = load_feature_matrix(fortran, cache_dir=tmp_path / "conv")
    assert isinstance(loaded, np.memmap) and loaded.flags.c_contiguous
    np.testing.assert_array_equal(loaded, array)
    doubles = tmp_path / "doubles.npy"
    np.save(doubles, array.astype(np.float64))
    np.testing.assert_array_equal(load_feature_matrix(doubles, cache_dir=tmp_path / "conv"), array)
    columns = tmp_path / "columns.npy"
    np.save(columns, array.T.copy())
    np.testing.assert_array_equal(load_feature_matrix(columns, layout="columns",
                                                      cache_dir=tmp_path / "conv"), array)


def test_save_writes_npy_and_hdf5_block_by_block_from_a_memory_map(tmp_path, small_blocks):
    source = tmp_path / "src.npy"
    np.save(source, features(25, 4))
    mapped = load_feature_matrix(source)
    for name, layout in (("out.npy", "rows"), ("out.h5", "columns"), ("out.hdf5", "rows")):
        save_feature_matrix(tmp_path / name, mapped, "features", layout=layout)
        np.testing.assert_array_equal(load_feature_matrix(tmp_path / name, layout=layout,
                                                          cache_dir=tmp_path / "conv"), features(25, 4))


def test_unwritable_conversion_folder_is_a_user_error(tmp_path):
    from tf_twobranch.errors import UserInputError
    path = tmp_path / "t.h5"
    save_feature_matrix(path, features(6, 4), "text_features")
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    with pytest.raises(UserInputError, match=r"t\.h5: cannot write its row-major copy"):
        load_feature_matrix(path, cache_dir=blocker / "sub")
