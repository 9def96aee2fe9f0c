"""Served as TF Serving would serve it, and bad requests (issue 25 items 3 and 4).

The model server binary cannot be installed here (it is not a pip package and only package
registries are reachable), so everything up to it is tested, for every signature of every
family's export (`tests/support/serving_exports.py`):

* gRPC: `serving.predict_request` builds a real ``tensorflow_serving.apis.predict_pb2.PredictRequest``;
  its wire bytes are parsed back and each input decoded as the server decodes it
  (``tf.make_ndarray`` of the `TensorProto`), then run through the loaded SavedModel's signature:
  the outputs equal calling the signature directly.
* REST: `serving.rest_request_body` builds TF Serving's columnar JSON; `_rest_decode` below
  decodes it with the rules of tensorflow_serving/util/json_tensor.cc (shape from the nesting,
  ``{"b64": ...}`` only for strings, numbers converted to the signature's dtype) and the outputs
  equal the direct call.
* Warm-up: each export's ``assets.extra/tf_serving_warmup_requests`` parses with the real
  ``prediction_log_pb2.PredictionLog``, holds a request for every signature and replays; the
  run-time declared protos (the fallback without tensorflow-serving-api) write the same bytes.
* Bad requests: a wrong dtype of any input of any signature (float64 features, uint8 pixels for
  JPEG bytes, floats for ids / masks / k) is refused by the request builders and `call_signature`
  with an `InvalidRequestError` naming the input and what it takes; a declared static size too;
  a non-image element in a batch of image bytes and an empty caption are named by their index
  both by the builders and by the graph (which is what a request built otherwise meets).
"""
import base64
import json
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the string-input graphs' ops)
from tensorflow.core.protobuf import saved_model_pb2

from tests.support.serving_exports import FAMILIES, shared_export
from tf_twobranch.export import serving

predict_pb2 = pytest.importorskip(
    "tensorflow_serving.apis.predict_pb2",
    reason="tensorflow-serving-api is in the test extra: pip install -e '.[test]'")
from tensorflow_serving.apis import prediction_log_pb2  # noqa: E402

IA = tf.errors.InvalidArgumentError


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    path = shared_export(request.param, tmp_path_factory)
    loaded = tf.saved_model.load(str(path))
    saved_model = saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes())
    signature_defs = {name: d for name, d in saved_model.meta_graphs[0].signature_def.items()
                      if name != "__saved_model_init_op"}
    return request.param, path, loaded, signature_defs, serving.read_warmup_requests(path)


def _run(loaded, signature_name, arrays) -> dict:
    out = loaded.signatures[signature_name](**{name: tf.constant(value) for name, value in arrays.items()})
    return {name: value.numpy() for name, value in out.items()}


def _assert_same_outputs(got, want):
    assert set(got) == set(want)
    for name in want:
        if want[name].dtype == object:
            np.testing.assert_array_equal(got[name], want[name])
        else:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_every_signature_has_a_warmup_request(served):
    _, _, loaded, signature_defs, warmups = served
    assert {name for name, _ in warmups} == set(loaded.signatures) == set(signature_defs)


def test_grpc_predict_request_is_served_like_the_direct_call(served):
    family, path, loaded, signature_defs, warmups = served
    for name, inputs in warmups:
        request = serving.predict_request(name, inputs, model=path, model_name=family)
        assert isinstance(request, predict_pb2.PredictRequest)
        wire = predict_pb2.PredictRequest.FromString(request.SerializeToString())
        assert (wire.model_spec.name, wire.model_spec.signature_name) == (family, name)
        assert set(wire.inputs) == set(signature_defs[name].inputs)
        for input_name, tensor in wire.inputs.items():
            assert tensor.dtype == signature_defs[name].inputs[input_name].dtype, (name, input_name)
        decoded = {input_name: tf.make_ndarray(tensor) for input_name, tensor in wire.inputs.items()}
        for input_name, array in serving.predict_request_inputs(wire).items():
            np.testing.assert_array_equal(array, decoded[input_name])
        _assert_same_outputs(_run(loaded, name, decoded), _run(loaded, name, inputs))


def test_warmup_file_parses_with_the_real_protos_and_replays(served, tmp_path):
    _, path, loaded, _, warmups = served
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(path / "assets.extra" / serving.WARMUP_FILENAME))]
    names = []
    for record in records:
        log = prediction_log_pb2.PredictionLog.FromString(record)
        assert log.WhichOneof("log_type") == "predict_log"
        request = log.predict_log.request
        names.append(request.model_spec.signature_name)
        _run(loaded, request.model_spec.signature_name,
             {name: tf.make_ndarray(tensor) for name, tensor in request.inputs.items()})
    assert set(names) == set(loaded.signatures)
    # Without tensorflow-serving-api the declared messages write the same file.
    model_name = prediction_log_pb2.PredictionLog.FromString(records[0]).predict_log.request.model_spec.name
    declared = serving.write_warmup_requests(tmp_path, warmups, model_name=model_name, declared=True)
    assert declared.read_bytes() == (path / "assets.extra" / serving.WARMUP_FILENAME).read_bytes()


