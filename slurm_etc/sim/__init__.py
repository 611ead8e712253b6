"""Trace-driven cluster simulator: the compact allocator against a naive one."""
from .engine import ALLOCATORS, SimResult, simulate
from .synthetic import synthetic_trace
from .trace import Trace, TraceError, load_trace, parse_trace

__all__ = ["ALLOCATORS", "SimResult", "Trace", "TraceError", "load_trace", "parse_trace",
           "simulate", "synthetic_trace"]
