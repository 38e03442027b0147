"""dpzero: DPZero — the method and its config (``method.py``), the zeroth-order DP training loop
(``training.py``) and its privacy event (``events.py``)."""

from .method import DPZERO, DPZeroConfig  # noqa: F401  (registers the method)
from . import neighbour_stats  # noqa: F401,E402  (registers DPZero's pre-noise statistic)
