"""elastic-export: one ranking of every MLP neuron and attention head, sliced into one model per budget."""

__version__ = "0.1.0"

from elastic_export.core.errors import UserError  # noqa: E402,F401
