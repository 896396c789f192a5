"""A held-out retrieval set assembled from text shipped with the interpreter.

Calibration (``elastic_export.data.calibration``) reads the Python *language reference*
(``pydoc_data.topics``); this module reads something else: the **docstrings of standard-library
modules**. Every public function, class and method defined in one of :data:`MODULES` gives at most
one pair:

* ``query``: the docstring's summary, i.e. the first sentence of its first paragraph;
* ``doc``: the rest of the docstring (whitespace normalised).

A pair is kept when the query has at least :data:`MIN_QUERY_WORDS` words, the doc at least
:data:`MIN_DOC_WORDS`, the query does not appear verbatim in the doc, and neither side appears
verbatim in the calibration text. Pairs are deduplicated by query and by doc (first one wins, in
module / name order), then ``n`` of them are drawn with ``random.Random(seed)`` and returned in
source order. Nothing depends on hash order; objects that other packages patch into a module are
skipped (only what a module defines itself counts), and so are run-time hooks such as
``threading.excepthook`` that test runners swap. The output is therefore identical across runs on
the same Python version (docstrings change between Python versions, and a module missing from a
build, e.g. ``sqlite3``, is skipped). A package that *replaces* a standard-library function in
place would drop that one pair (importing torch, transformers, timm, onnxruntime and matplotlib
changes nothing).

Command line::

    python -m elastic_export.data.retrieval_data --n 1000 --out pairs.jsonl
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import random
import re
import sys
import warnings
from pathlib import Path

MIN_QUERY_WORDS = 4
MIN_DOC_WORDS = 15
MAX_DOC_WORDS = 256  # the encoders truncate long before this; keeps the JSONL small

#: Standard-library modules that import cleanly, quickly and without side effects (sorted).
MODULES: tuple[str, ...] = tuple(sorted([
    "abc", "argparse", "array", "ast", "asyncio.base_events", "asyncio.events", "asyncio.futures",
    "asyncio.locks", "asyncio.protocols", "asyncio.queues", "asyncio.streams", "asyncio.subprocess",
    "asyncio.tasks", "asyncio.transports", "base64", "bdb", "binascii", "bisect", "bz2", "calendar",
    "cmath", "cmd", "code", "codecs", "codeop", "collections", "collections.abc", "colorsys",
    "compileall", "concurrent.futures", "concurrent.futures.process", "concurrent.futures.thread",
    "configparser", "contextlib", "contextvars", "copy", "copyreg", "cProfile", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "doctest", "email.charset", "email.contentmanager",
    "email.feedparser", "email.generator", "email.header", "email.headerregistry", "email.iterators",
    "email.message", "email.parser", "email.policy", "email.utils", "enum", "filecmp", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "gc", "getopt", "gettext", "glob", "graphlib",
    "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.client", "http.cookiejar",
    "http.cookies", "http.server", "imaplib", "importlib", "importlib.abc", "importlib.metadata",
    "importlib.util", "inspect", "io", "ipaddress", "itertools", "json", "json.decoder",
    "json.encoder", "keyword", "linecache", "locale", "logging", "logging.config", "logging.handlers",
    "lzma", "mailbox", "marshal", "math", "mimetypes", "modulefinder", "multiprocessing.connection",
    "multiprocessing.managers", "multiprocessing.pool", "multiprocessing.process",
    "multiprocessing.queues", "multiprocessing.shared_memory", "multiprocessing.synchronize", "netrc",
    "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil",
    "platform", "plistlib", "poplib", "posixpath", "pprint", "profile", "pstats", "py_compile",
    "queue", "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets", "select", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl",
    "statistics", "string", "stringprep", "struct", "subprocess", "symtable", "sysconfig",
    "tabnanny", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize",
    "trace", "traceback", "tracemalloc", "types", "typing", "unicodedata", "unittest.case",
    "unittest.loader", "unittest.mock", "unittest.result", "unittest.runner", "unittest.suite",
    "urllib.error", "urllib.parse", "urllib.request", "urllib.robotparser", "uuid", "warnings",
    "wave", "weakref", "wsgiref.handlers", "wsgiref.headers", "wsgiref.simple_server",
    "wsgiref.util", "wsgiref.validate", "xml.dom.minidom", "xml.dom.pulldom", "xml.etree.ElementTree",
    "xml.sax.handler", "xml.sax.saxutils", "xml.sax.xmlreader", "xmlrpc.client", "xmlrpc.server",
    "zipfile", "zipimport", "zlib", "zoneinfo",
]))

#: Objects implemented in a private accelerator module count for the public module that exports them.
_ALIASES = {"os": ("posix", "nt"), "io": ("_io",), "collections": ("_collections",),
            "functools": ("_functools",), "heapq": ("_heapq",), "bisect": ("_bisect",), "pickle": ("_pickle",),
            "json.decoder": ("_json",), "csv": ("_csv",), "struct": ("_struct",), "socket": ("_socket",),
            "sqlite3": ("sqlite3.dbapi2", "_sqlite3"), "ssl": ("_ssl",), "operator": ("_operator",),
            "random": ("_random",), "hashlib": ("_hashlib",), "contextvars": ("_contextvars",),
            "datetime": ("_datetime",), "decimal": ("_decimal",), "zoneinfo": ("zoneinfo._zoneinfo",),
            "queue": ("_queue",), "weakref": ("_weakref", "_weakrefset"), "codecs": ("_codecs",),
            "locale": ("_locale",), "warnings": ("_warnings",), "threading": ("_thread",),
            "asyncio.futures": ("_asyncio",), "bz2": ("_bz2",), "lzma": ("_lzma",)}

#: Module attributes that are meant to be replaced at run time; what they hold depends on the process.
_REPLACEABLE = {"showwarning", "formatwarning"}

_SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*((-->|->|=>).*)?$")  # "name(a, b) -> int" lines of C docstrings
_CODE_LIKE = re.compile(r"^[\w.]+\(|-->|->|=>|>>>")  # summaries that are signatures or code, not prose
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


def _norm(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=1)
def _calibration_text() -> str:
    """The calibration text (``pydoc_data.topics``), whitespace normalised, for the disjointness check."""
    from pydoc_data.topics import topics

    return _norm(" ".join(topics[k] for k in sorted(topics)))


def _split_docstring(doc: str) -> tuple[str, str] | None:
    """(summary sentence, rest) of a docstring, or None when it has no usable summary."""
    lines = inspect.cleandoc(doc).splitlines()
    while lines and (not lines[0].strip() or _SIGNATURE.match(lines[0].strip())):
        lines.pop(0)  # leading signature lines ("sqrt(x) -> float") and blanks
    if not lines:
        return None
    paras = re.split(r"\n\s*\n", "\n".join(lines))
    first = _norm(paras[0])
    parts = _SENTENCE_END.split(first, maxsplit=1)
    query = parts[0].strip()
    rest_of_first = parts[1] if len(parts) > 1 else ""
    rest = _norm(" ".join([rest_of_first] + paras[1:]))
    return query, rest


def _members(module) -> list[tuple[str, object]]:
    """(qualified name, object) of public functions, classes and methods defined in ``module``."""
    out = []
    modname = module.__name__
    homes = {modname, *_ALIASES.get(modname, ())}
    for name in sorted(vars(module)):
        if name.startswith("_") or name.endswith("hook") or name in _REPLACEABLE:
            continue  # hooks that test runners and frameworks swap at run time (threading.excepthook)
        obj = vars(module)[name]
        if getattr(obj, "__module__", None) not in homes:
            continue  # re-exports are counted once, where they are defined
        if inspect.isclass(obj):
            out.append((f"{modname}.{name}", obj))
            for attr in sorted(vars(obj)):
                if attr.startswith("_"):
                    continue
                member = vars(obj)[attr]
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if not (inspect.isfunction(member) or inspect.ismethoddescriptor(member) or isinstance(member, property)):
                    continue
                home = getattr(member.fget if isinstance(member, property) else member, "__module__", None)
                if home is not None and home not in homes:
                    continue  # patched in by another package (e.g. transformers adds logging methods)
                out.append((f"{modname}.{name}.{attr}", member))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            out.append((f"{modname}.{name}", obj))
    return out


def _import(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # not built into this interpreter (sqlite3, lzma, ...) or removed
            return None


def candidate_pairs() -> list[dict]:
    """Every usable pair, deduplicated, in module / name order (each with its ``source`` name)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. typing.io's DeprecationWarning on attribute access
        return _candidate_pairs()


