"""Attacks that measure RAPT's empirical privacy. They read UNPRIVATISED data (the original ids,
the private attribute): the caller records each run as a non-private use. Each returns numbers only.

* :func:`embedding_inversion_success` — nearest-neighbour inversion of the privatised INPUT
  embeddings. A privatised token IS a vocabulary embedding, so its nearest neighbour is itself:
  the success equals 1 − replacement probability by construction (the paper's Fig. 3a number).
* :func:`hidden_inversion_nn_success` / :class:`HiddenStateInverter` — inversion of the model's
  per-token OUTPUT states of privatised inputs: nearest input embedding, and a small learned
  inverter trained on PUBLIC text privatised the same way (the informative number).
* :func:`attribute_inference` — a 2-layer MLP on pooled representations; held-out success beside
  the held-out majority-class rate.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .privatize import VocabularyIndex


def _check_pairs(original: torch.Tensor, positions: torch.Tensor) -> None:
    if original.shape != positions.shape:
        raise ValueError(f"the original ids and the position mask must share a shape, got {tuple(original.shape)} "
                         f"and {tuple(positions.shape)}")
    if not bool(positions.any()):
        raise ValueError("no positions to attack")


def embedding_inversion_success(privatized_ids, original_ids, positions, index: VocabularyIndex) -> float:
    """Share of ``positions`` (bool mask, e.g. the text tokens) whose original id is the nearest
    vocabulary row (``index``) of the privatised token's input embedding. Equals
    1 − replacement probability by construction (the privatised embedding is a vocabulary row)."""
    priv, orig, pos = (torch.as_tensor(privatized_ids).long(), torch.as_tensor(original_ids).long(),
                       torch.as_tensor(positions).bool())
    _check_pairs(orig, pos)
    guess = torch.from_numpy(index.nearest(index.vocab64[priv[pos]]))
    return float((guess == orig[pos]).float().mean())


def hidden_inversion_nn_success(hidden: torch.Tensor, original_ids, positions, index: VocabularyIndex) -> float:
    """Share of ``positions`` whose output state's nearest input embedding is the original id
    (needs hidden size = embedding width, true for BERT-like encoders). ``hidden`` (N, L', h) may
    be shorter than the ids (N, L) (trailing all-padding columns dropped)."""
    L = hidden.shape[1]
    orig, pos = torch.as_tensor(original_ids).long()[:, :L], torch.as_tensor(positions).bool()[:, :L]
    _check_pairs(orig, pos)
    if hidden.shape[-1] != index.dim:
        raise ValueError(f"hidden size {hidden.shape[-1]} differs from the embedding width {index.dim}")
    guess = torch.from_numpy(index.nearest(hidden.detach()[pos].double().cpu()))
    return float((guess == orig[pos]).float().mean())


class HiddenStateInverter(nn.Module):
    """MLP from an output state to its original token over ``vocab_ids`` (e.g. the reconstruction
    vocabulary of public text); a token outside the vocabulary is always a miss."""

    def __init__(self, hidden_size: int, vocab_ids: torch.Tensor, width: int = 256):
        super().__init__()
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).sort().values)
        self.net = nn.Sequential(nn.Linear(hidden_size, width), nn.ReLU(), nn.Linear(width, self.vocab_ids.numel()))

    def _targets(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.searchsorted(self.vocab_ids, ids).clamp_max(self.vocab_ids.numel() - 1)
        return pos, self.vocab_ids[pos] == ids

    def fit(self, hidden: torch.Tensor, original_ids: torch.Tensor, epochs: int = 30, lr: float = 3e-3,
            batch_size: int = 256, generator: torch.Generator | None = None) -> HiddenStateInverter:
        """Train on (output state, original id) pairs of PUBLIC text (rows: flattened positions)."""
        x, ids = hidden.detach().float().reshape(-1, hidden.shape[-1]), torch.as_tensor(original_ids).long().reshape(-1)
        target, known = self._targets(ids)
        x, target = x[known], target[known]
        if x.shape[0] == 0:
            raise ValueError("no training token is in the inverter's vocabulary")
        opt = torch.optim.Adam(self.parameters(), lr=lr)
        for _ in range(epochs):
            for idx in torch.randperm(x.shape[0], generator=generator).split(batch_size):
                loss = F.cross_entropy(self.net(x[idx]), target[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        return self

    @torch.no_grad()
    def success(self, hidden: torch.Tensor, original_ids: torch.Tensor) -> float:
        """Share of tokens (flattened rows) whose original id is predicted."""
        x, ids = hidden.detach().float().reshape(-1, hidden.shape[-1]), torch.as_tensor(original_ids).long().reshape(-1)
        if x.shape[0] == 0:
            raise ValueError("no positions to attack")
        guess = self.vocab_ids[self.net(x).argmax(-1)]
        return float((guess == ids).float().mean())


def attribute_inference(features: torch.Tensor, attributes, test_fraction: float = 0.3, width: int = 768,
                        epochs: int = 100, lr: float = 1e-3, generator: torch.Generator | None = None) -> dict[str, float]:
    """2-layer MLP (``width`` hidden units, ReLU; the paper's attacker) from pooled
    representations to a private attribute, trained on a random split and evaluated on the rest:
    {'success': held-out accuracy, 'majority_rate': held-out share of the train split's majority
    class, 'n_test'}. Empirical privacy is 1 − success."""
    x = torch.as_tensor(features).detach().float()
    y_raw = np.asarray(attributes)
    if x.dim() != 2 or x.shape[0] != y_raw.shape[0]:
        raise ValueError(f"features must be (N, h) with one attribute per row, got {tuple(x.shape)} and {y_raw.shape}")
    classes, y_np = np.unique(y_raw, return_inverse=True)
    if len(classes) < 2:
        raise ValueError("the attribute must take at least two values")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    y = torch.as_tensor(y_np, dtype=torch.long)
    perm = torch.randperm(x.shape[0], generator=generator)
    n_test = max(1, round(test_fraction * x.shape[0]))
    test, train = perm[:n_test], perm[n_test:]
    if train.numel() == 0:
        raise ValueError("too few rows for a train/test split")
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
    x = (x - mean) / std
    net = nn.Sequential(nn.Linear(x.shape[1], width), nn.ReLU(), nn.Linear(width, len(classes)))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(epochs):
        for idx in train[torch.randperm(train.numel(), generator=generator)].split(64):
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        success = float((net(x[test]).argmax(-1) == y[test]).float().mean())
    majority = int(torch.bincount(y[train], minlength=len(classes)).argmax())
    return {"success": success, "majority_rate": float((y[test] == majority).float().mean()), "n_test": float(n_test)}


@torch.no_grad()
def text_states(classifier, data, batch_size: int = 32) -> torch.Tensor:
    """(N, L, h) output states of privatised inputs, padded back to the encoding's width."""
    N, L = data.input_ids.shape
    out = None
    for s in range(0, N, batch_size):
        h = classifier.hidden_states(data.rows(slice(s, s + batch_size))).float().cpu()
        if out is None:
            out = torch.zeros((N, L, h.shape[-1]))
        out[s:s + h.shape[0], :h.shape[1]] = h
    return out if out is not None else torch.zeros((0, L, 1))


def pooled_text_states(states: torch.Tensor, text_mask) -> torch.Tensor:
    """(N, h) mean of the text positions' states (:func:`text_states` output): the features of
    the attribute-inference attack, as ``RaptClassifier.pooled_text`` computes them."""
    m = torch.as_tensor(text_mask)[:, :states.shape[1]].unsqueeze(-1).to(states.dtype)
    return (states * m).sum(1) / m.sum(1).clamp_min(1.0)


def hidden_inversion_attack(classifier, private_data, private_original_ids, public_data, public_original_ids,
                            index: VocabularyIndex, inverter_vocab: torch.Tensor, batch_size: int = 32,
                            epochs: int = 20, generator: torch.Generator | None = None,
                            states: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Inversion of the tuned model's per-token output states of privatised text (text positions
    only): {'nn_success': nearest input embedding, 'learned_success': an MLP inverter trained on
    PUBLIC text privatised the same way (``public_data`` with its original ids), over
    ``inverter_vocab`` (e.g. the reconstruction vocabulary)}. Reads the private ORIGINAL ids:
    a non-private use. ``classifier``: a :class:`tasks.methods.rapt.model.RaptClassifier`; ``states``:
    its :func:`text_states` of (private_data, public_data) when the caller has them already.

    The inverter's classes are the ids of ``inverter_vocab`` that occur among the public training
    tokens: a class without one training example only ever receives gradients that lower its logit,
    so dropping it loses the attacker nothing, and the output layer (most of the attack's time) shrinks."""
    priv_h, pub_h = states if states is not None else (text_states(classifier, private_data, batch_size),
                                                       text_states(classifier, public_data, batch_size))
    priv_mask, pub_mask = private_data.text_mask, public_data.text_mask
    priv_ids, pub_ids = torch.as_tensor(private_original_ids).long(), torch.as_tensor(public_original_ids).long()
    nn_success = hidden_inversion_nn_success(priv_h, priv_ids, priv_mask, index)
    vocab = torch.as_tensor(inverter_vocab).long()
    vocab = vocab[torch.isin(vocab, pub_ids[pub_mask])]
    if vocab.numel() == 0:
        raise ValueError("no public training token is in the inverter's vocabulary")
    inverter = HiddenStateInverter(priv_h.shape[-1], vocab)
    inverter.fit(pub_h[pub_mask], pub_ids[pub_mask], epochs=epochs, generator=generator)
    return {"nn_success": nn_success, "learned_success": inverter.success(priv_h[priv_mask], priv_ids[priv_mask])}
