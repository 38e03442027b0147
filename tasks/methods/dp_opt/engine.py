"""DP-OPT's engine lives in the method toolkit (``tasks/methodkit/causal_engine.py``) since
dp_fewshot generates on it too; this name stays for the code and benches that import it here."""

from ...methodkit.causal_engine import CausalEngine, SharedPrefix, attention_backends  # noqa: F401
