"""Serving helpers shared by every SavedModel export: input specs, in-graph
validation, batch image decoding and the TF Serving warm-up file.

(``saved_model_cli`` with the tensorflow-text ops registered is the
command-line tool `tf_twobranch.tools.saved_model_cli`.)

Static or dtype-only input specs: a shape in a signature's `TensorSpec` is
enforced *before* the graph runs, by callers that each word it differently (a
Python ``TypeError`` "Can not cast TensorSpec" from ``loaded.signatures[...]``,
a ``ValueError`` "Cannot feed value of shape" from ``saved_model_cli run``, a
`UserInputError` naming the input from `call_signature`), while a dtype-only
spec leaves every check to the validators below, which every caller sees as
the same ``InvalidArgumentError`` naming the input and the expected shape.
The spec helpers take the shape as an option: exports whose sizes are part of
the interface (the two-branch export: ``(None, image_dim)``, ``(None,)``
strings) declare them, so ``saved_model_cli show`` and TF Serving's metadata
tell a client what to send; the validators still run inside the graph for
clients that feed without checking. The expected shapes are listed in
docs/SERVING.md and the exports' docstrings.

A wrong *dtype* cannot be checked in the graph (a signature has one dtype
per input); it is rejected by the runtime before the graph runs, as
``InvalidArgumentError: cannot compute ... as input #0(zero-based) was
expected to be a string tensor but is a float tensor`` (`tf.saved_model.load`)
or ``Expects arg[0] to be string but float is provided`` (TF Serving's
session), which name neither the input nor what it takes. Where the package
calls a signature it goes through `call_signature` (and the ``saved_model_cli``
tool through `check_signature_inputs`), which checks every input against the
signature's `TensorSpec` first and names the input, the expected dtype and
shape and what it got (`check_signature_inputs`). The client-side request
builders (`predict_request` for gRPC, `rest_request_body` for REST) make the
same check against the export's signature, plus the per-element checks the
graph would make (image bytes, non-empty UTF-8 captions), naming the element,
so a bad request is refused before it is sent (`InvalidRequestError`).

Warm-up: TF Serving replays ``assets.extra/tf_serving_warmup_requests`` (a
TFRecord of ``tensorflow.serving.PredictionLog`` protos) when it loads a
model, so the first real request does not pay for graph initialisation.
The protos are `tensorflow-serving-api`'s when it is importable (the
package's ``test`` extra installs it; it is a client library, so it is not a
runtime dependency). Without it the four messages needed here
(`PredictionLog` → `PredictLog` → `PredictRequest` → `ModelSpec`) are
declared at run time from a small `FileDescriptorProto` with the field
numbers of tensorflow_serving/apis/*.proto, in a private descriptor pool (no
clash if the real package is imported later); both write the same bytes
(deterministic serialisation; tests/apps/test_serving_requests.py compares them).
Inputs are TensorFlow's own `TensorProto`.

Keras 3 models inside a `tf.Module` need `track_keras_variables`, or TF
Serving and ``saved_model_cli run`` cannot find their variables (see there).
"""
from __future__ import annotations

import base64
import functools
import os
import pathlib
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import tensorflow as tf
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from tensorflow.core.framework import tensor_pb2
from tensorflow.core.protobuf import saved_model_pb2

from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError
from tf_twobranch.features.images import tf_pil_resize
from tf_twobranch.image_decoding import (TF_IMAGE_FORMATS, describe_image_formats, image_format, tf_decode_image,
                                         tf_is_image_bytes)

__all__ = [
    "WARMUP_FILENAME",
    "replay_warmup_file",
    "IMAGE_FORMATS",
    "track_keras_variables",
    "string_batch_spec",
    "jpeg_batch_spec",
    "feature_batch_spec",
    "signature_function",
    "fed_shape",
    "fed_rank",
    "fed_dim",
    "fed_or_stand_in",
    "validate_strings",
    "validate_features",
    "signature_input_specs",
    "check_signature_inputs",
    "call_signature",
    "InvalidRequestError",
    "IMAGE_INPUTS",
    "TEXT_INPUTS",
    "signature_specs",
    "request_inputs",
    "predict_request",
    "predict_request_inputs",
    "rest_request_body",
    "serving_api_available",
    "decode_jpeg_batch",
    "map_decoded_images",
    "write_warmup_requests",
    "read_warmup_requests",
    "run_warmup_requests",
]

WARMUP_FILENAME = "tf_serving_warmup_requests"
# The formats `decode_jpeg_batch` accepts (`tf_decode_image` names), and as its errors name them.
_BATCH_FORMATS = ("JPEG", "PNG")
IMAGE_FORMATS = describe_image_formats(_BATCH_FORMATS)   # "JPEG or PNG"


# --------------------------------------------------------------------------
# Input specs (shapes optional; the validators below check them in the graph, see module doc).


def string_batch_spec(name: str, *, static_shape: bool = False) -> tf.TensorSpec:
    """Spec of a batch of strings, shape (batch,) checked by `validate_strings` (declared with
    `static_shape`)."""
    return tf.TensorSpec([None] if static_shape else None, tf.string, name=name)


def jpeg_batch_spec(name: str, *, static_shape: bool = False) -> tf.TensorSpec:
    """Spec of a batch of encoded images, shape (batch,) checked by `decode_jpeg_batch` (declared
    with `static_shape`)."""
    return tf.TensorSpec([None] if static_shape else None, tf.string, name=name)


