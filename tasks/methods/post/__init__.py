"""post: POST (Wang et al. 2024) — the method and its config (``method.py``), the student's
distillation (``distill.py``) and the prompt transfer (``tasks.methodkit.transfer``, on ``models.prompt_transfer``)."""

from .method import POST, PostConfig  # noqa: F401  (registers the method)
