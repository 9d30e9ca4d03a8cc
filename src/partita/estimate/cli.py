"""``partita estimate`` and ``partita plan``: per-rank memory of every ZeRO configuration for a
model on given machines, and the fastest one that fits written as ``ds_config.json``.

Exit status 0, 1 when nothing fits (said plainly), 2 on bad input (one line naming the value).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from partita.estimate import plan, trial, zeropp_plan
from partita.estimate.memory import (
    DTYPE_BYTES,
    Candidate,
    Estimate,
    Hardware,
    Settings,
    candidates,
    estimate,
)
from partita.estimate.model import ModelShape
from partita.estimate.plan import HEADROOM
from partita.estimate.ulysses import ATTENTION, check_sequence_parallel
from partita.estimate.units import EstimateError, format_bytes, parse_bytes, parse_count
from partita.estimate.zeropp import ZeroPP

__all__ = ["estimate_main", "plan_main"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _share(text: str) -> float:
    value = _parse_fraction(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _parse_fraction(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


def _parse_fraction(text: str) -> float:
    try:
        return float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction such as 0.1 or 10%, got {text!r}"
        ) from None


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model folder (its config.json; no weights)")
    src.add_argument("--params", help="parameter count, e.g. 70B, 350M, 13e9")
    ap.add_argument("--largest_unit", help="with --params: parameters of the largest block")
    ap.add_argument("--devices_per_node", "--num_gpus", type=_positive, default=1)
    ap.add_argument("--nodes", "--num_nodes", type=_positive, default=1)
    ap.add_argument("--device_memory", help="per device, e.g. 80GB, 24GiB")
    ap.add_argument("--host_memory", help="per node, e.g. 512GB")
    ap.add_argument("--nvme", help="NVMe space per node, e.g. 4TB (enables NVMe offload)")
    ap.add_argument("--micro_batch", type=_positive, default=1)
    ap.add_argument("--seq_len", type=_positive, default=2048)
    ap.add_argument(
        "--sp", type=_positive, nargs="+", metavar="N",
        help="sequence_parallel_size (Ulysses): each rank holds seq_len / N tokens; several "
        "values estimate each (default: --ds_config's, else 1)",
    )  # fmt: skip
    ap.add_argument(
        "--ds_config",
        help="DeepSpeed config to read sequence_parallel_size and the ZeRO++ keys from",
    )
    zeropp_plan.add_arguments(ap)
    ap.add_argument(
        "--tiled_mlp", type=_positive, metavar="TOKENS",
        help="run each block's MLP as partita.tiling.TiledMLP over shards of at most TOKENS",
    )  # fmt: skip
    ap.add_argument(
        "--tiled_loss", type=_positive, metavar="TOKENS",
        help="run the LM head and loss as TiledFusedLogitsLoss over shards of at most TOKENS",
    )  # fmt: skip
    ap.add_argument(
        "--attention", choices=ATTENTION, default="traced",
        help="attention's memory: 'traced' (what the model's attention saves on fake tensors: "
        "the seq x seq scores for eager and SDPA's math path) or 'fused' (flash / "
        "memory-efficient kernels: inputs, output, a log-sum-exp per row)",
    )  # fmt: skip
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument(
        "--checkpointing", choices=["on", "off", "both"], default="both",
        help="activation checkpointing (default: consider both)",
    )  # fmt: skip
    ap.add_argument(
        "--cpu", action="store_true",
        help="ranks are CPU processes: their device memory is host memory (give --host_memory)",
    )  # fmt: skip
    ap.add_argument(
        "--headroom", type=_fraction, default=HEADROOM,
        help=f"fraction of each memory kept free for what the estimate misses ({HEADROOM})",
    )  # fmt: skip
    ap.add_argument("--detail", action="store_true", help="print every item of every config")
    ap.add_argument("--plot", metavar="FILE.png", help="stacked bars per configuration")
    return ap


def _model(args: argparse.Namespace, sp: int = 1) -> ModelShape:
    if args.params is not None:
        largest = (
            None if args.largest_unit is None else parse_count(args.largest_unit, "--largest_unit")
        )
        return ModelShape.from_count(parse_count(args.params, "--params"), largest)
    from partita.estimate.model import from_hf_config

    return from_hf_config(
        args.model, args.micro_batch, args.seq_len, _dtype(args), sp, args.attention,
        _tiling(args),
    )  # fmt: skip


def _tiling(args: argparse.Namespace) -> Any:
    from partita.estimate.tiled import Tiling

    return Tiling(args.tiled_mlp, args.tiled_loss)


def _dtype(args: argparse.Namespace) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]


def _sp_values(args: argparse.Namespace) -> list[int]:
    """The sequence-parallel degrees asked for: ``--sp``, else ``--ds_config``'s
    ``sequence_parallel_size``, else 1; each must divide the ranks."""
    if args.sp:
        values = list(dict.fromkeys(args.sp))
    elif args.ds_config:
        values = [_config_sp(args.ds_config)]
    else:
        values = [1]
    world = args.devices_per_node * args.nodes
    for sp in values:
        check_sequence_parallel(None, sp, world)
    return values


def _config_sp(path: str) -> int:
    """``sequence_parallel_size`` of a DeepSpeed JSON config (1 when absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise EstimateError(f"--ds_config {path!r}: not readable as JSON: {error}") from None
    sp = config.get("sequence_parallel_size", 1) if isinstance(config, dict) else None
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise EstimateError(
            f"--ds_config {path!r}: sequence_parallel_size {sp!r} must be an integer >= 1"
        )
    return sp


def _hardware(args: argparse.Namespace) -> Hardware:
    return Hardware(
        args.devices_per_node,
        args.nodes,
        None if args.device_memory is None else parse_bytes(args.device_memory, "--device_memory"),
        None if args.host_memory is None else parse_bytes(args.host_memory, "--host_memory"),
        None if args.nvme is None else parse_bytes(args.nvme, "--nvme"),
        "cpu" if args.cpu else "cuda",
        args.headroom,
    )


def _candidates(
    args: argparse.Namespace, hw: Hardware, activations: bool, zeropp: Sequence[ZeroPP] = ()
) -> list[Candidate]:
    """The configurations to estimate; each stage-3 one without parameter offload once more
    with each of `zeropp`'s options."""
    ckpt = {"on": True, "off": False, "both": None}[args.checkpointing]
    if not activations:
        ckpt = False  # without shapes checkpointing changes nothing estimated
    base = [
        c
        for c in candidates(args.precision, ckpt)
        if hw.nvme is not None or "nvme" not in (c.offload_optimizer, c.offload_param)
    ]
    more = [
        replace(c, zeropp=o)
        for o in zeropp
        for c in base
        if c.stage == 3 and c.offload_param == "none"
    ]
    return base + more


def _zeropp(args: argparse.Namespace, planning: bool) -> list[ZeroPP]:
    """The ZeRO++ options to price: those asked for (flags, else ``--ds_config``), checked
    against the machines; else, when planning on several nodes, the planner's variants."""
    asked = zeropp_plan.options(args)
    if asked is not None:
        zeropp_plan.check(asked, args.devices_per_node, args.devices_per_node * args.nodes)
        return [asked]
    if planning and args.nodes > 1:
        return zeropp_plan.variants(args.devices_per_node)
    return []


def _estimates(
    args: argparse.Namespace, sp: int = 1, planning: bool = False
) -> tuple[ModelShape, list[Estimate]]:
    """One rank's model (at sequence-parallel degree `sp`) and every candidate's estimate."""
    hw = _hardware(args)
    zeropp = _zeropp(args, planning)
    model = _model(args, sp)
    cands = _candidates(args, hw, model.activations is not None, zeropp)
    return model, [estimate(model, c, hw, Settings()) for c in cands]


def _print_zeropp(model: ModelShape, estimates: list[Estimate]) -> None:
    """Each ZeRO++ option set's bytes per rank and step by group and link, and its memory."""
    hw = estimates[0].hardware
    seen: dict[tuple[ZeroPP, str], None] = {}
    for e in estimates:
        if e.candidate.zeropp is not None:
            seen[(e.candidate.zeropp, e.candidate.precision)] = None
    for opts, precision in seen:
        figures = zeropp_plan.priced(model.units, hw.world, opts, DTYPE_BYTES[precision])
        for line in zeropp_plan.describe(f"{opts.label} {precision}", figures, hw.nodes):
            print(line)


_LIMIT_FLAGS = {"device": "--device_memory", "host": "--host_memory", "nvme": "--nvme"}
PER_PARAM_NOTE = (
    "bytes/param: one rank's bytes (device + host + nvme) per trainable parameter. The familiar "
    "16 is 2 weights + 2 gradients + 4 fp32 master + 8 Adam moments (16-bit, nothing sharded); "
    "partita also keeps fp32 gradients for the masters (+4, sharded with them from stage 1), "
    "and counts buffers (gathered units, reduce buckets, staging), activations, the allocator's "
    "slack (10% of the live bytes on CUDA, 5% on CPU ranks) and other (a CPU rank's runtime)"
)
"""Printed under the table: where a row's bytes per parameter differ from the familiar 16."""


def _verdict(e: Estimate) -> str:
    """A row's verdict: "fits", "NO: ..." and what was not checked. A memory whose limit was
    not given is never called fitting (1.1 TB of host memory is "host unchecked")."""
    unchecked = e.unchecked()
    flags = ", ".join(_LIMIT_FLAGS[what] for what in unchecked)
    open_ = f"{' and '.join(unchecked)} unchecked (give {flags})" if unchecked else ""
    if not e.fits:
        return "NO: " + "; ".join(e.shortfalls()) + (f"; {open_}" if open_ else "")
    checked = [what for what, need, have in e.needs() if need and have is not None]
    if not open_:
        return "fits"
    return (f"fits {' and '.join(checked)}; " if checked else "") + open_


def _row(e: Estimate) -> str:
    return (
        f"{e.candidate.label:30s} {format_bytes(e.device):>10s} {format_bytes(e.host_per_node):>10s}"
        f" {format_bytes(e.nvme_per_node):>10s}  {_verdict(e)}"
    )


def _per_param_row(e: Estimate) -> str:
    """The row's bytes per trainable parameter by group, adding up to its total."""
    per = e.per_param()
    # The familiar four always (a 0 there says something); the rest only where present.
    parts = " + ".join(
        f"{name} {v:.2f}"
        for name, v in per.items()
        if name != "total" and (v or name in ("weights", "grads", "master", "moments"))
    )
    return f"    bytes/param: {parts} = {per['total']:.2f}"


def _print(model: ModelShape, estimates: list[Estimate], detail: bool, sp: int = 1) -> None:
    hw = estimates[0].hardware
    tokens = f", micro-batch {model.micro_batch} x {model.seq_len} tokens" if model.seq_len else ""
    if sp > 1:
        per_rank = f" ({model.seq_len // sp} per rank)" if model.seq_len else ""
        tokens += f", sequence_parallel_size {sp}{per_rank}"
    print(
        f"{model.name}: {model.trainable / 1e9:.3g}B trainable parameters on {hw.nodes} node(s) "
        f"x {hw.devices_per_node} device(s)" + tokens
    )
    print(f"{'configuration':30s} {'device/rank':>10s} {'host/node':>10s} {'nvme/node':>10s}")
    shared = estimates[0].notes[1:]  # the first note names the moment of each one's peak
    for e in estimates:
        print(_row(e))
        print(_per_param_row(e))
        if detail:
            for i in e.items:
                print(
                    f"    {i.name:20s} {format_bytes(i.device):>10s} {format_bytes(i.host):>10s}"
                    f" {format_bytes(i.nvme):>10s}  (per rank)"
                )
            for note in e.notes[:1] + [n for n in e.notes[1:] if n not in shared]:
                print(f"    {note}")  # its own: the moment of its peak first
    for note in shared:
        print(f"note: {note}")
    print(f"note: {PER_PARAM_NOTE}")
    unchecked = sorted({w for e in estimates for w in e.unchecked()})
    if unchecked:
        flags = ", ".join(_LIMIT_FLAGS[w] for w in unchecked)
        print(
            f"note: {' and '.join(unchecked)} memory not checked: {flags} not given, so no row "
            "is said to fit it"
        )


def _nothing_fits(estimates: list[Estimate], longest_hint: bool = False) -> str:
    best = min(estimates, key=lambda e: e.device)
    hint = " --longest finds the longest sequence that fits." if longest_hint else ""
    return (
        "Nothing fits: no configuration meets the memory given. The least device memory is "
        f"{best.candidate.label} at {format_bytes(best.device)} per device "
        f"({'; '.join(best.shortfalls())}).{hint}"
    )


def estimate_main(argv: Sequence[str]) -> int:
    """``partita estimate``: prints every configuration's per-rank memory and whether it fits."""
    ap = _parser("partita estimate", estimate_main.__doc__ or "")
    ap.add_argument(
        "--longest", action="store_true",
        help="search the longest sequence (a multiple of sp) each configuration fits at each "
        "--sp, and itemise one rank's memory there (needs --model and a memory limit)",
    )  # fmt: skip
    ap.add_argument(
        "--max_seq_len", type=_positive, default=1 << 24,
        help="with --longest: the longest sequence searched (default 16M tokens)",
    )  # fmt: skip
    args = ap.parse_args(list(argv))
    if args.longest:
        return _longest_main(args)
    everything: list[Estimate] = []
    try:
        for sp in _sp_values(args):
            model, estimates = _estimates(args, sp)
            _print(model, estimates, args.detail, sp)
            _print_zeropp(model, estimates)
            everything += estimates
        if args.plot:
            from partita.estimate.plot import plot_estimates

            plot_estimates(everything, args.plot)
            print(f"wrote {args.plot}")
    except EstimateError as error:
        print(f"partita estimate: error: {error}", file=sys.stderr)
        return 2
    if not any(e.fits for e in everything):
        print(_nothing_fits(everything, args.model is not None))
        return 1
    return 0


def _longest_main(args: argparse.Namespace) -> int:
    """``partita estimate --longest``: the longest sequence of every configuration and degree,
    with one rank's memory there by group (`longest.format_longest`)."""
    from partita.estimate import longest
    from partita.estimate.model import load_hf_config

    try:
        if args.model is None:
            raise EstimateError("--longest needs --model: activations come from its shapes")
        hw = _hardware(args)
        if (hw.host_memory if hw.accelerator == "cpu" else hw.device_memory) is None:
            need = "--host_memory (with --cpu)" if args.cpu else "--device_memory"
            raise EstimateError(f"--longest needs a memory to fit: give {need}")
        found = []
        for sp in _sp_values(args):
            shape, fit = longest.fit_sequence(
                args.model, args.micro_batch, sp, _dtype(args), args.attention,
                tiling=_tiling(args),
            )  # fmt: skip
            found += [
                longest.longest_sequence(shape, fit, c, hw, args.max_seq_len)
                for c in _candidates(args, hw, True)
            ]
    except EstimateError as error:
        print(f"partita estimate: error: {error}", file=sys.stderr)
        return 2
    config = load_hf_config(args.model)
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    tiled = _tiling(args).any
    print(longest.format_longest(shape, hw, found, positions, tiled))
    return 0 if any(r.seq_len for r in found) else 1


def _compute_rate(args: argparse.Namespace) -> float:
    """The calibrated compute rate: the model's own forward and backward when its config is
    given, else a square matmul; on the threads one CPU rank gets with ``--cpu``."""
    import torch

    from partita.estimate import calibrate
    from partita.estimate.model import load_hf_config

    threads = calibrate.rank_threads(args.devices_per_node) if args.cpu else None
    if args.model is None:
        return calibrate.calibrate_flops(threads=threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
    config = load_hf_config(args.model)
    return calibrate.calibrate_model_flops(
        config, args.micro_batch, args.seq_len, dtype, threads=threads
    )


def plan_main(argv: Sequence[str]) -> int:
    """``partita plan``: ranks the configurations that fit by predicted step time and writes
    the fastest as a DeepSpeed config."""
    ap = _plan_parser()
    args = ap.parse_args(list(argv))
    if args.trial and (args.model is None or args.nodes != 1):
        ap.error("--trial runs the model on this node: it needs --model and --nodes 1")
    try:
        sp = _plan_sp(args)
        rates = _rates(args)
        model, estimates = _estimates(args, sp, planning=True)
    except EstimateError as error:
        print(f"partita plan: error: {error}", file=sys.stderr)
        return 2
    tokens = args.micro_batch * args.seq_len // sp  # one rank's share of the sequence
    a2a = _a2a_link_bytes(args, sp)
    ranked = plan.rank(
        estimates, model.trainable, tokens, rates, model.recomputed, a2a, model.units
    )
    kept = (
        plan.kept_out_by_headroom(model, estimates, ranked, tokens, rates, a2a)
        if args.headroom > 0
        else []
    )
    if not ranked and not (args.trial and kept):
        print(_nothing_fits(estimates))
        return 1
    _print_ranking(ranked)
    ranked = _zeropp_choice(model, estimates, ranked)
    best: Candidate | None = ranked[0][0].candidate if ranked else None
    if args.trial:
        try:
            best = _trial(args, kept, best)
        except trial.TrialError as error:
            print(f"partita plan: error: {error}", file=sys.stderr)
            return 2
    if best is None:  # only trials could have found one, and none fit
        print(_nothing_fits(estimates))
        return 1
    config = plan.ds_config(best, args.micro_batch, args.nvme_path, sp)
    plan.write_ds_config(args.output, config)
    extra = " (enable activation checkpointing in the model)" if best.checkpointing else ""
    print(f"chose {best.label}; wrote {args.output}{extra}")
    if not args.trial:
        _print_kept_out(args, estimates, ranked, kept)
    return 0


def _a2a_link_bytes(args: argparse.Namespace, sp: int) -> int:
    """What one forward's Ulysses all-to-alls send from a rank over links (0 without sp or
    without a model config to read the layers and heads from)."""
    if sp == 1 or args.model is None:
        return 0
    from partita.estimate.memory import DTYPE_BYTES
    from partita.estimate.model import load_hf_config
    from partita.estimate.ulysses import all_to_all_bytes

    config = load_hf_config(args.model)
    whole = all_to_all_bytes(
        config, args.micro_batch, args.seq_len, sp, DTYPE_BYTES[args.precision]
    )
    return whole * (sp - 1) // sp  # each rank keeps its own block


def _plan_sp(args: argparse.Namespace) -> int:
    """The one sequence-parallel degree ``partita plan`` plans for."""
    values = _sp_values(args)
    if len(values) > 1:
        raise EstimateError(
            f"partita plan takes one --sp, got {' '.join(map(str, values))} (partita estimate "
            "compares degrees)"
        )
    if args.trial and values[0] > 1:
        raise EstimateError(
            f"--trial runs the model without sequence parallelism: sequence_parallel_size "
            f"{values[0]} cannot be tried (leave out --trial)"
        )
    return values[0]


def _plan_parser() -> argparse.ArgumentParser:
    ap = _parser("partita plan", plan_main.__doc__ or "")
    ap.add_argument(
        "--flops",
        help="training FLOP/s per rank (default: a short calibration on the model's own "
        "forward and backward, or a matmul with --params)",
    )
    ap.add_argument("--link_bandwidth", default="100GB", help="collective bytes/s per rank")
    ap.add_argument(
        "--inter_node_bandwidth", default="25GB",
        help="bytes/s one rank sends across nodes, with --nodes > 1 (default 25GB: a 200 "
        "Gb/s network port per device); --link_bandwidth is inside a node",
    )  # fmt: skip
    ap.add_argument("--host_bandwidth", default="20GB", help="device-host bytes/s per rank")
    ap.add_argument(
        "--adam_rate",
        help="CPU Adam parameters/s per rank (default: measured here with --cpu, else 1B)",
    )
    ap.add_argument("--disk_bandwidth", default="3GB", help="NVMe bytes/s per node")
    ap.add_argument(
        "--comm_cpu_share",
        type=_share,
        default=1.0,
        help="with --cpu: the part of a collective's time its own CPU work takes, which "
        "compute beside it cannot hide (1: none hidden; benchmarks/bench_estimate.py "
        "measures it for gloo)",
    )
    ap.add_argument("--nvme_path", help="directory for NVMe offload files in the config")
    ap.add_argument("--output", default="ds_config.json", help="where to write the config")
    ap.add_argument(
        "--trial",
        action="store_true",
        help="run each configuration predicted faster than the choice that only --headroom "
        "kept out for 3 steps on this node (fastest first; needs --model) and take the "
        f"first whose measured peak leaves {trial.TRIAL_MARGIN:.0%} free",
    )
    return ap


def _rates(args: argparse.Namespace) -> plan.Rates:
    """The rates the step time is predicted from: given, defaults, or calibrated here."""
    from partita.estimate import calibrate

    # CPU ranks share the node's cores: calibrate with the threads one of them gets.
    threads = calibrate.rank_threads(args.devices_per_node) if args.cpu else None
    flops = float(parse_count(args.flops, "--flops")) if args.flops else _compute_rate(args)
    if args.adam_rate is not None:
        adam = float(parse_count(args.adam_rate, "--adam_rate"))
    else:
        adam = calibrate.calibrate_adam_rate(threads=threads) if args.cpu else 1e9
    return plan.Rates(
        flops,
        parse_bytes(args.link_bandwidth, "--link_bandwidth"),
        parse_bytes(args.host_bandwidth, "--host_bandwidth"),
        adam,
        parse_bytes(args.disk_bandwidth, "--disk_bandwidth"),
        inter_node_bandwidth=parse_bytes(args.inter_node_bandwidth, "--inter_node_bandwidth"),
        comm_cpu_share=args.comm_cpu_share,
    )


QUANTIZED_GAIN = 0.05
"""The predicted gain a quantized plan (qwZ or qgZ) must show over the fastest exact one to be
chosen: quantizing changes the numbers (within bounds, docs/zero.md) and its own compute is
not in the step time. A chosen bar, not a measured one; hpZ alone is exact and needs none."""


def _zeropp_choice(
    model: ModelShape, estimates: list[Estimate], ranked: list[tuple[Estimate, plan.Timing]]
) -> list[tuple[Estimate, plan.Timing]]:
    """`ranked` with the choice first, after saying why the fastest ZeRO++ configuration is
    chosen or not (nothing when none was priced)."""
    tried = [e for e in estimates if e.candidate.zeropp is not None]
    if not tried:
        return ranked
    zpp = [(e, t) for e, t in ranked if e.candidate.zeropp is not None]
    exact = [(e, t) for e, t in ranked if e.candidate.zeropp is None]
    if not zpp:
        least = min(tried, key=plan.rank_need)
        print(
            f"zero++: none of the {len(tried)} ZeRO++ configurations fits; the least memory, "
            f"{least.candidate.label}: {'; '.join(least.shortfalls())}"
        )
        return ranked
    (ze, zt) = zpp[0]
    if not exact:
        print(f"zero++: chose {ze.candidate.label}: no exact configuration fits")
        return ranked
    (be, bt) = exact[0]
    why = _zeropp_why(model, ze, zt, be, bt)
    quantized = ze.candidate.zeropp is not None and (
        ze.candidate.zeropp.quantized_weights or ze.candidate.zeropp.quantized_gradients
    )
    bar = QUANTIZED_GAIN if quantized else 0.0
    if ranked[0][0] is ze and 1 - zt.total / bt.total >= bar:
        print(f"zero++: chose {ze.candidate.label}: {why}")
        return ranked
    if ranked[0][0] is ze:  # quantized, faster, but under the bar: the exact one instead
        print(f"zero++: rejected {ze.candidate.label}: {why}, under the {bar:.0%} a quantized "
              "plan must gain")  # fmt: skip
        return [(be, bt)] + [et for et in ranked if et[0] is not be]
    print(f"zero++: rejected {ze.candidate.label}: {why}")
    return ranked


def _zeropp_why(
    model: ModelShape, ze: Estimate, zt: plan.Timing, be: Estimate, bt: plan.Timing
) -> str:
    """The comparison printed: step times, gain, and inter-node bytes where stage 3 has them."""
    hw = ze.hardware
    gain = 1 - zt.total / bt.total if bt.total else 0.0
    text = (
        f"predicted {zt.total:.3g} s a step against {bt.total:.3g} s for {be.candidate.label}, "
        f"the fastest exact configuration ({gain:+.0%})"
    )
    if be.candidate.stage == 3:
        inter = [
            zeropp_plan.link_bytes(
                zeropp_plan.priced(
                    model.units, hw.world, e.candidate.zeropp or ZeroPP(),
                    DTYPE_BYTES[e.candidate.precision],
                ),
                hw.nodes,
            )["inter"]
            for e in (ze, be)
        ]  # fmt: skip
        text += f"; inter-node bytes per rank and step {inter[0]:,} against {inter[1]:,}"
    return text


def _print_ranking(ranked: list[tuple[Estimate, plan.Timing]]) -> None:
    print(
        f"{'configuration':30s} {'step s':>8s} {'compute':>8s} {'comm':>8s} {'offload':>8s} {'nvme':>8s}"
    )
    for e, t in ranked:
        print(
            f"{e.candidate.label:30s} {t.total:8.3g} {t.compute:8.3g} {t.comm:8.3g}"
            f" {t.offload:8.3g} {t.nvme:8.3g}"
        )


def _trial(
    args: argparse.Namespace,
    kept: list[tuple[Estimate, plan.Timing]],
    chosen: Candidate | None,
) -> Candidate | None:
    """``--trial``: runs the configurations the headroom kept out, fastest first, and returns
    the first whose measured peak per rank fits with `trial.TRIAL_MARGIN` to spare (else
    `chosen`, None when nothing fit the headroom either)."""
    for e, _ in kept:
        hw = e.hardware
        # What one rank may use: the device, or on CPU ranks its share of the node's host.
        have = hw.device_memory if hw.accelerator != "cpu" else hw.host_memory
        assert have is not None  # a configuration kept out by the headroom had a limit
        if hw.accelerator == "cpu":
            have //= hw.devices_per_node
        limit = int(have * (1 - trial.TRIAL_MARGIN))
        run = trial.trial_peaks(
            args.model, e.candidate, hw.devices_per_node, args.micro_batch, args.seq_len,
            hw.accelerator, nvme_path=args.nvme_path,
        )  # fmt: skip
        predicted = format_bytes(plan.rank_need(e))
        what = f"trial: {e.candidate.label} (predicted {predicted} per rank)"
        if run.error is not None:
            print(f"{what} failed: {run.error}")
        elif run.peak > limit:
            print(f"{what} peaked at {format_bytes(run.peak)}, over {format_bytes(limit)}")
        else:
            print(f"{what} peaked at {format_bytes(run.peak)}, within {format_bytes(limit)}")
            return e.candidate
    return chosen


def _print_kept_out(
    args: argparse.Namespace,
    estimates: list[Estimate],
    ranked: list[tuple[Estimate, plan.Timing]],
    faster: list[tuple[Estimate, plan.Timing]],
) -> None:
    """Names the faster configurations only the headroom kept out, and by how much."""
    short = {e.candidate: e.shortfalls() for e in estimates}
    chosen = ranked[0][1].total
    for e, t in faster:
        print(
            f"note: {e.candidate.label} is predicted {1 - t.total / chosen:.0%} faster and fits "
            f"the memory in full, not with the {args.headroom:.0%} --headroom kept free for "
            f"what the estimate misses ({'; '.join(short[e.candidate])})"
        )