def _candidate_pairs() -> list[dict]:
    calib = _calibration_text()
    seen_q: set[str] = set()
    seen_d: set[str] = set()
    out = []
    for modname in MODULES:
        module = _import(modname)
        if module is None:
            continue
        for qualname, obj in _members(module):
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or not doc.strip():
                continue
            split = _split_docstring(doc)
            if split is None:
                continue
            query, rest = split
            if _CODE_LIKE.search(query):
                continue
            words = rest.split()
            if len(query.split()) < MIN_QUERY_WORDS or len(words) < MIN_DOC_WORDS:
                continue
            rest = " ".join(words[:MAX_DOC_WORDS])
            if query.lower() in rest.lower():
                continue
            if query in calib or rest in calib:
                continue  # must not overlap the calibration text
            qk, dk = query.lower(), rest.lower()
            if qk in seen_q or dk in seen_d:
                continue
            seen_q.add(qk)
            seen_d.add(dk)
            out.append({"query": query, "doc": rest, "source": qualname})
    return out


def heldout_pairs(n: int = 1000, seed: int = 0) -> list[dict]:
    """``n`` held-out {"query", "doc"} pairs from standard-library docstrings (deterministic).

    Args:
        n: how many pairs (fewer when fewer exist; there are about 2,000 on CPython 3.11).
        seed: which ``n`` are drawn when more exist.

    Returns:
        A list of ``{"query": str, "doc": str}``, doc ``i`` relevant to query ``i``, in source order.
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    pool = candidate_pairs()
    if len(pool) > n:
        keep = sorted(random.Random(seed).sample(range(len(pool)), n))
        pool = [pool[i] for i in keep]
    return [{"query": p["query"], "doc": p["doc"]} for p in pool]


def cut_to_tokens(tokenizer, text: str, tokens: int) -> str:
    """``text`` cut after its last whole word that fits in ``tokens`` tokens of ``tokenizer`` (a
    ``tokenizers.Tokenizer``, special tokens included: one after the cut); unchanged when it fits."""
    e = tokenizer.encode(text)
    last = {w: i for i, w in enumerate(e.word_ids) if w is not None}  # each word's last token
    keep = [i for _, i in sorted(last.items()) if i + 2 <= tokens]
    return text[:e.offsets[keep[-1]][1]] if keep else text


def fit_pairs(pairs: list[dict], tokenizer, tokens: int) -> list[dict]:
    """``pairs`` with query and doc cut to at most ``tokens`` tokens (:func:`cut_to_tokens`), so that every
    encoder that truncates at ``tokens`` or later sees the same text (``elastic-export eval`` truncates at
    the manifest's N, a served model at its own context); a pair whose cut query or doc repeats an earlier
    one (case-insensitively) is dropped."""
    seen: set[str] = set()
    out = []
    for p in pairs:
        q, d = cut_to_tokens(tokenizer, p["query"], tokens), cut_to_tokens(tokenizer, p["doc"], tokens)
        if q.lower() not in seen and d.lower() not in seen:
            seen |= {q.lower(), d.lower()}
            out.append({"query": q, "doc": d})
    return out


def write_pairs_jsonl(path: str | Path, pairs: list[dict]) -> Path:
    """Write one ``{"query", "doc"}`` JSON object per line (UTF-8), atomically."""
    from elastic_export.core.fileio import atomic_write

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for p in pairs:
                f.write(json.dumps({"query": p["query"], "doc": p["doc"]}, ensure_ascii=False) + "\n")

    return atomic_write(path, write)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m elastic_export.data.retrieval_data",
        description="Write a held-out retrieval set (standard-library docstrings) as JSONL.",
    )
    ap.add_argument("--n", type=int, default=1000, help="number of pairs (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="which pairs are drawn (default 0)")
    ap.add_argument("--out", default="pairs.jsonl", help="output file (default pairs.jsonl)")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n must be positive, got {args.n}")
    pairs = heldout_pairs(args.n, args.seed)
    write_pairs_jsonl(args.out, pairs)
    print(f"wrote {len(pairs)} pairs to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
