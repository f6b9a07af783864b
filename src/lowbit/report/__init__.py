"""Compare schemes against float: metrics per scheme, SQNR per layer, report.json and a PNG."""

from lowbit.report.compare import DEFAULT_SCHEMES, CompareOptions, machine_info, run_compare
from lowbit.report.layers import estimated_size_bytes, layer_sqnr, sqnr_db
from lowbit.report.writer import plot_report, report_json, write_report

__all__ = ["DEFAULT_SCHEMES", "CompareOptions", "run_compare", "machine_info", "estimated_size_bytes",
           "layer_sqnr", "sqnr_db", "plot_report", "report_json", "write_report"]
