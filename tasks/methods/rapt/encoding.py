"""RAPT inputs: ``[CLS] k_1..k_m x_1..x_n [SEP]`` token ids of the tuned model's tokenizer, and
their privatised form, the only thing the model side accepts.

The m plain tokens k are public, arbitrary ids prepended before privatisation (paper §3.2.2);
``text_mask`` marks the x positions (what the task loss pools, eq. 8). Privatisation replaces
ids one for one, so the masks of the plain encoding hold for the privatised one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .privatize import BackbonePrivatizer, changed_share

PLAIN_TOKENS = 40  # m


def default_plain_ids(tokenizer, m: int = PLAIN_TOKENS, seed: int = 0) -> list[int]:
    """m arbitrary public token ids (the paper: "can be chosen arbitrarily"): seeded draws of
    non-special vocabulary ids. Not DP randomness: the plain tokens are public by design."""
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    unused = {i for t, i in tokenizer.get_vocab().items() if t.startswith("[unused")}
    allowed = np.array(sorted(set(range(len(tokenizer))) - special - unused))
    return [int(i) for i in np.random.default_rng(seed).choice(allowed, size=m, replace=False)]


def encode_rapt(tokenizer, texts: list[str], plain_ids: list[int], max_length: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``text_mask`` (N, L) for
    ``[CLS] plain text [SEP]``; the text is truncated to fit ``max_length``."""
    plain = [int(i) for i in plain_ids]
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    if cls_id is None or sep_id is None:
        raise ValueError("RAPT's encoding needs a tokenizer with [CLS] and [SEP] tokens (a BERT-like encoder)")
    budget = max_length - len(plain) - 2
    if budget < 1:
        raise ValueError(f"max_length={max_length} must hold {len(plain)} plain tokens, [CLS], [SEP] and at least one text token")
    # verbose=False: the tokenizer's "longer than the model's maximum" warning prints a private text's length
    text_ids = tokenizer([str(t) for t in texts], add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    rows = [[cls_id] + plain + list(ids)[:budget] + [sep_id] for ids in text_ids]
    L = max((len(r) for r in rows), default=len(plain) + 2)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), L), int(pad), dtype=torch.long)
    attention = torch.zeros((len(rows), L), dtype=torch.long)
    text_mask = torch.zeros((len(rows), L), dtype=torch.bool)
    start = 1 + len(plain)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r)
        attention[i, :len(r)] = 1
        text_mask[i, start:len(r) - 1] = True
    return {"input_ids": input_ids, "attention_mask": attention, "text_mask": text_mask}


@dataclass(frozen=True)
class PrivatizedEncoding:
    """Privatised RAPT inputs (made only by :func:`privatize_encoding`): what tuning and
    inference take. ``plain_ids`` are the ORIGINAL public plain tokens (reconstruction targets),
    at positions 1..m. No statistic of the private text rides along (the share of tokens the
    mechanism changed is an audit statistic, :func:`replaced_share`, computed on the local side)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    text_mask: torch.Tensor
    plain_ids: tuple[int, ...]
    eta: float

    @property
    def n_plain(self) -> int:
        return len(self.plain_ids)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, idx) -> PrivatizedEncoding:
        idx = torch.as_tensor(idx, dtype=torch.long) if isinstance(idx, list) else idx
        return PrivatizedEncoding(self.input_ids[idx], self.attention_mask[idx], self.text_mask[idx],
                                  self.plain_ids, self.eta)


def privatize_encoding(encoding: dict[str, torch.Tensor], plain_ids: list[int], privatizer: BackbonePrivatizer,
                       eta: float, rng: np.random.Generator) -> PrivatizedEncoding:
    """d_X-privatise every plain and text token of an :func:`encode_rapt` result, special ids
    inside the text included (``[UNK]``, a literal ``[MASK]``: none is released as it was); the
    framing [CLS], [SEP] and padding pass through. ``rng``: the secret generator (tests inject a
    seeded one)."""
    ids, attn, text = encoding["input_ids"], encoding["attention_mask"], encoding["text_mask"]
    m = len(plain_ids)
    if m and ids.shape[0] and not bool((ids[:, 1:1 + m] == torch.tensor(plain_ids)).all()):
        raise ValueError("the encoding's positions 1..m must hold the plain tokens given")
    positions = text.clone()
    positions[:, 1:1 + m] = attn[:, 1:1 + m].bool()  # the plain tokens; special ids inside the text too
    private = privatizer(ids, attn, eta, rng, positions=positions)
    return PrivatizedEncoding(private, attn.clone(), text.clone(), tuple(int(i) for i in plain_ids), float(eta))


def replaced_share(encoding: dict[str, torch.Tensor], data: PrivatizedEncoding) -> float:
    """LOCAL side: the share of text tokens (plain tokens excluded) the mechanism changed — it
    reads the original ids, so it is an audit statistic of the private text, not DP."""
    return changed_share(encoding["input_ids"], data.input_ids, encoding["text_mask"])


def without_plain(data: PrivatizedEncoding, encoding: dict[str, torch.Tensor]) -> tuple[PrivatizedEncoding, dict]:
    """The privatization-only variant of a draw made with plain tokens: positions 1..m dropped
    from the privatised ids and from the original encoding (post-processing of the same draw, so
    variants with and without the reconstruction task share it; the text tokens are the same)."""
    m = data.n_plain
    if not m:
        return data, encoding
    keep = torch.tensor([0] + list(range(1 + m, data.input_ids.shape[1])), dtype=torch.long)
    cut = {k: v[:, keep] for k, v in encoding.items()}
    return PrivatizedEncoding(data.input_ids[:, keep], data.attention_mask[:, keep], data.text_mask[:, keep], (),
                              data.eta), cut
