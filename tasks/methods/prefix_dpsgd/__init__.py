"""prefix_dpsgd and prefix_sgd: (DP-SGD) prefix tuning (``method.py``; the torch code is the generic
``models.dp_prompt_training`` and ``models.prompts.prefix``, the flatness diagnostics ``models.landscape``)."""

from .method import PREFIX_DPSGD, PREFIX_SGD, PrefixDPSGDConfig  # noqa: F401  (registers the methods)
