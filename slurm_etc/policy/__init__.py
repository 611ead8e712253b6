"""Admin resize policies and ``decide``: pure, no I/O."""
from .decide import (
    Decision,
    JobView,
    Notice,
    Pause,
    Release,
    RequestGrow,
    ResizeDecision,
    decide,
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
    "Release", "RequestGrow", "ResizeDecision", "ResizePolicy", "Scope", "JobView", "decide",
    "effective", "parse_assignments"]
