"""Learnable data for the demo: byte-level text, as ``examples/train_gpt.py`` uses.

Sample ``i`` is ``seq + 1`` consecutive bytes of a few Python standard library sources
(vocabulary 256: bytes are token ids), at a fixed stride, so nothing is downloaded, every
rank reads the same tokens for the same index, and a model learns it: the loss falls, across
resizes too (random tokens, :class:`~slurm_etc.worker.gpt.SeededTokens`, have nothing to
learn). The same sources on every process of one Python: the sample of an index is the same
in every layout.
"""
from __future__ import annotations

import argparse
import json
import textwrap

import torch

STRIDE = 37  # bytes between sample starts: neighbouring samples overlap, none repeat early


class StdlibText:
    """Map-style dataset of byte-level text; ``vocab_size`` below 256 folds the bytes."""

    def __init__(self, seq: int, vocab_size: int = 256) -> None:
        text = b"".join(open(str(m.__file__), "rb").read() for m in (argparse, json, textwrap))
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.tokens = tokens % vocab_size if vocab_size < 256 else tokens
        self.seq = seq
        self.count = (len(self.tokens) - seq - 1) // STRIDE
        if self.count < 1:
            raise ValueError(f"sequences of {seq} tokens do not fit the text's "
                             f"{len(self.tokens)} bytes")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        start = (i % self.count) * STRIDE  # a long run goes round the text again
        return self.tokens[start:start + self.seq + 1]
