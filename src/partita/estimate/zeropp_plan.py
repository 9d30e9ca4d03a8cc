"""ZeRO++ in ``partita estimate`` and ``partita plan``: the options from flags or a DeepSpeed
config, the memory items and per-link seconds `price` gives them, the variants the planner
tries on several nodes, and the lines both commands print.

[Note: ZeRO++ in the planner]
A node is `Hardware.devices_per_node` ranks; hpZ's group is a node (or a part of one: the
group must lie inside a node, so its bytes are intra-node) and qgZ's lane crosses nodes. On
one node every group is intra-node. A group of g ranks moves (g - 1)/g of the bytes `price`
counts per rank (its own share stays), at ``--link_bandwidth`` inside a node and at
``--inter_node_bandwidth`` across nodes: a collective over ranks of several nodes goes at the
slower link's pace. The planner tries qwZ, hpZ (one node), qwZ + hpZ, qgZ + hpZ and all three
(int4, no error feedback: DeepSpeed's defaults) on every stage-3 configuration without
parameter offload when the job spans nodes; quantizing's own compute is not modelled, so a
quantized plan wins only on the links' time it saves, and an exact one wins ties.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from partita.estimate.units import EstimateError, format_bytes
from partita.estimate.zeropp import (
    LANE_GROUP,
    NODE_GROUP,
    WORLD_GROUP,
    Price,
    ZeroPP,
    group_sizes,
    price,
)

__all__ = [
    "add_arguments",
    "check",
    "config_options",
    "describe",
    "link_bytes",
    "link_seconds",
    "options",
    "priced",
    "variants",
]

KEYS = (
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_quantized_gradients_bits",
    "zero_quantized_gradients_error_feedback",
    "zero_hpz_partition_size",
)
"""The ``zero_optimization`` keys priced (DeepSpeed's names, and partita's two qgZ keys)."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ZeRO++ flags, named as the config keys (stage-3 rows only)."""
    ap.add_argument(
        "--zero_quantized_weights", action="store_true", default=None,
        help="ZeRO++ qwZ: stage 3 gathers weights as int8 blocks",
    )  # fmt: skip
    ap.add_argument(
        "--zero_quantized_gradients", action="store_true", default=None,
        help="ZeRO++ qgZ: stage 3 reduces gradients in two quantized hops (needs hpZ)",
    )  # fmt: skip
    ap.add_argument("--zero_quantized_gradients_bits", type=int, choices=[4, 8], default=None)
    ap.add_argument("--zero_quantized_gradients_error_feedback", action="store_true", default=None)
    ap.add_argument(
        "--zero_hpz_partition_size", type=int, metavar="H", default=None,
        help="ZeRO++ hpZ: a secondary copy of 1/H of every unit; H ranks inside one node",
    )  # fmt: skip


def options(args: argparse.Namespace) -> ZeroPP | None:
    """The ZeRO++ options asked for: the flags when any is given, else ``--ds_config``'s
    ``zero_optimization`` keys; None when neither turns one on."""
    given = {k: getattr(args, k, None) for k in KEYS}
    raw = {k: v for k, v in given.items() if v is not None}
    if not raw and getattr(args, "ds_config", None):
        raw = config_options(args.ds_config)
    opts = ZeroPP(
        quantized_weights=bool(raw.get("zero_quantized_weights", False)),
        quantized_gradients=bool(raw.get("zero_quantized_gradients", False)),
        gradient_bits=int(raw.get("zero_quantized_gradients_bits", 8)),
        error_feedback=bool(raw.get("zero_quantized_gradients_error_feedback", False)),
        hpz=int(raw.get("zero_hpz_partition_size", 1)),
    )
    if opts.error_feedback and not opts.quantized_gradients:
        raise EstimateError(
            "zero_quantized_gradients_error_feedback needs zero_quantized_gradients"
        )
    return opts if opts.any else None


