"""rapt: RAPT (Li et al. 2023) — the method and its config (``method.py``), local d_X token
privatisation (``privatize.py``, ``encoding.py``), prompt tuning with privatised-token
reconstruction (``model.py``, ``head.py``), and the attacks that measure its empirical privacy
(``attacks.py``)."""

from .method import RAPT, Rapt, RaptConfig  # noqa: F401  (registers the method)