def feature_batch_spec(name: str, dim: int | None = None) -> tf.TensorSpec:
    """Spec of a float32 feature batch, shape (batch, dim) checked by `validate_features`; with
    `dim` the spec declares (None, dim)."""
    return tf.TensorSpec(None if dim is None else [None, int(dim)], tf.float32, name=name)


def signature_function(*input_signature: tf.TensorSpec):
    """Decorator: an export's function of these input specs (a signature, or a query function).

    Traced without AutoGraph: no export has tensor-dependent Python control flow (its Python
    loops only build per-input checks), and AutoGraph would convert every function a trace calls,
    Keras' own included, for the warm-up before saving and again for the save.
    """
    return tf.function(input_signature=list(input_signature), autograph=False)


# --------------------------------------------------------------------------
# Calling a signature: each input checked against its TensorSpec first.


def signature_input_specs(signature) -> dict[str, tf.TensorSpec]:
    """``{input name: TensorSpec}`` of a loaded signature (``loaded.signatures[name]``), a
    `tf.function` with an input signature, or a ``SignatureDef`` proto (``saved_model_cli``)."""
    if hasattr(signature, "inputs") and hasattr(signature, "method_name"):     # SignatureDef
        return {name: tf.TensorSpec(tf.TensorShape(info.tensor_shape), tf.as_dtype(info.dtype), name)
                for name, info in signature.inputs.items()}
    if hasattr(signature, "get_concrete_function") and not hasattr(signature, "structured_input_signature"):
        signature = signature.get_concrete_function()
    args, kwargs = signature.structured_input_signature
    specs = dict(kwargs)
    specs.update({spec.name: spec for spec in args})
    return specs


def _describe_spec(spec: tf.TensorSpec) -> str:
    if spec.shape.rank is None:
        return spec.dtype.name
    dims = ", ".join("batch" if d is None and i == 0 else "?" if d is None else str(d)
                     for i, d in enumerate(spec.shape.as_list()))
    return f"{spec.dtype.name} of shape ({dims}{',' if spec.shape.rank == 1 else ''})"


def _a(word: str) -> str:
    """`word` with its indefinite article: "an int64", "an object", "a uint8", "a float32"."""
    return f"{'an' if word[:1].lower() in 'aeio' else 'a'} {word}"


def _describe_value(value) -> str:
    if tf.is_tensor(value):
        return f"{_a(value.dtype.name)} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (np.ndarray, np.generic)):
        return f"{_a(str(value.dtype))} array of shape {np.shape(value)}"
    return _a(type(value).__name__)


class InvalidRequestError(UserInputError):
    """A request refused on the client side, before it is sent or run: the counterpart of the
    server's ``INVALID_ARGUMENT``, naming the signature, the input, what it takes and, for a bad
    element of a batch, the element's index."""


def _checked_input(spec: tf.TensorSpec, value, where: str):
    """`value` as a tensor of `spec`'s dtype, or a UserInputError naming what was expected."""
    expected = _describe_spec(spec)
    got = _describe_value(value)

    def refuse(hint=""):
        raise InvalidRequestError(f"{where}: expected {expected}, got {got}{hint}")

    dtype = None
    if tf.is_tensor(value):
        dtype = value.dtype
    elif isinstance(value, (np.ndarray, np.generic)):
        dtype = tf.string if value.dtype.kind in "OSU" else tf.as_dtype(value.dtype)
    if dtype is not None and dtype != spec.dtype:
        if spec.dtype == tf.string and dtype.is_integer and len(np.shape(value)) >= 3:
            refuse(" (pixels?); this input takes the encoded image files' bytes (JPEG or PNG), "
                   "e.g. open(path, 'rb').read(), not decoded pixels")
        if not (dtype.is_integer and spec.dtype.is_integer):
            refuse(f"; cast it first (e.g. .astype(np.{spec.dtype.name}))"
                   if spec.dtype != tf.string and dtype != tf.string else "")
        values = np.asarray(value)
        if values.size and (values.min() < spec.dtype.min or values.max() > spec.dtype.max):
            refuse(f" with values outside the {spec.dtype.name} range")
    try:
        tensor = tf.convert_to_tensor(value if dtype is None or dtype == spec.dtype
                                      else np.asarray(value).astype(spec.dtype.as_numpy_dtype),
                                      dtype_hint=spec.dtype)
    except (TypeError, ValueError, tf.errors.InvalidArgumentError):
        tensor = None    # refused below, outside the handler: the message is the whole story
    if tensor is None or tensor.dtype != spec.dtype:
        refuse()
    if spec.shape.rank is not None and not spec.shape.is_compatible_with(tensor.shape):
        refuse()
    return tensor


def check_signature_inputs(specs: Mapping[str, tf.TensorSpec], inputs: Mapping[str, object],
                           signature_name: str) -> dict[str, tf.Tensor]:
    """Every input of a request checked against the signature's specs; returns the tensors.

    Names must be exactly the signature's. A value with a dtype (a NumPy array
    or a tensor) must have the input's dtype; the exceptions are integer arrays
    for an integer input (NumPy's default int64 for int32 ids) when every value
    fits. Values without one (Python numbers, lists, str/bytes) are converted to
    the input's dtype. A spec with a known rank or dimensions is checked too
    (dtype-only specs leave the shape to the graph's validators).

    Raises:
      InvalidRequestError: (a `UserInputError`) naming the signature, the
        input, the expected dtype (and shape) and what was given; e.g. float64
        features for a float32 input, uint8 pixels for an ``image_jpeg`` string
        input.
    """
    missing = sorted(set(specs) - set(inputs))
    unknown = sorted(set(inputs) - set(specs))
    if missing or unknown:
        raise InvalidRequestError(
            f"signature {signature_name!r} takes the inputs "
            f"{', '.join(f'{n} ({_describe_spec(specs[n])})' for n in sorted(specs))}; "
            + (f"missing {missing}" if missing else "") + ("; " if missing and unknown else "")
            + (f"unknown {unknown}" if unknown else ""))
    return {name: _checked_input(spec, inputs[name], f"signature {signature_name!r}, input {name!r}")
            for name, spec in specs.items()}


