"""Gating and dispatch of `partita.moe` in one process: capacity with drops and dropless, the
eval capacity factor, routes that address distinct slots, dispatch and combine against GShard's
dense form, the layer with one expert-parallel rank, the refusals of bad arguments, and
DeepSpeed's optimizer-group split (``deepspeed.moe.utils``). DeepSpeed's own gating is compared
bitwise in tests/test_moe_deepspeed.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from partita.compat.deepspeed.moe.layer import MoE
from partita.compat.deepspeed.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from partita.moe.dispatch import decode, encode, route_slots
from partita.moe.gating import Routing, dense_weights, top1_routing, top2_routing, topk_routing

TOKENS, EXPERTS = 40, 4


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(seed))


def _check_slots(r: Routing) -> None:
    """Kept routes address distinct slots below the capacity; dropped ones weigh nothing."""
    kept = r.indices >= 0
    slots = (r.indices * r.capacity + r.locations)[kept].tolist()
    assert len(slots) == len(set(slots))
    assert bool((r.locations[kept] < r.capacity).all())
    assert bool((r.gates[~kept] == 0).all())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_capacity_drops_routes_beyond_it(k: int) -> None:
    """With drops, each expert keeps at most ceil(S / E * factor * k) routes (min_capacity at
    least); every other route is dropped."""
    logits = _logits(k)
    if k == 1:
        r = top1_routing(logits, 0.5, 2, use_rts=False)
    elif k == 2:
        r = top2_routing(logits, 0.5, 2, second_expert_sampling=False)
    else:
        r = topk_routing(logits, k, 0.5, 2)
    assert r.capacity == max(math.ceil(TOKENS / EXPERTS * 0.5 * k), 2)
    _check_slots(r)
    kept = torch.bincount(r.indices[r.indices >= 0], minlength=EXPERTS)
    assert bool((kept == torch.clamp(r.exp_counts, max=r.capacity)).all()), (kept, r.exp_counts)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_keeps_every_route(k: int) -> None:
    logits = _logits(10 + k)
    if k == 1:
        r = top1_routing(logits, 0.5, 0, drop_tokens=False)
    elif k == 2:
        r = top2_routing(logits, 0.5, 0, drop_tokens=False, second_expert_sampling=False)
    else:
        r = topk_routing(logits, k, 0.5, 0, drop_tokens=False)
    assert bool((r.indices >= 0).all())
    assert r.capacity == int(r.exp_counts.max())
    _check_slots(r)
    if k > 1:  # the kept weights of a token sum to one
        torch.testing.assert_close(r.gates.sum(0), torch.ones(TOKENS))


def test_encode_and_decode_match_gshards_dense_form() -> None:
    """Dispatch and combine through slots equal the einsums of GShard's combine weights and
    dispatch mask."""
    r = topk_routing(_logits(3), 2, 0.75, 1)
    tokens = torch.randn(TOKENS, 5)
    slots = route_slots(r.indices, r.locations, EXPERTS, r.capacity)
    combine, dispatch = dense_weights(r, TOKENS)
    buffer = encode(tokens, slots, EXPERTS, r.capacity)
    torch.testing.assert_close(buffer, torch.einsum("sec,sm->ecm", dispatch.float(), tokens))
    out = torch.randn_like(buffer)
    got = decode(out.reshape(-1, 5), slots, r.gates, TOKENS)
    torch.testing.assert_close(got, torch.einsum("sec,ecm->sm", combine, out))


def test_eval_mode_uses_the_eval_capacity_factor() -> None:
    torch.manual_seed(0)
    layer = MoE(6, nn.Linear(6, 6), num_experts=EXPERTS, capacity_factor=0.5,
                eval_capacity_factor=2.0, min_capacity=0)  # fmt: skip
    x = torch.randn(TOKENS, 6)
    layer(x)
    assert layer.deepspeed_moe.capacity == math.ceil(TOKENS / EXPERTS * 0.5)
    layer.eval()
    layer(x)
    assert layer.deepspeed_moe.capacity == math.ceil(TOKENS / EXPERTS * 2.0)


def test_one_rank_layer_equals_each_token_through_its_expert() -> None:
    """ep_size 1, dropless top-1: each token's output is its expert's output times its gate."""
    torch.manual_seed(0)
    layer = MoE(6, nn.Linear(6, 6), num_experts=EXPERTS, min_capacity=0, drop_tokens=False)
    x = torch.randn(TOKENS, 6)
    out, _, counts = layer(x)
    gates = torch.softmax(x @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    best = gates.argmax(1)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    pairs = enumerate(zip(x, best, strict=True))
    want = torch.stack([experts[int(e)](t) * gates[i, e] for i, (t, e) in pairs])
    torch.testing.assert_close(out, want)
    assert counts.tolist() == torch.bincount(best, minlength=EXPERTS).tolist()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_experts": 3, "ep_size": 2}, "num_experts: 3 is not divisible by ep_size 2"),
        ({"num_experts": 4, "k": 5}, "k: 5 must be between 1 and num_experts (4)"),
        ({"num_experts": 4, "noisy_gate_policy": "Gauss"}, "noisy_gate_policy: 'Gauss'"),
        ({"num_experts": 4, "enable_expert_tensor_parallelism": True}, "tensor-parallel experts"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        MoE(6, nn.Linear(6, 6), **kwargs)
    assert words in str(caught.value)


def test_too_few_tokens_for_min_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than min_capacity 8"):
        top1_routing(torch.randn(4, 2), 1.0, 8)


def test_param_groups_split_by_kind_as_deepspeed_does() -> None:
    """Expert parameters leave their group for one named after their expert group, with the
    same hyperparameters and ``moe`` set, cut at max_group_size elements."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), MoE(6, nn.Linear(6, 6), num_experts=4, ep_size=2))
    params = list(model.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": params, "name": "all", "lr": 0.5}, max_group_size=50
    )
    dense = [p for p in params if not is_moe_param(p)]
    assert groups[0]["params"] == dense and groups[0]["name"] == "all"
    experts = [p for g in groups[1:] for p in g["params"]]
    assert experts == [p for p in params if is_moe_param(p)] and len(experts) == 4
    for g in groups[1:]:
        assert g["moe"] is True and g["name"] == "ep_size_2" and g["lr"] == 0.5
        assert sum(p.numel() for p in g["params"]) <= 50
