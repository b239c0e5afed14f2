"""Request traces: synthetic generators and loaders for real production traces."""

from deltaserve.workloads.trace import Trace, TraceRequest

__all__ = ["Trace", "TraceRequest"]
