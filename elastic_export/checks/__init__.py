"""Checks: the one output comparison with its stated bounds, and ``verify`` (every artifact of a directory re-checked)."""
