"""Checkpoints of tensor-parallel training (AutoTP) load at another tensor degree and into
`partita.init_inference`, with no conversion step ([Note: tensor-parallel slices] in
`partita.checkpoint.slices`).

Four CPU ranks (tests/tp_checkpoint_workers.py): tiny Llama (grouped key/value heads, the
untied head split by vocabulary) and GPT-2 (fused QKV, Megatron's stride 3) train two steps at
one degree and ZeRO stage, save, and a fresh engine at another degree and stage (tp 2 x dp 2
-> tp 4 x dp 1 and back) loads the checkpoint and trains two more: every step's loss within
rtol 1e-6 of one process training the whole batch (fp32), master weights and Adam moments
re-cut from the saved slices; one case again, bitwise. A round trip (tp 2 -> tp 4 -> tp 2)
gives back the first engine's master weights and optimizer state bitwise. `init_inference` at
tp 1, 2 and 4 reads the tp-2 checkpoint: logits within 1e-5 of the one-process model. One
spawn runs every case. The single-process tests cut the inference planner's own slices (fused
QKV, grouped heads, packed gate/up) from one degree to another.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from models import assert_losses
from partita.checkpoint import CheckpointError
from partita.checkpoint.slices import RecutSource, recut, tensor_layout
from partita.inference.plan import build_plan
from partita.parallel.tensor import _slice_parameter
from partita.testing import run_distributed_grid
from tp_checkpoint_workers import grid, reference
from tp_training_workers import CLIP

WORLD = 4
RESUMES: list[tuple[str, tuple[int, int], tuple[int, int], bool]] = [
    # model, (tp, stage) saved, (tp, stage) loaded, round trip
    ("llama", (2, 1), (4, 3), True),
    ("llama", (4, 2), (2, 0), False),
    ("gpt2", (2, 2), (4, 1), True),
    ("gpt2", (4, 3), (2, 2), False),
]
FROZEN_CASE = ("llama", (2, 2), (4, 1), False)
"""Llama with one split weight frozen (`tp_checkpoint_workers.FROZEN`): a module tensor."""
RERUN = 3
"""The index of the case run a second time: the same losses bitwise."""
INFERENCE = [(kind, tp) for kind in ("llama", "gpt2") for tp in (1, 2, 4)]
"""`init_inference` at these degrees from the tp 2 x dp 2 checkpoint of each model."""


def _ids(case: tuple[str, tuple[int, int], tuple[int, int], bool]) -> str:
    kind, (tp, stage), (tp2, stage2), _ = case
    return f"{kind}-tp{tp}s{stage}-to-tp{tp2}s{stage2}"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folders = [str(tmp_path_factory.mktemp(f"tp-{_ids(c)}")) for c in RESUMES]
    again = str(tmp_path_factory.mktemp("tp-rerun"))

    def resume(i: int, folder: str, frozen: bool = False) -> dict[str, Any]:
        kind, save, load, round_trip = FROZEN_CASE if frozen else RESUMES[i]
        return {"case": "resume", "model_kind": kind, "save": save, "load": load,
                "folder": folder, "round_trip": round_trip, "frozen": frozen}  # fmt: skip

    saved_at_tp2 = {c[0]: f for c, f in zip(RESUMES, folders, strict=True) if c[1][0] == 2}
    cases = [
        *[resume(i, f) for i, f in enumerate(folders)],
        resume(RERUN, again),
        resume(-1, str(tmp_path_factory.mktemp("tp-frozen")), frozen=True),
        *[
            {"case": "inference", "model_kind": k, "folder": saved_at_tp2[k], "tp": tp}
            for k, tp in INFERENCE
        ],
    ]
    per_case = iter(run_distributed_grid(grid, WORLD, cases, timeout=400))
    return {
        "resume": [next(per_case) for _ in RESUMES],
        "rerun": next(per_case),
        "frozen": next(per_case),
        "inference": {c: next(per_case) for c in INFERENCE},
    }


@functools.cache
def _reference(kind: str, frozen: bool = False) -> dict[str, Any]:
    return reference(kind, frozen)


@pytest.mark.parametrize("i", range(len(RESUMES)), ids=[_ids(c) for c in RESUMES])
def test_training_continues_at_another_degree(results: dict[str, Any], i: int) -> None:
    kind, save, load, _ = RESUMES[i]
    want = _reference(kind)["losses"]
    assert all(n > CLIP for n in _reference(kind)["norms"])  # clipping acts at every step
    for run in results["resume"][i]:
        assert run["tp"] == (save[0], load[0])
        assert_losses(run["losses"], want)


def test_a_frozen_split_weight_is_recut_too(results: dict[str, Any]) -> None:
    kind, save, load, _ = FROZEN_CASE
    want = _reference(kind, frozen=True)["losses"]
    assert want != _reference(kind)["losses"]  # the frozen weight changes the run
    for run in results["frozen"]:
        assert run["tp"] == (save[0], load[0])
        assert_losses(run["losses"], want)


def test_rerun_is_bitwise(results: dict[str, Any]) -> None:
    for first, again in zip(results["resume"][RERUN], results["rerun"], strict=True):
        assert first["losses"] == again["losses"]


@pytest.mark.parametrize("i", [i for i, c in enumerate(RESUMES) if c[3]])
def test_round_trip_gives_back_masters_and_moments(results: dict[str, Any], i: int) -> None:
    for rank, run in enumerate(results["resume"][i]):
        assert run["round_trip_differs"] == [], f"rank {rank}"


@pytest.mark.parametrize("case", INFERENCE, ids=lambda c: f"{c[0]}-tp{c[1]}")
def test_init_inference_reads_the_training_checkpoint(
    results: dict[str, Any], case: tuple[str, int]
) -> None:
    want = _reference(case[0])["logits"]
    for logits in results["inference"][case]:
        torch.testing.assert_close(logits, want, rtol=0.0, atol=1e-5)


def _tiny(kind: str) -> nn.Module:
    from tp_training_workers import build_model

    return build_model(kind)


class _Experts(nn.Module):
    """A 3-D [experts, gate | up, hidden] weight, as the planner's ``packed_colwise`` splits."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, 16, 4))


