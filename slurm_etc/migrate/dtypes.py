"""The torch dtype of a state tensor from its itemsize (what the executor allocates a
destination as when the state does not name one), with the integer dtype of the same width
that bitwise comparisons use."""
from __future__ import annotations

import torch

# itemsize -> (value dtype, integer dtype of the same width for bitwise comparison)
DTYPES: dict[int, tuple[torch.dtype, torch.dtype]] = {
    1: (torch.uint8, torch.uint8),
    2: (torch.bfloat16, torch.int16),
    4: (torch.float32, torch.int32),
    8: (torch.float64, torch.int64),
}


def dtype_for(itemsize: int) -> torch.dtype:
    """The default torch dtype of a state with ``itemsize`` bytes per element."""
    try:
        return DTYPES[itemsize][0]
    except KeyError:
        raise ValueError(f"no dtype for itemsize {itemsize}; known: {sorted(DTYPES)}") from None
