"""One-line error messages stay one line, and an exception with an empty message cannot break
the error path (``errors.first_line``)."""

from __future__ import annotations

import pytest

from elastic_export.core.errors import UserError, first_line


class _Silent(Exception):
    """An exception whose message is empty (``str(e) == ""``)."""


def test_first_line():
    assert first_line(ValueError("bad input\nsecond line")) == "bad input"
    assert first_line(ValueError("\n  \n")) == "ValueError"
    assert first_line("") == "" and first_line("", empty="none") == "none"
    assert first_line("x" * 400, limit=300) == "x" * 300 and first_line("a\nb", limit=300) == "a"
    assert first_line(_Silent()) == "_Silent"
    # a message string (TensorRT's parser errors), and what an empty one reads as
    assert first_line("  In node 3: unsupported op\nstack") == "In node 3: unsupported op"
    assert first_line("\n", empty="?") == "?"
    assert first_line(ValueError(""), empty="?") == "?"


def _raise_silent(*args, **kwargs):
    raise _Silent()


def test_empty_message_through_a_loader_error_path(tmp_path, monkeypatch):
    """The ranking loader reports an unreadable file whose reader raised with no message."""
    import safetensors

    from elastic_export.ranking.file import load_ranking

    path = tmp_path / "r.safetensors"
    path.write_bytes(b"not a ranking")
    monkeypatch.setattr(safetensors, "safe_open", _raise_silent)
    with pytest.raises(UserError, match=r"not a readable ranking file \(_Silent\)$"):
        load_ranking(path)


def test_empty_message_through_the_pass_check(monkeypatch):
    """A pass whose output fails onnx.checker with an empty message still gets a one-line error."""
    import onnx
    from onnx import helper

    from elastic_export.passes.base import verify

    monkeypatch.setattr(onnx.checker, "check_model", lambda *a, **k: (_ for _ in ()).throw(
        onnx.checker.ValidationError("")))
    graph = helper.make_graph([], "g", [], [])
    with pytest.raises(RuntimeError, match=r"produced an invalid graph: ValidationError$"):
        verify(helper.make_model(graph), "cleanup")


def _one_line(excinfo, ending: str) -> None:
    """The error is one line, ends with ``ending`` (the type name standing in for the empty message)."""
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.endswith(ending), msg


def test_empty_message_through_the_hf_loader(tmp_path, monkeypatch):
    """A model directory whose config reader raises ``OSError()``."""
    import transformers

    from elastic_export.models.loader import load_encoder

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", _raise_silent_os)
    with pytest.raises(UserError) as e:
        load_encoder(str(tmp_path))
    _one_line(e, "not a loadable Hugging Face model directory (OSError)")


def test_empty_message_through_the_timm_loader(monkeypatch):
    """A timm name whose constructor raises ``OSError()``."""
    import timm

    from elastic_export.models.loader import load_encoder

    monkeypatch.setattr(timm, "create_model", _raise_silent_os)
    with pytest.raises(UserError) as e:
        load_encoder("vit_tiny_patch16_224", pretrained=False)
    _one_line(e, "could not build timm model 'vit_tiny_patch16_224': OSError")


def _raise_silent_os(*args, **kwargs):
    raise OSError()


def test_empty_message_through_the_fp16_check(monkeypatch):
    """An fp16 model that onnx.checker refuses with an empty message."""
    import onnx
    from onnx import helper

    from elastic_export.core import onnx_io
    from elastic_export.precision.fp16 import check_fp16_model

    monkeypatch.setattr(onnx_io, "check", lambda *a, **k: (_ for _ in ()).throw(onnx.checker.ValidationError("")))
    with pytest.raises(RuntimeError) as e:
        check_fp16_model(helper.make_model(helper.make_graph([], "g", [], [])))
    _one_line(e, "invalid after fp16 conversion: ValidationError")


def test_empty_message_through_the_quantizer(tmp_path, monkeypatch):
    """The int8 quantizer raising ``ValueError()``."""
    import onnxruntime.quantization

    from elastic_export.precision.int8 import quantize

    monkeypatch.setattr(onnxruntime.quantization, "quantize_dynamic", lambda *a, **k: (_ for _ in ()).throw(ValueError()))
    with pytest.raises(UserError) as e:
        quantize(tmp_path / "m.onnx", tmp_path / "m.int8.onnx")
    _one_line(e, "int8 quantization failed (ValueError)")


@pytest.mark.parametrize("opener", ["make_session", "eval"])
def test_empty_message_through_a_session_load(tmp_path, monkeypatch, opener):
    """onnxruntime failing to load a file with an empty message (targets.onnxruntime, eval)."""
    import onnxruntime

    from elastic_export.measure.evaluation import _session
    from elastic_export.targets.onnxruntime import make_session

    path = tmp_path / "m.onnx"
    path.write_bytes(b"x")
    monkeypatch.setattr(onnxruntime, "InferenceSession", _raise_silent)
    with pytest.raises(UserError) as e:
        (make_session if opener == "make_session" else _session)(path)
    _one_line(e, "onnxruntime cannot load it (_Silent)")


def test_empty_message_through_the_optimiser_source(tmp_path, monkeypatch):
    """An optimiser source that onnx cannot read, with an empty message."""
    import onnx

    from elastic_export.precision.ort_optimize import optimize_onnx

    path = tmp_path / "m.onnx"
    path.write_bytes(b"x")
    monkeypatch.setattr(onnx, "load", _raise_silent)
    with pytest.raises(UserError) as e:
        optimize_onnx(path)
    _one_line(e, "not a readable ONNX file (_Silent)")