def _models() -> list[tuple[str, nn.Module, dict[str, str] | None]]:
    experts = nn.Module()
    experts.layers = nn.ModuleList([_Experts()])
    return [
        ("gpt2", _tiny("gpt2"), None),
        ("llama", _tiny("llama"), None),
        ("experts", experts, {"layers.*.gate_up_proj": "packed_colwise"}),
    ]


def _slices(model: nn.Module, name: str, degree: int, policy: Any) -> list[nn.Parameter]:
    """Parameter `name` as each of `degree` training ranks holds it (`_slice_parameter`, the
    layout attributes included)."""
    out = []
    for rank in range(degree):
        param = nn.Parameter(model.get_parameter(name).detach().clone())
        _slice_parameter(param, build_plan(model, degree, rank, policy), name)
        out.append(param)
    return out


def _piece(pieces: list[nn.Parameter], t: int) -> torch.Tensor:
    return pieces[t].detach()


NAMES = {
    "gpt2": ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
             "transformer.h.1.mlp.c_proj.weight", "transformer.h.0.mlp.c_fc.bias"],
    "llama": ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight",
              "model.layers.1.mlp.up_proj.weight", "lm_head.weight"],
    "experts": ["layers.0.gate_up_proj"],
}  # fmt: skip
"""Fused QKV (stride 3), row-parallel, grouped key/value heads, the vocabulary-split head,
packed gate/up (stride 2)."""


@pytest.mark.parametrize(("saved", "loaded"), [(2, 4), (4, 2), (2, 1)])
def test_recut_gives_the_planners_slices_at_the_new_degree(saved: int, loaded: int) -> None:
    for kind, model, policy in _models():
        for name in NAMES[kind]:
            pieces = _slices(model, name, saved, policy)
            layout = tensor_layout(pieces[0])
            assert layout["layout"] == "sliced" and layout["partition_dim"] is not None, name
            layout["shapes"] = [list(p.shape) for p in pieces]
            whole = [model.get_parameter(name)]
            want = _slices(model, name, loaded, policy) if loaded > 1 else whole
            for rank, param in enumerate(want):
                read = functools.partial(_piece, pieces)
                got = recut(read, layout, loaded, rank, name)
                assert torch.equal(got, param.detach()), (kind, name, saved, loaded, rank)


def test_recut_refuses_an_uneven_cut_naming_the_tensor() -> None:
    layout = {"layout": "sliced", "partition_dim": 0, "partition_stride": 3,
              "shapes": [[6, 2], [6, 2]]}  # fmt: skip
    with pytest.raises(CheckpointError, match=r"'w'.* 4 .*tensor-parallel degree 3"):
        recut(lambda t: torch.zeros(6, 2), layout, 3, 0, "w")


def _split(shape: tuple[int, ...], dim: int | None) -> torch.Tensor:
    tensor = torch.zeros(shape)
    if dim is not None:
        tensor.tensor_model_parallel = True  # type: ignore[attr-defined]
        tensor.partition_dim = dim  # type: ignore[attr-defined]
        tensor.partition_stride = 1  # type: ignore[attr-defined]
    return tensor


def test_a_tensor_split_otherwise_than_saved_is_refused_by_name() -> None:
    """The re-cut follows the saved split; an engine cutting the same name along another
    dimension (or not at all) would get wrong numbers of the right shape."""
    sliced = {"layout": "sliced", "partition_dim": 0, "partition_stride": 1,
              "shapes": [[2, 4], [2, 4]]}  # fmt: skip
    manifest = {"tp_world_size": 2, "files": {},
                "tensors": {"w": {"kind": "trainable", "shape": [2, 4], "tp": sliced}}}  # fmt: skip
    source = RecutSource("ckpt", manifest, 4, 1)
    assert source.tensors["w"]["shape"] == [1, 4]
    source.check_split("w", _split((1, 4), 0))
    for dim, how in ((1, "split along dimension 1 with"), (None, "replicated in")):
        with pytest.raises(CheckpointError, match=f"'w' is saved split along .* but {how}"):
            source.check_split("w", _split((1, 4), dim))
