"""prompt_sgd: non-private soft-prompt tuning (``method.py``; the torch code is the generic
``models.dp_prompt_training``)."""

from .method import PROMPT_SGD  # noqa: F401  (registers the method)
