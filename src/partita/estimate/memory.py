"""Per-rank memory of one ZeRO configuration, itemised, from partita's own storage layout.

What each stage holds (read from ``partita/zero``; Ψ trainable elements, N data-parallel ranks,
p bytes per element of the module dtype, masters and their gradients fp32, Adam's two moments
fp32):

- stage 0 (``zero/stage0.py``): the module's parameters and gradient buckets (pΨ each); with a
  16-bit module, fp32 masters *and their fp32 gradients* (4Ψ + 4Ψ); optimizer state 8Ψ.
- stages 1-2 (``zero/sharded.py``, ``sharded_grads.py``): parameters pΨ; master, gradient and
  optimizer shards (4 + 4 + 8)Ψ/N, on the host under ``offload_optimizer``; stage 1 also keeps
  the full gradients (pΨ); stage 2 reduces through a pool of at most three buckets.
- stage 3 (``zero/stage3``): parameter shards pΨ/N (host or NVMe under ``offload_param``),
  parameters below the persistence threshold whole; masters (a copy unless the shard itself is
  fp32 and stays with the optimizer), their gradients and optimizer state as stages 1-2; while
  running, a window of gathered units (the current one, one prefetched, those kept for reuse,
  at most ``stage3_max_live_parameters``), per-unit gradient buffers and, under NVMe offload,
  swap buffers. These peak at different moments of a step (the activations at the loss's
  backward, NVMe write-through late in backward, swapped sub-groups in the step): the
  estimate is the largest moment's, not the sum of each buffer's largest (``stage3.py``).

Every stage releases its gradients after the step and makes them again in the next backward,
so the activations' peak (the loss's backward) holds none: each stage's estimate is its largest
moment's (``backward.py`` for stages 0-2). `Estimate.items` are that moment's; the model
states while they exist (all gradients included, as DeepSpeed counts them) are
`Estimate.states`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from partita.estimate.backward import GradLayout, pool_peak, stage012_moments
from partita.estimate.model import ModelShape
from partita.estimate.stage3_moments import Moment, Stage3Layout, moments
from partita.estimate.units import EstimateError, format_bytes
from partita.estimate.zeropp import ZeroPP, price
from partita.zero.stage3.settings import Stage3Settings

_RUN = Stage3Settings.defaults()
"""What stage 3 runs by when a config sets none of its keys: the estimator's defaults, so the
two cannot drift apart."""

__all__ = [
    "CPU_RUNTIME",
    "DTYPE_BYTES",
    "MODEL_STATES",
    "PER_PARAM_GROUPS",
    "Candidate",
    "Estimate",
    "Hardware",
    "Item",
    "Settings",
    "candidates",
    "estimate",
]

Offload = Literal["none", "cpu", "nvme"]
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CPU_RUNTIME = 64 << 20
"""What a CPU rank adds beyond its tensors once training runs: libraries loaded on first use
(gloo, oneDNN, the CPU Adam kernel), thread stacks and per-thread malloc arenas. A GPT-2 of
0.1M parameters measured 67-70 MiB of RSS over a post-import baseline after 3 steps at 2 ranks,
torch 2.13 (``tests/test_estimate_plan.py`` runs under a cap that counts it)."""
_COPY_SLICE_NUMEL = 1 << 22  # partita.zero.shard_step.COPY_SLICE_NUMEL (pinned copy-back slice)
MODEL_STATES = ("parameters", "gradients", "fp32 masters", "optimizer state")
"""The items DeepSpeed's estimator counts ("model states")."""
PER_PARAM_GROUPS = {
    "parameters": "weights",
    "gradients": "grads",
    "fp32 masters": "master",
    "optimizer state": "moments",
    "gathered units": "buffers",
    "reduce buckets": "buffers",
    "nvme buffers": "buffers",
    "pinned staging": "buffers",
    "activations": "activations",
    "gradient transient": "activations",
    "allocator slack": "slack",
    "runtime": "other",
    "hpz secondary": "weights",
    "qgz feedback": "grads",
    "qgz buffers": "buffers",
}
"""Which group of `Estimate.per_param` each item falls in: the familiar 16 bytes per parameter
(2 weights + 2 gradients + 4 fp32 master + 8 Adam moments) against what partita holds besides."""


