"""Serving helpers: in-graph validators, batch image decoding, the warm-up file."""
import io
import re

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tf_twobranch.export import serving
from tf_twobranch.errors import ConfigError, DataFormatError

IA = tf.errors.InvalidArgumentError


def _says(message, then=None):
    """Regex for an assertion message, optionally followed by a value.

    Eager and graph assertions print the data differently
    (``b'msg'\n2, 4`` versus ``[msg] [2 4]``).
    """
    pattern = re.escape(message)
    return pattern + r"['\]\s\[]*" + then if then else pattern


def _encode(image, fmt="JPEG"):
    out = io.BytesIO()
    Image.fromarray(image).save(out, format=fmt, quality=95)
    return out.getvalue()


def _image(seed, height=20, width=30, channels=3):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, channels) if channels > 1 else (height, width), dtype=np.uint8)


def test_validate_strings():
    out = serving.validate_strings(tf.constant(["a dog", "b"]), "captions")
    assert out.numpy().tolist() == [b"a dog", b"b"]
    with pytest.raises(IA, match=_says("captions must be non-empty strings; got an empty or whitespace-only string at index", "2")):
        serving.validate_strings(tf.constant(["a", "b", " \t "]), "captions")
    with pytest.raises(IA, match=r"captions must have shape \(batch,\); got a tensor of rank"):
        serving.validate_strings(tf.constant([["a"]]), "captions")
    with pytest.raises(IA, match=r"captions must have shape \(batch,\)"):
        serving.validate_strings(tf.constant("a"), "captions")
    with pytest.raises(IA, match="captions is empty"):
        serving.validate_strings(tf.zeros([0], tf.string), "captions")


@pytest.mark.parametrize("bad", [b"\xff", b"caf\xe9", b"a \xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80",
                                 b"\xf4\x90\x80\x80"],
                         ids=["ff", "latin1", "truncated", "overlong", "surrogate", "above_10ffff"])
def test_validate_strings_rejects_non_utf8_naming_the_index(bad):
    with pytest.raises(UnicodeDecodeError):
        bad.decode("utf-8")   # what the training readers reject
    message = _says("captions must be UTF-8 text; got bytes that are not valid UTF-8 at index", "2")
    with pytest.raises(IA, match=message):
        serving.validate_strings(tf.constant([b"a dog", "ein Hund".encode(), bad]), "captions")

    @tf.function(input_signature=[serving.string_batch_spec("phrases")])
    def f(x):
        return serving.validate_strings(x, "phrases")

    with pytest.raises(IA, match=_says("phrases must be UTF-8 text; got bytes that are not valid UTF-8 "
                                       "at index", "1")):
        f(tf.constant([b"a dog", bad, b"\xff"]))


def test_validate_strings_keeps_valid_unicode_unchanged():
    texts = ["a dog", "ein Hund läuft", "犬が走る 😀", "replacement \ufffd kept", "nul\x00inside",
             "\ufeffbom", "line\u2028sep"]
    encoded = [t.encode("utf-8") for t in texts]

    @tf.function(input_signature=[serving.string_batch_spec("captions")])
    def f(x):
        return serving.validate_strings(x, "captions")

    assert serving.validate_strings(tf.constant(encoded), "captions").numpy().tolist() == encoded
    assert f(tf.constant(encoded)).numpy().tolist() == encoded


def test_validate_features_in_a_graph():
    @tf.function(input_signature=[serving.feature_batch_spec("image_features")])
    def f(x):
        out = serving.validate_features(x, 3, "image_features")
        assert out.shape.as_list() == [None, 3]   # static shape for the layers after it
        return out * 2

    np.testing.assert_allclose(f(tf.ones([2, 3])), 2 * np.ones((2, 3)))
    with pytest.raises(IA, match=_says("image_features must have shape (batch, 3); got shape", "2,? 4")):
        f(tf.ones([2, 4]))
    with pytest.raises(IA, match=r"image_features must have shape \(batch, 3\); got a tensor of rank"):
        f(tf.ones([3]))
    with pytest.raises(IA, match="image_features is empty"):
        f(tf.ones([0, 3]))
    bad = np.ones((3, 3), np.float32)
    bad[1, 2] = np.inf
    with pytest.raises(IA, match=_says("image_features contains NaN or inf values; first bad row:", "1")):
        f(tf.constant(bad))


