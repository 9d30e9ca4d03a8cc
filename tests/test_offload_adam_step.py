"""partita.offload.adam_step: the CPU Adam/AdamW step of offloaded state, applied in tiles."""

from __future__ import annotations

import pytest
import torch

from partita.offload import AdamHyper, cpu_adam_step, make_cpu_adam

N, TILE, STEPS = 10_007, 3_000, 10


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=gen) for _ in range(STEPS)]


@pytest.mark.parametrize("decoupled", [True, False])
def test_tiled_steps_match_torch_fused_bitwise_and_foreach_closely(decoupled: bool) -> None:
    hyper = AdamHyper(
        lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.1, decoupled=decoupled
    )
    init = torch.randn(N, generator=torch.Generator().manual_seed(1))
    grads = _grads(2)
    # partita: the flat tensor in tiles, as sub-groups are stepped with offload.
    mine, m, v = init.clone(), torch.zeros(N), torch.zeros(N)
    for step, grad in enumerate(grads, start=1):
        for lo in range(0, N, TILE):
            sl = slice(lo, lo + TILE)
            cpu_adam_step([mine[sl]], [grad[sl]], [m[sl]], [v[sl]], step, hyper)
    results = {}
    for impl in ("fused", "foreach"):
        param = torch.nn.Parameter(init.clone())
        opt = (
            make_cpu_adam([param], hyper)
            if impl == "fused"
            else (torch.optim.AdamW if decoupled else torch.optim.Adam)(
                [param], lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1, foreach=True
            )
        )
        for grad in grads:
            param.grad = grad.clone()
            opt.step()
        results[impl] = param.detach()
    assert torch.equal(mine, results["fused"])
    assert not torch.equal(mine, init)
    # The same algorithm as torch's default implementation, up to float rounding.
    torch.testing.assert_close(mine, results["foreach"], rtol=1e-5, atol=1e-6)


def test_grad_scale_and_found_inf() -> None:
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    grad = torch.randn(100, generator=torch.Generator().manual_seed(3))
    a, b = torch.ones(100), torch.ones(100)
    m_a, v_a, m_b, v_b = (torch.zeros(100) for _ in range(4))
    cpu_adam_step([a], [grad], [m_a], [v_a], 1, hyper)
    cpu_adam_step([b], [grad * 1024], [m_b], [v_b], 1, hyper, grad_scale=torch.tensor(1024.0))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    skipped = torch.ones(100)
    m, v = torch.zeros(100), torch.zeros(100)
    cpu_adam_step([skipped], [grad], [m], [v], 1, hyper, found_inf=torch.tensor(1.0))
    assert torch.equal(skipped, torch.ones(100)) and not m.any()


def test_refuses_bad_step_and_missing_amsgrad_state() -> None:
    t = [torch.zeros(4)]
    with pytest.raises(ValueError, match="1-based"):
        cpu_adam_step(t, t, t, t, 0, AdamHyper(lr=1.0))
    with pytest.raises(ValueError, match="max_exp_avg_sqs"):
        cpu_adam_step(t, t, t, t, 1, AdamHyper(lr=1.0, amsgrad=True))