def config_options(path: str) -> dict[str, Any]:
    """The ZeRO++ keys a DeepSpeed JSON config sets (refused below stage 3, as partita's
    config refuses them)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise EstimateError(f"--ds_config {path!r}: not readable as JSON: {error}") from None
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
    if not isinstance(zero, dict):
        raise EstimateError(f"--ds_config {path!r}: zero_optimization must be an object")
    raw = {k: zero[k] for k in KEYS if k in zero}
    for key, value in raw.items():
        want = bool if key.endswith(("weights", "gradients", "feedback")) else int
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise EstimateError(f"--ds_config {path!r}: zero_optimization.{key} {value!r}")
    # What turns an option on (True == 1 in Python: the booleans are tested as such).
    on = [k for k, v in raw.items() if v is True or (k == KEYS[4] and v > 1)]
    if on and zero.get("stage", 0) != 3:
        raise EstimateError(
            f"--ds_config {path!r}: zero_optimization.{on[0]} is priced at stage 3 only "
            f"(stage {zero.get('stage', 0)}; the estimate does not price qwZ's all-gather at "
            "stages 1-2 yet)"
        )
    return raw


def check(opts: ZeroPP, devices_per_node: int, world: int) -> None:
    """Refuses what the engine refuses, and an hpZ group that would span nodes (its bytes
    would not be intra-node)."""
    h = opts.hpz
    if h < 1 or world % h:
        raise EstimateError(
            f"zero_hpz_partition_size {h} must be a positive divisor of the {world} ranks"
        )
    if devices_per_node % h:
        raise EstimateError(
            f"zero_hpz_partition_size {h} must divide the {devices_per_node} devices per node "
            "(hpZ's group lies inside a node)"
        )
    if opts.quantized_gradients and h <= 1:
        raise EstimateError(
            "zero_quantized_gradients needs zero_hpz_partition_size > 1 (qgZ's node groups)"
        )


def variants(devices_per_node: int) -> list[ZeroPP]:
    """What the planner tries on several nodes ([Note: ZeRO++ in the planner])."""
    out = [ZeroPP(quantized_weights=True)]
    if devices_per_node > 1:
        h = devices_per_node
        out += [
            ZeroPP(hpz=h),
            ZeroPP(quantized_weights=True, hpz=h),
            ZeroPP(quantized_gradients=True, hpz=h),
            ZeroPP(quantized_weights=True, quantized_gradients=True, hpz=h),
        ]
    return out


def priced(units: tuple[tuple[int, ...], ...], world: int, opts: ZeroPP, nbytes: int) -> Price:
    """`price` for one micro-batch a step, weights and gradients in the module dtype."""
    try:
        return price(units, world, opts, nbytes, nbytes)
    except ValueError as error:
        raise EstimateError(str(error)) from None


def _link(group: str, nodes: int) -> str:
    return "intra" if nodes == 1 or group == NODE_GROUP else "inter"


def link_bytes(p: Price, nodes: int) -> dict[str, int]:
    """Bytes per rank and step by link ("intra", "inter") as the counters record them."""
    out = {"intra": 0, "inter": 0}
    for group, n in list(p.gather.items()) + list(p.reduce.items()):
        out[_link(group, nodes)] += n
    return out


def link_seconds(
    p: Price, opts: ZeroPP, world: int, nodes: int, intra: float, inter: float
) -> tuple[float, float]:
    """(gathers' seconds, gradient reductions' seconds) of one step: each group's bytes times
    (g - 1)/g at its link's bandwidth ([Note: ZeRO++ in the planner])."""
    sizes = group_sizes(world, opts)

    def seconds(by_group: dict[str, int]) -> float:
        total = 0.0
        for group, n in by_group.items():
            g = sizes[group]
            rate = intra if _link(group, nodes) == "intra" else inter
            total += n * (g - 1) / g / rate if g > 1 else 0.0
        return total

    return seconds(p.gather), seconds(p.reduce)


def _names(by_group: dict[str, int], nodes: int) -> str:
    name = {WORLD_GROUP: "world", NODE_GROUP: "hpz", LANE_GROUP: "hpz_lane"}
    return ", ".join(f"{name[g]} {n:,} B ({_link(g, nodes)})" for g, n in by_group.items())


def describe(label: str, p: Price, nodes: int) -> list[str]:
    """The lines ``partita estimate`` prints for one set of options: bytes per rank and step
    by group and by link, and the memory per rank the options add."""
    links = link_bytes(p, nodes)
    return [
        f"zero++ {label}: per rank and step (1 micro-batch): gathers {_names(p.gather, nodes)}; "
        f"gradient reductions {_names(p.reduce, nodes)}",
        f"    inter node {links['inter']:,} B, intra node {links['intra']:,} B; memory per rank:"
        f" hpZ secondary {p.secondary_bytes:,} B, error feedback {p.feedback_bytes:,} B, "
        f"qgZ buffers {p.transient_bytes:,} B ({format_bytes(_memory(p))} in all)",
    ]


def _memory(p: Price) -> int:
    return p.secondary_bytes + p.feedback_bytes + p.transient_bytes