def test_decode_jpeg_batch_matches_decoder_and_resize():
    rgb, rgba, grey = _image(0), _image(1, channels=4), _image(2, channels=1)
    batch = [_encode(rgb), _encode(rgba, "PNG"), _encode(grey, "PNG")]
    out = serving.decode_jpeg_batch(tf.constant(batch), 8, "image_jpeg").numpy()
    assert out.shape == (3, 8, 8, 3) and out.dtype == np.float32
    assert out.min() >= 0 and out.max() <= 255
    decoded = tf.io.decode_jpeg(batch[0], channels=3, dct_method="INTEGER_ACCURATE")
    want = tf.image.resize(tf.cast(decoded, tf.float32), [8, 8], antialias=True).numpy()
    np.testing.assert_allclose(out[0], want, atol=1e-4)
    want_png = tf.image.resize(rgba[:, :, :3].astype(np.float32), [8, 8], antialias=True).numpy()
    np.testing.assert_allclose(out[1], want_png, atol=1e-3)  # alpha dropped
    np.testing.assert_allclose(out[2][..., 0], out[2][..., 1])  # grey -> RGB
    assert serving.decode_jpeg_batch(tf.constant(batch[:1]), (6, 10), "x").shape == (1, 6, 10, 3)


def test_decode_jpeg_batch_errors_name_input_and_index():
    good = _encode(_image(0))
    with pytest.raises(IA, match="(?s)" + _says("image_jpeg: cannot decode image; expected JPEG or PNG bytes")
                       + ".*" + _says("first bad element index:", "2")):
        serving.decode_jpeg_batch(tf.constant([good, good, b"GIF89a....", good]), 8, "image_jpeg")
    with pytest.raises(IA, match=r"image_jpeg must have shape \(batch,\) of encoded image bytes"):
        serving.decode_jpeg_batch(tf.constant(good), 8, "image_jpeg")
    with pytest.raises(IA, match="image_jpeg is empty"):
        serving.decode_jpeg_batch(tf.zeros([0], tf.string), 8, "image_jpeg")
    with pytest.raises(ConfigError, match="image size"):
        serving.decode_jpeg_batch(tf.constant([good]), 0, "image_jpeg")


def _zero_size_jpeg(jpeg):
    """Valid magic bytes and end marker, but a frame header (SOF0) of 0 x 0 pixels."""
    at = jpeg.find(b"\xff\xc0")
    return jpeg[:at + 5] + b"\x00\x00\x00\x00" + jpeg[at + 9:]


