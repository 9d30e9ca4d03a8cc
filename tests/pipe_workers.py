"""Rank-side code of tests/test_pipe_engine.py: a GPT-ish stack of layers as a `PipelineModule`
(embedding, residual blocks, norm, head; optionally the head tied to the embedding), trained
with `train_batch`, and the one-process reference that runs the same layers on the same
micro-batches with torch.optim."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import partita
from models import SEQ, VOCAB, Block
from partita.parallel.pipe_module import LayerSpec, PipelineModule, TiedLayerSpec, set_random_seed
from partita.parallel.tensor import copy_to_tensor_region, reduce_from_tensor_region
from partita.parallel.topology import PipelineParallelGrid, PipeModelDataParallelTopology

DIM = 32
BLOCKS = 4
BASE_SEED = 1234
LR = 1e-3


def unembed(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The tied output projection: hidden states times the embedding matrix."""
    return x @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class TensorBlock(nn.Module):
    """`Block` split over a tensor group as Megatron splits an MLP: ``fc1`` by its output
    features (column-parallel), ``fc2`` by its input features (row-parallel, its bias whole);
    built from a whole `Block` made here, so that seeding gives the one-process weights."""

    def __init__(self, dim: int, group: Any, size: int, rank: int) -> None:
        super().__init__()
        whole = Block(dim)
        h = whole.fc1.out_features // size
        cut = slice(rank * h, (rank + 1) * h)
        self.group = group
        self.norm = whole.norm
        self.fc1_weight = nn.Parameter(whole.fc1.weight.detach()[cut].clone())
        self.fc1_bias = nn.Parameter(whole.fc1.bias.detach()[cut].clone())
        self.fc2_weight = nn.Parameter(whole.fc2.weight.detach()[:, cut].clone())
        self.fc2_bias = whole.fc2.bias
        for p in (self.fc1_weight, self.fc1_bias, self.fc2_weight):
            p.tensor_model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = copy_to_tensor_region(self.norm(x), self.group)
        h = nn.functional.gelu(nn.functional.linear(y, self.fc1_weight, self.fc1_bias))
        out = reduce_from_tensor_region(nn.functional.linear(h, self.fc2_weight), self.group)
        return x + out + self.fc2_bias


def layer_specs(tied: bool, tensor: tuple[Any, int, int] | None = None) -> list[Any]:
    """The model as DeepSpeed's pipeline scripts write it; with `tensor` (group, size, rank),
    its blocks split over that tensor group (`TensorBlock`)."""
    first = (
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM)
        if tied
        else LayerSpec(nn.Embedding, VOCAB, DIM)
    )
    last = (
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=unembed)
        if tied
        else LayerSpec(nn.Linear, DIM, VOCAB, bias=False)
    )
    if tensor is None:
        blocks = [LayerSpec(Block, DIM) for _ in range(BLOCKS)]
    else:
        blocks = [LayerSpec(TensorBlock, DIM, *tensor) for _ in range(BLOCKS)]
    return [first, *blocks, LayerSpec(nn.LayerNorm, DIM), last]


def micro_batches(
    steps: int, micro: int, gas: int, dp: int, seed: int = 1
) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][dp_rank][micro_step]`` -> (tokens, targets)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (dp, gas, micro, SEQ), generator=gen)
        targets = (tokens * 5 + 1) % VOCAB
        out.append([[(tokens[r, i], targets[r, i]) for i in range(gas)] for r in range(dp)])
    return out


def loader_dataset(case: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of samples for ``initialize(training_data=...)``: every micro-batch of the
    run, as single (tokens, targets) samples."""
    batches = micro_batches(case["steps"], case["micro"], case["gas"], case["dp"], seed=3)
    return [
        (tokens[j], targets[j])
        for step in batches
        for rank_batches in step
        for tokens, targets in rank_batches
        for j in range(tokens.shape[0])
    ]


def loader_batches(
    case: dict[str, Any], seed: int
) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][dp_rank][micro_step]`` as the engine's loader serves `loader_dataset`: each
    data-parallel rank's share by torch's `DistributedSampler` (epoch 0, `seed`), in
    consecutive micro-batches."""
    from torch.utils.data import DistributedSampler

    data = loader_dataset(case)
    micro, gas, dp = case["micro"], case["gas"], case["dp"]
    shares = []
    for r in range(dp):
        sampler = DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=seed)
        sampler.set_epoch(0)
        idx = list(sampler)
        chunks = [idx[i : i + micro] for i in range(0, len(idx), micro)]
        shares.append(
            [
                (torch.stack([data[i][0] for i in c]), torch.stack([data[i][1] for i in c]))
                for c in chunks
            ]
        )
    return [[shares[r][s * gas : (s + 1) * gas] for r in range(dp)] for s in range(case["steps"])]


