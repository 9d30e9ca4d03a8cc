"""Offload benchmarks: NVMe swap throughput vs the disk, and CPU Adam step throughput.

(a) Swap: the disk's sequential bandwidth is measured first, in the same run and folder, with
    a plain single-threaded O_DIRECT write (then fsync) and read of ``--disk-mb`` MiB in
    ``--block-size`` requests from an aligned buffer. Then `SwapSpace` writes and reads the same
    number of bytes as ``--slots`` tensors through `ThreadPoolIO` for each ``--threads`` value
    (write time includes the fsync of every swap file). Reported as MB/s and as a fraction of
    the disk's (goal >= 0.8).
(b) CPU Adam: parameters updated per second by one AdamW step on a flat fp32 tensor of each
    ``--adam-sizes`` size, with each ``--adam-threads`` count of torch threads: partita's
    `CPUAdamW` and `cpu_adam_step` (its own kernel), ``torch.optim.AdamW`` with
    ``foreach=True``, ``fused=True`` and the per-tensor loop, DeepSpeed's ``DeepSpeedCPUAdam``
    when ``import deepspeed`` works (its first use compiles C++ for minutes; ``--no-deepspeed``
    skips it), and a memory-bandwidth ceiling: a C loop moving the same bytes as one Adam step
    with no arithmetic (``csrc/stream_probe.cpp``). Steps are interleaved round by round; the
    tables give the fastest and median step and, per implementation, the median and quartiles
    over rounds of its step time divided by partita's in the same round (robust to the
    machine's drift; quartiles on both sides of 1.00 mean no difference beyond the noise).
    A second table times the step as an offloaded engine runs it, ending with the updated
    weights in bf16: partita's `step_with_copy_back` (the kernel writes the bf16 weights in the
    same pass) against each optimizer's step followed by the cast (``Tensor.copy_``), which is
    what torch's and DeepSpeed's CPU Adam need (DeepSpeed 0.19's ZeRO-Offload casts after its
    step the same way).
(c) End-to-end stage 3 step time with and without each offload is the ``offload`` suite of
    ``bench_zero.py`` (``--suites offload``): whole training jobs, like the other suites.

    .venv/bin/python benchmarks/bench_offload.py [--dir /tmp] [--disk-mb 1024] [--block-size 1048576]
        [--threads 1,4] [--adam-sizes 1e6,1e7,5e7] [--adam-threads 1,2] [--repeats 21]

Prints markdown tables; writes ``benchmarks/results/offload.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything can import deepspeed

import torch

from partita.offload import (
    AdamHyper,
    SwapSpace,
    ThreadPoolIO,
    aligned_empty,
    byte_view,
    cpu_adam_step,
    probe_directory,
)
from partita.optim import CPUAdamW, adam_kernel
from partita.platform import native
from partita.zero.shard_step import COPY_SLICE_NUMEL, host_step

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_offload)
    from benchmarks.common import environment, write_results
else:  # python benchmarks/bench_offload.py: this folder is sys.path[0]
    from common import environment, write_results

MB = 1e6
HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


# ---------------------------------------------------------------- (a) swap vs disk


def disk_bandwidth(folder: Path, nbytes: int, block: int) -> dict[str, float]:
    """Plain sequential O_DIRECT write (+ fsync) and read of ``nbytes`` in ``block`` requests."""
    buf = aligned_empty(block, torch.uint8)
    buf.random_(0, 256)
    view = byte_view(buf, 0, block)
    path = folder / "partita-disk-probe.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.pwritev(fd, [view], offset)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.preadv(fd, [view], offset)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"write_MBps": nbytes / write_s / MB, "read_MBps": nbytes / read_s / MB}


def swap_bandwidth(
    folder: Path, nbytes: int, block: int, threads: int, queue_depth: int, slots: int
) -> dict[str, float]:
    """`SwapSpace` write (+ fsync) and read of ``nbytes`` split over ``slots`` fp32 tensors."""
    numel = nbytes // 4 // slots
    tensors = [aligned_empty(numel, torch.float32) for _ in range(slots)]
    for t in tensors:
        t.normal_()
    io = ThreadPoolIO(block_size=block, queue_depth=queue_depth, threads=threads)
    with SwapSpace(folder, rank=0, aio=io, run_id=f"bench-{os.getpid()}") as space:
        for i in range(slots):
            space.register(f"t{i}", numel, torch.float32)
        start = time.perf_counter()
        for i, t in enumerate(tensors):
            space.swap_out(f"t{i}", t)
        space.sync()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for i, t in enumerate(tensors):
            space.swap_in(f"t{i}", t)
        space.wait()
        read_s = time.perf_counter() - start
    io.close()
    moved = numel * 4 * slots
    return {"write_MBps": moved / write_s / MB, "read_MBps": moved / read_s / MB}


def bench_swap(args: argparse.Namespace) -> dict[str, Any]:
    """Part (a): disk baseline and swap throughput per thread count, ``--rounds`` times
    interleaved (the machine's load drifts); medians, and the swap/disk fractions of medians."""
    folder = Path(args.dir)
    probe = probe_directory(folder)
    nbytes = int(args.disk_mb * 2**20) // args.block_size * args.block_size
    disk_runs: list[dict[str, float]] = []
    swap_runs: dict[int, list[dict[str, float]]] = {t: [] for t in args.threads}
    for _ in range(args.rounds):
        disk_runs.append(disk_bandwidth(folder, nbytes, args.block_size))
        for threads in args.threads:
            swap_runs[threads].append(
                swap_bandwidth(
                    folder, nbytes, args.block_size, threads, args.queue_depth, args.slots
                )
            )

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    disk = {k: med(disk_runs, k) for k in ("write_MBps", "read_MBps")}
    rows = []
    for threads, runs in swap_runs.items():
        swap = {k: med(runs, k) for k in ("write_MBps", "read_MBps")}
        rows.append(
            {
                "threads": threads,
                **swap,
                "write_fraction": swap["write_MBps"] / disk["write_MBps"],
                "read_fraction": swap["read_MBps"] / disk["read_MBps"],
                "runs": runs,
            }
        )
    return {
        "dir": str(folder),
        "direct_io": probe.direct_io,
        "bytes": nbytes,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "rounds": args.rounds,
        "disk": {**disk, "runs": disk_runs},
        "swap": rows,
    }


def swap_markdown(res: dict[str, Any]) -> str:
    """Table of part (a)."""
    disk = res["disk"]
    lines = [
        f"### NVMe swap vs the disk ({res['bytes'] / 2**20:.0f} MiB, block {res['block_size']} B, "
        f"queue depth {res['queue_depth']}, O_DIRECT {res['direct_io']}, {res['dir']}; "
        f"medians of {res['rounds']} interleaved rounds)",
        "",
        "| path | write MB/s | write vs disk | read MB/s | read vs disk |",
        "|---|---:|---:|---:|---:|",
        f"| disk: plain sequential O_DIRECT | {disk['write_MBps']:.0f} | 1.00 | {disk['read_MBps']:.0f} | 1.00 |",
    ]
    for row in res["swap"]:
        lines.append(
            f"| SwapSpace, {row['threads']} thread(s) | {row['write_MBps']:.0f} | {row['write_fraction']:.2f} "
            f"| {row['read_MBps']:.0f} | {row['read_fraction']:.2f} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- (b) CPU Adam


def _time_interleaved(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` steps per implementation. Each round times one step of
    every implementation, in an order rotated every round, so drift of the machine and the
    position in a round hit all alike. One untimed warm-up step each first (state allocation,
    kernel selection)."""
    for step in steps.values():
        step()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_no in range(repeats):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _flat(n: int) -> tuple[torch.Tensor, ...]:
    return torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)


def _torch_adamw(
    n: int, *, fused: bool | None = None, foreach: bool | None = None, cls: type = torch.optim.AdamW
) -> Callable[[], None]:
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = cls([param], lr=HYPER.lr, weight_decay=HYPER.weight_decay, fused=fused, foreach=foreach)
    return opt.step


def _partita(n: int) -> Callable[[], None]:
    param, grad, m, v = _flat(n)
    counter = [0]

    def step() -> None:
        counter[0] += 1
        cpu_adam_step([param], [grad], [m], [v], counter[0], HYPER)

    return step


def _torch_direct(n: int) -> Callable[[], None]:
    """torch's fused kernel called as `cpu_adam_step` calls ours: without torch.optim's
    bookkeeping, so the two rows compare the kernels alone."""
    param, grad, m, v = _flat(n)
    counter = [0]

    def step() -> None:
        counter[0] += 1
        torch._fused_adamw_(
            [param], [grad], [m], [v], [], [torch.tensor(float(counter[0]))], lr=HYPER.lr,
            beta1=HYPER.beta1, beta2=HYPER.beta2, weight_decay=HYPER.weight_decay,
            eps=HYPER.eps, amsgrad=False, maximize=False,
        )  # fmt: skip

    return step


def _deepspeed(n: int) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([param], lr=HYPER.lr, weight_decay=HYPER.weight_decay, adamw_mode=True)
    return opt.step


def _quartiles(values: list[float]) -> list[float]:
    """[first quartile, median, third quartile] of ``values``."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, median, q3]


def _stream_probe() -> Callable[[int], Callable[[], None]]:
    """The memory-bandwidth ceiling (benchmarks/csrc/stream_probe.cpp), built like partita's
    own C++ helpers."""
    source = Path(__file__).resolve().parent / "csrc" / "stream_probe.cpp"
    cxx = native.compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    flags = ["-march=native", "-fopenmp"]
    probe = ctypes.CDLL(str(native.build_library(source, cxx, flags=flags))).partita_stream_probe
    probe.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int32]

    def make(n: int) -> Callable[[], None]:
        tensors = _flat(n)

        def step() -> None:  # holds `tensors`: the probe only sees their addresses
            probe(*(t.data_ptr() for t in tensors), n, torch.get_num_threads())

        return step

    return make


def _with_copy(
    make: Callable[[int, torch.nn.Parameter], Callable[[], None]],
) -> Callable[[int], Callable[[], None]]:
    """A step of ``make`` followed by the cast of the updated weights into bf16 weights (what
    torch's and DeepSpeed's optimizers need after their step under offload)."""

    def build(n: int) -> Callable[[], None]:
        param = torch.nn.Parameter(torch.randn(n))
        param.grad = torch.randn(n)
        weights = torch.empty(n, dtype=torch.bfloat16)
        step = make(n, param)

        def run() -> None:
            step()
            weights.copy_(param.detach())

        return run

    return build


def _partita_fused(n: int) -> Callable[[], None]:
    """What stages 1-3 run with host masters: `step_with_copy_back` over the engine's slices,
    the kernel writing the bf16 weights in the same pass."""
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    weights = torch.empty(n, dtype=torch.bfloat16)
    opt = CPUAdamW([param], lr=HYPER.lr, weight_decay=HYPER.weight_decay)
    return host_step(opt, [param], [[(0, weights)]], COPY_SLICE_NUMEL)


def _optimizer_on(
    cls: type, **kwargs: Any
) -> Callable[[int, torch.nn.Parameter], Callable[[], None]]:
    def make(n: int, param: torch.nn.Parameter) -> Callable[[], None]:
        del n
        return cls([param], lr=HYPER.lr, weight_decay=HYPER.weight_decay, **kwargs).step

    return make


PARTITA = "partita CPUAdamW (own kernel)"
PARTITA_FUSED = "partita step_with_copy_back (cast in the kernel)"
CEILING = "memory ceiling (stream probe)"


def bench_adam(args: argparse.Namespace) -> dict[str, Any]:
    """Part (b): parameters/s of each implementation at each size, per thread count; then the
    same with the cast of the updated weights to bf16 that an offloaded step needs."""
    impls: dict[str, Callable[[int], Callable[[], None]]] = {
        PARTITA: lambda n: _torch_adamw(n, cls=CPUAdamW),
        "partita cpu_adam_step (own kernel)": _partita,
        "torch AdamW fused": lambda n: _torch_adamw(n, fused=True),
        "torch _fused_adamw_ (direct call)": _torch_direct,
        "torch AdamW foreach": lambda n: _torch_adamw(n, foreach=True),
        "torch AdamW for-loop": lambda n: _torch_adamw(n, foreach=False),
    }
    copying: dict[str, Callable[[int], Callable[[], None]]] = {
        PARTITA_FUSED: _partita_fused,
        "partita CPUAdamW, then cast": _with_copy(_optimizer_on(CPUAdamW)),
        "torch AdamW fused, then cast": _with_copy(_optimizer_on(torch.optim.AdamW, fused=True)),
    }
    notes: dict[str, str] = {"partita kernel": "in use: bitwise torch's fused update"}
    if not adam_kernel.available():  # partita's rows then run torch's fused kernel
        notes["partita kernel"] = f"not used: {adam_kernel.why_not()}"
    if args.deepspeed:
        try:
            _deepspeed(16)()  # compiles the extension on first use
            impls["DeepSpeedCPUAdam"] = _deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            copying["DeepSpeedCPUAdam, then cast"] = _with_copy(
                _optimizer_on(DeepSpeedCPUAdam, adamw_mode=True)
            )
        except Exception as exc:  # not installed or the build failed: row skipped, reason kept
            notes["DeepSpeedCPUAdam"] = f"skipped: {type(exc).__name__}: {str(exc)[:200]}"
    try:
        impls[CEILING] = _stream_probe()
    except (OSError, RuntimeError) as exc:
        notes[CEILING] = f"skipped: {exc}"
    return {
        "sizes": args.adam_sizes,
        "threads": args.adam_threads,
        "runs": _measure(impls, PARTITA, args),
        "runs_with_cast": _measure(copying, PARTITA_FUSED, args),
        "notes": notes,
        "repeats": args.repeats,
    }


def _measure(
    impls: dict[str, Callable[[int], Callable[[], None]]], ref: str, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Per "threads/size": each implementation's best and median parameters/s and the
    quartiles of its step time over ``ref``'s in the same round."""
    runs: dict[str, dict[str, Any]] = {}
    for threads in args.adam_threads:
        torch.set_num_threads(threads)
        for n in args.adam_sizes:
            times = _time_interleaved({name: make(n) for name, make in impls.items()}, args.repeats)
            runs[f"{threads}/{n}"] = {
                name: {
                    "best": n / min(t),
                    "median": n / statistics.median(t),
                    # Paired: this implementation's step over partita's in the same round;
                    # the quartiles show whether a difference is more than the noise.
                    "vs_partita": _quartiles([a / b for a, b in zip(t, times[ref], strict=True)]),
                }
                for name, t in times.items()
            }
    return runs


def _ratio_cell(quartiles: list[float]) -> str:
    q1, median, q3 = quartiles
    return f"{median:.2f} ({q1:.2f}-{q3:.2f})"


def adam_markdown(res: dict[str, Any]) -> str:
    """Part (b) tables, one per thread count and kind of step: M params/s of the fastest step
    (median in brackets) and the median over rounds of the step time over partita's in the
    same round."""
    lines: list[str] = []
    kinds = (("runs", "CPU AdamW step"), ("runs_with_cast", "CPU AdamW step + bf16 weights"))
    for key, title in kinds:
        for threads in res["threads"]:
            runs = {n: res[key][f"{threads}/{n}"] for n in res["sizes"]}
            lines += _table(f"{title}, {threads} thread(s)", runs, res["repeats"])
    lines += [f"- {name}: {note}" for name, note in res["notes"].items()]
    return "\n".join(lines) + "\n"


def _table(title: str, runs: dict[int, dict[str, Any]], repeats: int) -> list[str]:
    names = list(next(iter(runs.values())))
    head = " | ".join(f"{n / 1e6:g}M" for n in runs)
    lines = [
        f"### {title}: M params/s, fastest of {repeats} interleaved steps (median); time / "
        "partita's in the same round, median (quartiles)",
        "",
        f"| implementation | {head} | {head} |",
        "|---|" + "---:|" * 2 * len(runs),
    ]
    for name in names:
        speed = [
            f"{r[name]['best'] / 1e6:.0f} ({r[name]['median'] / 1e6:.0f})" for r in runs.values()
        ]
        ratio = [_ratio_cell(r[name]["vs_partita"]) for r in runs.values()]
        lines.append(f"| {name} | {' | '.join(speed)} | {' | '.join(ratio)} |")
    return [*lines, ""]


# ---------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="folder on the disk to test")
    parser.add_argument(
        "--disk-mb",
        type=float,
        default=256,
        help="MiB moved per measurement (1024+ on an idle machine)",
    )
    parser.add_argument(
        "--block-size", type=int, default=1 << 20, help="bytes per request (aio.block_size)"
    )
    parser.add_argument("--queue-depth", type=int, default=8, help="aio.queue_depth")
    parser.add_argument(
        "--threads", type=_ints, default=[1, 4], help="aio.intra_op_parallelism values"
    )
    parser.add_argument(
        "--slots", type=int, default=8, help="swap tensors the bytes are split into"
    )
    parser.add_argument(
        "--adam-sizes", type=_ints, default=[1_000_000, 10_000_000], help="elements"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed optimizer steps per size")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved disk/swap rounds")
    parser.add_argument(
        "--adam-threads", type=_ints, default=[torch.get_num_threads()], help="torch threads"
    )
    parser.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
    parser.add_argument("--skip-swap", action="store_true")
    parser.add_argument("--skip-adam", action="store_true")
    args = parser.parse_args()

    payload: dict[str, Any] = {
        "environment": environment(),
        "note": "taken on a shared, busy machine",
    }
    sections = []
    if not args.skip_swap:
        payload["swap"] = bench_swap(args)
        sections.append(swap_markdown(payload["swap"]))
        print(sections[-1], flush=True)
    if not args.skip_adam:
        payload["adam"] = bench_adam(args)
        sections.append(adam_markdown(payload["adam"]))
        print(sections[-1], flush=True)
    md_path, json_path = write_results("offload", "\n".join(sections), payload)
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
