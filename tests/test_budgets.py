"""``--budgets`` parsing (DESIGN.md §4: ``0.1..0.6``, ``0.1..0.6:0.05``, ``0.1,0.25,0.5``) and budget tags."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from elastic_export.core.budgets import budget_tag, parse_budgets
from elastic_export.core.errors import UserError

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- the three syntaxes --------------------------------------------------------------------------
def test_range_default_step_is_0_1():
    assert parse_budgets("0.1..0.6") == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]


def test_range_with_step():
    got = parse_budgets("0.1..0.6:0.05")
    assert len(got) == 11
    assert got == [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6]


def test_comma_list_is_sorted():
    assert parse_budgets("0.5,0.1,0.25") == [0.1, 0.25, 0.5]


@pytest.mark.parametrize(
    "spec, want",
    [
        ("0.5", [0.5]),
        ("0", [0.0]),
        ("0.0..0.0", [0.0]),
        ("0.3..0.3", [0.3]),
        ("0..0.9", [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]),
        ("0.05..0.70:0.05", [round(0.05 * i, 6) for i in range(1, 15)]),  # the paper's 14 targets
        ("0.1..0.65", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),  # the end need not be on the grid
        ("  0.1 .. 0.3  ", [0.1, 0.2, 0.3]),
        (" 0.5 , 0.1 ,0.25 ", [0.1, 0.25, 0.5]),
        (".5,.25", [0.25, 0.5]),
        ("5e-1,2.5e-1", [0.25, 0.5]),
        ("0.999", [0.999]),
    ],
)
def test_valid_specs(spec, want):
    assert parse_budgets(spec) == want


def test_result_is_rounded_to_6_decimals():
    # 0.1 + 2 * 0.1 is 0.30000000000000004 in binary floating point
    assert parse_budgets("0.1..0.3") == [0.1, 0.2, 0.3]
    assert parse_budgets("0.0..0.3:0.1")[3] == 0.3


# --- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        # empty
        "", "   ", None,
        # malformed
        "abc", "0.1..", "..0.6", "0.1...0.6", "0.1..0.6:", "0.1..0.6:0.1:0.1", "0.1..0.6..0.8",
        "0.1;0.2", "0.1 0.2", "0.1,,0.2", "0.1,", ",0.1", "0,1..0,6", "1/2", "0x0.8", "half",
        "-0.1..0.5", "0.1..-0.5",
        # range end below start, non-positive step
        "0.7..0.2", "0.1..0.6:0", "0.1..0.6:0.0", "0.1..0.6:-0.1",
        # too many budgets
        "0..0.9:0.0001",
        # duplicates (also after rounding to 6 decimals)
        "0.1,0.1", "0.5,0.25,0.5", "0.1,0.10", "0.1234567,0.1234568",
        # out of range
        "1.5", "1", "1.0", "0.5..1.0", "0.5..1.5", "0.1,1", "-0.1", "0.1,-0.2", "2..3",
        # non-finite
        "nan", "inf", "-inf", "NaN,0.1", "0.1,infinity", "1e400", "0..inf", "nan..0.5",
    ],
)
def test_bad_specs_raise_user_error(spec):
    with pytest.raises(UserError) as info:
        parse_budgets(spec)
    msg = str(info.value)
    assert msg and "\n" not in msg
    assert "budgets" in msg


def test_messages_name_the_problem():
    with pytest.raises(UserError, match="empty"):
        parse_budgets("")
    with pytest.raises(UserError, match="duplicate"):
        parse_budgets("0.1,0.1")
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        parse_budgets("1.5")
    with pytest.raises(UserError, match="below its start"):
        parse_budgets("0.7..0.2")
    with pytest.raises(UserError, match="step"):
        parse_budgets("0.1..0.6:0")
    with pytest.raises(UserError, match="step"):
        parse_budgets("0.1..0.6:0.0000001")
    with pytest.raises(UserError, match="not a number"):
        parse_budgets("abc")
    with pytest.raises(UserError, match="finite"):
        parse_budgets("nan")


@pytest.mark.parametrize(
    "spec",
    [
        # used to escape as OverflowError / ValueError from math.floor (a traceback in the CLI)
        "0..1e308", "0..0.5:1e-320", "1e400..1e400", "0..1e400", "0.1..0.5:1e400",
        # used to give duplicate budgets after rounding to 6 decimals
        "0..0.00001:0.0000001", "5e-07..2.05e-05:1e-6", "1.5e-06..2.15e-05:1e-6", "0.1000005..0.10003:0.000001",
    ],
)
def test_overflowing_or_tiny_step_range_raises_user_error(spec):
    with pytest.raises(UserError):
        parse_budgets(spec)


@PROPERTY
@given(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True),
       st.floats(0, 1, exclude_min=True, allow_subnormal=True))
def test_range_never_gives_duplicates(a, b, step):
    lo, hi = sorted((a, b))
    try:
        got = parse_budgets(f"{lo!r}..{hi!r}:{step!r}")
    except UserError:
        return
    assert len(got) == len(set(got)), got


# --- budget_tag ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "s, tag",
    [(0.0, "s000"), (0, "s000"), (0.05, "s005"), (0.1, "s010"), (0.125, "s0125"), (0.25, "s025"),
     (0.5, "s050"), (0.6, "s060"), (0.001, "s0001"), (0.999999, "s0999999")],
)
def test_budget_tag(s, tag):
    assert budget_tag(s) == tag


def test_tags_of_parsed_budgets_are_unique():
    budgets = parse_budgets("0.0..0.95:0.005")
    tags = [budget_tag(s) for s in budgets]
    assert len(set(tags)) == len(tags)


# --- properties ----------------------------------------------------------------------------------
@PROPERTY
@given(st.lists(st.integers(0, 999), min_size=1, max_size=30, unique=True))
def test_comma_list_round_trips(millis):
    values = [round(m / 1000, 3) for m in millis]
    spec = ",".join(repr(v) for v in values)
    assert parse_budgets(spec) == sorted(values)


@PROPERTY
@given(st.lists(st.floats(0, 1, exclude_max=True).map(lambda x: round(x, 3)), min_size=1, max_size=30,
                unique=True))
def test_comma_list_of_rounded_floats_round_trips(values):
    assume(all(v < 1.0 for v in values))  # rounding 0.9996 gives 1.0
    spec = ",".join(str(v) for v in values)
    assert parse_budgets(spec) == sorted(values)


@PROPERTY
@given(st.text(max_size=40))
def test_arbitrary_text_only_raises_user_error(spec):
    try:
        got = parse_budgets(spec)
    except UserError as e:
        assert str(e)
        return
    assert got == sorted(got)
    assert all(0.0 <= v < 1.0 for v in got)


_BUDGET_ALPHABET = st.sampled_from(list("0123456789.,:eE+- ") + ["..", "nan", "inf"])


@PROPERTY
@given(st.lists(_BUDGET_ALPHABET, max_size=16).map("".join))
def test_budget_like_text_only_raises_user_error(spec):
    try:
        got = parse_budgets(spec)
    except UserError:
        return
    assert got == sorted(got)
    assert len(got) == len(set(got))
    assert all(0.0 <= v < 1.0 for v in got)


@PROPERTY
@given(st.integers(0, 999), st.integers(0, 999), st.integers(1, 1000), st.booleans())
def test_range_gives_ascending_values_within_bounds(a, b, step_millis, explicit_step):
    lo, hi = sorted((a / 1000, b / 1000))
    step = step_millis / 1000
    spec = f"{lo}..{hi}:{step}" if explicit_step else f"{lo}..{hi}"
    if not explicit_step:
        step = 0.1
    got = parse_budgets(spec)
    assert got, spec
    assert got[0] == lo
    assert all(x < y for x, y in zip(got, got[1:])), got
    assert all(lo <= v <= hi for v in got), got
    # the grid is filled: the next step would pass hi
    assert got[-1] + step > hi - 1e-9
    assert len(got) == math.floor((hi - lo) / step + 1e-9) + 1
    assert all(abs((y - x) - step) < 1e-6 for x, y in zip(got, got[1:]))


@PROPERTY
@given(
    st.floats(0, 1, exclude_max=True, allow_subnormal=False),
    st.floats(0, 1, exclude_max=True, allow_subnormal=False),
    st.floats(1e-6, 1, allow_subnormal=False),
)
def test_range_of_arbitrary_floats_ascending_within_bounds(a, b, step):
    lo, hi = sorted((a, b))
    spec = f"{lo!r}..{hi!r}:{step!r}"
    try:
        got = parse_budgets(spec)
    except UserError as e:
        # a step too small / too many budgets, or the end rounds (6 decimals) to 1.0: out of range
        msg = str(e)
        assert "step" in msg or "too many" in msg or (round(hi, 6) >= 1.0 and "[0, 1)" in msg), msg
        return
    assert got
    assert all(x < y for x, y in zip(got, got[1:])), got
    # values are rounded to 6 decimals
    assert all(lo - 5e-7 <= v <= hi + 5e-7 for v in got), (lo, hi, got)


@PROPERTY
@given(st.integers(0, 999_999))
def test_budget_tag_encodes_the_value(micros):
    s = round(micros / 1e6, 6)
    tag = budget_tag(s)
    assert tag.startswith("s0") and tag[1:].isdigit()
    assert float("0." + tag[2:]) == s


@PROPERTY
@given(st.integers(0, 999_999), st.integers(0, 999_999))
def test_budget_tag_is_injective(m1, m2):
    assume(m1 != m2)
    assert budget_tag(round(m1 / 1e6, 6)) != budget_tag(round(m2 / 1e6, 6))


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=24), st.text(alphabet="0123456789.,:-e+ ", max_size=24)))
def test_any_string_parses_cleanly_or_raises_user_error(spec):
    """The parser never raises anything but UserError, and what it accepts is sorted, unique, in [0, 1)."""
    try:
        values = parse_budgets(spec)
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert list(values) == sorted(set(values)) and values
    assert all(isinstance(v, float) and 0 <= v < 1 and math.isfinite(v) for v in values)