@pytest.mark.parametrize("make_bad", [
    lambda jpeg, png: jpeg[:len(jpeg) // 2],    # truncated JPEG
    lambda jpeg, png: jpeg[:len(jpeg) - 2],     # only the end marker missing
    lambda jpeg, png: jpeg[:200],               # truncated in the headers
    lambda jpeg, png: jpeg[:4] + bytes(range(256)) * 4,   # garbage after the magic bytes
    lambda jpeg, png: _zero_size_jpeg(jpeg),
    lambda jpeg, png: png[:len(png) // 2],      # truncated PNG
], ids=["truncated_jpeg", "no_eoi", "truncated_header", "garbage_jpeg", "zero_size_jpeg",
        "truncated_png"])
def test_decode_jpeg_batch_names_truncated_or_corrupt_element(make_bad):
    jpeg, png = _encode(_image(0, 64, 80)), _encode(_image(1, 64, 80), "PNG")
    bad = make_bad(jpeg, png)
    batch = tf.constant([jpeg, png, jpeg, bad, jpeg])
    message = ("(?s)" + re.escape("image_jpeg: cannot decode image; the JPEG/PNG data is truncated or corrupt")
               + ".*" + _says("first bad element index:", "3"))
    with pytest.raises(IA, match=message):
        serving.decode_jpeg_batch(batch, 8, "image_jpeg")

    @tf.function(input_signature=[serving.jpeg_batch_spec("image_jpeg")])
    def f(x):
        return serving.decode_jpeg_batch(x, 8, "image_jpeg")

    with pytest.raises(IA, match=message):
        f(batch)
    with pytest.raises(IA, match="(?s)first bad element index:" + r"['\]\s\[]*0.*bad elements:"
                       + r"['\]\s\[]*2.*of['\]\s\[]*2"):
        f(tf.constant([bad, bad]))
    # Bad magic bytes are still reported first, with their own message.
    with pytest.raises(IA, match=_says("first bad element index:", "1") + ".*starts with"):
        f(tf.constant([bad, b"GIF89a....", jpeg]))


def test_decode_jpeg_batch_output_equals_per_image_decoding():
    batch = [_encode(_image(i, 30 + 7 * i, 50 - 3 * i), "PNG" if i % 3 == 2 else "JPEG") for i in range(7)]

    def reference(data):
        if data[:3] == b"\xff\xd8\xff":
            image = tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_ACCURATE")
        else:
            image = tf.io.decode_png(data, channels=3)
        resized = tf.image.resize(tf.cast(image, tf.float32), [12, 16], method="bilinear", antialias=True)
        return tf.clip_by_value(resized, 0.0, 255.0).numpy()

    want = np.stack([reference(b) for b in batch])

    @tf.function(input_signature=[serving.jpeg_batch_spec("image_jpeg")])
    def f(x):
        out = serving.decode_jpeg_batch(x, (12, 16), "image_jpeg")
        assert out.shape.as_list() == [None, 12, 16, 3]
        return out

    np.testing.assert_array_equal(serving.decode_jpeg_batch(tf.constant(batch), (12, 16), "x").numpy(), want)
    np.testing.assert_array_equal(f(tf.constant(batch)).numpy(), want)
    np.testing.assert_array_equal(f(tf.constant(batch[3:4])).numpy(), want[3:4])


def test_validators_survive_a_saved_model(tmp_path):
    class Module(tf.Module):
        @tf.function(input_signature=[serving.jpeg_batch_spec("image_jpeg"),
                                      serving.string_batch_spec("captions")])
        def serve(self, image_jpeg, captions):
            pixels = serving.decode_jpeg_batch(image_jpeg, 8, "image_jpeg")
            texts = serving.validate_strings(captions, "captions")
            return {"mean": tf.reduce_mean(pixels, axis=[1, 2, 3]), "length": tf.strings.length(texts)}

    module = Module()
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.serve})
    serve = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    jpeg = _encode(_image(0))
    good = serve(image_jpeg=tf.constant([jpeg, jpeg]), captions=tf.constant(["a dog", "ein Hund"]))
    np.testing.assert_allclose(good["mean"].numpy(), module.serve(tf.constant([jpeg, jpeg]),
                                                                  tf.constant(["a", "b"]))["mean"].numpy())
    with pytest.raises(IA, match="(?s)truncated or corrupt.*" + _says("first bad element index:", "1")):
        serve(image_jpeg=tf.constant([jpeg, jpeg[:-40]]), captions=tf.constant(["a dog"]))
    with pytest.raises(IA, match=_says("not valid UTF-8 at index", "0")):
        serve(image_jpeg=tf.constant([jpeg]), captions=tf.constant([b"caf\xe9"]))


def _fields(buffer):
    """Minimal protobuf wire-format reader: [(field number, bytes or int)]."""
    out, i = [], 0
    def varint():
        nonlocal i
        value, shift = 0, 0
        while True:
            byte = buffer[i]; i += 1
            value |= (byte & 0x7F) << shift; shift += 7
            if byte < 0x80:
                return value
    while i < len(buffer):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 2:
            n = varint(); out.append((number, buffer[i:i + n])); i += n
        elif wire == 0:
            out.append((number, varint()))
        else:
            raise AssertionError(f"unexpected wire type {wire}")
    return out


