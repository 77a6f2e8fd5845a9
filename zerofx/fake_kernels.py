"""Fake kernels that refuse what the op's CPU kernel computes, widened while zerofx traces a step.

``torch._grouped_mm`` runs the experts of Mixture-of-Experts layers (Hugging Face's Mixtral, Qwen-MoE, ...). Its meta
function states the CUDA kernel's rule, bfloat16 inputs only, but the CPU kernel multiplies float32 and float16 too,
so a float32 MoE model trains eagerly on a CPU and its trace fails. While zerofx traces, the meta function answers
for those dtypes as the CPU kernel computes: the shape bfloat16 inputs would give, contiguous, in the inputs' dtype
(or ``out_dtype``). On CUDA such a step still meets the CUDA kernel's own refusal when it runs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import _meta_registrations
from torch._subclasses.fake_tensor import FakeTensorMode

_ALSO_ON_CPU = (torch.float32, torch.float16)


@contextlib.contextmanager
def cpu_dtypes_for_grouped_mm() -> Iterator[None]:
    original = _meta_registrations._meta_grouped_mm_common

    def common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
               use_fast_accum=False):
        if scale_a is not None or mat_a.dtype != mat_b.dtype or mat_a.dtype not in _ALSO_ON_CPU:
            return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)
        shaped = original(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), None, None, offs, bias)
        return shaped.new_empty(shaped.shape, dtype=out_dtype or mat_a.dtype)

    _meta_registrations._meta_grouped_mm_common = common
    try:
        yield
    finally:
        _meta_registrations._meta_grouped_mm_common = original
        # the fake-op cache is one for the process: answers given here must not outlive the widening
        for key in [k for k in FakeTensorMode.cache if k.key and k.key[0] is torch.ops.aten._grouped_mm.default]:
            del FakeTensorMode.cache[key]
