"""Batched next-token computation on a frozen local causal LM, built for DP-OPT's queries (and
dp_fewshot's: the text-prompt methods share it, :func:`causal_engine_for` builds it from a config).

* One *query* gives the next-token logits of J sequences at their LAST position only.
* The sequences of a run share a head (the backward template with the run's instruction): it is
  encoded once, and its key/value cache is copied into every batch (``SharedPrefix``).
* The suffixes are bucketed by length and LEFT-padded inside the bucket; the attention mask
  covers head + suffix, and position ids count only real tokens, so a padded row computes exactly
  what it computes alone (tested against unpadded, one-by-one forwards).
* Incremental decoding (OPT's ensemble, demos fixed per prompt) keeps one KV cache across tokens.
* On CUDA the forwards run without cuDNN's attention kernel (:func:`models.device.attention_backends`): nearly
  every call here has shapes never run before (one token longer, other buckets), and cuDNN attention,
  scaled_dot_product_attention's first choice for bfloat16 on Hopper, builds a plan per new shape
  (bench/bench_cuda_shapes.py, Llama-2-7B's architecture in bfloat16 on an H100: 217 vs 40 ms per
  OPT token, 1.58 vs 1.08 s per DP-OPT query of J = 205 on fresh shapes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.device import attention_backends  # noqa: F401  (re-exported: the engine's forwards use it)
from models.row_own import batch_rows_default, probe_tokens, row_batch, run_row_own


@dataclass
class SharedPrefix:
    """The encoded shared head: its ids and its KV cache for a batch of one."""

    ids: list[int]
    cache: object | None

    @property
    def length(self) -> int:
        return len(self.ids)


HEAD_ROOM = 32  # positions a scored row always has after a shared instruction head (a longer head is cut)


class CausalEngine:
    """``model``: a frozen causal LM (eval mode); ``tokenizer``: its tokenizer."""

    def __init__(self, model, tokenizer, max_batch: int = 32, bucket_width: int = 16, batch_rows: bool | None = None):
        self.model, self.tok = model, tokenizer
        self.max_batch, self.bucket_width = max_batch, bucket_width
        self.device = next(model.parameters()).device
        # last_logits_rowwise batches rows in public shapes on an accelerator; on a CPU every row runs
        # alone at its own length (a batch buys little there, and its bucket padding, pad-only fill rows
        # and per-shape checks cost 3-5× — measured in bench/bench_dpopt.py --mixed)
        # (never for a model whose rows mix at a fixed shape: models.row_own.rows_mix)
        self.batch_rows = batch_rows_default(self.device, model, batch_rows)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.eos_id = tokenizer.eos_token_id
        self._heads: dict[str, SharedPrefix] = {}  # label_logprobs' encoded heads, the last few (public text)
        self.row_checks: dict[tuple, bool] = {}  # last_logits_rowwise's checked batch shapes → row-own (else rows alone)

    @property
    def max_positions(self) -> int | None:
        """The model's positions, if bounded (:meth:`models.backbones.Backbone.max_positions`)."""
        from models.backbones import config_positions

        return config_positions(self.model.config)

    # ---- tokenisation ------------------------------------------------------------------------
    def ids(self, text: str) -> list[int]:
        # verbose=False: the tokenizer's "longer than the model's maximum" warning prints a private text's length
        return list(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def encode_prefix(self, text: str, room: int = 0) -> SharedPrefix:
        """Encode the shared head once (with the tokenizer's BOS, if it adds one); ``room``: positions
        kept free after it — a head longer than the model's context less ``room`` keeps its first tokens
        (public: a head is an instruction, never a private text)."""
        ids = list(self.tok(text, add_special_tokens=True, verbose=False)["input_ids"]) if text else []
        limit = self.max_positions
        if room and limit is not None and len(ids) > limit - room:
            ids = ids[:max(0, limit - room)]
        if not ids:
            return SharedPrefix([], None)
        with torch.no_grad(), attention_backends(self.device):
            out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True)
        return SharedPrefix(ids, out.past_key_values)

    # ---- one query: last-position logits of many sequences -------------------------------------
    @torch.no_grad()
    def last_logits(self, suffixes: list[list[int]], prefix: SharedPrefix | None = None) -> torch.Tensor:
        """(J, V) float32 logits at the last position of ``prefix.ids + suffixes[j]``, in the order
        given. Suffixes are grouped into length buckets and left-padded within a bucket."""
        prefix = prefix or SharedPrefix([], None)
        if any(len(s) == 0 for s in suffixes):
            raise ValueError("every sequence needs at least one token after the shared prefix")
        order = sorted(range(len(suffixes)), key=lambda j: len(suffixes[j]))
        out: list[torch.Tensor | None] = [None] * len(suffixes)
        start = 0
        while start < len(order):
            first = len(suffixes[order[start]])
            stop = start
            while (stop < len(order) and stop - start < self.max_batch
                   and len(suffixes[order[stop]]) - first < self.bucket_width):
                stop += 1
            batch = [order[i] for i in range(start, stop)]
            logits = self._forward_left_padded([suffixes[j] for j in batch], prefix)
            for row, j in enumerate(batch):
                out[j] = logits[row]
            start = stop
        return torch.stack(out) if out else torch.zeros(0)

    def _forward_left_padded(self, rows: list[list[int]], prefix: SharedPrefix, length: int | None = None) -> torch.Tensor:
        B, L, P = len(rows), length or max(len(r) for r in rows), prefix.length
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, L - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, L - len(r):] = 1
        positions = (P + mask.cumsum(1) - 1).clamp(min=0)
        if length is not None:  # a public shape (last_logits_rowwise): padding sits at the shape's last position,
            # so the batch's largest position id is P + L - 1 whatever the rows — RoPE variants that pick their
            # factors from it (longrope) then treat every row alike; masked, it moves no real token
            positions = torch.where(mask.bool(), positions, torch.full_like(positions, P + L - 1))
        full_mask = torch.cat([torch.ones((B, P), dtype=torch.long), mask], dim=1)
        cache = None
        if prefix.cache is not None:
            cache = copy.deepcopy(prefix.cache)
            cache.batch_repeat_interleave(B)
        with attention_backends(self.device):
            out = self.model(input_ids=ids.to(self.device), attention_mask=full_mask.to(self.device),
                             position_ids=positions.to(self.device), past_key_values=cache,
                             use_cache=cache is not None, logits_to_keep=1)
        return out.logits[:, -1, :].float().cpu()

    # ---- proposals ----------------------------------------------------------------------------
    @staticmethod
    def propose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
        """One next token per row: greedy when ``temperature`` is 0, else a sample at that
        temperature from ``generator``. A row whose logits are not a distribution (a NaN, a +inf,
        or all -inf: one member's demos overflowing in reduced precision) proposes -1, no token —
        it casts no vote instead of failing the whole query (a crash decided by one
        record). The sampled rows' draws do not depend on which rows were left out."""
        scaled = logits / temperature if temperature > 0 else logits  # screened after the division (NaN at
        bad = torch.isnan(scaled).any(-1) | torch.isposinf(scaled).any(-1) | torch.isneginf(scaled).all(-1)  # T→0)
        safe = torch.where(bad.unsqueeze(-1), torch.zeros_like(scaled), scaled)
        if temperature <= 0:
            picked = safe.argmax(dim=-1)
        else:
            picked = torch.multinomial(F.softmax(safe, dim=-1), 1, generator=generator).squeeze(1)
        return torch.where(bad, torch.full_like(picked, -1), picked)

    # ---- incremental decoding with a KV cache (OPT's ensemble) ---------------------------------
    @torch.no_grad()
    def start(self, rows: list[list[int]]):
        """Encode full left-padded sequences once; returns a decoding state for :meth:`step`."""
        B, L = len(rows), max(len(r) for r in rows)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, L - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, L - len(r):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with attention_backends(self.device):
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), use_cache=True, logits_to_keep=1)
        return {"cache": out.past_key_values, "mask": mask, "next_pos": mask.sum(1),
                "logits": out.logits[:, -1, :].float().cpu()}

    @torch.no_grad()
    def step(self, state: dict, tokens: torch.Tensor) -> dict:
        """Append one token per row (B,) and return the state with the new last logits."""
        B = tokens.shape[0]
        state["mask"] = torch.cat([state["mask"], torch.ones((B, 1), dtype=torch.long)], dim=1)
        with attention_backends(self.device):
            out = self.model(input_ids=tokens.view(B, 1).to(self.device), attention_mask=state["mask"].to(self.device),
                             position_ids=state["next_pos"].view(B, 1).to(self.device),
                             past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
        state["next_pos"] = state["next_pos"] + 1
        state["cache"], state["logits"] = out.past_key_values, out.logits[:, -1, :].float().cpu()
        return state

    # ---- scoring a discrete prompt ---------------------------------------------------------------
    @torch.no_grad()
    def label_logprobs(self, prefix_text: str, texts: list[str], label_words: list[str],
                       template, rowwise: bool = False) -> torch.Tensor:
        """(N, n_labels) log-probabilities of each label word's first token as the next token
        after ``template(text)`` (the instruction is part of ``prefix_text``: encoded once).
        ``rowwise``: each row's from that row alone (:meth:`last_logits_rowwise`)."""
        label_ids = []
        for w in label_words:
            toks = self.ids(w)
            if not toks:
                raise ValueError(f"label word {w!r} gives no tokens")
            label_ids.append(toks[0])
        if len(set(label_ids)) != len(label_ids):
            raise ValueError(f"label words {label_words!r} share a first token")
        prefix = self._head(prefix_text)
        suffixes = [self.ids(template(t)) for t in texts]
        if prefix.length == 0:  # no shared head: the first row tokens carry BOS if the tokenizer adds one
            suffixes = [list(self.tok(template(t), add_special_tokens=True, verbose=False)["input_ids"]) for t in texts]
        suffixes = [self.fit_row(s, prefix.length) for s in suffixes]
        logits = (self.last_logits_rowwise if rowwise else self.last_logits)(suffixes, prefix)
        return F.log_softmax(logits, dim=-1)[:, label_ids]

    def fit_row(self, ids: list[int], head: int) -> list[int]:
        """A scored row's tokens as the model can take them after a head of ``head`` tokens — a function
        of that row alone and public numbers, so one record never makes a forward raise where its
        neighbour's runs: past the context, its last tokens (the template's tail,
        where the label is read); no token at all (a record of only zero-width characters in a template
        with nothing around its text), one public stand-in. The token budgets keep rows within the
        context on the tokenizers tested; this is the guard where a seam still tokenizes longer."""
        limit = self.max_positions
        if limit is not None and len(ids) > limit - head:
            ids = ids[-max(1, limit - head):]
        if not ids:
            stand_in = next((t for t in (self.tok.unk_token_id, self.eos_id, self.tok.pad_token_id) if t is not None), 0)
            ids = [int(stand_in)]
        return ids

    def _head(self, text: str, keep: int = 4) -> SharedPrefix:
        """The encoded head of ``text`` (an instruction: public), kept for the next calls: scoring
        rows one by one (each alone, for privacy) encodes the head once, not once per row."""
        if text not in self._heads:
            if len(self._heads) >= keep:
                self._heads.pop(next(iter(self._heads)))
            # a scored row always has room after it (a released candidate that re-encodes longer
            # than its tokens filled the context, and a holdout of one row raised where an empty one did not)
            self._heads[text] = self.encode_prefix(text, room=HEAD_ROOM)
        return self._heads[text]

    @torch.no_grad()
    def last_logits_rowwise(self, suffixes: list[list[int]], prefix: SharedPrefix | None = None) -> torch.Tensor:
        """:meth:`last_logits` where every row's logits are a function of that row alone, batched.

        With :meth:`last_logits`, a row's logits move by float rounding with its companions' lengths
        and padding (1e-7–1e-6 on tiny-gpt2): at a near-tie one record could flip another member's
        vote — two votes moved where LimitedDomain is calibrated for one — or another row's ŷ.
        Here the SHAPE of every forward pass is public and the row's own
        (:func:`models.row_own.run_row_own`): a row is left-padded to its length rounded up to
        ``bucket_width``, the rows of one padded length go in batches of exactly :meth:`row_batch`
        rows (a function of that length alone), each holding at least one pad-only row, and each
        (batch, length, head) shape is checked on the device, bit for bit, the first time it runs, on
        public probe rows (``row_checks``); a shape that fails runs its rows alone. On an H100 a 7B
        model's query of J = 205 mixed members took 0.89 s with :meth:`last_logits`, 1.21 s here and
        7.27 s with every row in its own pass (bench/RESULTS.md).

        Without ``batch_rows`` (the default on a CPU) every row runs alone at its own length: no
        companions, no padding, nothing to check."""
        prefix = prefix or SharedPrefix([], None)
        if any(len(s) == 0 for s in suffixes):
            raise ValueError("every sequence needs at least one token after the shared prefix")
        if not self.batch_rows:
            return torch.cat([self._forward_left_padded([s], prefix) for s in suffixes]) if suffixes else torch.zeros(0)
        vocab = int(self.model.get_input_embeddings().num_embeddings)  # probe ids the model can embed
        limit = self.max_positions
        # padded lengths (and the probes of the row checks) within the positions the head leaves: a row
        # that fits is never padded past the model (a crash decided by one record)
        cap = None if limit is None else max(1, limit - prefix.length)
        out = run_row_own(suffixes, [len(s) for s in suffixes],
                          lambda rows, length: self._forward_left_padded(rows, prefix, length), [self.pad_id],
                          lambda size, length: probe_tokens(size, length, vocab, self.bucket_width),
                          self.row_checks, key=prefix.length, width=self.bucket_width, cap=cap, max_batch=self.max_batch)
        return torch.stack(out) if out else torch.zeros(0)

    def row_batch(self, length: int) -> int:
        """:meth:`last_logits_rowwise`'s batch size for rows padded to ``length`` (:func:`models.row_own.row_batch`)."""
        return row_batch(length, self.max_batch)


def causal_engine_for(cfg, max_batch: int = 32) -> CausalEngine:
    """The engine of ``models.local`` (a causal LM; any other kind is refused with one line)."""
    from models.backbones import load_backbone

    from ..errors import ConfigError

    bb = load_backbone(cfg.models.local, seed=cfg.seed, placement=cfg.models.placement_of(cfg.models.local))
    if bb.kind != "causal":
        raise ConfigError(f"models.local={cfg.models.local!r} is a {bb.kind} model: discrete-prompt methods "
                          "generate with a causal LM (e.g. smollm2)")
    return CausalEngine(bb.model, bb.tokenizer, max_batch=max_batch)
