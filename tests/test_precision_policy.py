"""The precision policy: which dtype weights, gradients, reductions and masters use."""

from __future__ import annotations

import pytest
import torch

from partita.precision import PrecisionPolicy, full_dtype


def _module(*dtypes: torch.dtype) -> torch.nn.Module:
    return torch.nn.ModuleList(torch.nn.Linear(2, 2).to(d) for d in dtypes)


def test_float64_module_trains_in_float64_without_masters() -> None:
    policy = PrecisionPolicy.from_flags(False, False, None).for_module(_module(torch.float64))
    assert policy.param_dtype == policy.reduce_dtype == policy.master_dtype == torch.float64
    assert not policy.needs_master and not policy.uses_loss_scaling


@pytest.mark.parametrize(
    "dtypes", [(torch.float32,), (torch.float64, torch.float32), (torch.bfloat16,), ()]
)
def test_other_full_precision_modules_train_in_fp32(dtypes: tuple[torch.dtype, ...]) -> None:
    policy = PrecisionPolicy.from_flags(False, False, None).for_module(_module(*dtypes))
    assert policy == PrecisionPolicy.from_flags(False, False, None)
    assert policy.param_dtype == torch.float32


@pytest.mark.parametrize(("fp16", "bf16"), [(True, False), (False, True)])
def test_16_bit_modes_keep_fp32_masters_for_a_float64_module(fp16: bool, bf16: bool) -> None:
    base = PrecisionPolicy.from_flags(fp16, bf16, None)
    assert base.for_module(_module(torch.float64)) == base
    assert base.master_dtype == torch.float32


def test_full_dtype_widens_16_bit_and_keeps_float64() -> None:
    assert full_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
    assert full_dtype(torch.zeros(1, dtype=torch.float16)) == torch.float32
    assert full_dtype(torch.zeros(1)) == torch.float32
    assert full_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64
