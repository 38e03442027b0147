"""dp_fewshot's generation loop on the shared causal LM engine (``tasks/methodkit/causal_engine``):
one demonstration, token by token, each token a DP query over the group's private subsets.

Each sequence is the shared head (the instruction, encoded once: its KV cache is reused), a
subset's demos, the label's open slot and the tokens generated so far. Every subset is scored
ALONE (a batch of one): batched, a row's logits move by float rounding with its neighbours'
lengths and padding, so one record's subset could move the others' distributions and the sum by
more than the sensitivity the noise is calibrated to (the same reason DP-OPT scores its holdout
rows one by one). The public row (no private demos) gives the top-k domain of the query."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ...methodkit.causal_engine import CausalEngine, SharedPrefix


@dataclass
class DemoResult:
    tokens: list[int] = field(default_factory=list)
    queries: int = 0        # DP queries made (each one distribution_vote release)
    stop_reason: str = ""   # eos | newline | max_tokens


def public_domain(public_logits: torch.Tensor, top_k: int) -> np.ndarray:
    """Token ids of the query's domain: the ``top_k`` most likely next tokens of the public prompt
    (the paper's reduced vocabulary), or the whole vocabulary when ``top_k`` is 0 or larger."""
    vocab = public_logits.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return np.arange(vocab)
    return torch.topk(public_logits, top_k).indices.numpy()


def subset_distributions(engine: CausalEngine, prefix: SharedPrefix, bodies: list[list[int]],
                         tail: list[int], domain: np.ndarray) -> np.ndarray:
    """(m, K) next-token distributions of the m subsets over ``domain``, each renormalised over
    the domain (a row with no mass there stays zero)."""
    if not bodies:
        return np.zeros((0, len(domain)))
    rows = []
    for body in bodies:  # one by one: see the module docstring
        probs = torch.softmax(engine.last_logits([body + tail], prefix)[0], dim=-1).numpy().astype(float)
        rows.append(probs[domain])
    p = np.stack(rows)
    total = p.sum(axis=1, keepdims=True)
    return np.divide(p, total, out=np.zeros_like(p), where=total > 0)


def generate_demo(engine: CausalEngine, prefix: SharedPrefix, bodies: list[list[int]], header: list[int],
                  max_tokens: int, top_k: int, vote: Callable[[np.ndarray], int],
                  eos_ids: set[int] | None = None) -> DemoResult:
    """One demonstration: ``vote`` (the caller's DP aggregate over the (m, K) distributions) picks
    each token of the public domain; EOS or a token with a line break ends the demonstration."""
    eos_ids = eos_ids if eos_ids is not None else ({engine.eos_id} if engine.eos_id is not None else set())
    result = DemoResult()
    while len(result.tokens) < max_tokens:
        tail = header + result.tokens
        domain = public_domain(engine.last_logits([tail], prefix)[0], top_k)
        token = int(domain[vote(subset_distributions(engine, prefix, bodies, tail, domain))])
        result.queries += 1
        if token in eos_ids:
            result.stop_reason = "eos"
            return result
        if "\n" in engine.tok.decode([token]):
            result.stop_reason = "newline"
            return result
        result.tokens.append(token)
    result.stop_reason = "max_tokens"
    return result
