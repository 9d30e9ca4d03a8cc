"""The FLOPs profiler: per-module FLOPs, MACs, parameters, forward latency and MFU.

Counting is torch's `torch.utils.flop_counter.FlopCounterMode`, which sees every aten op the
forward dispatches (whatever Python wrote it: ``F.linear``, ``@``, ``scaled_dot_product_attention``)
and attributes it to the modules on the stack. Its registry counts the matrix products
(matmul, addmm, bmm, baddbmm, convolutions, the fused attention kernels): the FLOPs that bound a
transformer's step. Unlike DeepSpeed's profiler (which patches ``torch.nn.functional``),
element-wise ops (activations, norms, softmax) are not counted; every counted op is a sum of
products, so MACs are exactly half the FLOPs.

Latency is measured with forward hooks on every module (the device synchronised on CUDA so a
module's time is its own); the model's total is its root module's forward time.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from torch.utils.hooks import RemovableHandle

from partita.profiling.peaks import device_name, peak_flops
from partita.profiling.report import ModuleProfile, write_profile

__all__ = ["FlopsProfiler", "ModuleProfile", "get_model_profile"]


def _cpu_flash_attention_flops(
    query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """The CPU fused attention's two matmuls, as torch counts its CUDA siblings."""
    return int(sdpa_flop_count(query, key, value))


# torch's registry (2.13) has the CUDA flash / efficient / cuDNN attention kernels but not the
# CPU one that scaled_dot_product_attention picks on the host: without this entry a model with
# SDPA attention (Hugging Face's default) counts no attention FLOPs on CPU.
_EXTRA_FORMULAS: dict[Any, Any] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = (
        _cpu_flash_attention_flops
    )


@dataclass
class _Timing:
    """Forward time spent in one module, summed over its calls."""

    seconds: float = 0.0
    calls: int = 0
    started: list[float] | None = None


