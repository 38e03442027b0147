"""Local leakage report of generated prompts against the private training texts (DP-OPT's
Appendix B.1 searched nearest neighbours by sentence embeddings; its code only checked exact
substrings). Returns counts and a similarity, never a text. They are exact statistics of the
private texts (not DP), so they are named ``audit.leakage.*``: published only as labelled audit
statistics, and listed by the ledger as a non-private use (see ../shared/RUN_RECORD.md)."""

from __future__ import annotations

import re

import torch

_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def exact_copies(prompts: list[str], private_texts: list[str], n: int = 6) -> int:
    """Prompts that contain an ``n``-word sequence of a private text (a private text shorter than
    ``n`` words counts when it appears whole, with at least 3 words)."""
    grams: set[tuple[str, ...]] = set()
    for t in private_texts:
        w = _words(t)
        grams |= _ngrams(w, n) if len(w) >= n else ({tuple(w)} if len(w) >= 3 else set())
    count = 0
    for p in prompts:
        w = _words(p)
        sizes = {len(g) for g in grams}
        if any(g in grams for k in sizes for g in _ngrams(w, k)):
            count += 1
    return count


@torch.inference_mode()  # an audit's forward: no graph (66,000 private texts at the paper's scale)
def sentence_embeddings(texts: list[str], backbone, batch_size: int = 64, max_length: int = 128) -> torch.Tensor:
    """Mean-pooled, L2-normalised token embeddings of an encoder (all-MiniLM-L6-v2's recipe)."""
    out = []
    for i in range(0, len(texts), batch_size):
        enc = backbone.tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                                 return_tensors="pt").to(backbone.device)
        hidden = backbone.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        out.append(torch.nn.functional.normalize(emb.float(), dim=-1).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def leakage_report(prompts: list[str], private_texts: list[str], encoder=None, n: int = 6,
                   near_threshold: float = 0.9, progress=None) -> dict[str, float]:
    """``audit.leakage.exact_copies`` (prompts with an n-gram copy of a private text),
    ``audit.leakage.prompts`` (prompts checked), ``audit.leakage.near_copies`` (prompts whose
    nearest private text by sentence embedding has cosine ≥ ``near_threshold``) and
    ``audit.leakage.max_similarity`` (the largest such cosine): audit statistics, not DP.
    ``progress(step, 10, stage=...)``: tenths of the embedding pass over the private texts (minutes
    on a CPU at the paper's scale), 1, 2, …, 10 for any number of texts — never a count of them or of
    their chunks (the training set's exact size, or its bucket)."""
    report = {"audit.leakage.exact_copies": float(exact_copies(prompts, private_texts, n)),
              "audit.leakage.prompts": float(len(prompts))}
    if encoder is not None and prompts:
        p = sentence_embeddings(prompts, encoder)
        best = torch.full((len(prompts),), -1.0)
        # by length, so that each batch pads to about its own texts' length (only the best cosine is kept:
        # the order changes nothing else, up to float rounding): 2.4× faster on SST-2 (8,192 texts, MiniLM,
        # 2 CPU threads: 54 → 22 s). In ten parts of near-equal size, a progress line after each: ten lines
        # at even intervals for any number of texts, none at all included (lines in bursts
        # per fixed-size chunk timed the chunks' count)
        ordered = sorted(private_texts, key=len)
        for k in range(10):
            part = ordered[k * len(ordered) // 10:(k + 1) * len(ordered) // 10]
            if part:
                q = sentence_embeddings(part, encoder)
                best = torch.maximum(best, (p @ q.T).max(dim=1).values)
            if progress is not None:
                progress(k + 1, 10, stage="leakage audit")
        if private_texts:
            report["audit.leakage.near_copies"] = float((best >= near_threshold).sum())
            report["audit.leakage.max_similarity"] = float(best.max())
    return report