def _rest_scalar(value, dtype: tf.DType):
    """One JSON leaf as json_tensor.cc's AddValueToTensor / JsonDecodeBase64Object convert it."""
    if dtype == tf.string:
        if isinstance(value, dict):
            assert set(value) == {"b64"}, f"JSON Value: {value} not formatted correctly for base64 data"
            return base64.b64decode(value["b64"], validate=True)
        assert isinstance(value, str), f"JSON Value: {value!r} is not of expected type: string"
        return value.encode("utf-8")
    if dtype == tf.bool:
        assert isinstance(value, bool), f"JSON Value: {value!r} is not of expected type: bool"
        return value
    assert isinstance(value, (int, float)) and not isinstance(value, bool), \
        f"JSON Value: {value!r} is not of expected type: {dtype.name}"
    if dtype.is_integer:
        assert isinstance(value, int), f"JSON Value: {value!r} is not of expected type: {dtype.name}"
    return value


def _rest_decode(body: dict, tensor_infos) -> dict:
    """The model server's decoding of a columnar REST body (FillTensorMapFromInputsMap)."""
    inputs = body["inputs"]
    out = {}
    for name, info in tensor_infos.items():
        assert name in inputs, f"Missing named input: {name} in 'inputs' object."
        dtype = tf.as_dtype(info.dtype)
        shape, value = [], inputs[name]
        while isinstance(value, list):          # GetDenseTensorShape: the first element's nesting
            shape.append(len(value))
            value = value[0] if value else None
        flat = []

        def fill(value, level):
            if not isinstance(value, list):
                assert level == len(shape), f"JSON Value found at incorrect level {level + 1}"
                flat.append(_rest_scalar(value, dtype))
                return
            assert level < len(shape) and len(value) == shape[level], "Encountered list at unexpected size"
            for v in value:
                fill(v, level + 1)

        fill(inputs[name], 0)
        out[name] = np.array(flat, dtype=object if dtype == tf.string else dtype.as_numpy_dtype).reshape(shape)
    return out


def test_rest_body_is_served_like_the_direct_call(served):
    _, path, loaded, signature_defs, warmups = served
    for name, inputs in warmups:
        body = json.loads(json.dumps(serving.rest_request_body(name, inputs, model=path)))
        assert body["signature_name"] == name and set(body) == {"signature_name", "inputs"}
        for input_name in serving.IMAGE_INPUTS:
            if input_name in body["inputs"]:    # image files travel base64-encoded
                assert "b64" in json.dumps(body["inputs"][input_name])
        decoded = _rest_decode(body, signature_defs[name].inputs)
        _assert_same_outputs(_run(loaded, name, decoded), _run(loaded, name, inputs))


def _wrong_dtype(name: str, array: np.ndarray):
    """(a value of another dtype, the dtype the message must name)."""
    if array.dtype == object:
        if name in serving.IMAGE_INPUTS:
            return np.zeros(array.shape + (4, 4, 3), np.uint8), "string"      # decoded pixels
        return np.zeros(array.shape, np.float32), "string"
    if array.dtype == np.float32:
        return array.astype(np.float64), "float32"
    if array.dtype == np.int32:
        return array.astype(np.float32), "int32"
    assert array.dtype == bool, array.dtype
    return array.astype(np.float32), "bool"


def test_wrong_dtypes_are_refused_naming_the_input(served):
    _, path, loaded, _, warmups = served
    for name, inputs in warmups:
        for input_name, array in inputs.items():
            bad, expected = _wrong_dtype(input_name, array)
            message = rf"signature '{name}', input '{input_name}': expected {expected}\b.*got a {bad.dtype}"
            request = dict(inputs, **{input_name: bad})
            for build in (lambda: serving.predict_request(name, request, model=path),
                          lambda: serving.rest_request_body(name, request, model=path),
                          lambda: serving.call_signature(loaded, name, **request)):
                with pytest.raises(serving.InvalidRequestError, match=message):
                    build()
            if bad.dtype == np.uint8:
                with pytest.raises(serving.InvalidRequestError, match=r"\(pixels\?\).*not decoded pixels"):
                    serving.predict_request(name, request, model=path)


def test_declared_static_sizes_are_checked_before_sending(served):
    _, path, _, signature_defs, warmups = served
    checked = 0
    for name, inputs in warmups:
        specs = serving.signature_specs(path, name)
        for input_name, spec in specs.items():
            if spec.shape.rank is None:
                continue
            array = np.asarray(inputs[input_name])
            bad = array[None] if spec.shape.rank == 0 else array[..., :0] if spec.shape[-1] is not None else \
                array.reshape(array.shape + (1,))
            with pytest.raises(serving.InvalidRequestError,
                               match=rf"signature '{name}', input '{input_name}': expected .* of shape"):
                serving.predict_request(name, dict(inputs, **{input_name: bad}), model=path)
            checked += 1
    families_with_static_specs = ("two_branch_embedding", "two_branch_similarity", "dual_path", "fragment", "npair")
    assert checked or served[0] not in families_with_static_specs    # every retrieve_* has the scalar k


