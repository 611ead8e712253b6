"""Errors raised by the pure planning core."""


from ..errors import InputError, InternalError


class ConfigError(InputError, ValueError):
    """A parallel configuration or model description that cannot work, with the numbers."""


class StateLostError(ConfigError):
    """Devices died holding the only copies of some state: no plan can rebuild it in memory.

    Attributes:
        tensors: the tensors (catalog names) some part of which no surviving device holds.
        lost: the lost devices.
    """

    def __init__(self, message: str, tensors: tuple[str, ...], lost: tuple[int, ...]) -> None:
        super().__init__(message)
        self.tensors = tensors
        self.lost = lost


class PlanError(InternalError, RuntimeError):
    """A migration plan that violates its own invariants (a bug, never user input)."""


def require(condition: bool, message: str) -> None:
    """Raise PlanError('invalid migration plan: ...') unless condition holds.

    Used instead of assert: plans must validate under ``python -O`` too.
    """
    if not condition:
        raise PlanError(f"invalid migration plan: {message}")