@dataclass(frozen=True)
class Hardware:
    """The machines: ranks, and memory per device, per node (host) and NVMe per node."""

    devices_per_node: int = 1
    nodes: int = 1
    device_memory: int | None = None
    host_memory: int | None = None
    nvme: int | None = None
    accelerator: Literal["cuda", "cpu"] = "cuda"
    """"cuda": host copies are staged through pinned buffers; "cpu": the ranks are CPU
    processes, so what a GPU rank would hold on its device is host memory too."""
    headroom: float = 0.0
    """Fraction of each memory kept free for what the estimate misses (the CLI's default is
    `partita.estimate.plan.HEADROOM`)."""

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise EstimateError(f"{name} {getattr(self, name)} must be >= 1")
        if not 0.0 <= self.headroom < 1.0:
            raise EstimateError(f"headroom {self.headroom} must be in [0, 1)")
        if self.accelerator == "cpu" and self.device_memory is not None:
            raise EstimateError(
                "device_memory has no meaning for CPU ranks (their device is the host): "
                "give host_memory"
            )
        for name in ("device_memory", "host_memory", "nvme"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise EstimateError(f"{name} {value} must be >= 0 bytes")

    @property
    def world(self) -> int:
        """Data-parallel ranks."""
        return self.devices_per_node * self.nodes


@dataclass(frozen=True)
class Settings:
    """The ``zero_optimization`` values that change memory, with partita's defaults (those
    stage 3 runs by, `Stage3Settings.defaults`: note ``reduce_bucket_size`` 4M elements, not
    DeepSpeed's 5e8)."""

    reduce_bucket_size: int = _RUN.reduce_bucket_size
    stage3_prefetch_bucket_size: int = _RUN.prefetch_bucket_size
    stage3_max_live_parameters: int = _RUN.max_live_parameters
    stage3_max_reuse_distance: int = _RUN.max_reuse_distance
    stage3_param_persistence_threshold: int = _RUN.param_persistence_threshold
    sub_group_size: int = _RUN.sub_group_size
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    param_max_in_cpu: int = 0
    """offload_param.max_in_cpu: NVMe parameter offload keeps this many shard elements per
    rank in host memory instead, units taking from it in build order while their shard fits."""
    nvme_pipeline: bool = False
    """offload_optimizer.pipeline_read/write: up to three sub-groups resident instead of one."""
    optimizer_bytes_per_param: int = 8
    """Adam/AdamW: two fp32 moments."""
    allocator_slack: float | None = None
    """Memory the allocator holds beyond live tensors (fragmentation); None: 0.10 on CUDA
    (torch's caching allocator), 0.05 on CPU ranks (partita's host allocator keeps what it
    maps within 1.05x of the peak requested, ``platform/host_cache.py``)."""


@dataclass(frozen=True)
class Candidate:
    """One configuration: ZeRO stage, offload targets, precision, activation checkpointing."""

    stage: int
    offload_optimizer: Offload = "none"
    offload_param: Offload = "none"
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    checkpointing: bool = False
    zeropp: ZeroPP | None = None
    """ZeRO++'s options (stage 3 only; None: none on)."""

    def __post_init__(self) -> None:
        if self.zeropp is not None and self.stage != 3:
            raise EstimateError(f"ZeRO++ ({self.zeropp.label}) is stage 3 only")
        if self.stage not in (0, 1, 2, 3):
            raise EstimateError(f"stage {self.stage} must be 0, 1, 2 or 3")
        if self.precision not in DTYPE_BYTES:
            raise EstimateError(f"precision {self.precision!r} must be fp32, bf16 or fp16")
        if self.stage == 0 and self.offload_optimizer != "none":
            raise EstimateError("offload_optimizer needs stage 1, 2 or 3 (got stage 0)")
        if self.stage < 3 and "nvme" in (self.offload_optimizer, self.offload_param):
            raise EstimateError(f"NVMe offload needs stage 3 (got stage {self.stage})")
        if self.stage < 3 and self.offload_param != "none":
            raise EstimateError(f"offload_param needs stage 3 (got stage {self.stage})")

    @property
    def label(self) -> str:
        """Short name: ``z3 opt=cpu param=nvme bf16 ckpt``."""
        parts = [f"z{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt={self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param={self.offload_param}")
        parts.append(self.precision + (" ckpt" if self.checkpointing else ""))
        if self.zeropp is not None:
            parts.append(self.zeropp.label)
        return " ".join(parts)


@dataclass(frozen=True)
class Item:
    """One kind of memory on one rank, by where it lives (bytes)."""

    name: str
    device: int = 0
    host: int = 0
    nvme: int = 0


@dataclass
class Estimate:
    """The itemised per-rank memory of a candidate on some hardware."""

    candidate: Candidate
    hardware: Hardware
    items: list[Item]
    notes: list[str] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)
    """Each item's own largest bytes over a step (buffers and gradients peak at different
    moments, so an item may exceed its value in `items`, which are those of the peak's
    moment)."""
    states: list[Item] = field(default_factory=list)
    """The model states while they exist (gradients whole); empty: as in `items`."""
    trainable: int = 0
    """The model's trainable parameters (Ψ), what `per_param` divides by."""

    def total(self, where: Literal["device", "host", "nvme"]) -> int:
        """Sum over items of one rank's bytes in `where`."""
        return sum(getattr(i, where) for i in self.items)

    def model_states(self, where: Literal["device", "host", "nvme"] = "device") -> int:
        """Parameters, gradients, masters and optimizer state while they exist (DeepSpeed's
        "model states"; the peak's moment may hold fewer gradients, see `items`)."""
        return sum(getattr(i, where) for i in self.states or self.items if i.name in MODEL_STATES)

    @property
    def device(self) -> int:
        """Peak device bytes per rank."""
        return self.total("device")

    @property
    def host_per_node(self) -> int:
        """Host bytes per node (every rank of the node)."""
        return self.total("host") * self.hardware.devices_per_node

    @property
    def nvme_per_node(self) -> int:
        """NVMe bytes per node."""
        return self.total("nvme") * self.hardware.devices_per_node

    def needs(self) -> list[tuple[Literal["device", "host", "nvme"], int, int | None]]:
        """(memory, bytes needed, bytes given or None) for the device (per device), the host
        and NVMe (per node). A CPU rank's device is host memory: counted there, not twice."""
        hw = self.hardware
        cpu = hw.accelerator == "cpu"
        host = self.host_per_node + (self.device * hw.devices_per_node if cpu else 0)
        return [
            ("device", 0 if cpu else self.device, hw.device_memory),
            ("host", host, hw.host_memory),
            ("nvme", self.nvme_per_node, hw.nvme),
        ]

    def shortfalls(self) -> list[str]:
        """Why this does not fit (empty when it fits or no limits were given)."""
        hw, out = self.hardware, []
        for what, need, have in self.needs():
            if not need or have is None:
                continue
            usable = int(have * (1.0 - hw.headroom))
            if need > usable:
                scope = "per device" if what == "device" else "per node"
                kept = f" ({hw.headroom:.0%} kept free)" if hw.headroom else ""
                out.append(
                    f"{what} needs {format_bytes(need)} {scope}, has {format_bytes(have)}{kept}"
                )
        return out

    @property
    def fits(self) -> bool:
        """True when every limit given is met (see `unchecked` for the memories not given)."""
        return not self.shortfalls()

    def unchecked(self) -> list[str]:
        """The memories ("device", "host", "nvme") this configuration uses whose limit was not
        given: `fits` says nothing about them."""
        return [what for what, need, have in self.needs() if need and have is None]

    def per_param(self) -> dict[str, float]:
        """One rank's bytes (device + host + NVMe) per trainable parameter, by group of items
        (`PER_PARAM_GROUPS`: weights, grads, master, moments, buffers, activations, slack,
        other),
        with their sum as "total"; so the familiar 16 can be read against this estimate."""
        psi = max(self.trainable, 1)
        out = dict.fromkeys(dict.fromkeys(PER_PARAM_GROUPS.values()), 0.0)
        for i in self.items:
            group = PER_PARAM_GROUPS.get(i.name, "other")
            out[group] += (i.device + i.host + i.nvme) / psi
        out["total"] = sum(out.values())
        return out