def call_signature(loaded, signature_name: str, **inputs) -> dict:
    """``loaded.signatures[signature_name](**inputs)`` after `check_signature_inputs`."""
    if signature_name not in loaded.signatures:
        raise UserInputError(f"the SavedModel has no signature {signature_name!r}; it has "
                             f"{sorted(loaded.signatures)}")
    signature = loaded.signatures[signature_name]
    return signature(**check_signature_inputs(signature_input_specs(signature), inputs, signature_name))


# --------------------------------------------------------------------------
# Client side: TF Serving requests (gRPC PredictRequest, REST JSON) built from
# inputs checked against the export's signature.

# The exports' input names for encoded images and for captions / phrases: the
# request builders check their elements as the graph would, naming the element.
IMAGE_INPUTS = ("image_jpeg",)
TEXT_INPUTS = ("captions", "caption", "phrases")


@functools.lru_cache(maxsize=8)
def _signature_defs(saved_model_pb: str, mtime_ns: int) -> dict:
    saved_model = saved_model_pb2.SavedModel.FromString(pathlib.Path(saved_model_pb).read_bytes())
    graphs = [g for g in saved_model.meta_graphs if "serve" in g.meta_info_def.tags] or list(saved_model.meta_graphs)
    # Not the initializer's entry (`__saved_model_init_op`), which is no signature a client calls.
    return {name: d for name, d in graphs[0].signature_def.items() if not name.startswith("__")} if graphs else {}


def signature_specs(model, signature_name: str) -> dict[str, tf.TensorSpec]:
    """``{input name: TensorSpec}`` of the signature `signature_name` of an export.

    Args:
      model: the SavedModel directory (its ``saved_model.pb`` is read, nothing
        is loaded, so a client needs no tensorflow-text ops), a loaded
        SavedModel (``tf.saved_model.load``), a ``{name: SignatureDef}`` map
        (e.g. TF Serving's GetModelMetadata), a ``SignatureDef``, a signature
        function, or the ``{input name: TensorSpec}`` mapping itself.
      signature_name: the signature.

    Raises:
      InvalidRequestError: the export has no such signature.
      DataFormatError: a directory without ``saved_model.pb``.
    """
    def unknown(names):
        raise InvalidRequestError(f"the SavedModel has no signature {signature_name!r}; it has {sorted(names)}")

    if isinstance(model, (str, os.PathLike)):
        path = pathlib.Path(model) / "saved_model.pb"
        if not path.is_file():
            raise DataFormatError(model, "not a SavedModel directory (no saved_model.pb)")
        defs = _signature_defs(str(path.resolve()), path.stat().st_mtime_ns)
        return signature_input_specs(defs[signature_name]) if signature_name in defs else unknown(defs)
    if isinstance(model, Mapping):
        if all(isinstance(v, tf.TensorSpec) for v in model.values()):
            return dict(model)
        return signature_input_specs(model[signature_name]) if signature_name in model else unknown(model)
    if hasattr(model, "signatures") and not hasattr(model, "method_name"):
        signatures = model.signatures
        return (signature_input_specs(signatures[signature_name]) if signature_name in signatures
                else unknown(signatures))
    return signature_input_specs(model)


def _check_elements(signature_name: str, name: str, array: np.ndarray) -> None:
    """The graph's per-element checks of image bytes and captions, on the client."""
    where = f"signature {signature_name!r}, input {name!r}"
    if array.dtype != object or array.ndim > 1 or name not in IMAGE_INPUTS + TEXT_INPUTS:
        return
    if array.ndim == 1 and array.size == 0:
        raise InvalidRequestError(f"{where}: the batch is empty; send at least one element")
    if name in IMAGE_INPUTS:
        # A batch is decoded by `decode_jpeg_batch` (JPEG, PNG), one image (the region model) by any decoder.
        formats = _BATCH_FORMATS if array.ndim else TF_IMAGE_FORMATS
        for index, data in enumerate(array.reshape(-1)):
            if image_format(data, formats) is None:
                at = f", element {index}" if array.ndim else ""
                raise InvalidRequestError(
                    f"{where}{at}: expected {describe_image_formats(formats)} bytes (the image file's contents, "
                    f"e.g. open(path, 'rb').read()), got bytes starting with {bytes(data[:8])!r}")
        return
    for index, data in enumerate(array.reshape(-1)):
        at = f"{where}, element {index}" if array.ndim else where
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidRequestError(f"{at}: not valid UTF-8 text ({err.reason} at byte {err.start})") from None
        if not text.strip():
            raise InvalidRequestError(f"{at}: an empty or whitespace-only string; expected text with a word")


