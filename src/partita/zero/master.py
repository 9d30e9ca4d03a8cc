"""fp32 master weights for 16-bit modules: the optimizer steps these, the module gets copies.

Masters live in one flat fp32 buffer (and their gradients in another), so loading gradients and
copying weights back are a handful of foreach kernels rather than a loop of small copies. The
gradient buffer exists only during the step: `load_grads` makes it, `release_grads` drops it
([Note: released gradients]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class MasterWeights:
    """Higher-precision copies of `params`, each an `nn.Parameter` with a `.grad` view."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype = torch.float32
    ) -> None:
        self.model_params = list(params)
        total = sum(p.numel() for p in self.model_params)
        device = self.model_params[0].device if self.model_params else torch.device("cpu")
        self.flat = torch.empty(total, dtype=dtype, device=device)
        self.flat_grad: torch.Tensor | None = None
        """The masters' gradients (flat); None outside the step."""
        self.params: list[torch.nn.Parameter] = []
        offset = 0
        with torch.no_grad():
            for p in self.model_params:
                n = p.numel()
                master = torch.nn.Parameter(self.flat[offset : offset + n].view_as(p))
                master.copy_(p.detach())
                self.params.append(master)
                offset += n
        self.by_model_param = dict(zip(self.model_params, self.params, strict=True))

    @property
    def nbytes(self) -> int:
        """Bytes of master weights (gradients not included)."""
        return self.flat.numel() * self.flat.element_size()

    @property
    def grad_nbytes(self) -> int:
        """Bytes of the masters' gradient buffer while it exists (during the step)."""
        return self.flat.numel() * self.flat.element_size()

    @property
    def held_grad_nbytes(self) -> int:
        """Bytes of the masters' gradient buffer now (0 outside the step)."""
        return 0 if self.flat_grad is None else self.grad_nbytes

    def load_grads(self, model_grads: Sequence[torch.Tensor]) -> None:
        """Copies (and upcasts) the module's gradients into the masters' gradients, making the
        buffer and pointing each master's ``.grad`` at its view first."""
        if self.flat_grad is None:  # every element is written below: no zeroing needed
            self.flat_grad = torch.empty_like(self.flat)
        grads = []
        offset = 0
        for m in self.params:
            n = m.numel()
            m.grad = self.flat_grad[offset : offset + n].view_as(m)
            grads.append(m.grad)
            offset += n
        if model_grads:
            torch._foreach_copy_(grads, list(model_grads))

    def release_grads(self) -> None:
        """Drops the masters' gradients ([Note: released gradients])."""
        for m in self.params:
            m.grad = None
        self.flat_grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Writes the masters, cast to the module dtype, into the module's parameters."""
        if self.params:
            torch._foreach_copy_(
                [p.data for p in self.model_params], list[torch.Tensor](self.params)
            )
