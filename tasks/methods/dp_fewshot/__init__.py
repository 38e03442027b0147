"""dp_fewshot: DP few-shot generation (Tang et al., "Privacy-Preserving In-Context Learning with
Differentially Private Few-Shot Generation", ICLR 2024) on the local causal LM.

For each label ℓ and each of D demonstrations, a disjoint group of M private subsets of ℓ's rows
(each at most N rows, a SECRET keyed-hash partition: ``tasks/methodkit/keyed_partition.py``) conditions the local LLM;
every token of the demonstration is drawn by the paper's DP aggregate (``privacy.mechanisms.
distribution_vote``): each subset's next-token distribution, restricted to the public top-k tokens
of the same prompt without private demos (the paper's reduced vocabulary) and clipped to a
distribution, is summed, the sum gets Gaussian noise N(0, (σ·√2)² I), and its argmax is the token.
The published prompt is the instruction and the D·|labels| generated demonstrations, used for
in-context learning at the target like the ICL baseline's demonstrations — after that, any number
of queries costs nothing.

Neighbouring relation: add/remove one record (a text with its label) of the source dataset. The
record's keyed hash puts it in exactly one subset of one (label, demonstration) group, so one
subset's distribution changes (replaced, or appears / vanishes) in that group's queries only: L2
sensitivity √2 per query of that group, no other group touched. Each group makes at most
``max_new_tokens`` queries, charged in full (``events.py``): T Gaussian queries at σ, the groups in
parallel composition. Replacing a record by one with another label is two such steps (group
privacy, not what ε states)."""

from .method import DP_FEWSHOT, DPFewShotConfig  # noqa: F401  (registers the method)
from . import neighbour_stats  # noqa: F401,E402  (registers dp_fewshot's pre-noise statistic)
