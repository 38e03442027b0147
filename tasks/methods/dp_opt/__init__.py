"""dp_opt: DP-OPT (Hong et al. 2024) and its baselines (opt, dln1, icl) — the methods and their
configs (``method.py``), the text-prompt pieces they share (``text_prompts.py``), templates
(``templates.py``), the batched next-token engine of a local causal LM (``engine.py``: shared-prefix
KV reuse, left-padded buckets with masks and positions), the generation loops (``generate.py``: DP
ensemble, Algorithm 2; OPT: ensemble with a KV cache), the leakage report (``leakage.py``) and the
privacy events (``events.py``). The privacy math (LimitedDomain, DP-argmax, accounting) stays in
``privacy/``: the loops take it as callbacks."""

from .method import DLN_1, DP_OPT, ICL_BASELINE, OPT, DPOptConfig, ICLConfig, OptConfig  # noqa: F401  (registers the methods)
from . import neighbour_stats  # noqa: F401,E402  (registers DP-OPT's pre-noise statistics)
