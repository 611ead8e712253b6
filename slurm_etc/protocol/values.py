"""Structured values that cross a socket, a store or a process boundary: msgpack (msgspec)
with torch tensors as an extension type. Never pickle: decoding builds only dicts, lists,
strings, numbers, bytes, None and tensors of plain dtypes, whatever the bytes say.

Used for a resize's trainer state and RNG extras (scheduler and grad-scaler state dicts,
CUDA and megatron tracker RNG states), a survivor's holdings and the head of a peer copy.
Tuples come back as lists.
"""
from __future__ import annotations

from typing import Any, Final

import msgspec
import torch

from ..errors import InternalError

_TENSOR: Final = 1
# dtypes a value may carry (RNG states are uint8; scalers and counters float/int)
_DTYPES: Final = {name: getattr(torch, name) for name in (
    "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "bool")}
_HEADER: Final = msgspec.msgpack.Decoder(tuple[str, list[int]])


class BadValue(InternalError, ValueError):
    """Bytes that are not a value this module wrote (one line, never a traceback)."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"a tensor of dtype {dtype} cannot be encoded")
        header = msgspec.msgpack.encode((dtype, list(t.shape)))
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgspec.msgpack.Ext(_TENSOR, len(header).to_bytes(4, "little") + header + data)
    raise TypeError(f"a {type(obj).__name__} cannot be encoded as a value")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _TENSOR:
        raise BadValue(f"unknown extension type {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = _HEADER.decode(data[4:4 + n])
    if dtype not in _DTYPES or any(s < 0 for s in shape):
        raise BadValue(f"a tensor of dtype {dtype[:20]!r} and shape {shape[:8]}")
    dt = _DTYPES[dtype]
    payload = data[4 + n:]
    numel = 1
    for s in shape:
        numel *= s
    if numel * dt.itemsize != len(payload):
        raise BadValue(f"a {dtype} tensor of shape {shape[:8]} with {len(payload)} bytes")
    if not numel:
        return torch.empty(shape, dtype=dt, device="cpu")  # a value off the wire: host
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dt).reshape(shape)


_ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER: Final = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode_value(obj: Any) -> bytes:
    """``obj`` (dicts, lists, tuples, str, int, float, bool, None, bytes, tensors)."""
    return _ENCODER.encode(obj)


def decode_value(data: bytes) -> Any:
    """What :func:`encode_value` wrote.

    Raises:
        ValueError: anything else (malformed, an unknown extension, a bad tensor).
    """
    try:
        return _DECODER.decode(data)
    except BadValue:
        raise
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError) as e:
        raise BadValue(f"not a slurm-etc value: {str(e)[:200]}") from None
