"""Graph passes (onnx-graphsurgeon) that turn the dense rank-permuted ONNX into one budget's ONNX,
or into one elastic ONNX whose ``budget_index`` input selects the budget (:mod:`.elastic_graph`).

Each pass is one small unit with a name and a docstring of what it guarantees; :func:`run_passes`
runs a list of them and verifies the graph in memory after each one (every input defined, sortable,
known ops, no 0-sized tensor), and with ``onnx.checker`` at the end unless the caller opts out.
Passes read the unit map the dense export stored in the model (``elastic_export.units``) and the
per-layer unit counts of a budget; they never go back to torch.
"""

from elastic_export.passes.base import (  # noqa: F401
    BUDGET_PIPELINE,
    PASSES,
    BudgetSlicer,
    Pass,
    PassContext,
    apply_passes,
    register_pass,
    run_passes,
    slice_model,
)

# isort: split
# registration side effects: each module registers its passes
from elastic_export.passes import cleanup, drop_empty, head_reshapes, slice_weights  # noqa: F401,E402
from elastic_export.passes.elastic_graph import (  # noqa: F401,E402
    ELASTIC_PIPELINE,
    build_elastic_model,
    dense_counts,
    get_elastic,
)
