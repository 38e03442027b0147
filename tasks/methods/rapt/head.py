"""RAPT's privatized-token reconstruction head and its vocabulary (paper eq. 6-7).

The head reads the hidden states of the m plain-token positions and predicts the ORIGINAL plain
tokens over a vocabulary T: the most frequent ids of PUBLIC text plus the plain tokens (the
paper: |T| = 7,630, c = 96). p_i = softmax(W1 W2 g_i) with W2 (c × h), W1 (|T| × c), two linear
layers without bias or activation. It exists only while tuning: the inference model never holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

HEAD_HIDDEN = 96  # c
HEAD_VOCAB = 7630  # |T| of the paper (most frequent public ids; the plain tokens are added)


def reconstruction_vocab(public_ids: Iterable, plain_ids: Iterable[int], size: int = HEAD_VOCAB,
                         exclude_ids: Iterable[int] = ()) -> torch.Tensor:
    """Sorted LLM ids of the head's vocabulary: the ``size`` most frequent ids of the PUBLIC token
    sequences ``public_ids`` (lists or 1-D tensors; ``exclude_ids``, e.g. special tokens and
    padding, not counted; ties by lower id) plus every plain token id."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    excluded = {int(i) for i in exclude_ids}
    counts: Counter[int] = Counter()
    for seq in public_ids:
        vals = seq.reshape(-1).tolist() if isinstance(seq, torch.Tensor) else [int(i) for i in seq]
        counts.update(i for i in vals if i not in excluded)
    frequent = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    plain = [int(i) for i in plain_ids]
    if not plain:
        raise ValueError("plain_ids must hold at least one token id")
    return torch.tensor(sorted(set(frequent) | set(plain)), dtype=torch.long)


class ReconstructionHead(nn.Module):
    """W1 W2 g over the vocabulary ``vocab_ids`` (sorted LLM ids, from :func:`reconstruction_vocab`)."""

    def __init__(self, vocab_ids: torch.Tensor, hidden_size: int, head_hidden: int = HEAD_HIDDEN):
        super().__init__()
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long).reshape(-1)
        if vocab_ids.numel() == 0 or bool((vocab_ids[1:] <= vocab_ids[:-1]).any()):
            raise ValueError("vocab_ids must be a non-empty, strictly increasing list of token ids")
        if hidden_size < 1 or head_hidden < 1:
            raise ValueError(f"hidden_size and head_hidden must be >= 1, got {hidden_size}, {head_hidden}")
        self.register_buffer("vocab_ids", vocab_ids)
        self.w2 = nn.Linear(hidden_size, head_hidden, bias=False)  # W2 ∈ R^{c×h}
        self.w1 = nn.Linear(head_hidden, vocab_ids.numel(), bias=False)  # W1 ∈ R^{|T|×c}

    @property
    def vocab_size(self) -> int:
        return int(self.vocab_ids.numel())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., h) hidden states -> (..., |T|) logits."""
        return self.w1(self.w2(hidden))

    def target_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Index in T of every LLM id; an id outside T is a programming error (plain tokens are in T)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.vocab_ids.device)
        pos = torch.searchsorted(self.vocab_ids, token_ids)
        ok = (pos < self.vocab_size) & (self.vocab_ids[pos.clamp_max(self.vocab_size - 1)] == token_ids)
        if not bool(ok.all()):
            raise ValueError("plain token ids must be in the reconstruction vocabulary")
        return pos

    def loss(self, plain_hidden: torch.Tensor, plain_ids: torch.Tensor) -> torch.Tensor:
        """Eq. 7: −Σ_i log p_i[j_i] over the m plain positions, averaged over the batch.
        ``plain_hidden`` (B, m, h); ``plain_ids`` (m,) or (B, m) original plain ids."""
        logits = self(plain_hidden).float()
        B, m, _ = logits.shape
        target = self.target_index(plain_ids).to(logits.device)
        if target.dim() == 1:
            target = target.unsqueeze(0).expand(B, m)
        return F.cross_entropy(logits.reshape(B * m, -1), target.reshape(-1), reduction="sum") / B
