"""Errors of the allocator."""


from ..errors import InputError


class AllocationError(InputError, ValueError):
    """Devices that cannot be turned into the requested allocation, with the numbers."""