def request_inputs(model, signature_name: str, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """The inputs of a request as arrays of the signature's dtypes, checked first.

    `check_signature_inputs` against the signature's specs (`signature_specs`:
    names, dtypes, rank and static sizes where the signature declares them),
    then, for the encoded-image inputs (`IMAGE_INPUTS`) and the caption /
    phrase inputs (`TEXT_INPUTS`), each element as the graph checks it: an
    empty batch, bytes that are not an image file, an empty or non-UTF-8
    caption. Shapes the signature leaves open are still checked by the graph
    when the request runs.

    Raises:
      InvalidRequestError: naming the signature, the input, what it takes and,
        for a bad element, its index.
    """
    specs = signature_specs(model, signature_name)
    # Strings as object arrays of bytes, scalars too (a scalar string tensor's .numpy() is bytes).
    arrays = {name: np.asarray(tensor.numpy(), dtype=object if tensor.dtype == tf.string else None)
              for name, tensor in check_signature_inputs(specs, inputs, signature_name).items()}
    for name, array in arrays.items():
        _check_elements(signature_name, name, array)
    return arrays


def predict_request(signature_name: str, inputs: Mapping[str, object], *, model, model_name: str = ""):
    """A TF Serving gRPC ``PredictRequest`` (``tensorflow.serving.PredictionService/Predict``).

    Args:
      signature_name: ``model_spec.signature_name``.
      inputs: ``{input name: value}``: arrays, (nested) lists, numbers, str
        (sent as UTF-8) or bytes (sent as they are: image files' contents).
      model: where the signature's specs come from (`signature_specs`): the
        export's directory, the loaded SavedModel, its SignatureDefs.
      model_name: ``model_spec.name``, the name the server serves it under.

    Returns:
      ``tensorflow_serving.apis.predict_pb2.PredictRequest`` when
      tensorflow-serving-api is installed; otherwise a message of the same
      fields and wire format (send ``request.SerializeToString()``).

    Raises:
      InvalidRequestError: see `request_inputs`.
    """
    arrays = request_inputs(model, signature_name, inputs)
    request = _serving_protos().predict_request()
    _fill_request(request, signature_name, arrays, model_name)
    return request


def _json_value(name: str, array: np.ndarray):
    if array.dtype != object:
        return array.tolist()     # float32 -> the double of the same value, which the server casts back exactly

    def encode(data: bytes):
        if name not in IMAGE_INPUTS:
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                pass
        return {"b64": base64.b64encode(data).decode("ascii")}

    def walk(value):
        return [walk(v) for v in value] if isinstance(value, list) else encode(value)

    return walk(array.tolist())


def rest_request_body(signature_name: str, inputs: Mapping[str, object], *, model) -> dict:
    """The JSON body of a TF Serving REST predict request (``POST /v1/models/<name>:predict``).

    TF Serving's columnar format, which allows inputs of different batch
    sizes: ``{"signature_name": ..., "inputs": {input name: nested lists}}``.
    Encoded images (and any string that is not valid UTF-8) are sent as
    ``{"b64": "<base64>"}``, the REST API's form for binary strings; other
    strings as JSON strings; numbers as JSON numbers (the server converts
    them to the signature's dtype). Send it with ``json.dumps(body)``.

    Args / Raises: as `predict_request`.
    """
    arrays = request_inputs(model, signature_name, inputs)
    return {"signature_name": signature_name,
            "inputs": {name: _json_value(name, array) for name, array in arrays.items()}}


# --------------------------------------------------------------------------
# Keras 3 variables in SavedModels read by TF1-style loaders.


def track_keras_variables(module: tf.Module, *layers) -> None:
    """Makes `tf.saved_model.save(module)` loadable by TF Serving and ``saved_model_cli run``.

    Keras 3 variables are wrappers: `tf.saved_model.save` writes a copy of
    each (named ``Variable``, ``Variable_1``, ...) that the checkpoint
    restores, while the signature graphs read the wrapped `tf.Variable`
    (``dense/bias``). `tf.saved_model.load` maps the two, but the TF1-style
    loaders of TF Serving and ``saved_model_cli run`` do not, and every
    request fails with ``FailedPrecondition: Could not find variable
    dense/bias`` (keras-team/keras#19274, #20095). Tracking the wrapped
    `tf.Variable`s on the module saves and restores exactly the variables the
    graphs read. Call it in the module's ``__init__`` with every Keras model
    or layer its signatures use (``None`` entries are skipped).
    """
    tracked = list(getattr(module, "keras_tf_variables", []))
    seen = {id(v) for v in tracked}
    for layer in layers:
        if layer is None:
            continue
        for variable in layer.variables:
            tf_variable = variable if isinstance(variable, tf.Variable) else variable.value
            if id(tf_variable) not in seen:
                seen.add(id(tf_variable))
                tracked.append(tf_variable)
    module.keras_tf_variables = tracked


# --------------------------------------------------------------------------
# In-graph validators. Each returns its (possibly reshaped) input with the
# checks as control dependencies, so they run before anything uses it.


def fed_shape(x) -> tf.Tensor:
    """The int32 shape of `x` as the client fed it, for the graph's shape checks.

    A signature that declares its sizes gives its function an argument of that
    static shape, and everything computed from the shape is folded to the
    declared value: `tf.rank` and `tf.shape` of known dimensions become
    constants when the function is traced, and Grappler folds even
    ``Rank`` / ``Size`` ops from the argument's declared shape. A client that
    feeds the signature directly (TF Serving's session, ``loaded.signatures[name](...)``)
    is not held to the declaration, so a check written with those values
    always passes and a wrong shape fails later with TensorFlow's own message
    (``Invalid reduction dimension``, ``ConcatOp``). The shape read back through
    a serialize/parse round trip is opaque to both: its value is the fed shape
    and its static shape is unknown. (A fully declared shape, e.g. a scalar,
    folds even ``Shape``: its value itself makes the round trip; the exports
    declare no large fully sized input.)
    """
    x = tf.convert_to_tensor(x)
    if x.shape.is_fully_defined():
        return tf.shape(tf.io.parse_tensor(tf.io.serialize_tensor(x), x.dtype), out_type=tf.int32)
    return tf.io.parse_tensor(tf.io.serialize_tensor(tf.shape(x, out_type=tf.int32)), tf.int32)


def fed_rank(x) -> tf.Tensor:
    """The rank of `x` as fed (`fed_shape`), a scalar int32 that the graph cannot fold."""
    return tf.size(fed_shape(x), out_type=tf.int32)


def fed_dim(shape, index: int) -> tf.Tensor:
    """Dimension `index` (0 or -1) of a `fed_shape`, -1 where the tensor has no dimension (a scalar):
    safe to compare whatever the rank."""
    return tf.concat([shape, [-1]], axis=0)[0] if index == 0 else tf.concat([[-1], shape], axis=0)[-1]


def fed_or_stand_in(x, shape, ok, static_shape, stand_in: Callable[[], tf.Tensor]) -> tf.Tensor:
    """What the ops after a shape check read: `x` where `ok` (its fed `shape` is the one the
    check wants), else ``stand_in()``, a small valid value of `static_shape`.

    The check's ``Assert`` fails the request either way; the stand-in keeps the ops below it
    from failing first, with TensorFlow's own message, on a tensor of another shape. Ordering
    them after the check by a control dependency is not enough: Grappler removes a reshape or
    identity that the declared shape makes redundant, and the order with it.
    """
    out = tf.cond(ok, lambda: tf.reshape(x, shape), stand_in)
    out.set_shape(static_shape)
    return out


def _rank_and_batch_checks(x, rank: int, name: str, expected: str, shape=None):
    shape = fed_shape(x) if shape is None else shape
    got_rank = tf.size(shape, out_type=tf.int32)
    rank_check = tf.debugging.Assert(
        tf.equal(got_rank, rank),
        [f"{name} must have shape {expected}; got a tensor of rank", got_rank, "and shape", shape])
    with tf.control_dependencies([rank_check]):
        batch_check = tf.debugging.Assert(
            tf.logical_or(tf.not_equal(got_rank, rank), fed_dim(shape, 0) > 0),
            [f"{name} is empty; expected shape {expected} with batch >= 1"])
    return [rank_check, batch_check]


def validate_strings(strings, name: str) -> tf.Tensor:
    """Checks a (batch,) string tensor: rank 1, batch >= 1, no empty / whitespace-only string,
    valid UTF-8.

    Raises (when the graph runs) `tf.errors.InvalidArgumentError` whose
    message names `name`, what was expected and, for an empty string or
    bytes that are not valid UTF-8, the index of the first one. UTF-8 is
    checked as strictly as Python's ``bytes.decode("utf-8")`` (the training
    readers): invalid, truncated or overlong sequences, encoded surrogates and
    code points above U+10FFFF are rejected.

    Returns:
      `strings` as a (None,) tf.string tensor that depends on the checks.
    """
    strings = tf.convert_to_tensor(strings, tf.string)
    checks = _rank_and_batch_checks(strings, 1, name, "(batch,)")
    with tf.control_dependencies(checks):
        # Any shape flattens: the ops below never fail before the checks do.
        flat = tf.reshape(strings, [-1])
        empty = tf.equal(tf.strings.length(tf.strings.strip(flat)), 0)
        checks.append(tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(empty)),
            [f"{name} must be non-empty strings; got an empty or whitespace-only string at index",
             tf.argmax(tf.cast(empty, tf.int32))]))
    with tf.control_dependencies(checks):
        # Invalid UTF-8 is replaced by U+FFFD; valid strings (U+FFFD included)
        # come back unchanged, so a difference marks a non-UTF-8 string.
        # (errors="strict" would raise without naming the element.)
        transcoded = tf.strings.unicode_transcode(flat, "UTF-8", "UTF-8", errors="replace",
                                                  replacement_char=0xFFFD)
        not_utf8 = tf.not_equal(transcoded, flat)
        checks.append(tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(not_utf8)),
            [f"{name} must be UTF-8 text; got bytes that are not valid UTF-8 at index",
             tf.argmax(tf.cast(not_utf8, tf.int32))]))
    with tf.control_dependencies(checks):
        out = tf.identity(flat)
    out.set_shape([None])
    return out


