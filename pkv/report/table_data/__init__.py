"""From result files to table rows: every number a rendered table shows is computed here.

The templates in paper_tables/ own the layout; this package owns the arithmetic (ratios within one
run, mean and sample standard deviation over seeds) and says, for every cell it cannot fill, why.
Cells are typed values (Num, MeanStd, Sci, Text, Missing) so that one set of rows renders to both
Markdown and LaTeX; pkv.report.tables formats them.

    cells        typed cells, numbered footnotes, mean and sample std
    inputs       a table's header facts (device, commit, performance flag, inputs not run)
    loading      result trees on disk, the calibration seed and the held-out seeds
    labels       what the paper reports and the names the tables print
    comparisons  subject against baseline within one run_id, ratios over seeds (none against a
                 baseline the float64 reference found wrong)
    isolated     Table 1, isolated single-request kernels
    trace_runs   Tables 2, 3 and 4, serving trace runs and their counters
    ncu_profile  Table 5, Nsight Compute counters
    ablations    Tables 7 and 8, the split-count and GQA sweeps

Table 6, the evidence map, is pkv.report.evidence. Callers import from this package; the names
below are re-exported from the modules that define them.
"""

from pkv.report.table_data.ablations import SPLIT_SWEEPS, table7, table8
from pkv.report.table_data.cells import (
    BaselineWrong,
    Cell,
    MeanStd,
    Missing,
    NotApplicable,
    Notes,
    Num,
    Sci,
    Text,
    mean_std,
)
from pkv.report.table_data.comparisons import (
    Comparison,
    ServingAggregate,
    WrongBaseline,
    aggregate_serving,
    compare_in_run,
    metric,
    pick_subject,
    ratio,
    unfilled_cell,
    wrong_baseline,
)
from pkv.report.table_data.inputs import Inputs, is_performance_record
from pkv.report.table_data.isolated import table1
from pkv.report.table_data.labels import (
    COUNTER_TRACE,
    ENGINE_LABELS,
    GQA_TRACE,
    ISOLATED_METHOD_ORDER,
    METHOD_LABELS,
    PAPER_ISOLATED_CONTEXTS,
    PAPER_MLP_TRACES,
    PAPER_SERVING_TRACES,
    ROUTE_LABELS,
    STAND_INS,
    context_label,
    paper_then_found,
    route_label,
    seeds_text,
    selected_route,
    trace_label,
)
from pkv.report.table_data.loading import (
    CALIBRATION_SEED,
    Loaded,
    held_out,
    load_ablation,
    load_seed_dir,
    load_trace_tree,
)
from pkv.report.table_data.ncu_profile import NCU_COLUMNS, table5
from pkv.report.table_data.trace_runs import COUNTER_COLUMNS, RAGGEDNESS_LABELS, table2, table3, table4

__all__ = [
    "BaselineWrong", "WrongBaseline", "unfilled_cell", "wrong_baseline",
    "CALIBRATION_SEED", "COUNTER_COLUMNS", "COUNTER_TRACE", "Cell", "Comparison", "ENGINE_LABELS",
    "GQA_TRACE", "ISOLATED_METHOD_ORDER", "Inputs", "Loaded", "METHOD_LABELS", "MeanStd", "Missing",
    "NCU_COLUMNS", "NotApplicable", "Notes", "Num", "PAPER_ISOLATED_CONTEXTS", "PAPER_MLP_TRACES",
    "PAPER_SERVING_TRACES", "RAGGEDNESS_LABELS", "ROUTE_LABELS", "SPLIT_SWEEPS", "STAND_INS", "Sci", "ServingAggregate",
    "Text", "aggregate_serving", "compare_in_run", "context_label", "held_out", "is_performance_record",
    "load_ablation", "load_seed_dir", "load_trace_tree", "mean_std", "metric", "paper_then_found",
    "pick_subject", "ratio", "route_label", "seeds_text", "selected_route", "table1", "table2", "table3",
    "table4", "table5", "table7", "table8", "trace_label",
]
