"""Admin resize policies and ``decide``: pure, no I/O."""
from .decide import (
    Decision,
    Notice,
    Pause,
    Release,
    RequestGrow,
    Resize,
    Snapshot,
    decide,
    format_devices,
)
from .rules import (
    FIELDS,
    EffectivePolicy,
    PolicyError,
    ResizePolicy,
    Scope,
    effective,
    parse_assignments,
)

__all__ = ["Decision", "EffectivePolicy", "FIELDS", "Notice", "Pause", "PolicyError",
    "Release", "RequestGrow", "Resize", "ResizePolicy", "Scope", "Snapshot", "decide",
    "effective", "format_devices", "parse_assignments"]
