"""prompt_dpsgd (PromptDPSGD): a soft prompt trained with DP-SGD — Poisson sampling, per-example
clipping, Gaussian noise σ·C — on the frozen local model; σ calibrated to the target ε. The
DP-SGD plan, training and accounting are the toolkit's skeleton
(:class:`~tasks.methodkit.prompt_methods.SoftPromptDPSGD`), which the prefix methods extend too."""

from __future__ import annotations

from ...methodkit.prompt_methods import SoftPromptDPSGD
from ...schema import DPSGDConfig
from .. import register_method


@register_method
class PromptDPSGD(SoftPromptDPSGD):
    name = "prompt_dpsgd"
    config_class = DPSGDConfig
    label = "prompt tuning (DP-SGD)"