def validate_features(x, dim: int, name: str) -> tf.Tensor:
    """Checks a float feature batch: rank 2, batch >= 1, last dimension `dim`, finite values.

    Raises (when the graph runs) `tf.errors.InvalidArgumentError` naming
    `name`, the expected shape and, for NaN/inf, the first bad row.

    Returns:
      `x` as a (None, dim) float32 tensor that depends on the checks.
    """
    dim = int(dim)
    expected = f"(batch, {dim})"
    x = tf.convert_to_tensor(x, tf.float32)
    shape = fed_shape(x)
    checks = _rank_and_batch_checks(x, 2, name, expected, shape)
    ok = tf.equal(tf.size(shape), 2) & tf.equal(fed_dim(shape, -1), dim) & (fed_dim(shape, 0) > 0)
    with tf.control_dependencies(checks):
        checks.append(tf.debugging.Assert(
            tf.logical_or(ok, tf.not_equal(tf.size(shape), 2)),
            [f"{name} must have shape {expected}; got shape", shape]))
    x = fed_or_stand_in(x, shape, ok, [None, dim], lambda: tf.zeros([1, dim]))
    with tf.control_dependencies(checks):
        bad_rows = tf.logical_not(tf.reduce_all(tf.math.is_finite(x), axis=1))
        checks.append(tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(bad_rows)),
            [f"{name} contains NaN or inf values; first bad row:", tf.argmax(tf.cast(bad_rows, tf.int32))]))
    with tf.control_dependencies(checks):
        out = tf.identity(x)
    out.set_shape([None, dim])
    return out