def test_warmup_file_round_trips_and_uses_tf_serving_field_numbers(tmp_path):
    jpeg = _encode(_image(0))
    requests = [("embed_texts", {"captions": ["a dog runs", "ein Hund läuft"]}),
                ("embed_images", {"image_features": np.arange(6, dtype=np.float64).reshape(2, 3)}),
                ("score_proposals", {"image_jpeg": jpeg, "proposals": [[0.0, 0.0, 5.0, 5.0]],
                                     "phrases": ["a dog"]})]
    path = serving.write_warmup_requests(tmp_path / "model", requests, model_name="two_branch")
    assert path == tmp_path / "model" / "assets.extra" / "tf_serving_warmup_requests"
    back = serving.read_warmup_requests(tmp_path / "model")
    assert [name for name, _ in back] == ["embed_texts", "embed_images", "score_proposals"]
    assert back[0][1]["captions"].tolist() == [b"a dog runs", "ein Hund läuft".encode()]
    np.testing.assert_array_equal(back[1][1]["image_features"], np.arange(6).reshape(2, 3))
    assert back[1][1]["image_features"].dtype == np.float32
    assert back[2][1]["image_jpeg"].shape == () and back[2][1]["image_jpeg"].item() == jpeg
    assert back[2][1]["proposals"].shape == (1, 4)
    # Independent of the runtime-built classes: PredictionLog.predict_log = 6,
    # PredictLog.request = 1, PredictRequest.model_spec = 1 / inputs = 2,
    # ModelSpec.name = 1 / signature_name = 3 (tensorflow_serving/apis/*.proto).
    from tensorflow.core.framework import tensor_pb2
    record = next(iter(tf.data.TFRecordDataset(str(path)))).numpy()
    [(six, predict_log)] = _fields(record)
    [(one, request)] = _fields(predict_log)
    assert (six, one) == (6, 1)
    fields = _fields(request)
    spec = dict(_fields(dict(fields)[1]))
    assert spec == {1: b"two_branch", 3: b"embed_texts"}
    [entry] = [value for number, value in fields if number == 2]
    entry = dict(_fields(entry))
    assert entry[1] == b"captions"
    assert tf.make_ndarray(tensor_pb2.TensorProto.FromString(entry[2])).tolist() == [
        b"a dog runs", "ein Hund läuft".encode()]


def test_warmup_errors(tmp_path):
    with pytest.raises(ConfigError, match="at least one request"):
        serving.write_warmup_requests(tmp_path, [])
    with pytest.raises(ConfigError, match="'x'.*non-empty"):
        serving.write_warmup_requests(tmp_path, [("s", {"x": []})])
    with pytest.raises(DataFormatError, match="does not exist"):
        serving.read_warmup_requests(tmp_path / "nothing")
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a tfrecord file at all")
    with pytest.raises(DataFormatError, match="not a TFRecord"):
        serving.read_warmup_requests(bad)


def test_run_warmup_requests_checks_names():
    @tf.function(input_signature=[serving.string_batch_spec("captions")])
    def lengths(texts):
        return {"length": tf.strings.length(serving.validate_strings(texts, "captions"))}

    out = serving.run_warmup_requests({"lengths": lengths}, [("lengths", {"captions": ["ab", "c"]})])
    assert out[0]["length"].tolist() == [2, 1]
    with pytest.raises(ConfigError, match="unknown signature"):
        serving.run_warmup_requests({"lengths": lengths}, [("embed", {"captions": ["a"]})])
    with pytest.raises(ConfigError, match="expects"):
        serving.run_warmup_requests({"lengths": lengths}, [("lengths", {"phrases": ["a"]})])
    with pytest.raises(IA, match="non-empty"):
        serving.run_warmup_requests({"lengths": lengths}, [("lengths", {"captions": [""]})])
