"""``export-st``: an artifact directory's budgets as sentence-transformers folders."""

from __future__ import annotations

import click


@click.command("export-st")
@click.argument("directory", metavar="DIR")
@click.option("--out", required=True, type=click.Path(), help="New directory: one folder per budget and precision.")
@click.option("--budgets", default=None, help="Sparsities of DIR to write, e.g. 0.3,0.6 [default: all].")
@click.option("--precision", default=None, metavar="LIST",
              help="Comma list of fp32, fp16, int8 [default: every precision DIR was exported with].")
@click.option("--model", default=None, metavar="PATH",
              help="The model directory DIR was made from (tokenizer, config, pooling modules) [default: the "
                   "manifest's model.source].")
def export_st_cmd(directory, out, budgets, precision, model):
    """Write the budgets of a text encoder's artifact DIR as sentence-transformers folders (OUT/s030-fp32, ...):
    the source model's tokenizer, config and Transformer / Pooling / Normalize modules, with the budget's ONNX
    as onnx/model.onnx, so that SentenceTransformer(folder, backend="onnx").encode(texts) serves the budget."""
    from elastic_export.serving.st_layout import export_st

    export_st(directory, out, budgets=budgets, precisions=precision, model=model, echo=click.echo)
