"""dp_lora: LoRA adapters on the frozen local model trained with DP-SGD (``method.py``; the torch
code is the generic ``models.dp_prompt_training`` on a ``models.prompts.lora`` prompt). ``lora_sgd``:
the same adapters trained without DP (a ceiling; no guarantee)."""

from .method import DP_LORA, LORA_SGD  # noqa: F401  (registers the methods)
