"""DP-OPT's generation loops on a :class:`~tasks.methods.dp_opt.engine.CausalEngine`.

``dp_generate`` is Algorithm 2 with its DP randomness injected: per token a FRESH subsample of
meta-prompts (``draw_bodies``: the caller Poisson-samples private demos with a secret generator),
each meta-prompt proposes its next token (``last_logits_rowwise``: a vote is a function of its
member's demos alone), and the vote histogram goes through ``select`` (the
caller's LimitedDomain from ``privacy/``). ⊥ retries with a fresh subsample; two ⊥ in a row end
the prompt; EOS ends it; a query the budget cannot afford is never made (``can_query``).

``ensemble_generate`` is OPT (ε = ∞): the demos are drawn once per prompt, every meta-prompt keeps
its KV cache across tokens, and the plain majority vote picks each token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .engine import CausalEngine, SharedPrefix


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    queries: int = 0          # histogram releases made (what the accountant composes)
    bottoms: int = 0          # ⊥ answers among them
    stop_reason: str = ""     # eos | max_tokens | two_bottoms | budget


def dp_generate(engine: CausalEngine, prefix: SharedPrefix, draw_bodies: Callable[[], list[list[int]]],
                select: Callable[[np.ndarray], int | None], can_query: Callable[[int], bool],
                max_tokens: int, temperature: float = 0.0,
                new_generator: Callable[[], torch.Generator] | None = None,
                eos_ids: set[int] | None = None, progress: Callable[[int, int], None] | None = None
                ) -> GenerationResult:
    """Generate one prompt token by token from a DP ensemble (see the module docstring).
    ``can_query(n)``: may the run make its n-th query in total? (the caller's budget).
    ``new_generator()``: a fresh generator for the members' sampled proposals of ONE query
    (temperature > 0); the caller seeds it from its secret stream. Greedy proposals use none."""
    if temperature > 0 and new_generator is None:  # never torch's global stream (a logged seed may set it)
        raise ValueError("dp_generate: sampled proposals (temperature > 0) need new_generator, a fresh secret "
                         "generator per query")
    eos_ids = eos_ids or ({engine.eos_id} if engine.eos_id is not None else set())
    result = GenerationResult()
    bottoms_in_a_row = 0
    vocab = None
    while len(result.tokens) < max_tokens:
        if not can_query(result.queries + 1):
            result.stop_reason = "budget"
            return result
        bodies = draw_bodies()  # a fresh subsample for every query (retries included)
        if bodies:
            logits = engine.last_logits_rowwise([b + result.tokens for b in bodies], prefix)  # each member's own
            vocab = logits.shape[1]
            generator = new_generator() if temperature > 0 and new_generator is not None else None
            proposals = engine.propose(logits, temperature, generator).numpy()
            counts = np.bincount(proposals[proposals >= 0], minlength=vocab).astype(float)  # -1: no vote
        else:  # an empty subsample still makes the query (skipping it would reveal the emptiness)
            counts = np.zeros(vocab or len(engine.tok), dtype=float)
        result.queries += 1
        token = select(counts)
        if progress is not None:
            progress(len(result.tokens), max_tokens)
        if token is None:
            result.bottoms += 1
            bottoms_in_a_row += 1
            if bottoms_in_a_row >= 2:
                result.stop_reason = "two_bottoms"
                return result
            continue
        bottoms_in_a_row = 0
        if int(token) in eos_ids:
            result.stop_reason = "eos"
            return result
        result.tokens.append(int(token))
    result.stop_reason = "max_tokens"
    return result


def ensemble_generate(engine: CausalEngine, prefix_ids: list[int], bodies: list[list[int]], max_tokens: int,
                      temperature: float = 0.0, generator: torch.Generator | None = None,
                      eos_ids: set[int] | None = None) -> GenerationResult:
    """OPT: fixed meta-prompts, majority vote per token, one KV cache across all tokens."""
    eos_ids = eos_ids or ({engine.eos_id} if engine.eos_id is not None else set())
    state = engine.start([prefix_ids + b for b in bodies])
    result = GenerationResult()
    for _ in range(max_tokens):
        proposals = engine.propose(state["logits"], temperature, generator).numpy()
        token = int(np.bincount(proposals[proposals >= 0], minlength=state["logits"].shape[1]).argmax())
        result.queries += 1
        if token in eos_ids:
            result.stop_reason = "eos"
            return result
        result.tokens.append(token)
        state = engine.step(state, torch.full((len(bodies),), token, dtype=torch.long))
    result.stop_reason = "max_tokens"
    return result


def reencode_generate(engine: CausalEngine, prefix_ids: list[int], bodies: list[list[int]], max_tokens: int,
                      eos_ids: set[int] | None = None) -> GenerationResult:
    """The reference code's way (re-encode every meta-prompt at every token, no KV cache): kept
    only to benchmark and to test that :func:`ensemble_generate` computes the same thing."""
    eos_ids = eos_ids or ({engine.eos_id} if engine.eos_id is not None else set())
    result = GenerationResult()
    for _ in range(max_tokens):
        logits = engine.last_logits([prefix_ids + b + result.tokens for b in bodies])
        token = int(np.bincount(logits.argmax(-1).numpy()).argmax())
        result.queries += 1
        if token in eos_ids:
            result.stop_reason = "eos"
            return result
        result.tokens.append(token)
    result.stop_reason = "max_tokens"
    return result
