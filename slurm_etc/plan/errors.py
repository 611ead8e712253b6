"""Errors raised by the pure planning core."""


class ConfigError(ValueError):
    """A parallel configuration or model description that cannot work, with the numbers."""


class PlanError(RuntimeError):
    """A migration plan that violates its own invariants (a bug, never user input)."""


def require(condition: bool, message: str) -> None:
    """Raise PlanError('invalid migration plan: ...') unless condition holds.

    Used instead of assert: plans must validate under ``python -O`` too.
    """
    if not condition:
        raise PlanError(f"invalid migration plan: {message}")
