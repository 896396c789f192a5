"""The ``elastic-export`` command line."""

from elastic_export.cli.main import main  # noqa: F401
