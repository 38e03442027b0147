"""prompt_sgd: non-private soft-prompt tuning (a baseline and an upper bound; no guarantee) — the
toolkit's :class:`~tasks.methodkit.prompt_methods.NonPrivateSoftPrompt`, registered."""

from __future__ import annotations

from ...methodkit.prompt_methods import NON_PRIVATE_SOFT_PROMPT, NonPrivateSoftPrompt
from ...schema import PromptTuningConfig
from .. import register_method
from ..base import MethodSpec, Traits

PROMPT_SGD = register_method(MethodSpec(
    name=NON_PRIVATE_SOFT_PROMPT, config_class=PromptTuningConfig, mechanism=NonPrivateSoftPrompt(),
    label="prompt tuning (non-private)", traits=Traits(test_settings={"n_tokens": 2, "epochs": 1, "batch_size": 8})))