def _image_size(size) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)):
        size = (int(size), int(size))
    size = tuple(int(s) for s in size)
    if len(size) != 2 or min(size) < 1:
        raise ConfigError(f"image size must be a positive int or (height, width), got {size!r}")
    return size


def decode_jpeg_batch(jpeg_bytes, size, name: str, *, pil_resize: bool = False) -> tf.Tensor:
    """Decodes a (batch,) tensor of JPEG/PNG bytes to float32 RGB (batch, H, W, 3), 0..255.

    The batch wrapper of the package's one image decoder,
    `tf_twobranch.image_decoding.tf_decode_image` (JPEGs with the accurate
    integer DCT: pixels equal PIL's; grey images become RGB, alpha is
    dropped): it adds the batch's checks and the resize. Every element must
    start with the JPEG or PNG magic bytes; otherwise an
    `InvalidArgumentError` names `name` and the index of the first bad
    element. Each image is resized (bilinear, antialiased, aspect ratio not
    kept) to `size` (an int or (height, width)), the tower's input size; with
    `pil_resize` by `tf_twobranch.features.images.tf_pil_resize`, whose
    whole grey levels equal PIL's ``Image.resize(..., BILINEAR)`` (the offline
    `features.images.resize`), otherwise by `tf.image.resize` (antialiased,
    not rounded). Bytes with valid magic bytes that the decoder
    rejects (a truncated file, a corrupt body) raise an
    `InvalidArgumentError` naming `name`, the index of the first such
    element and how many there are, instead of the decoder's anonymous
    "jpeg::Uncompress failed" (the decoder's own message may still be logged
    to stderr).
    """
    height, width = _image_size(size)

    def resize(image):
        if pil_resize:
            return tf.cast(tf_pil_resize(image, height, width), tf.float32)
        resized = tf.image.resize(tf.cast(image, tf.float32), [height, width], method="bilinear",
                                  antialias=True)
        return tf.clip_by_value(resized, 0.0, 255.0)

    (images,) = map_decoded_images(jpeg_bytes, name, lambda image: (resize(image),),
                                   [(tf.float32, [height, width, 3])])
    images.set_shape([None, height, width, 3])
    return images