def _graph_index(message: str, index: int) -> str:
    """Regex: `message` then the element index, as graph assertions print data ('] [1]')."""
    return "(?s)" + message + r".*?index:?['\]\s\[]*" + str(index) + r"\b"


def test_bad_elements_are_named_by_index_by_the_builders_and_the_graph(served):
    family, path, loaded, _, warmups = served
    seen = set()
    for name, inputs in warmups:
        for input_name, array in inputs.items():
            if input_name not in serving.IMAGE_INPUTS + serving.TEXT_INPUTS:
                continue
            bad = array.copy()
            if input_name in serving.IMAGE_INPUTS:
                bad.reshape(-1)[-1] = b"GIF89a, not a JPEG" if array.ndim else b"not an image"
                client, graph = r"expected JPEG", input_name + ": cannot decode image"
            else:
                bad[-1] = b" \t"
                client, graph = "an empty or whitespace-only string", "empty"
            request = dict(inputs, **{input_name: bad})
            at = f", element {len(array) - 1}" if array.ndim else ""
            for build in (serving.predict_request, serving.rest_request_body):
                with pytest.raises(serving.InvalidRequestError,
                                   match=f"signature '{name}', input '{input_name}'{at}: {client}"):
                    build(name, request, model=path)
            # What a request built by other means meets: the graph's own check, naming the element.
            if array.ndim and input_name in serving.IMAGE_INPUTS:
                bad[-1] = b"GIF89a, not JPEG or PNG"    # also refused: the batch decoder takes JPEG and PNG
            with pytest.raises(IA, match=_graph_index(graph, len(array) - 1) if array.ndim else graph):
                _run(loaded, name, request)
            seen.add(input_name)
    expected = {"two_branch_raw": {"image_jpeg", "captions"}, "two_branch_lstm": {"captions"},
                "region_phrase": {"image_jpeg", "phrases"}, "dual_path": {"image_jpeg", "captions"},
                "fragment": {"image_jpeg"}, "npair": {"image_jpeg", "caption"}}
    assert seen == expected.get(family, set())


def test_signature_specs_from_the_directory_equal_the_loaded_ones(served):
    _, path, loaded, _, _ = served
    for name in loaded.signatures:
        from_dir = serving.signature_specs(path, name)
        from_loaded = serving.signature_specs(loaded, name)
        assert {k: (v.dtype, v.shape.rank) for k, v in from_dir.items()} == \
               {k: (v.dtype, v.shape.rank) for k, v in from_loaded.items()}
    with pytest.raises(serving.InvalidRequestError, match="no signature 'nope'; it has"):
        serving.predict_request("nope", {}, model=path)


def test_declared_protos_have_the_real_wire_format():
    declared = serving._serving_protos(declared=True)
    assert not declared.real and serving.serving_api_available()
    request = declared.predict_request()
    request.model_spec.name, request.model_spec.signature_name = "m", "embed_texts"
    request.inputs["captions"].ParseFromString(tf.make_tensor_proto([b"a dog"]).SerializeToString())
    real = predict_pb2.PredictRequest.FromString(request.SerializeToString())
    assert real.model_spec.signature_name == "embed_texts"
    assert tf.make_ndarray(real.inputs["captions"]).tolist() == [b"a dog"]
    assert real.SerializeToString(deterministic=True) == request.SerializeToString(deterministic=True)


def test_rest_body_encodes_bytes_as_b64_and_text_as_strings():
    specs = {"image_jpeg": tf.TensorSpec(None, tf.string), "captions": tf.TensorSpec(None, tf.string),
             "k": tf.TensorSpec([], tf.int32)}
    jpeg = b"\xff\xd8\xff\xe0 rest of a JPEG"
    body = serving.rest_request_body("retrieve", {"image_jpeg": [jpeg], "captions": ["a dog", b"caf\xc3\xa9"],
                                                  "k": 3}, model=specs)
    assert body == {"signature_name": "retrieve",
                    "inputs": {"image_jpeg": [{"b64": base64.b64encode(jpeg).decode()}],
                               "captions": ["a dog", "café"], "k": 3}}
    assert json.loads(json.dumps(body)) == body
    with pytest.raises(serving.InvalidRequestError, match=re.escape("input 'captions', element 0: not valid UTF-8")):
        serving.rest_request_body("retrieve", {"image_jpeg": [jpeg], "captions": [b"\xff"], "k": 3}, model=specs)
    with pytest.raises(serving.InvalidRequestError, match="input 'captions': the batch is empty"):
        serving.rest_request_body("retrieve", {"image_jpeg": [jpeg], "captions": [], "k": 3}, model=specs)
