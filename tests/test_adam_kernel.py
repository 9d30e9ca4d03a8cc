"""partita's CPU Adam kernel and CPUAdam/CPUAdamW: bitwise torch's fused CPU update."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from partita.optim import CPUAdam, CPUAdamW, adam_kernel
from partita.optim.adam_kernel import AdamArgs, adam_step
from partita.testing import run_python

# Only the tests of the kernel itself; CPUAdam/CPUAdamW fall back to torch's step without it.
needs_kernel = pytest.mark.skipif(
    not adam_kernel.available(), reason=f"kernel not usable here: {adam_kernel.why_not()}"
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _torch_step(tensors: list[list[torch.Tensor]], args: AdamArgs) -> None:
    kernel = torch._fused_adamw_ if args.decoupled else torch._fused_adam_
    p, g, m, v = tensors
    kernel(
        p, g, m, v, [], [torch.tensor(float(args.step))] * len(p), lr=args.lr, beta1=args.beta1,
        beta2=args.beta2, weight_decay=args.weight_decay, eps=args.eps, amsgrad=False,
        maximize=False,
    )  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize(("beta1", "weight_decay"), [(0.9, 0.0), (0.9, 0.05), (0.2, 0.05)])
def test_bitwise_torch_fused(threads: int, decoupled: bool, beta1: float, weight_decay: float):
    """Mixed sizes (empty, below one vector, a tail, large enough to split over threads) in one
    call, gradients from tiny to overflowing, several steps: every bit equal to torch's."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        sizes = [0, 1, 7, 16, 17, 1000, 40_000, 100_003]
        ours = [[torch.randn(n, generator=gen) for n in sizes]] + [
            [torch.zeros(n) for n in sizes] for _ in range(2)
        ]
        theirs = [[t.clone() for t in ts] for ts in ours]
        for step in range(1, 6):
            grads = [torch.randn(n, generator=gen) * 10.0 ** (6 * step - 18) for n in sizes]
            grads[-1][::7] = 0.0
            grads[-1][3] = 3e19 if step == 2 else grads[-1][3]  # squared: an infinite moment
            args = AdamArgs(step, 3e-3, beta1, 0.99, 1e-8, weight_decay, decoupled)
            adam_step(ours[0], grads, ours[1], ours[2], args)
            _torch_step([theirs[0], [g.clone() for g in grads], theirs[1], theirs[2]], args)
            for mine, ref in zip(ours, theirs, strict=True):
                for a, b in zip(mine, ref, strict=True):
                    assert torch.equal(_bits(a), _bits(b)), (step, a.numel())
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_split_into_tiles_is_bitwise_the_whole():
    """Elementwise: stepping a tensor in pieces cut at multiples of 16 elements (torch's
    vector width, so the scalar tail stays the same elements) equals stepping it whole."""
    gen = torch.Generator().manual_seed(1)
    whole = [torch.randn(5000, generator=gen), torch.zeros(5000), torch.zeros(5000)]
    tiled = [t.clone() for t in whole]
    for step in (1, 2):
        grad = torch.randn(5000, generator=gen)
        args = AdamArgs(step, 1e-2, 0.9, 0.999, 1e-8, 0.01, True)
        adam_step([whole[0]], [grad], [whole[1]], [whole[2]], args)
        for lo, hi in ((0, 1232), (1232, 1248), (1248, 5000)):
            adam_step(*([t[lo:hi]] for t in (tiled[0], grad, tiled[1], tiled[2])), args)
    for a, b in zip(whole, tiled, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def _train(opt_cls: type, steps: int, **kwargs: object) -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 40), torch.nn.GELU(), torch.nn.Linear(40, 3))
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    data = torch.randn(32, 13, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(data).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize(
    ("ours", "torchs"), [(CPUAdamW, torch.optim.AdamW), (CPUAdam, torch.optim.Adam)]
)
def test_optimizer_matches_torch_fused_and_shares_its_state(ours: type, torchs: type):
    model_a, opt_a = _train(ours, 6)
    model_b, opt_b = _train(torchs, 6, fused=True)
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(_bits(a.detach()), _bits(b.detach()))
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()  # type: ignore[attr-defined]
    assert state_a["param_groups"] == state_b["param_groups"]
    for k, sa in state_a["state"].items():
        for key, value in sa.items():
            assert torch.equal(value, state_b["state"][k][key]), key
    # A state dict of either loads into the other.
    twin = torchs(copy.deepcopy(model_a).parameters(), lr=1e-2, fused=True)
    twin.load_state_dict(state_a)
    assert torch.equal(twin.state_dict()["state"][0]["exp_avg"], state_a["state"][0]["exp_avg"])


def test_other_cases_take_torchs_step():
    """amsgrad and non-fp32 parameters run torch's fused step: still torch's numbers."""
    for kwargs in ({"amsgrad": True}, {"maximize": True}):
        model_a, _ = _train(CPUAdamW, 3, **kwargs)
        model_b, _ = _train(torch.optim.AdamW, 3, fused=True, **kwargs)
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert torch.equal(a, b)
    p = torch.nn.Parameter(torch.randn(40, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    opts = [CPUAdamW([p], lr=0.1), torch.optim.AdamW([q], lr=0.1, fused=True)]
    for _ in range(3):
        for t, opt in zip((p, q), opts, strict=True):
            t.grad = torch.ones_like(t)
            opt.step()
    assert torch.equal(p, q)


def test_disabled_or_without_compiler_falls_back_to_torch(tmp_path: os.PathLike) -> None:
    code = "from partita.optim import adam_kernel as k; print(k.available(), k.why_not())"
    assert run_python(code, PARTITA_CPU_ADAM="0") == "False disabled by PARTITA_CPU_ADAM=0"
    # No compiler, and nothing built yet in an empty cache folder.
    out = run_python(code, PATH=str(tmp_path), CXX="", PARTITA_CACHE_DIR=str(tmp_path))
    assert out == "False no C++ compiler found (set CXX)"


def test_parameters_at_different_steps():
    """Each parameter's own step counter sets its bias correction, as in torch."""
    pairs = []
    for cls, kwargs in ((CPUAdamW, {}), (torch.optim.AdamW, {"fused": True})):
        torch.manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 4096)]
        opt = cls(params, lr=1e-2, weight_decay=0.1, **kwargs)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.state[params[1]]["step"].fill_(41.0)  # as if restored from a longer run
        for _ in range(2):
            opt.step()
        pairs.append((params, opt))
    (ours, opt_a), (theirs, opt_b) = pairs
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt_a.state[a]["step"], opt_b.state[b]["step"])
    assert float(opt_a.state[ours[1]]["step"]) == 43.0


@needs_kernel
def test_avx2_path_when_torch_uses_avx2() -> None:
    """With torch's AVX2 kernels (8-wide: a different body/tail split) the kernel's AVX2 code
    passes its bitwise check against torch too."""
    code = (
        "import torch; from partita.optim import adam_kernel as k; "
        "print(torch.backends.cpu.get_cpu_capability(), k.available(), k.why_not(), k._isa)"
    )
    assert run_python(code, ATEN_CPU_CAPABILITY="avx2") == "AVX2 True None 1"