def reference(
    case: dict[str, Any], batches: list[Any] | None = None, logits: list[Any] | None = None
) -> tuple[list[float], float]:
    """One process, the same layers (seeded per layer as ``seed_layers`` does), the same
    micro-batches, torch's AdamW: per-step losses (mean over every micro-batch), and the loss
    of the evaluation batch after training; `logits`, when given, gets each data-parallel
    rank's last evaluation micro-batch's outputs."""
    specs = layer_specs(case["tied"])
    funcs: list[Any] = []
    tied: dict[str, nn.Module] = {}
    params: list[nn.Parameter] = []
    for idx, spec in enumerate(specs):
        set_random_seed(BASE_SEED + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
                params += list(tied[spec.key].parameters())
            module = tied[spec.key]
            funcs.append(
                module
                if spec.forward_fn is None
                else (lambda x, m=module, f=spec.forward_fn: f(m, x))
            )
        else:
            module = spec.build()
            params += list(module.parameters())
            funcs.append(module)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
    dp, gas = case["dp"], case["gas"]
    losses = []
    if batches is None:
        batches = micro_batches(case["steps"], case["micro"], gas, dp)
    for step in batches:
        total = torch.zeros(())
        for rank_batches in step:
            for tokens, targets in rank_batches:
                x: Any = tokens
                for f in funcs:
                    x = f(x)
                loss = lm_loss(x, targets)
                (loss / (gas * dp)).backward()
                total += loss.detach()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(params, case["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(float(total / (gas * dp)))
    with torch.no_grad():
        total = torch.zeros(())
        for rank_batches in micro_batches(1, case["micro"], gas, dp, seed=2)[0]:
            for tokens, targets in rank_batches:
                x = tokens
                for f in funcs:
                    x = f(x)
                total += lm_loss(x, targets)
            if logits is not None:
                logits.append(x)
    return losses, float(total / (gas * dp))


def config(micro: int, gas: int, stage: int = 0, clip: float = 0.0) -> dict[str, Any]:
    """A ds_config for the pipeline runs."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def pipe_train(case: dict[str, Any]) -> dict[str, Any]:
    """Trains the pipeline module for ``case["steps"]`` batches; returns every step's loss as
    `train_batch` returned it on this rank, with this rank's stage and layer range."""
    torch.manual_seed(0)
    tensor, topology = None, None
    if case.get("tp", 1) > 1:  # a model axis: the blocks split over the grid's slices
        topology = PipeModelDataParallelTopology(case["stages"], case["tp"], case["dp"])
        grid = PipelineParallelGrid(topology)
        tensor = (grid.get_slice_parallel_group(), case["tp"], grid.get_slice_parallel_rank())
    module = PipelineModule(
        layer_specs(case["tied"], tensor),
        num_stages=None if topology else case["stages"],
        topology=topology,
        loss_fn=lm_loss,
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method=case.get("partition", "parameters"),
        activation_checkpoint_interval=case.get("ckpt", 0),
        virtual_stages=case.get("virtual", 1),
    )
    cfg = config(case["micro"], case["gas"], case.get("stage", 0), case.get("clip", 0.0))
    if "schedule" in case:
        cfg["pipeline"] = {"schedule": case["schedule"]}
    seed = None
    applied: list[bool] = []
    if case.get("loader"):
        # DeepSpeed's script shape: deepspeed.initialize(training_data=...), train_batch().
        import partita.compat.deepspeed as deepspeed

        params = [p for p in module.parameters() if p.requires_grad]
        engine, _, loader, _ = deepspeed.initialize(
            model=module, model_parameters=params, training_data=loader_dataset(case), config=cfg
        )
        seed = loader.seed
        losses = [float(engine.train_batch()) for _ in range(case["steps"])]
    else:
        engine, _, _, _ = partita.initialize(model=module, config=cfg)
        dp_rank = engine.grid.get_data_parallel_rank()
        poison = _poison_last_stage(engine, module) if "inf_step" in case else [False]
        losses = []
        for i, step in enumerate(
            micro_batches(case["steps"], case["micro"], case["gas"], case["dp"])
        ):
            poison[0] = i == case.get("inf_step")
            losses.append(float(engine.train_batch(iter(step[dp_rank]))))
            applied.append(engine.was_step_applied())
    dp_rank = engine.grid.get_data_parallel_rank()
    evaluation = micro_batches(1, case["micro"], case["gas"], case["dp"], seed=2)[0][dp_rank]
    evaluated = float(engine.eval_batch(iter(evaluation)))
    # The outputs of the last evaluation micro-batch, on the last stage (None elsewhere).
    _, last_logits = engine.eval_batch(iter(evaluation), return_logits=True)
    out = {
        "losses": losses,
        "eval": evaluated,
        "logits": last_logits,
        "dp_rank": dp_rank,
        "stage": engine.stage_id,
        "parts": module.partitions(),
        "layers": sorted(int(k.split(".")[0]) for k in module.state_dict() if k[0].isdigit()),
        "engine": type(engine).__name__,
        "first_last": (engine.is_first_stage(), engine.is_last_stage()),
        "seed": seed,
        "applied": applied,
        "skipped": engine.skipped_steps,
        # Optimizer state elements on this rank, and the parameters its stage holds.
        "opt_numel": sum(
            t.numel()
            for state in engine.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        ),
        "stage_numel": sum(p.numel() for p in module.parameters()),
        "mesh": _mesh(engine),
    }
    engine.destroy()
    return out


def _mesh(engine: Any) -> dict[str, Any] | None:
    """The engine's `DeviceMesh`: dimension names, layout and each dimension's group."""
    import torch.distributed as dist

    mesh = engine.mesh_device
    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names)
    groups = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names}
    return {"names": names, "layout": mesh.mesh.tolist(), "groups": groups}


def _poison_last_stage(engine: Any, module: PipelineModule) -> list[bool]:
    """On the last stage only, makes one weight's gradient inf while the returned flag is
    set: every stage must then skip the step (the overflow check spans the pipeline)."""
    when = [False]
    if engine.is_last_stage():

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if when[0]:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        # A weight of the stage's own last layer: not tied, so the inf stays on this stage.
        list(module.parameters())[-1].register_hook(hook)
    return when


def bad_input(case: dict[str, Any]) -> str:
    """The error this rank raises for a bad pipeline set-up ("" when none)."""
    try:
        module = PipelineModule(
            case.get("layers", layer_specs(False)),
            num_stages=case["stages"],
            loss_fn=lm_loss,
            virtual_stages=case.get("virtual", 1),
        )
        cfg = config(1, case.get("gas", 2), case.get("stage", 0))
        if "schedule" in case:
            cfg["pipeline"] = {"schedule": case["schedule"]}
        partita.initialize(model=module, config=cfg)
    except (ValueError, RuntimeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def reshard(case: dict[str, Any]) -> dict[str, float]:
    """Trains the tied model at pp 2 x dp 2 for two steps, saves its weights per layer, and
    loads them into freshly built (differently seeded) modules at pp 4 and pp 1: the loss of
    one evaluation batch at each degree."""
    from partita import comm

    micro, gas = case["micro"], case["gas"]
    module = PipelineModule(
        layer_specs(True), num_stages=2, loss_fn=lm_loss, seed_layers=True, base_seed=BASE_SEED
    )
    engine, _, _, _ = partita.initialize(model=module, config=config(micro, gas))
    dp_rank = engine.grid.get_data_parallel_rank()
    for step in micro_batches(2, micro, gas, 2):
        engine.train_batch(iter(step[dp_rank]))
    module.save_state_dict(case["dir"])
    comm.barrier()
    evaluation = micro_batches(1, micro, gas, 1, seed=2)[0][0]  # one share, on every rank
    out = {"pp2": float(engine.eval_batch(iter(evaluation)))}
    engine.destroy()
    for stages in (4, 1):
        other = PipelineModule(
            layer_specs(True), num_stages=stages, loss_fn=lm_loss, seed_layers=True, base_seed=7
        )
        other.load_state_dir(case["dir"])
        engine, _, _, _ = partita.initialize(model=other, config=config(micro, gas))
        out[f"pp{stages}"] = float(engine.eval_batch(iter(evaluation)))
        engine.destroy()
    return out


def tensor_layers(case: dict[str, Any]) -> dict[str, Any]:
    """pp 2 x tp 2: trains two steps, saves the weights per layer and slice, loads them into a
    freshly built (differently seeded) module: the evaluation loss before and after, and the
    file names. Checkpoints of the engine are refused with a model axis: the message."""
    from partita import comm

    topology = PipeModelDataParallelTopology(2, 2, 1)
    grid = PipelineParallelGrid(topology)
    tensor = (grid.get_slice_parallel_group(), 2, grid.get_slice_parallel_rank())

    def build(seed: int) -> Any:
        module = PipelineModule(layer_specs(True, tensor), topology=topology, loss_fn=lm_loss,
                                seed_layers=True, base_seed=seed)  # fmt: skip
        return module, partita.initialize(model=module, config=config(2, 4))[0]

    module, engine = build(BASE_SEED)
    for step in micro_batches(2, 2, 4, 1):
        engine.train_batch(iter(step[0]))
    try:
        engine.save_checkpoint(case["dir"])
        refused = "accepted"
    except NotImplementedError as error:
        refused = str(error)
    module.save_state_dict(case["dir"])
    comm.barrier()
    evaluation = micro_batches(1, 2, 4, 1, seed=2)[0][0]
    out = {"trained": float(engine.eval_batch(iter(evaluation))), "refused": refused}
    engine.destroy()
    other, engine = build(7)
    out["fresh"] = float(engine.eval_batch(iter(evaluation)))
    engine.destroy()
    other.load_state_dir(case["dir"])
    engine = partita.initialize(model=other, config=config(2, 4))[0]
    out["loaded"] = float(engine.eval_batch(iter(evaluation)))
    out["files"] = sorted(os.listdir(case["dir"]))
    engine.destroy()
    return out


RESUME_LOADS = [(2, 1), (4, 0), (1, 1)]
"""(pipeline stages, ZeRO stage) of the engines that load the pp 2 x dp 2 checkpoint."""


def _resume_run(
    case: dict[str, Any],
    stages: int,
    zero: int,
    seed: int,
    start: int,
    save: bool,
    saved: dict[str, torch.Tensor] | None = None,
) -> list[float]:
    """The tied model at `stages` stages over the 4 ranks (dp = 4 / stages), the same 16
    sequences per step whatever dp is; from step `start` on, after loading the checkpoint
    when `start` > 0, saving it after step 2 when `save` (and then copying this stage's
    module weights into `saved`, by their names in the whole model)."""
    micro = case["micro"]
    flat = [
        [mb for rank in step for mb in rank]
        for step in micro_batches(case["steps"], micro, case["gas"], 2)
    ]
    gas = len(flat[0]) * stages // 4
    module = PipelineModule(
        layer_specs(True), num_stages=stages, loss_fn=lm_loss, seed_layers=True, base_seed=seed
    )
    engine, _, _, _ = partita.initialize(model=module, config=config(micro, gas, zero))
    if start:
        engine.load_checkpoint(case["dir"], tag="two")
    r = engine.grid.get_data_parallel_rank()
    losses = []
    for i, step in enumerate(flat[start:], start):
        losses.append(float(engine.train_batch(iter(step[r * gas : (r + 1) * gas]))))
        if save and i == 1:
            engine.save_checkpoint(case["dir"], tag="two")
            for name, value in module.state_dict().items():
                if saved is not None:
                    saved[name] = value.detach().clone()
    engine.destroy()
    return losses


def resume(case: dict[str, Any]) -> dict[Any, Any]:
    """Engine checkpoints of a pipeline: trained at pp 2 x dp 2 (ZeRO 1, tied embedding),
    saved after step 2; freshly built, differently seeded modules load it at each of
    `RESUME_LOADS` and train the remaining steps. Every run's losses."""
    saved: dict[str, torch.Tensor] = {}
    out: dict[Any, Any] = {"whole": _resume_run(case, 2, 1, BASE_SEED, 0, True, saved)}
    out["saved"], out["dir"] = saved, case["dir"]
    out["files"] = sorted(os.listdir(os.path.join(case["dir"], "two")))
    for stages, zero in RESUME_LOADS:
        out[(stages, zero)] = _resume_run(case, stages, zero, 7, 2, False)
    return out


def save16(case: dict[str, Any]) -> dict[str, Any]:
    """Trains ``case["steps"]`` batches, then `save_16bit_model` into ``case["dir"]``; returns
    this rank's stage weights as its module holds them (gathered at ZeRO 3) and its stage."""
    from partita.zero.gather import GatheredParameters

    torch.manual_seed(0)
    module = PipelineModule(
        layer_specs(case["tied"]), num_stages=case["stages"], loss_fn=lm_loss,
        seed_layers=True, base_seed=BASE_SEED,
    )  # fmt: skip
    cfg = config(case["micro"], case["gas"], case.get("stage", 0))
    engine, _, _, _ = partita.initialize(model=module, config=cfg)
    dp_rank = engine.grid.get_data_parallel_rank()
    for step in micro_batches(case["steps"], case["micro"], case["gas"], case["dp"]):
        engine.train_batch(iter(step[dp_rank]))
    assert engine.save_16bit_model(case["dir"])
    with GatheredParameters(list(module.parameters())):
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out = {"stage": engine.stage_id, "dp_rank": dp_rank, "state": state, "dir": case["dir"]}
    engine.destroy()
    return out


def pipe_grid(kind: str, case: dict[str, Any]) -> Any:
    """One case of the grid: ``kind`` "train" (`pipe_train`), "bad" (`bad_input`),
    "reshard" (`reshard`), "resume" (`resume`) or "save16" (`save16`)."""
    if kind == "reshard":
        return reshard(case)
    if kind == "resume":
        return resume(case)
    if kind == "save16":
        return save16(case)
    if kind == "tensor_layers":
        return tensor_layers(case)
    return pipe_train(case) if kind == "train" else bad_input(case)


def _ds_seed(seed: Any) -> None:
    """DeepSpeed's own seeding, given a Python int: DeepSpeed 0.19.8 adds the base seed to a
    NumPy integer from its "parameters" partition, which ``random.seed`` refuses."""
    from deepspeed.runtime.utils import set_random_seed as ds_set_random_seed

    ds_set_random_seed(int(seed))


def deepspeed_then_partita(cases: list[dict[str, Any]]) -> list[dict[str, list[float]]]:
    """Each case trained by DeepSpeed's own PipelineEngine (0.19.8, CPU, gloo: the same layers
    built with its deepspeed.pipe classes, torch's fused AdamW as the client optimizer), then by
    partita's, in the same processes: both runs' per-step losses."""
    import os

    import deepspeed
    from deepspeed.pipe import LayerSpec as DSLayerSpec
    from deepspeed.pipe import PipelineModule as DSPipelineModule
    from deepspeed.pipe import TiedLayerSpec as DSTiedLayerSpec

    assert "partita" not in (deepspeed.__file__ or ""), "not DeepSpeed itself"
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's PipelineModule reads it
    deepspeed.init_distributed(dist_backend="gloo")
    out = []
    for case in cases:
        tied, dim = case["tied"], DIM
        first = (
            DSTiedLayerSpec("embed", nn.Embedding, VOCAB, dim)
            if tied
            else DSLayerSpec(nn.Embedding, VOCAB, dim)
        )
        last = (
            DSTiedLayerSpec("embed", nn.Embedding, VOCAB, dim, forward_fn=unembed)
            if tied
            else DSLayerSpec(nn.Linear, dim, VOCAB, bias=False)
        )
        blocks = [DSLayerSpec(Block, dim) for _ in range(BLOCKS)]
        module = DSPipelineModule(
            [first, *blocks, DSLayerSpec(nn.LayerNorm, dim), last],
            num_stages=case["stages"],
            loss_fn=lm_loss,
            seed_layers=True,
            base_seed=BASE_SEED,
            seed_fn=_ds_seed,
        )
        opt = torch.optim.AdamW(list(module.parameters()), lr=LR, weight_decay=0.01, fused=True)
        cfg = config(case["micro"], case["gas"])
        del cfg["optimizer"]
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
        dp_rank = engine.grid.get_data_parallel_rank()
        steps = micro_batches(case["steps"], case["micro"], case["gas"], case["dp"])
        ds_losses = [float(engine.train_batch(iter(s[dp_rank]))) for s in steps]
        out.append({"deepspeed": ds_losses, "partita": pipe_train(case)["losses"]})
    return out
