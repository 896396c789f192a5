"""ONNX files of any size: weights inline below protobuf's 2 GiB, in one external data file above it.

A ``ModelProto`` serialises to at most 2 GiB, so a model whose weights pass that (about 530M fp32
parameters: Qwen3-Embedding-4B / 8B, ViT-g) keeps them in ``NAME.onnx.data`` beside ``NAME.onnx``
(ONNX's external data format, one file per model; onnxruntime, TensorRT's parser and
``onnx.load`` read it from the same folder). Every writer of a model file in this project goes
through :func:`save`, every in-memory check through :func:`check`, and every copier of a model
file through :func:`files`, so the size never needs a second code path elsewhere.

``INLINE_LIMIT`` is a module attribute on purpose: the tests lower it to run the whole external-data
path on tiny models; ``--external-data`` on the CLI forces it for any model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import onnx
from onnx.external_data_helper import load_external_data_for_model

PROTOBUF_LIMIT = 2**31 - 1  # bytes: one serialised ModelProto, weights inside, is at most this
INLINE_LIMIT = PROTOBUF_LIMIT - 2**26  # weight bytes a file keeps inline (room left for nodes and metadata)
SIZE_THRESHOLD = 1024  # bytes: smaller tensors stay inline even in an external-data file (onnx's default)
DATA_SUFFIX = ".data"
MODEL_GRAPH = 7  # ModelProto.graph (protobuf field numbers)
GRAPH_INITIALIZER = 5  # GraphProto.initializer
_LENGTH_DELIMITED = 2


def field_header(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited protobuf field (varints)."""
    out, n = bytearray(), number << 3 | _LENGTH_DELIMITED
    for value in (n, length):
        while True:
            byte, value = value & 0x7F, value >> 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                break
    return bytes(out)


def data_name(onnx_name: str) -> str:
    """File name of the external data of the model file ``onnx_name`` (``budget_0.30.onnx.data``)."""
    return onnx_name + DATA_SUFFIX


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers (the part that can outgrow a protobuf)."""
    return sum(t.ByteSize() for t in model.graph.initializer)


def needs_external(nbytes: int, external: bool | None = None) -> bool:
    """Whether weights of ``nbytes`` go to an external data file (``external``: force on / off; None: by size)."""
    return bool(external) if external is not None else nbytes >= INLINE_LIMIT


def files(path: str | Path) -> list[Path]:
    """The model file and, when it has one, its external data file: what to copy, link or delete together."""
    path = Path(path)
    data = path.with_name(data_name(path.name))
    return [path, data] if data.is_file() else [path]


def external_like(path: str | Path) -> bool | None:
    """For a twin of the model file ``path`` (fp16, int8): external data when ``path`` has it, else by size."""
    return True if len(files(path)) > 1 else None


def share_mode(path: str | Path) -> None:
    """Give a data file the mode ``open`` would have (onnx writes external data as 0600)."""
    from elastic_export.core.fileio import umask

    Path(path).chmod(0o666 & ~umask())


def write_via_scratch(directory: str | Path, name: str, write: Callable[[Path], None]) -> None:
    """``write(path)`` into a scratch folder inside ``directory`` (quantizers leave helper files beside
    their output), then move the model file ``name`` and its external data into ``directory``."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        write(Path(scratch) / name)
        for f in files(Path(scratch) / name):
            share_mode(f)
            f.replace(directory / f.name)


def save(model: onnx.ModelProto, path: str | Path, external: bool | None = None) -> bool:
    """Write ``model`` to ``path``; weights to ``path.data`` when :func:`needs_external`.

    ``model`` is left as it was (onnx moves the weights out of the proto while writing them; they are
    read back). Returns True when an external data file was written.
    """
    path = Path(path)
    data = path.with_name(data_name(path.name))
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    if not needs_external(weight_bytes(model), external):
        write_inline(model, path)
        return False
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=SIZE_THRESHOLD)
    load_external_data_for_model(model, str(path.parent))
    share_mode(data)
    return True


def _split(message, at: int, skip: str):
    """Two messages of ``message``'s type: its set fields numbered below ``at`` and above it (``skip`` left out)."""
    from google.protobuf.message import Message

    low, high = type(message)(), type(message)()
    for f, value in message.ListFields():  # the set fields
        if f.name == skip:
            continue
        dst = low if f.number < at else high
        if hasattr(value, "extend"):  # a repeated field
            getattr(dst, f.name).extend(value)
        elif isinstance(value, Message):
            getattr(dst, f.name).CopyFrom(value)
        else:
            setattr(dst, f.name, value)
    return low, high


