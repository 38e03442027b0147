"""prompt_dpsgd: a soft prompt trained with DP-SGD — Poisson sampling, per-example clipping,
Gaussian noise σ·C — on the frozen local model; σ calibrated to the target ε. The DP-SGD plan,
training and accounting are the toolkit's mechanism
(:class:`~tasks.methodkit.prompt_methods.SoftPromptDPSGD`), which the prefix methods extend too."""

from __future__ import annotations

from ...methodkit.prompt_methods import DPSGD_TRAITS, SoftPromptDPSGD
from ...schema import DPSGDConfig
from .. import register_method
from ..base import MethodSpec

PROMPT_DPSGD = register_method(MethodSpec(name="prompt_dpsgd", config_class=DPSGDConfig, mechanism=SoftPromptDPSGD(),
                                          label="prompt tuning (DP-SGD)", traits=DPSGD_TRAITS))
