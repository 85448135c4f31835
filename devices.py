"""Which kind of device the kernels are chosen for.

The code picks a kernel by the kind of device it will run on: the grouped GEMM and its 16-row group
alignment, FlexAttention for `attention_backend = "auto"`, on GPUs; the plain kernels on the CPU.
That is the device the tensors live on, except in a rehearsal (tools/rehearsal.py), which runs a GPU
job's step on fake CPU tensors and asks for the GPU's choices, so that what a GPU would run (and the
GPU kernels' own shape and dtype checks) is what runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_target: str | None = None  # "cuda" while a rehearsal targets a GPU; None: the tensors' own device


def kernel_device_type(device: torch.device | str) -> str:
    """ "cuda" or "cpu": the kind of device whose kernels to use for tensors on `device`."""
    return _target or torch.device(device).type


@contextmanager
def targeting(device_type: str) -> Iterator[None]:
    """Choose kernels for `device_type` whatever device the tensors are on (tools/rehearsal.py)."""
    global _target
    previous, _target = _target, device_type
    try:
        yield
    finally:
        _target = previous
