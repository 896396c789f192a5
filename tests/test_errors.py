"""One-line error messages stay one line, and an exception with an empty message cannot break
the error path (``errors.first_line``)."""

from __future__ import annotations

import pytest

from elastic_export.errors import UserError, first_line


class _Silent(Exception):
    """An exception whose message is empty (``str(e) == ""``)."""


def test_first_line():
    assert first_line(ValueError("bad input\nsecond line")) == "bad input"
    assert first_line(ValueError("\n  \n")) == "ValueError"
    assert first_line(_Silent()) == "_Silent"


def _raise_silent(*args, **kwargs):
    raise _Silent()


def test_empty_message_through_a_loader_error_path(tmp_path, monkeypatch):
    """The ranking loader reports an unreadable file whose reader raised with no message."""
    import safetensors

    from elastic_export.ranking import load_ranking

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
