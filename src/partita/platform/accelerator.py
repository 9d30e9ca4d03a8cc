"""The device partita computes on: CUDA when present, else CPU.

The only module that touches ``torch.cuda``. Engines and algorithms ask it for the device,
streams, events, pinned memory and memory statistics, so the same code path runs on CPU
(where streams are no-ops and pinning is skipped) and on GPUs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from functools import lru_cache

import psutil
import torch

from partita.platform import env


class Accelerator:
    """One device type's operations. `device_type` is "cuda" or "cpu"."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    @property
    def is_cuda(self) -> bool:
        """True on CUDA devices."""
        return self.device_type == "cuda"

    @property
    def communication_backend(self) -> str:
        """The torch.distributed backend matching this device."""
        return "nccl" if self.is_cuda else "gloo"

    def device_for_rank(self, local_rank: int) -> torch.device | None:
        """The device a process with `local_rank` uses (None on CPU: no binding needed)."""
        if not self.is_cuda:
            return None
        return torch.device("cuda", local_rank % torch.cuda.device_count())

    def current_device(self) -> torch.device:
        """The device tensors of this process live on."""
        if self.is_cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        """Binds this process to its device (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def synchronize(self) -> None:
        """Waits for all queued device work (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize()

    def new_stream(self) -> torch.cuda.Stream | None:
        """A side stream for communication or copies (None on CPU)."""
        return torch.cuda.Stream() if self.is_cuda else None

    @contextlib.contextmanager
    def stream(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Runs the block on `stream` (a no-op for None)."""
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def wait_stream(self, waiter: torch.cuda.Stream | None, done: torch.cuda.Stream | None) -> None:
        """Work queued on `waiter` after this call starts after what `done` has queued so far
        (None: the current stream; a no-op on CPU)."""
        if self.is_cuda:
            (waiter or torch.cuda.current_stream()).wait_stream(done or torch.cuda.current_stream())

    def record_event(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event marking what `stream` has queued so far (None on CPU)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream or torch.cuda.current_stream())
        return event

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked copy of a CPU tensor on CUDA machines; the tensor itself elsewhere."""
        return tensor.pin_memory() if self.is_cuda else tensor

    def get_rng_states(self) -> list[torch.Tensor]:
        """Every local device generator's state (empty on CPU: torch's CPU state covers it)."""
        return list(torch.cuda.get_rng_state_all()) if self.is_cuda else []

    def set_rng_states(self, states: list[torch.Tensor]) -> None:
        """Restores `get_rng_states` output (no-op on CPU)."""
        if self.is_cuda and states:
            torch.cuda.set_rng_state_all(states)

    def memory_allocated(self) -> int:
        """Bytes of device memory held by tensors (0 on CPU: see `host_rss`)."""
        return int(torch.cuda.memory_allocated()) if self.is_cuda else 0

    def max_memory_allocated(self) -> int:
        """Peak device memory held by tensors since start or the last reset (0 on CPU)."""
        return int(torch.cuda.max_memory_allocated()) if self.is_cuda else 0

    def reset_peak_memory_stats(self) -> None:
        """Restarts peak tracking (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats()


def pin_if(pin: bool, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` page-locked (`Accelerator.pin_memory`) when ``pin`` is set and it is in host
    memory; else ``tensor`` itself (offload blocks' ``pin_memory``)."""
    return get_accelerator().pin_memory(tensor) if pin and tensor.device.type == "cpu" else tensor


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` where ``src`` may live on another device (a reduced gradient added into
    an offloaded master's gradient). A copy into host memory blocks until the data is there:
    ``src.to("cpu", non_blocking=True)`` returns before the device has written it, and the
    CPU add would read it early (the first GPU check saw offloaded runs drift from the same
    run without offload). Copies towards a device stay asynchronous: the device's stream
    orders them before their use."""
    if src.device != dst.device:
        src = src.to(dst.device, non_blocking=dst.device.type != "cpu")
    dst.add_(src)


def host_rss() -> int:
    """Resident set size of this process, bytes."""
    return int(psutil.Process().memory_info().rss)


def host_peak_rss() -> int:
    """Peak resident set size of this process, bytes (Linux: VmHWM; else current RSS)."""
    peak = _status_bytes("VmHWM")
    return host_rss() if peak is None else peak


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes; None where there is none."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            for line in fh:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_file_rss() -> int:
    """Resident pages of this process backed by files (libraries' code, mapped files), bytes
    (Linux: RssFile; else 0). They are clean and reclaimable, not memory a job can run out of,
    and how many a run maps depends on the page cache: in a fresh virtual environment the same
    3 training steps mapped 65 MiB of them, in an older one 26 (2026-12-05)."""
    return _status_bytes("RssFile") or 0


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@lru_cache(maxsize=1)
def configure_host_allocator() -> bool:
    """Sets up host memory for training: partita's caching allocator for large blocks, and a
    fixed glibc mmap threshold for the rest.

    Training frees and re-allocates many multi-megabyte host buffers every step (activations,
    gradient buckets, gathered ZeRO-3 units). glibc raises its mmap threshold each time such a
    block is freed, after which blocks of that size come from the heap and stay resident:
    measured on 2 CPU ranks training a 23M-parameter GPT-2, peak RSS per rank was 1364 MB
    (stage 0) and 1515 MB (stage 3) with glibc's default, 1228 MB and 1236 MB with a fixed 1 MB
    threshold. But then every large block is a fresh mapping each step, page-faulted and zeroed
    again (190k faults per step there); `partita.platform.host_cache` keeps blocks of 1 MiB and
    more for reuse while the mapped total stays within 1.05x the peak of what tensors asked for.
    ``PARTITA_MMAP_THRESHOLD`` sets the threshold in bytes (0 leaves glibc's default),
    ``PARTITA_HOST_CACHE=0`` turns the cache off. Returns True when either was applied (Linux only).
    """
    from partita.platform.host_cache import install_host_cache

    cached = install_host_cache()
    threshold = env.mmap_threshold()
    if threshold <= 0 or not sys.platform.startswith("linux"):
        return cached
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) or cached
    except (OSError, AttributeError):
        return cached


@lru_cache(maxsize=1)
def get_accelerator() -> Accelerator:
    """The process-wide accelerator. PARTITA_ACCELERATOR=cpu forces CPU on a GPU machine."""
    forced = env.forced_accelerator()
    if forced == "cpu" or not torch.cuda.is_available():
        return Accelerator("cpu")
    return Accelerator("cuda")
