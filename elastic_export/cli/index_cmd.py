"""``elastic-export index DIR CORPUS``: a dense FAISS index of a corpus under ``DIR/index/``."""

from __future__ import annotations

import click


@click.command("index", short_help="Embed a corpus with DIR's dense model into a FAISS index (DIR/index/).")
@click.argument("directory", metavar="DIR")
@click.argument("corpus", metavar="CORPUS")
@click.option("--id-field", default="id", show_default=True, help="JSONL: the field holding each document's id.")
@click.option("--text-field", default="text", show_default=True, help="JSONL: the field holding each document's text.")
@click.option("--hnsw", is_flag=True, default=False, help="An HNSW index (approximate, for large corpora) instead of exact.")
@click.option("--batch-size", type=int, default=64, show_default=True, help="Documents per onnxruntime run.")
@click.option("--overwrite", is_flag=True, default=False, help="Replace an existing DIR/index/.")
def index_cmd(directory: str, corpus: str, id_field: str, text_field: str, hnsw: bool, batch_size: int,
              overwrite: bool) -> None:
    """Embed CORPUS (.txt: one document per line, ids = line numbers; .jsonl: objects with an id and a
    text field) with DIR's dense model and write a FAISS index of inner products of normalised
    embeddings (exact unless --hnsw), the ids and the documents under DIR/index/, atomically;
    record it in DIR's manifest. `serve` searches it with queries encoded at the budget the load allows."""
    from elastic_export.cli.options import echo_err
    from elastic_export.index.build import build_index

    entry = build_index(directory, corpus, id_field=id_field, text_field=text_field, hnsw=hnsw, batch_size=batch_size,
                        overwrite=overwrite, echo=echo_err)
    click.echo(f"indexed {entry['count']} documents ({entry['dims']} dims, {entry['kind']}) in "
               f"{directory}/{entry['dir']}/")
