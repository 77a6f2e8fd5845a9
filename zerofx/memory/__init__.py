"""Memory: bytes measured at run time (`tracking`), and offsets planned ahead of time for buffers whose lifetimes
are known (`planner`, with its CSV format in `csvfile` and a command line in ``python -m zerofx.memory``)."""

from zerofx.memory.csvfile import read_csv, write_csv
from zerofx.memory.planner import DEFAULT_HEURISTICS, HEURISTICS, Block, Plan, plan
from zerofx.memory.tracking import LiveStorageTracker, StepProbe, storage_bytes

__all__ = ["LiveStorageTracker", "StepProbe", "storage_bytes", "Block", "Plan", "plan", "HEURISTICS",
           "DEFAULT_HEURISTICS", "read_csv", "write_csv"]
