"""A padded batch run as groups of similar length (``elastic_export.serving.length_groups``): which rows go
together, and that the grouped run answers what the whole batch does, on a real onnxruntime session."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_export.serving.length_groups import MIN_ROWS, length_groups, padded_tokens, row_outputs, run_grouped


def _flat(groups):
    return sorted(i for g in groups for i in g)


def test_rows_of_one_length_stay_one_group_in_order():
    assert length_groups([12] * 40) == [list(range(40))]


def test_too_few_rows_to_cut_stay_one_group():
    lengths = [5] * (MIN_ROWS - 1) + [30] * MIN_ROWS
    assert length_groups(lengths) == [list(range(len(lengths)))]


def test_short_and_long_rows_go_apart_and_pad_less():
    rng = np.random.default_rng(0)
    lengths = rng.permutation([5] * 10 + [30] * 10).tolist()
    groups = length_groups(lengths)
    assert len(groups) == 2 and _flat(groups) == list(range(20))
    assert sorted({lengths[i] for i in g} for g in groups) == [{5}, {30}]
    assert sum(padded_tokens([lengths[i] for i in g]) for g in groups) < 0.6 * padded_tokens(lengths)


def test_a_cut_that_saves_little_is_not_made():
    lengths = [28] * 10 + [30] * 10  # cutting saves 10 x 2 tokens of 600: under MIN_SAVING
    assert length_groups(lengths) == [list(range(20))]


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_each_group_large_enough(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 200, int(rng.integers(1, 129))).tolist()
    groups = length_groups(lengths)
    assert _flat(groups) == list(range(len(lengths)))
    assert len(groups) == 1 or min(len(g) for g in groups) >= MIN_ROWS
    if len(groups) > 1:  # sorted by length: no group's rows are longer than the next group's shortest
        assert all(max(lengths[i] for i in a) <= min(lengths[i] for i in b) for a, b in zip(groups, groups[1:]))


def _padded(lengths, seed=0):
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids, mask = np.zeros((len(lengths), width), np.int64), np.zeros((len(lengths), width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = rng.integers(1000, 20000, n), 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def test_each_group_runs_trimmed_to_its_longest_row_and_rows_come_back_in_order():
    lengths = [5, 30] * 10
    feeds = _padded(lengths)
    shapes = []

    def run(names, part):
        shapes.append(part["input_ids"].shape)
        return [part["input_ids"][:, :1].astype(np.float32) * 2]  # one value per row: its first token, doubled

    (out,) = run_grouped(run, ["y"], feeds)
    assert sorted(shapes) == [(10, 5), (10, 30)]
    np.testing.assert_array_equal(out, feeds["input_ids"][:, :1] * 2)


def test_a_batch_asking_for_an_output_that_is_not_pooled_runs_whole():
    feeds, shapes = _padded([5, 30] * 10), []

    def run(names, part):
        shapes.append(part["input_ids"].shape)
        return [part["input_ids"][:, :1]]

    run_grouped(run, ["tokens"], feeds, pooled={"pooled"})
    assert shapes == [(20, 30)]
    run_grouped(run, ["pooled"], feeds, pooled={"pooled"})
    assert sorted(shapes[1:]) == [(10, 5), (10, 30)]


def test_row_outputs_are_the_outputs_without_a_token_axis():
    outputs = [{"name": "sentence_embedding", "dims": [384]}, {"name": "last_hidden_state", "dims": [-1, 384]}]
    assert row_outputs({"max_batch_size": 128, "output": outputs}) == {"sentence_embedding"}
    unbatched = [{"name": n, "dims": [-1, *t["dims"]]} for n, t in ((t["name"], t) for t in outputs)]
    assert row_outputs({"max_batch_size": 0, "output": unbatched}) == {"sentence_embedding"}


def test_feeds_without_a_mask_run_whole():
    calls = []
    out = run_grouped(lambda names, f: calls.append(f) or [f["x"]], ["y"], {"x": np.ones((20, 3))})
    assert len(calls) == 1 and out[0].shape == (20, 3)


def test_grouped_embeddings_match_the_whole_batch_on_onnxruntime(minilm_small):
    """The real MiniLM export's pooled output: the grouped run equals the padded whole batch (fp32)."""
    from elastic_export.core.manifest import Manifest
    from elastic_export.targets.onnxruntime import make_session

    m = Manifest.load(minilm_small)
    session = make_session(minilm_small / m.budgets[-1].onnx)
    lengths = np.random.default_rng(1).integers(5, 31, 24).tolist()
    feeds = _padded(lengths, seed=2)
    whole = session.run(["sentence_embedding"], feeds)[0]
    groups = length_groups(lengths)
    assert len(groups) > 1, "these lengths are meant to be cut"
    (grouped,) = run_grouped(session.run, ["sentence_embedding"], feeds)
    np.testing.assert_allclose(grouped, whole, rtol=0, atol=1e-5)