def map_decoded_images(jpeg_bytes, name: str, fn: Callable, output_specs: Sequence[tuple], extra=()
                       ) -> tuple:
    """``fn(image, *extra_b)`` of every decoded image b of a (batch,) tensor of JPEG/PNG bytes, stacked.

    The checks of `decode_jpeg_batch` (rank 1, batch >= 1, the magic bytes of
    every element, then the elements the decoder rejects, each named by its
    index), for any per-image computation on the uint8 (H, W, 3) image at its
    own size (e.g. crops of its boxes).

    Args:
      jpeg_bytes: (batch,) string tensor; `name` names it in the errors.
      fn: ``(image uint8 (H, W, 3), *elements of extra) -> tuple of tensors``.
      output_specs: ``(dtype, shape)`` of each output of `fn` (a shape may be
        a 1-D int tensor, e.g. with a size taken from a request's tensors).
      extra: tensors whose first dimension is the batch (the caller checks
        it), element b going with image b.

    Returns:
      One (batch, ...) tensor per output, in input order.
    """
    jpeg_bytes = tf.convert_to_tensor(jpeg_bytes, tf.string)
    checks = _rank_and_batch_checks(jpeg_bytes, 1, name, "(batch,) of encoded image bytes")
    with tf.control_dependencies(checks):
        flat = tf.reshape(jpeg_bytes, [-1])     # any shape flattens (see validate_strings)
        bad = tf.logical_not(tf_is_image_bytes(flat, _BATCH_FORMATS))
        checks.append(tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(bad)),
            [f"{name}: cannot decode image; expected {IMAGE_FORMATS} bytes "
             "(raw file contents, base64-decoded); first bad element index:",
             tf.argmax(tf.cast(bad, tf.int32)), "starts with:", tf.gather(tf.strings.substr(flat, 0, 8),
                                                                           tf.argmax(tf.cast(bad, tf.int32)))]))
    with tf.control_dependencies(checks):
        flat = tf.identity(flat)
    count = tf.shape(flat, out_type=tf.int64)[0]

    def decode_one(index, data, *elements):
        # The magic bytes were checked above, for the whole batch.
        return (index, *fn(tf_decode_image(data, check_format=False), *elements))

    # A decoder error cannot be caught in a graph, but tf.data can drop the
    # elements that raise one (`ignore_errors`): the indices of the decoded
    # elements tell which failed. The order is kept (deterministic map).
    decoded = tf.data.Dataset.from_tensor_slices((tf.range(count), flat, *extra)).map(
        decode_one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors().batch(2 ** 31 - 1)
    # One batch of everything decoded; the empty batch when nothing was.
    nothing = tf.data.Dataset.from_tensors(
        (tf.zeros([0], tf.int64),
         *[tf.zeros(tf.concat([[0], tf.cast(shape, tf.int32)], axis=0), dtype) for dtype, shape in output_specs]))
    indices, *outputs = decoded.concatenate(nothing).take(1).get_single_element()
    # The decoded indices ascend, so the first failure is where they leave 0, 1, 2, ...
    first_bad = tf.reduce_sum(tf.cast(tf.equal(indices, tf.range(tf.size(indices, out_type=tf.int64))),
                                      tf.int64))
    decode_check = tf.debugging.Assert(
        tf.equal(tf.size(indices, out_type=tf.int64), count),
        [f"{name}: cannot decode image; the JPEG/PNG data is truncated or corrupt (its magic bytes are "
         "fine); first bad element index:", first_bad, "bad elements:",
         count - tf.size(indices, out_type=tf.int64), "of", count])
    with tf.control_dependencies([decode_check]):
        return tuple(tf.identity(output) for output in outputs)


# --------------------------------------------------------------------------
# TF Serving warm-up file.


class _Protos(NamedTuple):
    prediction_log: type     # tensorflow.serving.PredictionLog
    predict_request: type    # tensorflow.serving.PredictRequest
    real: bool               # tensorflow-serving-api's classes (else declared at run time)


def serving_api_available() -> bool:
    """Whether `tensorflow-serving-api` (the real request protos) is importable."""
    return _serving_protos().real


@functools.lru_cache(maxsize=2)
def _serving_protos(declared: bool = False) -> _Protos:
    """TF Serving's message classes: tensorflow-serving-api's, or (`declared`, or the package
    missing) the run-time declaration of the fields the package writes."""
    if not declared:
        try:
            from tensorflow_serving.apis import predict_pb2, prediction_log_pb2
        except ImportError:
            pass
        else:
            return _Protos(prediction_log_pb2.PredictionLog, predict_pb2.PredictRequest, True)

    pool = descriptor_pool.DescriptorPool()
    added = set()

    def add_file(file_descriptor):
        if file_descriptor.name in added:
            return
        for dependency in file_descriptor.dependencies:
            add_file(dependency)
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(file_descriptor.serialized_pb))
        added.add(file_descriptor.name)

    add_file(tensor_pb2.DESCRIPTOR)
    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="tf_twobranch/tf_serving_prediction_log.proto", package="tensorflow.serving", syntax="proto3",
        dependency=[tensor_pb2.DESCRIPTOR.name])

    def message(name, fields, nested=()):
        m = proto.message_type.add(name=name)
        for field_name, number, kind, type_name, label in fields:
            f = m.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                f.type_name = type_name
        for n in nested:
            m.nested_type.add().CopyFrom(n)
        return m

    optional, repeated = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    # Field numbers of tensorflow_serving/apis/{model,predict,prediction_log}.proto.
    message("ModelSpec", [("name", 1, F.TYPE_STRING, None, optional),
                          ("signature_name", 3, F.TYPE_STRING, None, optional)])
    inputs_entry = descriptor_pb2.DescriptorProto(name="InputsEntry")
    inputs_entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=optional)
    inputs_entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=optional,
                           type_name=".tensorflow.TensorProto")
    inputs_entry.options.map_entry = True
    message("PredictRequest", [("model_spec", 1, F.TYPE_MESSAGE, ".tensorflow.serving.ModelSpec", optional),
                               ("inputs", 2, F.TYPE_MESSAGE, ".tensorflow.serving.PredictRequest.InputsEntry",
                                repeated)], nested=[inputs_entry])
    message("PredictLog", [("request", 1, F.TYPE_MESSAGE, ".tensorflow.serving.PredictRequest", optional)])
    message("PredictionLog", [("predict_log", 6, F.TYPE_MESSAGE, ".tensorflow.serving.PredictLog", optional)])
    pool.Add(proto)

    def get(name):
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))

    return _Protos(get("tensorflow.serving.PredictionLog"), get("tensorflow.serving.PredictRequest"), False)


def _fill_request(request, signature_name: str, inputs: Mapping[str, np.ndarray], model_name: str) -> None:
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    for input_name, array in inputs.items():
        # Through bytes: the declared classes have their own TensorProto class.
        request.inputs[input_name].ParseFromString(tf.make_tensor_proto(array).SerializeToString())


def predict_request_inputs(request) -> dict[str, np.ndarray]:
    """``{input name: array}`` of a ``PredictRequest``, decoded as the model server decodes it
    (each `TensorProto` to a tensor: `tf.make_ndarray`; strings come back as bytes)."""
    return {name: tf.make_ndarray(tensor_pb2.TensorProto.FromString(tensor.SerializeToString()))
            for name, tensor in request.inputs.items()}


def _as_array(value, signature_name: str, input_name: str) -> np.ndarray:
    """A numpy array for a request input: str/bytes (and nested lists of them) → object array of bytes."""
    def encode(v):
        return v.encode("utf-8") if isinstance(v, str) else v

    if isinstance(value, (str, bytes)):
        return np.array(encode(value), dtype=object)
    array = np.asarray(value, dtype=object if isinstance(value, (list, tuple)) else None)
    if array.dtype == object or array.dtype.kind in "US":
        flat = [encode(v) for v in array.ravel().tolist()]
        if flat and all(isinstance(v, bytes) for v in flat):
            return np.array(flat, dtype=object).reshape(array.shape)
        if array.dtype == object and isinstance(value, (list, tuple)):
            array = np.asarray(value)   # a list of numbers
    if array.dtype == np.float64:
        array = array.astype(np.float32)  # the exports' float inputs are float32
    if array.dtype == object or array.dtype.kind in "US" or array.size == 0:
        raise ConfigError(f"warm-up request {signature_name!r}: input {input_name!r} must be a non-empty "
                          f"numeric array or strings, got {type(value).__name__}")
    return array


