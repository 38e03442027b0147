"""zero_shot: the model with no prompt (``method.py``)."""

from .method import ZERO_SHOT, ZeroShotConfig  # noqa: F401  (registers the method)