def write_inline(model: onnx.ModelProto, path: str | Path) -> None:
    """``onnx.save(model, path)``, byte for byte, one initializer at a time: protobuf writes a message's
    fields in number order, so the model is its fields before the graph, the graph (its fields before
    the initializers, each initializer, the rest) and the fields after it. onnx's own serialises the
    whole model into one buffer first (3 s of a 436 MB model's save in the main job; half that here)."""
    m_low, m_high = _split(model, MODEL_GRAPH, "graph")
    g_low, g_high = (part.SerializeToString() for part in _split(model.graph, GRAPH_INITIALIZER, "initializer"))
    sizes = [t.ByteSize() for t in model.graph.initializer]
    graph = len(g_low) + len(g_high) + sum(len(field_header(GRAPH_INITIALIZER, n)) + n for n in sizes)
    with open(path, "wb") as f:
        f.write(m_low.SerializeToString() + field_header(MODEL_GRAPH, graph) + g_low)
        for t, n in zip(model.graph.initializer, sizes):
            f.write(field_header(GRAPH_INITIALIZER, n))
            f.write(t.SerializeToString())
        f.write(g_high + m_high.SerializeToString())


def model_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """Everything of ``model`` but its graph (opsets, producer, metadata, functions)."""
    skeleton = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name == "graph":
            continue
        repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; older ones have label only
        if repeated if repeated is not None else field.label == field.LABEL_REPEATED:
            getattr(skeleton, field.name).extend(value)
        elif field.message_type is not None:
            getattr(skeleton, field.name).CopyFrom(value)
        else:
            setattr(skeleton, field.name, value)
    return skeleton


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` for checking: initializers of ``SIZE_THRESHOLD`` bytes or more become graph
    inputs of the same type and shape (small ones, such as reshape targets, stay), so the checker and
    shape inference see the same graph without serialising gigabytes."""
    g = model.graph
    big = [t for t in g.initializer if t.ByteSize() >= SIZE_THRESHOLD]
    names, inputs = {t.name for t in big}, {i.name for i in g.input}
    out = model_skeleton(model)
    out.graph.CopyFrom(onnx.helper.make_graph(
        list(g.node), g.name,
        list(g.input) + [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in big
                         if t.name not in inputs],
        list(g.output), [t for t in g.initializer if t.name not in names],
        doc_string=g.doc_string, value_info=list(g.value_info)))
    return out


def infer_shapes(model: onnx.ModelProto, strict_mode: bool = False) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` for a model of any size, without serialising its weights:
    the shapes are inferred on :func:`weightless` and written into ``model``'s value_info and outputs;
    ``model`` is returned. (onnx's own would serialise every weight twice: 2 s for all-mpnet-base-v2.)"""
    inferred = onnx.shape_inference.infer_shapes(weightless(model), strict_mode=strict_mode).graph
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.value_info)
    del model.graph.output[:]
    model.graph.output.extend(inferred.output)
    return model


#: sub-byte element types: raw data packs several elements per byte
_PACKED = {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
           if hasattr(onnx.TensorProto, n)}


def _raw_data_problem(t: onnx.TensorProto) -> str | None:
    """Why the raw data of ``t`` does not fit its shape and type (None when it does, or cannot be sized)."""
    import numpy as np

    if t.data_type == onnx.TensorProto.STRING:
        return "raw data in a string tensor"
    if t.data_type in _PACKED:
        return None
    need = int(np.prod(t.dims, dtype=np.int64)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    got = len(t.raw_data)
    return None if got == need else f"{got} bytes of raw data for shape {list(t.dims)} ({need} expected)"


def check_weights(model: onnx.ModelProto) -> None:
    """What ``onnx.checker`` checks of the initializers (:func:`weightless` takes the large ones out),
    without serialising them: a defined data type, one value field (or external data with a location),
    and raw data of exactly the bytes the shape and type need (the checker does not count those).

    Raises:
        onnx.checker.ValidationError: naming the first bad tensor.
    """
    fields = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
    for t in model.graph.initializer:
        why = None
        if t.data_type not in onnx.TensorProto.DataType.values() or t.data_type == onnx.TensorProto.UNDEFINED:
            why = f"undefined data type {t.data_type}"
        elif t.data_location == onnx.TensorProto.EXTERNAL:
            why = None if any(e.key == "location" for e in t.external_data) else "external data without a location"
        elif (n := sum(1 for f in fields if len(getattr(t, f))) + t.HasField("raw_data")) > 1 or (
                n == 0 and 0 not in t.dims):
            why = f"{n} value fields (one expected)"
        elif t.HasField("raw_data"):
            why = _raw_data_problem(t)
        if why:
            raise onnx.checker.ValidationError(f"initializer {t.name!r}: {why}")


def check(model: onnx.ModelProto | str | Path, full_check: bool = False) -> None:
    """``onnx.checker`` on a file (with its external data) or on a model of any size.

    An in-memory model is checked as :func:`weightless` (its large initializers as typed graph inputs)
    plus :func:`check_weights`: the checker would otherwise serialise every weight to a copy (2 s and
    the model's size again in memory for all-mpnet-base-v2, 0.1 s this way).

    Raises:
        onnx.checker.ValidationError / onnx.shape_inference.InferenceError: as ``onnx.checker``.
    """
    if not isinstance(model, onnx.ModelProto):
        onnx.checker.check_model(str(model), full_check=full_check)
        return
    check_weights(model)
    onnx.checker.check_model(weightless(model), full_check=full_check)
