"""privacy_flat: Privacy-Flat — the method and its config (``method.py``) and its torch code
(``flat.py``: the DP-step hook with AWP, sparse prefix layers and the cross-model regulariser)."""

from .method import PRIVACY_FLAT, FlatConfig, PrivacyFlat, PrivacyFlatConfig  # noqa: F401  (registers the method)