def write_warmup_requests(export_dir, requests: Sequence[tuple[str, Mapping[str, object]]],
                          model_name: str = "", *, declared: bool = False) -> pathlib.Path:
    """Writes ``<export_dir>/assets.extra/tf_serving_warmup_requests``.

    Args:
      export_dir: the SavedModel directory (written before or after the
        SavedModel itself; ``assets.extra`` is created).
      requests: ``(signature_name, {input_name: value})`` pairs; each becomes
        one ``PredictionLog`` with a ``predict_log.request``. A value is a
        numpy array, a (nested) list of numbers or of str/bytes (a batch of
        strings), or one str/bytes (a scalar string). Strings are stored as
        bytes (str as UTF-8); float64 as float32.
      model_name: ``model_spec.name`` of every request (TF Serving ignores it
        during warm-up; set it to the served name for clarity).
      declared: write with the run-time declared protos even when
        tensorflow-serving-api is installed (the bytes are the same; tests).

    Returns:
      The path of the warm-up file.

    Raises:
      ConfigError: no request, or an input that cannot become a tensor.
    """
    if not requests:
        raise ConfigError("write_warmup_requests needs at least one request")
    protos = _serving_protos(declared)
    path = pathlib.Path(export_dir) / "assets.extra" / WARMUP_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for signature_name, inputs in requests:
        if not inputs:
            raise ConfigError(f"warm-up request {signature_name!r} has no inputs")
        log = protos.prediction_log()
        _fill_request(log.predict_log.request, signature_name,
                      {name: _as_array(value, signature_name, name) for name, value in inputs.items()}, model_name)
        # Deterministic: map entries sorted, so the file does not depend on which classes wrote it.
        records.append(log.SerializeToString(deterministic=True))
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def read_warmup_requests(path) -> list[tuple[str, dict[str, np.ndarray]]]:
    """Decodes a warm-up file (or the SavedModel directory holding one).

    Returns:
      ``[(signature_name, {input_name: numpy array})]`` in file order
      (strings come back as bytes objects).

    Raises:
      DataFormatError: the file is missing or a record is not a
        ``PredictionLog`` with a predict request.
    """

    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "assets.extra" / WARMUP_FILENAME
    if not path.is_file():
        raise DataFormatError(path, "warm-up file does not exist")
    prediction_log_class = _serving_protos().prediction_log
    out = []
    try:
        records = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
    except tf.errors.OpError as err:
        raise DataFormatError(path, f"not a TFRecord file ({err.message})") from None
    for index, record in enumerate(records):
        try:
            log = prediction_log_class.FromString(record)
        except Exception as err:  # protobuf's DecodeError differs between implementations
            raise DataFormatError(path, f"not a PredictionLog ({err})", record=index) from None
        if not log.HasField("predict_log"):
            raise DataFormatError(path, "expected a PredictionLog with predict_log", record=index)
        request = log.predict_log.request
        out.append((request.model_spec.signature_name, predict_request_inputs(request)))
    return out


def run_warmup_requests(signatures: Mapping[str, object],
                        requests: Sequence[tuple[str, Mapping[str, object]]]) -> list[dict]:
    """Runs warm-up requests through a module's signature functions (before saving).

    TF Serving refuses to load a model whose warm-up request fails, so the
    exports run theirs once before writing them.

    Args:
      signatures: ``{signature_name: tf.function with an input_signature}``,
        e.g. ``module.signatures()`` of the exports.
      requests: as for `write_warmup_requests`.

    Returns:
      The output dicts (numpy values), one per request.

    Raises:
      ConfigError: unknown signature or input name.
      tf.errors.InvalidArgumentError: a request fails validation.
    """
    outputs = []
    for signature_name, inputs in requests:
        if signature_name not in signatures:
            raise ConfigError(f"warm-up request for unknown signature {signature_name!r}; "
                              f"expected one of {sorted(signatures)}")
        function = signatures[signature_name]
        specs = function.get_concrete_function().structured_input_signature[0]
        names = [spec.name for spec in specs]
        if set(names) != set(inputs):
            raise ConfigError(f"warm-up request {signature_name!r} has inputs {sorted(inputs)}; "
                              f"the signature expects {sorted(names)}")
        args = []
        for spec in specs:
            array = _as_array(inputs[spec.name], signature_name, spec.name)
            # The file keeps the array's dtype and TF Serving feeds it as is: an int64 `k` for an
            # int32 input would pass a cast here and fail the served model's warm-up.
            if array.dtype != object and tf.as_dtype(array.dtype) != spec.dtype:
                raise ConfigError(f"warm-up request {signature_name!r}: input {spec.name!r} is "
                                  f"{tf.as_dtype(array.dtype).name}, the signature takes {spec.dtype.name} "
                                  "(TF Serving feeds the warm-up file's tensors as written)")
            args.append(tf.constant(array, spec.dtype))
        outputs.append({k: v.numpy() for k, v in function(*args).items()})
    return outputs


def replay_warmup_file(export_dir, loaded=None) -> list[str]:
    """Runs a written SavedModel's warm-up file through the reloaded model, as TF Serving does on load.

    `loaded`: the SavedModel already loaded from `export_dir` (default: load it here).
    Returns the signature names of the replayed requests, in file order.
    """
    loaded = tf.saved_model.load(str(export_dir)) if loaded is None else loaded
    requests = read_warmup_requests(export_dir)
    for signature_name, inputs in requests:
        # As written, without the client's conversions: TF Serving feeds the file's tensors.
        loaded.signatures[signature_name](**{name: tf.constant(value) for name, value in inputs.items()})
    return [name for name, _ in requests]
