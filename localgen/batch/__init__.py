"""`localgen batch`: JSONL jobs in (native or OpenAI Batch API lines), JSONL results out, resumable.

Light to import (no torch): the engine is passed in by the caller.
"""

from localgen.batch.formats import Job, LineError, parse_line, parse_lines
from localgen.batch.jsonl_io import JsonlWriter, OutputState, iter_input_lines, scan_output
from localgen.batch.runner import BatchInterrupted, BatchProgress, BatchSummary, run_batch

__all__ = [
    "BatchInterrupted",
    "BatchProgress",
    "BatchSummary",
    "Job",
    "JsonlWriter",
    "LineError",
    "OutputState",
    "iter_input_lines",
    "parse_line",
    "parse_lines",
    "run_batch",
    "scan_output",
]
