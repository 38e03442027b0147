"""prompt_sgd: non-private soft-prompt tuning (a baseline and an upper bound; no guarantee) — the
toolkit's :class:`~tasks.methodkit.prompt_methods.NonPrivateSoftPrompt`, registered."""

from __future__ import annotations

from ...methodkit.prompt_methods import NonPrivateSoftPrompt
from .. import register_method


@register_method
class PromptSGD(NonPrivateSoftPrompt):
    name = "prompt_sgd"
