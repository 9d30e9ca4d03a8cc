"""The ``expert_parallel`` section: DeepSpeed's AutoEP (expert parallelism for Hugging Face MoE
models found by their structure), on partita's expert plan (`partita.moe.hf_experts`)."""

from __future__ import annotations

from pydantic import Field

from .base import Bool, PositiveInt, Section

__all__ = ["ExpertParallelConfig"]


class ExpertParallelConfig(Section):
    """``expert_parallel``: split the experts of a Hugging Face MoE model (Mixtral, Qwen2-MoE,
    Qwen3-MoE, DeepSeek-V3, OLMoE: the modules its ``base_model_ep_plan`` names) over
    ``autoep_size`` consecutive ranks (see ``docs/parallelism.md``)."""

    enabled: Bool = Field(default=False, description="Split the model's experts over ranks.")
    autoep_size: PositiveInt = Field(
        default=1,
        description="Ranks a layer's experts are split across (consecutive ranks, dividing "
        "the data-parallel size and the number of experts).",
    )
    preset_model: str | None = Field(
        default=None,
        description="DeepSpeed's name for the model family whose layout to expect; partita "
        "reads the layout from the model's own base_model_ep_plan.",
    )
