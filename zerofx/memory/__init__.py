"""Memory: bytes measured at run time (`tracking`) and offsets planned ahead of time for buffers of known
lifetimes (`planner`)."""

from zerofx.memory.tracking import LiveStorageTracker, StepProbe, storage_bytes

__all__ = ["LiveStorageTracker", "StepProbe", "storage_bytes"]
