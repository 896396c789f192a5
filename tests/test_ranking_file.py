"""The ranking file (DESIGN.md §4): safetensors scores plus JSON metadata; deterministic bytes
(invariant 4); any damage or mismatch is refused with a one-line UserError."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from elastic_export.core.errors import UserError
from elastic_export.models.inventory import Inventory, LayerInventory, head_flops, neuron_flops
from elastic_export.ranking.file import META_KEY, RANKING_VERSION, Ranking, load_ranking, make_meta, save_ranking

FINGERPRINT = "sha256:" + "ab" * 32
COUNTS = [(4, 16), (4, 8), (2, 16)]  # (heads, neurons) per layer
WIDTH, HEAD_DIM, TOKENS = 32, 8, 16


def make_inventory(counts=COUNTS, tokens=TOKENS) -> Inventory:
    layers = [
        LayerInventory(index=i, heads=h, head_dim=HEAD_DIM, neurons=n, swiglu=False,
                       head_cost=head_flops(WIDTH, HEAD_DIM, tokens), neuron_cost=neuron_flops(WIDTH, tokens),
                       head_params=4 * WIDTH * HEAD_DIM + 3 * HEAD_DIM, neuron_params=2 * WIDTH + 1)
        for i, (h, n) in enumerate(counts)
    ]
    return Inventory(layers, tokens=tokens, width=WIDTH, fixed_flops=1000, total_params=123_456)


def make_ranking(inventory: Inventory | None = None, seed: int = 0, method: str = "initial") -> Ranking:
    inv = inventory or make_inventory()
    rng = np.random.default_rng(seed)
    heads = [rng.standard_normal(L.heads).astype(np.float32) for L in inv.layers]
    neurons = [rng.standard_normal(L.neurons).astype(np.float32) for L in inv.layers]
    meta = make_meta(inv, FINGERPRINT, method, {"seed": seed, "calib_size": 4},
                     {"source": "unit test", "samples": 4})
    return Ranking(heads, neurons, meta)


def assert_one_line_user_error(fn, *args, match: str | None = None) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


@pytest.fixture
def saved(tmp_path):
    rk = make_ranking()
    path = tmp_path / "ranking.safetensors"
    save_ranking(rk, path)
    return rk, path


def _write_tensors(path, tensors, meta):
    metadata = None if meta is None else {META_KEY: meta if isinstance(meta, str) else json.dumps(meta)}
    save_file(tensors, str(path), metadata=metadata)


def _tensors(rk: Ranking) -> dict:
    out = {}
    for i in range(rk.num_layers):
        out[f"layers.{i}.heads"] = rk.heads[i]
        out[f"layers.{i}.neurons"] = rk.neurons[i]
    return out


# --- round trip and determinism ------------------------------------------------------------------
def test_round_trip(saved):
    rk, path = saved
    got = load_ranking(path)
    assert got.num_layers == rk.num_layers == len(COUNTS)
    for i in range(rk.num_layers):
        assert got.heads[i].dtype == np.float32 and got.neurons[i].dtype == np.float32
        np.testing.assert_array_equal(got.heads[i], rk.heads[i])
        np.testing.assert_array_equal(got.neurons[i], rk.neurons[i])
    assert got.meta == rk.meta
    assert got.meta["version"] == RANKING_VERSION
    assert got.meta["fingerprint"] == FINGERPRINT
    assert got.meta["tokens"] == TOKENS
    assert [u["heads"] for u in got.meta["units"]] == [h for h, _ in COUNTS]
    assert [u["neurons"] for u in got.meta["units"]] == [n for _, n in COUNTS]
    for i in range(rk.num_layers):
        for kind in ("heads", "neurons"):
            np.testing.assert_array_equal(got.order(kind, i), rk.order(kind, i))
    got.check_matches(make_inventory(), FINGERPRINT, "test")  # no error


def test_round_trip_converts_to_float32(tmp_path):
    rk = make_ranking()
    rk64 = Ranking([h.astype(np.float64) for h in rk.heads], [n.astype(np.float64) for n in rk.neurons], rk.meta)
    save_ranking(rk64, tmp_path / "r.safetensors")
    got = load_ranking(tmp_path / "r.safetensors")
    for i in range(rk.num_layers):
        assert got.heads[i].dtype == np.float32
        np.testing.assert_array_equal(got.heads[i], rk.heads[i])


def test_layer_with_zero_units_round_trips(tmp_path):
    inv = make_inventory([(4, 16), (0, 0), (1, 1)])
    rk = make_ranking(inv)
    save_ranking(rk, tmp_path / "r.safetensors")
    got = load_ranking(tmp_path / "r.safetensors")
    assert [len(h) for h in got.heads] == [4, 0, 1]
    assert [len(n) for n in got.neurons] == [16, 0, 1]
    got.check_matches(inv, FINGERPRINT, "test")


def test_same_ranking_gives_same_bytes(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "sub" / "b.safetensors"
    save_ranking(make_ranking(seed=7), a)
    save_ranking(make_ranking(seed=7), b)  # an equal, separately built ranking
    assert a.read_bytes() == b.read_bytes()
    # load -> save again is byte-identical too
    c = tmp_path / "c.safetensors"
    save_ranking(load_ranking(a), c)
    assert c.read_bytes() == a.read_bytes()


def test_meta_key_order_does_not_change_bytes(tmp_path):
    rk = make_ranking()
    shuffled = Ranking(rk.heads, rk.neurons, dict(reversed(list(rk.meta.items()))))
    save_ranking(rk, tmp_path / "a.safetensors")
    save_ranking(shuffled, tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_different_scores_give_different_bytes(tmp_path):
    save_ranking(make_ranking(seed=1), tmp_path / "a.safetensors")
    save_ranking(make_ranking(seed=2), tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() != (tmp_path / "b.safetensors").read_bytes()


def test_save_leaves_no_temp_files_and_replaces(tmp_path):
    path = tmp_path / "ranking.safetensors"
    save_ranking(make_ranking(seed=1), path)
    save_ranking(make_ranking(seed=2), path)
    assert sorted(os.listdir(tmp_path)) == ["ranking.safetensors"]
    np.testing.assert_array_equal(load_ranking(path).heads[0], make_ranking(seed=2).heads[0])


def test_meta_has_no_timestamp(saved):
    _, path = saved
    meta = load_ranking(path).meta
    assert set(meta) == {"version", "tool", "fingerprint", "method", "tokens", "units", "hyperparameters",
                         "calibration"}


def test_order_is_descending_with_ties_by_index():
    rk = Ranking([np.array([0.5, 2.0, 0.5, -1.0, 2.0], dtype=np.float32)], [np.zeros(3, np.float32)], {})
    assert rk.order("heads", 0).tolist() == [1, 4, 0, 2, 3]
    assert rk.order("neurons", 0).tolist() == [0, 1, 2]


# --- refusals ------------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    msg = assert_one_line_user_error(load_ranking, tmp_path / "nope.safetensors", match="no such file")
    assert "nope.safetensors" in msg


def test_directory_is_not_a_ranking_file(tmp_path):
    assert_one_line_user_error(load_ranking, tmp_path)


def test_empty_file(tmp_path):
    (tmp_path / "r.safetensors").write_bytes(b"")
    assert_one_line_user_error(load_ranking, tmp_path / "r.safetensors")


def test_truncated_file(saved):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_one_line_user_error(load_ranking, path)


@pytest.mark.parametrize("keep", [1, 7, 8, 9, 40, -1])
def test_truncated_at_various_points(saved, keep):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    assert_one_line_user_error(load_ranking, path)


@pytest.mark.parametrize("seed", range(5))
def test_garbage_bytes(tmp_path, seed):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(np.random.default_rng(seed).bytes(4096))
    assert_one_line_user_error(load_ranking, path)


def test_text_file(tmp_path):
    path = tmp_path / "r.safetensors"
    path.write_text("this is not a ranking\n")
    assert_one_line_user_error(load_ranking, path)


def test_safetensors_without_metadata(tmp_path):
    path = tmp_path / "r.safetensors"
    _write_tensors(path, _tensors(make_ranking()), None)
    assert_one_line_user_error(load_ranking, path, match="metadata")


def test_safetensors_with_other_metadata_only(tmp_path):
    path = tmp_path / "r.safetensors"
    save_file(_tensors(make_ranking()), str(path), metadata={"format": "pt"})
    assert_one_line_user_error(load_ranking, path, match="metadata")


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "42", '"a string"', "null", ""])
def test_corrupt_metadata(tmp_path, raw):
    path = tmp_path / "r.safetensors"
    _write_tensors(path, _tensors(make_ranking()), raw)
    assert_one_line_user_error(load_ranking, path)


@pytest.mark.parametrize("version", [0, 2, RANKING_VERSION + 1, "1", None, 1.5])
def test_wrong_version(tmp_path, version):
    rk = make_ranking()
    meta = dict(rk.meta, version=version)
    path = tmp_path / "r.safetensors"
    _write_tensors(path, _tensors(rk), meta)
    assert_one_line_user_error(load_ranking, path, match="version")


def test_missing_version(tmp_path):
    rk = make_ranking()
    meta = {k: v for k, v in rk.meta.items() if k != "version"}
    path = tmp_path / "r.safetensors"
    _write_tensors(path, _tensors(rk), meta)
    assert_one_line_user_error(load_ranking, path, match="version")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", ["heads", "neurons"])
def test_non_finite_scores(tmp_path, bad, kind):
    rk = make_ranking()
    getattr(rk, kind)[1][0] = bad
    path = tmp_path / "r.safetensors"
    save_ranking(rk, path)
    assert_one_line_user_error(load_ranking, path, match="finite")


def test_wrong_dtype(tmp_path):
    rk = make_ranking()
    t = _tensors(rk)
    t["layers.0.heads"] = t["layers.0.heads"].astype(np.float64)
    path = tmp_path / "r.safetensors"
    _write_tensors(path, t, rk.meta)
    assert_one_line_user_error(load_ranking, path)


def test_wrong_rank(tmp_path):
    rk = make_ranking()
    t = _tensors(rk)
    t["layers.0.neurons"] = t["layers.0.neurons"].reshape(4, 4)
    path = tmp_path / "r.safetensors"
    _write_tensors(path, t, rk.meta)
    assert_one_line_user_error(load_ranking, path)


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.pop("layers.1.neurons"),
        lambda t: t.pop("layers.0.heads"),
        lambda t: t.update({"layers.5.heads": np.zeros(2, np.float32)}),
        lambda t: t.update({"extra": np.zeros(2, np.float32)}),
        lambda t: t.clear() or t.update({"x": np.zeros(1, np.float32)}),
    ],
    ids=["missing-neurons", "missing-first-heads", "gap", "extra", "no-layers"],
)
def test_missing_or_unexpected_tensors(tmp_path, edit):
    rk = make_ranking()
    t = _tensors(rk)
    edit(t)
    path = tmp_path / "r.safetensors"
    _write_tensors(path, t, rk.meta)
    assert_one_line_user_error(load_ranking, path)


# --- check_matches -------------------------------------------------------------------------------
def test_check_matches_other_fingerprint(saved):
    _, path = saved
    rk = load_ranking(path)
    assert_one_line_user_error(rk.check_matches, make_inventory(), "sha256:" + "cd" * 32, "--ranking x",
                               match="fingerprint")


def test_check_matches_unknown_fingerprint_is_not_checked(saved):
    _, path = saved
    load_ranking(path).check_matches(make_inventory(), None, "--ranking x")


@pytest.mark.parametrize(
    "counts",
    [
        [(4, 16), (4, 8), (2, 17)],  # one more neuron
        [(4, 16), (3, 8), (2, 16)],  # one head fewer
        [(4, 16), (4, 8)],  # a layer fewer
        [(4, 16), (4, 8), (2, 16), (2, 16)],  # a layer more
        [(4, 8), (4, 16), (2, 16)],  # layers swapped
    ],
)
def test_check_matches_other_unit_counts(saved, counts):
    _, path = saved
    rk = load_ranking(path)
    assert_one_line_user_error(rk.check_matches, make_inventory(counts), FINGERPRINT, "--ranking x",
                               match="unit counts")


def test_check_matches_other_token_count(saved):
    _, path = saved
    rk = load_ranking(path)
    assert_one_line_user_error(rk.check_matches, make_inventory(tokens=TOKENS * 2), FINGERPRINT, "--ranking x",
                               match="N=")


# --- random bytes --------------------------------------------------------------------------------
def _valid_bytes() -> bytes:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        save_ranking(make_ranking(), Path(d) / "r.safetensors")
        return (Path(d) / "r.safetensors").read_bytes()


VALID = _valid_bytes()


def _header_file(header: bytes, tail: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + tail


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_headers = st.dictionaries(
    st.sampled_from(["__metadata__", "layers.0.heads", "layers.0.neurons", "layers.1.heads", "x"]),
    st.one_of(
        _json_values,
        st.fixed_dictionaries({
            "dtype": st.sampled_from(["F32", "F64", "I64", "U8", "F16", "BOOL", "XX"]),
            "shape": st.lists(st.integers(-2, 2**40), max_size=3),
            "data_offsets": st.lists(st.integers(-2, 2**40), min_size=0, max_size=3),
        }),
        st.dictionaries(st.sampled_from([META_KEY, "other"]), st.text(max_size=60), max_size=2),
    ),
    max_size=5,
).map(lambda d: json.dumps(d).encode())


@st.composite
def _mutated_valid(draw):
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 8))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut]) if draw(st.booleans()) else bytes(data)


_file_bytes = st.one_of(
    st.binary(max_size=2048),
    st.builds(_header_file, st.binary(max_size=256), st.binary(max_size=256)),
    st.builds(_header_file, _headers, st.binary(max_size=256)),
    _mutated_valid(),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_file_bytes)
def test_random_bytes_only_raise_user_error(tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "hypothesis-ranking.safetensors"
    path.write_bytes(data)
    try:
        rk = load_ranking(path)
    except UserError as e:
        assert str(e) and "\n" not in str(e)
        return
    # whatever loads is a well-formed ranking
    assert rk.num_layers >= 1
    assert rk.meta["version"] == RANKING_VERSION
    for arrays in (rk.heads, rk.neurons):
        for a in arrays:
            assert a.ndim == 1 and a.dtype == np.float32 and np.isfinite(a).all()


@pytest.mark.parametrize("tokens", [None, "many", "16", [16], {"n": 16}, True, 0, -3, 16.5])
def test_non_integer_tokens_in_metadata(tmp_path, tokens):
    # int(None) in check_matches used to escape as TypeError (a traceback in the CLI)
    rk = make_ranking()
    path = tmp_path / "r.safetensors"
    _write_tensors(path, _tensors(rk), dict(rk.meta, tokens=tokens))
    with pytest.raises(UserError) as info:
        load_ranking(path).check_matches(make_inventory(), FINGERPRINT, "--ranking x")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fingerprint", [123, ["sha256:ab"], {"a": 1}, True])
def test_non_string_fingerprint_in_metadata(tmp_path, fingerprint):
    rk = make_ranking()
    path = tmp_path / "r.safetensors"
    _write_tensors(path, _tensors(rk), dict(rk.meta, fingerprint=fingerprint))
    with pytest.raises(UserError):
        load_ranking(path).check_matches(make_inventory(), FINGERPRINT, "--ranking x")