class FlopsProfiler:
    """Profiles a model's forward: DeepSpeed's ``FlopsProfiler`` on torch's flop counter.

    Args:
        model: the module to profile (the engine's module, or any ``nn.Module``).
        ds_engine: the engine, when the engine drives the profiler (adds world and batch
            sizes to the summary).
        recompute_fwd_factor: DeepSpeed's factor for forward recomputation in backward
            (activation checkpointing); reported, not measured.
        peak_flops: the device's peak FLOP/s for MFU; None looks the device up in
            `partita.profiling.peaks` (unknown on CPU).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ds_engine: Any = None,
        recompute_fwd_factor: float = 0.0,
        peak_flops: float | None = None,
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.peak = peak_flops
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._handles: list[RemovableHandle] = []
        self._timings: dict[int, _Timing] = {}
        self._ignored: tuple[type, ...] = ()
        self._frozen: dict[str, ModuleProfile] | None = None

    # --- DeepSpeed's lifecycle ---------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Starts counting FLOPs and timing every module's forward (modules whose type is in
        `ignore_list` are left out of the totals)."""
        if self.started:
            return
        self._ignored = tuple(ignore_list or ())
        self._timings = {id(m): _Timing() for m in self.model.modules()}
        self._frozen = None
        sync = next(self.model.parameters(), torch.empty(0)).device.type == "cuda"
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(sync)))
            self._handles.append(
                module.register_forward_hook(self._post_hook(sync), always_call=True)
            )
        self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stops counting; the results stay readable until `end_profile`."""
        if not self.started:
            return
        self._frozen = self._profiles()
        self._close_counter()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.started = False

    def reset_profile(self) -> None:
        """Zeroes the counts and timings (keeps profiling if started)."""
        if self._counter is not None:
            self._counter.flop_counts.clear()
        self._timings = {id(m): _Timing() for m in self.model.modules()}
        self._frozen = None

    def end_profile(self) -> None:
        """Stops profiling (if still running) and drops the results."""
        self.stop_profile()
        self._frozen = None
        self._timings = {}

    def _close_counter(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _pre_hook(self, sync: bool) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            timing = self._timings.setdefault(id(module), _Timing())
            if sync:
                torch.cuda.synchronize()
            # A stack, not one start time: a module may call itself (or be shared) recursively.
            timing.started = [*(timing.started or []), time.perf_counter()]

        return hook

    def _post_hook(self, sync: bool) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            timing = self._timings.get(id(module))
            if timing is None or not timing.started:
                return
            if sync:
                torch.cuda.synchronize()
            timing.seconds += time.perf_counter() - timing.started.pop()
            timing.calls += 1

        return hook

    # --- results -----------------------------------------------------------------------------
    def module_profiles(self) -> dict[str, ModuleProfile]:
        """Per-module results keyed by the name in ``model.named_modules()`` ("" is the model)."""
        return self._frozen if self._frozen is not None else self._profiles()

    def _profiles(self) -> dict[str, ModuleProfile]:
        counts = self._counter.get_flop_counts() if self._counter is not None else {}
        root = type(self.model).__name__
        out: dict[str, ModuleProfile] = {}
        for name, module in self.model.named_modules():
            key = f"{root}.{name}" if name else root
            flops = int(sum(counts.get(key, {}).values()))
            timing = self._timings.get(id(module), _Timing())
            params = sum(p.numel() for p in module.parameters() if p.requires_grad)
            out[name] = ModuleProfile(
                name=name,
                kind=type(module).__name__,
                flops=flops,
                macs=flops // 2,
                params=params,
                duration=timing.seconds,
                calls=timing.calls,
                ignored=isinstance(module, self._ignored) if self._ignored else False,
            )
        return out

    def _ignored_total(self, field: str) -> float:
        """The sum of `field` over the outermost ignored modules (their children are inside)."""
        profiles = self.module_profiles()
        outer = [n for n, p in profiles.items() if p.ignored]
        outer = [n for n in outer if not any(n.startswith(o + ".") for o in outer if o != n)]
        return sum(getattr(profiles[n], field) for n in outer)

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model since `start_profile` (ignored modules left out)."""
        total = int(self.module_profiles()[""].flops - self._ignored_total("flops"))
        return _string(total, "", as_string)

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates (half the counted FLOPs: see the module docstring)."""
        total = int(self.module_profiles()[""].macs - self._ignored_total("macs"))
        return _string(total, "MACs", as_string)

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Trainable parameters of the model held by this rank."""
        return _string(self.module_profiles()[""].params, "", as_string)

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forward since `start_profile`."""
        seconds = self.module_profiles()[""].duration
        if as_string:
            from partita.profiling.units import duration_to_string

            return duration_to_string(seconds)
        return seconds

    def get_peak_flops(self) -> float | None:
        """The device's peak FLOP/s used for MFU (given, or looked up; None when unknown)."""
        if self.peak is not None:
            return self.peak
        param = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        if param is None:
            return None
        return peak_flops(device_name(param.device), param.dtype)

    def get_mfu(self) -> float | None:
        """Forward model-FLOPs utilisation: FLOPs / latency / peak (None when the peak is
        unknown or nothing was timed)."""
        peak, seconds = self.get_peak_flops(), self.get_total_duration()
        if peak is None or not seconds:
            return None
        return float(self.get_total_flops()) / float(seconds) / peak

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Prints the summary, the top modules per depth and (if `detailed`) the module tree, to
        stdout or to `output_file`."""
        with _output(output_file) as stream:
            write_profile(
                stream,
                self,
                profile_step=profile_step,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
            )


def _string(value: int, unit: str, as_string: bool) -> int | str:
    from partita.profiling.units import number_to_string

    return number_to_string(value, unit) if as_string else value


@contextlib.contextmanager
def _output(path: str | None) -> Iterator[IO[str]]:
    if path is None:
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as stream:
        yield stream


def _run(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], mode: str) -> None:
    if mode == "forward":
        model(*args, **kwargs)
    elif mode == "generate":
        model.generate(*args, **kwargs)  # type: ignore[operator]
    else:
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")


def get_model_profile(
    model: torch.nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[int | str, int | str, int | str]:
    """Profiles one forward (or ``generate``) of `model`: ``(flops, macs, params)``.

    `input_shape` builds the only positional argument (an uninitialised tensor of the model's
    dtype and device); otherwise `args` / `kwargs` are passed. `warm_up` unprofiled calls run
    first so that latencies leave out one-time costs. Strings (``"1.2 G"``) when `as_string`.
    """
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got "
                             f"{input_shape!r}")  # fmt: skip
        param = next(model.parameters(), None)
        like = param if param is not None else torch.empty(0)
        args = [like.new_empty(input_shape)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, args or kwargs")
    model.eval()
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            _run(model, args, kwargs, mode)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            _run(model, args, kwargs, mode)
        finally:
            profiler.stop_profile()
    flops, macs, params = (
        profiler.get_total_flops(as_string),
        profiler.get_total_macs(as_string),
        profiler.get_total_params(as_string),
    )
    if print_profile:
        profiler.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
    profiler.end_profile()
    return flops, macs, params
