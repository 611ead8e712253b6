"""Errors of the allocator."""


class AllocationError(ValueError):
    """Devices that cannot be turned into the requested allocation, with the numbers."""
