"""DP-OPT's torch side (Hong et al. 2024): templates, the batched next-token engine of a local
causal LM (shared-prefix KV reuse, left-padded buckets with masks and positions), the generation
loops (DP ensemble: Algorithm 2; OPT: ensemble with a KV cache), label scoring of discrete
prompts, the leakage report, and an OpenAI-compatible completions client for remote targets.
The privacy math (LimitedDomain, DP-argmax, accounting) stays in ``privacy/``: the loops take it
as callbacks."""
