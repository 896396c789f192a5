"""05: one page that shows what the elastic model keeps and how fast each budget runs.

    python examples/05_report.py DIR

Writes ``DIR/report.html`` (self-contained: open it in any browser, no network needed). Run
``elastic-export eval DIR`` (it writes ``DIR/eval.json``) and ``elastic-export bench DIR`` first to
replace the main job's quick eval in the quality, speed and recommendation sections.
"""

import argparse
from pathlib import Path

from elastic_export.report.page import write_report

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("directory", type=Path)
args = ap.parse_args()

print(write_report(args.directory))
