"""``elastic-export``: the command line (click).

``elastic-export [OPTIONS]`` runs the whole pipeline; subcommands run single stages.
Exit codes: 0 success, 2 bad input (one line on stderr, no traceback), 130 interrupted.

This module holds the root group (the main job) and the entry point :func:`main`; the commands live
by group: :mod:`~elastic_export.cli.job` (``run``, ``export``, ``inspect``, ``rank``),
:mod:`~elastic_export.cli.measure` (``verify``, ``eval``, ``bench``, ``report``),
:mod:`~elastic_export.cli.deploy` (``build``, ``serve``), :mod:`~elastic_export.cli.export_st`
(``export-st``), their shared option groups in :mod:`~elastic_export.cli.options`.
"""

from __future__ import annotations

import sys

import click

from elastic_export.cli import deploy, export_st, index_cmd, job, measure
from elastic_export.cli.options import export_options, model_options, ranking_options
from elastic_export.core.errors import UserError


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@model_options
@ranking_options
@export_options
@click.version_option(package_name="elastic-export")
@click.pass_context
def cli(ctx, **kw):
    """Make a transformer encoder elastic: rank every MLP neuron and attention head on one FLOP
    scale, then write one sliced ONNX model per compute budget.

    Without a subcommand, runs the whole pipeline on --model (default: all-MiniLM-L6-v2).
    """
    if ctx.invoked_subcommand is None:
        job.run_main_job(**kw)


for command in (job.run_cmd, job.export_cmd, job.inspect_cmd, job.rank_cmd, measure.eval_cmd, measure.verify_cmd,
                measure.bench_cmd, measure.report_cmd, export_st.export_st_cmd, deploy.build_cmd, deploy.serve_cmd,
                index_cmd.index_cmd):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: maps bad input to one line and exit code 2 (a failed check: exit 1)."""
    from elastic_export.core.errors import CheckFailed, Interrupted

    try:
        cli.main(args=argv, prog_name="elastic-export", standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except CheckFailed as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except click.exceptions.NoArgsIsHelpError as e:  # pragma: no cover - click >= 8.2
        click.echo(e.ctx.get_help() if e.ctx else str(e))
        sys.exit(0)
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt) as e:
        cause = e.__cause__ if isinstance(e, click.Abort) else e  # click wraps Ctrl-C in Abort
        click.echo("interrupted" + (f"; {cause}" if isinstance(cause, Interrupted) else ""), err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    sys.exit(0)
