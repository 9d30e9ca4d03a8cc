"""fp32 master weights for 16-bit modules: the optimizer steps these, the module gets copies.

Masters live in one flat fp32 buffer (and their gradients in another), so loading gradients and
copying weights back are a handful of foreach kernels rather than a loop of small copies.
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
        self.flat_grad = torch.zeros(total, dtype=dtype, device=device)
        self.params: list[torch.nn.Parameter] = []
        offset = 0
        with torch.no_grad():
            for p in self.model_params:
                n = p.numel()
                master = torch.nn.Parameter(self.flat[offset : offset + n].view_as(p))
                master.copy_(p.detach())
                master.grad = self.flat_grad[offset : offset + n].view_as(p)
                self.params.append(master)
                offset += n
        self.by_model_param = dict(zip(self.model_params, self.params, strict=True))

    @property
    def grads(self) -> list[torch.Tensor]:
        """The masters' gradient views, in parameter order."""
        return [m.grad for m in self.params]  # type: ignore[misc]

    @property
    def nbytes(self) -> int:
        """Bytes of master weights (gradients not included)."""
        return self.flat.numel() * self.flat.element_size()

    @property
    def grad_nbytes(self) -> int:
        """Bytes of the masters' gradient buffer."""
        return self.flat_grad.numel() * self.flat_grad.element_size()

    def load_grads(self, model_grads: Sequence[torch.Tensor]) -> None:
        """Copies (and upcasts) the module's gradients into the masters' gradients."""
        if model_grads:
            torch._foreach_copy_(self.grads, list(model_grads))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Writes the masters, cast to the module dtype, into the module's parameters."""
        if self.params:
            torch._foreach_copy_(
                [p.data for p in self.model_params], list[torch.Tensor](self.params)
            )

    def restore_grad_views(self) -> None:
        """Puts the flat gradient views back if a caller replaced them (e.g. zero_grad)."""
        offset = 0
        for m in self.params:
            n = m.numel()
            view = self.flat_grad[offset : offset + n].view_as(m)
            if m.grad is None or m.grad.data_ptr() != view.data_ptr():
                m.grad = view
            offset += n
