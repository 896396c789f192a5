"""A dense index of a corpus, built once with the directory's dense model and searched with queries
encoded at any budget (``elastic-export index DIR CORPUS``; ``POST /v1/search`` on the HTTP API).

:mod:`~elastic_export.index.corpus` reads and checks a corpus, :mod:`~elastic_export.index.build`
embeds it and writes ``DIR/index/`` atomically, :mod:`~elastic_export.index.store` loads and searches it.
FAISS is imported only by the functions that need it, so this package stays light.
"""

INDEX_DIR = "index"
"""The index folder inside an artifact directory (the manifest's ``index.dir``)."""
INDEX_FILE = "index.faiss"
IDS_FILE = "ids.json"
DOCS_FILE = "docs.jsonl"
BUILD_FILE = "build.json"
"""The build's own entry (the manifest's ``index`` entry, with its ``build`` id): the folder describes itself."""
METRIC = "inner_product"
"""Scores are inner products of L2-normalised embeddings (cosine similarity)."""