def _place(where: Offload, nbytes: int) -> dict[str, int]:
    key = {"none": "device", "cpu": "host", "nvme": "nvme"}[where]
    return {key: nbytes}


def _window(units: list[int], settings: Settings) -> int:
    """Elements gathered at once in stage 3: the current unit and the next (when it fits the
    prefetch bucket), or more kept for reuse, never past the live bound (one unit always)."""
    if not units:
        return 0
    ordered = sorted(units, reverse=True)
    largest = ordered[0]
    following = ordered[1] if len(ordered) > 1 else 0
    base = largest + (following if following <= settings.stage3_prefetch_bucket_size else 0)
    reuse = min(sum(units), settings.stage3_max_reuse_distance + largest)
    return max(largest, min(max(base, reuse), settings.stage3_max_live_parameters))


def _stage2_buffers(m: ModelShape, n: int, bucket_numel: int) -> int:
    """Elements of stage 2's pooled gradient buffers at their most (zero/sharded_grads.py):
    segments are cut from the parameters last first; a segment of one parameter whose gradient
    fills it is reduced from the gradient itself, any other is copied into a pooled buffer;
    the pool's own rules decide the rest (`pool_peak`)."""
    from partita.partition import plan_buckets

    sizes = m.param_order
    plan = plan_buckets(sizes, bucket_numel, order=reversed(range(len(sizes))))
    copied = [
        -(-b.numel // n) * n  # padded to the ranks
        for b in plan
        if not (len(b.indices) == 1 and sizes[b.indices[0]] % n == 0)
    ]
    return pool_peak(copied)


def _stage012(c: Candidate, m: ModelShape, n: int, s: Settings, p: int) -> list[Item]:
    """Stages 0-2's model states while they exist; the moments say when (`_stage012_moments`)."""
    psi = m.trainable
    master = p != 4
    if c.stage == 0:
        return [
            Item("parameters", device=m.total * p),
            Item("gradients", device=psi * p + (psi * 4 if master else 0)),
            Item("fp32 masters", device=psi * 4 if master else 0),
            Item("optimizer state", device=psi * s.optimizer_bytes_per_param),
        ]
    dev, host = _shard_grads(c, m, n)
    return [
        Item("parameters", device=m.total * p),
        Item("gradients", device=(psi * p if c.stage == 1 else 0) + dev, host=host),
        Item("fp32 masters", **_place(c.offload_optimizer, -(-psi // n) * 4)),
        Item(
            "optimizer state",
            **_place(c.offload_optimizer, -(-psi // n) * s.optimizer_bytes_per_param),
        ),
    ]


def _shard_grads(c: Candidate, m: ModelShape, n: int) -> tuple[int, int]:
    """(device, host) bytes of the fp32 gradient shards of stages 1-3 while they exist (none
    held under NVMe optimizer offload: they are swapped out between uses)."""
    if c.stage == 0 or c.offload_optimizer == "nvme":
        return 0, 0
    nbytes = -(-m.trainable // n) * 4
    return (0, nbytes) if c.offload_optimizer == "cpu" else (nbytes, 0)


def _activation_fields(c: Candidate, m: ModelShape, p: int) -> dict[str, Any]:
    """The moments' activation sizes (none when the shapes are unknown): what the forward
    saved without the loss's two transients of the largest activation, that activation, what
    each block's backward frees (last block first: its inputs alone under checkpointing),
    and the largest parameter's gradient as autograd computes it."""
    acts = m.activations
    if acts is None:
        return {}
    frees = acts.block_inputs if c.checkpointing else acts.block_saved
    # A tiled backward's recompute, when larger, stands in for the loss's two transients.
    largest = max(acts.largest, -(-acts.recompute // 2))
    return {
        "held": acts.peak(c.checkpointing) - max(2 * acts.largest, acts.recompute),
        "largest_activation": largest,
        "block_frees": tuple(reversed(frees)),
        "transient": m.largest_param * p,
    }


def _stage012_moments(c: Candidate, m: ModelShape, n: int, s: Settings, p: int) -> list[Moment]:
    """The moments of a stage 0-2 step ([Note: stage 0-2 moments] in ``backward.py``)."""
    pool = _stage2_buffers(m, n, s.reduce_bucket_size) * p if c.stage == 2 else 0
    lay = GradLayout(
        m.param_order,
        m.arrivals,
        s.reduce_bucket_size,
        p,
        c.stage < 2,
        _shard_grads(c, m, n),
        m.trainable * 4 if c.stage == 0 and p != 4 else 0,
        pool,
    )
    return stage012_moments(replace(lay, **_activation_fields(c, m, p)))


def _stage3(c: Candidate, m: ModelShape, n: int, s: Settings, p: int) -> list[Item]:
    """Stage 3's model states while they exist; the moments say when (`_stage3_moments`)."""
    units, persistent = m.unit_sizes(s.stage3_param_persistence_threshold)
    sharded = sum(units) + m.frozen
    shard = -(-m.trainable // n)
    aliased = p == 4 and c.offload_optimizer != "nvme" and c.offload_param != "nvme"
    aliased = aliased and c.offload_optimizer == c.offload_param
    params = _place(c.offload_param, -(-sharded // n) * p)
    if c.offload_param == "nvme":
        in_cpu = sum(-(-u // n) for u in units) - sum(_swapped(units, n, s.param_max_in_cpu))
        params = {"host": in_cpu * p, "nvme": params["nvme"] - in_cpu * p}
    params["device"] = params.get("device", 0) + persistent * p + -(-persistent // n) * p
    opt = c.offload_optimizer
    return [
        Item("parameters", **params),
        Item("gradients", **_place(opt, shard * 4)),  # NVMe: swapped out between uses
        Item("fp32 masters", **_place(opt, 0 if aliased else shard * 4)),
        Item("optimizer state", **_place(opt, shard * s.optimizer_bytes_per_param)),
    ]


def _swapped(units: list[int], n: int, max_in_cpu: int) -> list[int]:
    """Per-rank shard elements of the units NVMe parameter offload swaps: in build order,
    each unit whose shard fits what is left of ``max_in_cpu`` stays in host memory
    (``zero/stage3/strategy.py``, `_UnitFactory`)."""
    left, out = max_in_cpu, []
    for u in units:
        shard = -(-u // n)
        if shard <= left:
            left -= shard
        else:
            out.append(shard)
    return out


def _stage3_moments(c: Candidate, m: ModelShape, n: int, s: Settings, p: int) -> list[Moment]:
    """The moments of a stage-3 step ([Note: stage-3 moments] in ``stage3.py``)."""
    units, persistent = m.unit_sizes(s.stage3_param_persistence_threshold)
    lay = Stage3Layout(
        units, persistent, n, p, _window(units, s), s.reduce_bucket_size,
        head_unit=m.head_unit, shard_grads=_shard_grads(c, m, n),
        swapped=_swapped(units, n, s.param_max_in_cpu),
    )  # fmt: skip
    lay = replace(lay, **_activation_fields(c, m, p))
    return moments(
        lay,
        c.offload_optimizer == "nvme",
        c.offload_param == "nvme",
        s.sub_group_size,
        3 if s.nvme_pipeline else 1,
        (s.param_buffer_count, s.param_buffer_size),
        s.optimizer_bytes_per_param,
    )


_MOMENT_FIELDS = {
    "gathered units": "gathered",
    "reduce buckets": "reduce",
    "nvme buffers": "nvme",
    "activations": "activations",
    "gradient transient": "transient",
}


def _moment_items(
    c: Candidate, m: ModelShape, hw: Hardware, moms: list[Moment], states: list[Item]
) -> tuple[list[Item], list[Item], dict[str, int], str]:
    """(model states and buffers as the peak's moment holds them, items after the staging
    ones, each item's own largest over the moments, a note naming the moment that decides
    the peak). On CPU ranks the moment with the most device + host bytes decides; on GPUs the
    one with the most device bytes, and host memory holds the largest of what the moments
    keep there (NVMe buffers, offloaded gradient shards)."""
    cpu = hw.accelerator == "cpu"
    # Of moments holding as much, the latest names the peak: with no activations or arrivals
    # known, the head's backward is counted holding every gradient, as the later ones do.
    peak = max(reversed(moms), key=lambda mo: mo.device + (mo.nvme + mo.host_grads if cpu else 0))
    before = [_grads_at(i, peak, moms, cpu) if i.name == "gradients" else i for i in states]
    if c.stage == 3:
        before.append(Item("gathered units", device=peak.gathered))
    before.append(Item("reduce buckets", device=peak.reduce))
    after = []
    if "nvme" in (c.offload_optimizer, c.offload_param):
        after.append(Item("nvme buffers", host=peak.nvme if cpu else max(mo.nvme for mo in moms)))
    if m.activations is not None:
        after.append(Item("activations", device=peak.activations))
        after.append(Item("gradient transient", device=peak.transient))
    moving = [i for i in before + after if i.name in _MOMENT_FIELDS]
    own = {i.name: max(getattr(mo, _MOMENT_FIELDS[i.name]) for mo in moms) for i in moving}
    grads = next(i for i in states if i.name == "gradients")
    own["gradients"] = grads.nvme + max(mo.grads + mo.host_grads for mo in moms)
    note = f"stage {c.stage} peaks at the {peak.name}; items are that moment's"
    later = [
        f"{name} {format_bytes(v)}" for name, v in own.items() if v > _value(before + after, name)
    ]
    if later:
        note += " (at other moments: " + ", ".join(later) + ")"
    return before, after, own, note


def _grads_at(whole: Item, peak: Moment, moms: list[Moment], cpu: bool) -> Item:
    """The gradients a moment holds (those swapped to NVMe stay where they are)."""
    host = peak.host_grads if cpu else max(mo.host_grads for mo in moms)
    return replace(whole, device=peak.grads, host=host)


def _value(items: list[Item], name: str) -> int:
    return sum(i.device + i.host + i.nvme for i in items if i.name == name)


def _buffers(c: Candidate, m: ModelShape, hw: Hardware, s: Settings, p: int) -> list[Item]:
    """Host-side staging: pinned copy-back slices (optimizer offload on GPUs)."""
    n = hw.world
    if c.offload_optimizer != "none" and hw.accelerator == "cuda":
        return [Item("pinned staging", host=2 * min(_COPY_SLICE_NUMEL, -(-m.trainable // n)) * p)]
    return []


def estimate(
    model: ModelShape,
    candidate: Candidate,
    hardware: Hardware,
    settings: Settings | None = None,
) -> Estimate:
    """The itemised per-rank memory of `candidate` for `model` on `hardware`."""
    s = settings or Settings()
    p = DTYPE_BYTES[candidate.precision]
    n = hardware.world
    notes = []
    staging = _buffers(candidate, model, hardware, s, p)
    if candidate.stage == 3:
        states = _stage3(candidate, model, n, s, p)
        moms = _stage3_moments(candidate, model, n, s, p)
    else:
        states = _stage012(candidate, model, n, s, p)
        moms = _stage012_moments(candidate, model, n, s, p)
    before, after, peaks, note = _moment_items(candidate, model, hardware, moms, states)
    items = before + staging + after + _zeropp_items(candidate, model, n, p)
    notes.append(note)
    if model.activations is None:
        notes.append("activations not included: give a model or config for its shapes")
    live = sum(i.device for i in items)
    if hardware.accelerator == "cpu":  # one allocator serves a CPU rank's "device" and host
        live += sum(i.host for i in items)
    slack = s.allocator_slack
    if slack is None:
        slack = 0.05 if hardware.accelerator == "cpu" else 0.10
    items.append(Item("allocator slack", device=int(live * slack)))
    if hardware.accelerator == "cpu":
        items.append(Item("runtime", device=CPU_RUNTIME))
    else:
        notes.append("the CUDA context and library workspaces are not included")
    own = {i.name: i.device + i.host + i.nvme for i in items} | peaks
    return Estimate(candidate, hardware, items, notes, own, states, model.trainable)


def _zeropp_items(c: Candidate, m: ModelShape, n: int, p: int) -> list[Item]:
    """What ZeRO++ adds to a rank, counted at every moment (`partita.estimate.zeropp.price`):
    hpZ's secondary copy and qgZ's error-feedback residuals live between steps; qgZ's packed
    buffers of one reduction in flight are counted at the peak too (backward reduces while
    its activations are still held)."""
    if c.zeropp is None:
        return []
    priced = price(m.units, n, c.zeropp, p, p)
    return [
        Item("hpz secondary", device=priced.secondary_bytes),
        Item("qgz feedback", device=priced.feedback_bytes),
        Item("qgz buffers", device=priced.transient_bytes),
    ]


def candidates(precision: str = "bf16", checkpointing: bool | None = None) -> list[Candidate]:
    """Every configuration partita runs: stage 0; stages 1-2 x optimizer offload none/cpu;
    stage 3 x (optimizer, parameter) offload. `checkpointing` None tries both."""
    ckpts = [False, True] if checkpointing is None else [checkpointing]
    combos: list[tuple[int, Offload, Offload]] = [(0, "none", "none")]
    combos += [(st, o, "none") for st in (1, 2) for o in ("none", "cpu")]
    combos += [
        (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"),
        (3, "nvme", "none"), (3, "nvme", "cpu"), (3, "nvme", "nvme"),
    ]  # fmt: skip
    return [
        Candidate(st, o, pa, precision, ck)  # type: ignore[arg-type]
        for st, o, pa in combos
        for ck in ckpts
    ]
