"""Frozen-backbone classifiers that take a soft prompt on the input embeddings.

Every classifier scores a pre-tokenised batch with an optional soft prompt prepended to the
INPUT EMBEDDINGS, so one (n_tokens, embed_dim) prompt can be scored on any backbone of that
width. Interface (:class:`PromptClassifier`):

* ``encode(texts, max_length)`` -> dict of CPU tensors ``input_ids`` (N, L), ``attention_mask``
  (N, L) (right padding) and ``label_pos`` (N,) (the position, without prompt, whose output is
  read: last real token for causal LMs, the mask token for masked LMs). Tokenise once, then
  slice rows with :func:`select_rows`.
* ``forward(batch, prompt)`` -> logits (B, n_labels); ``prompt`` is None, (n, d) (broadcast)
  or (B, n, d) (per-example copies, used for per-sample gradients), or a prefix: (L, 2, n, d_kv)
  or (B, L, 2, n, d_kv) keys and values for every attention layer (``models.prompts.prefix``),
  or a LoRA (``models.prompts.lora``: low-rank updates of the model's linear layers, shared or one
  per example), which takes no positions.

The backbone is frozen, in eval mode, and NOT a submodule (it is shared through the backbone
cache): ``classifier.train()`` cannot switch on its dropout, and ``classifier.parameters()`` is
empty. Examples never interact inside ``forward`` (no batch norm, padding masked out), which is
what makes the gradient w.r.t. a (B, n, d) prompt a per-sample gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.prompts.prefix import (active_prefix_tokens, is_prefix, prefix_hooks, prefix_position_ids,
                                   prefix_tokens)
from models.prompts.lora import is_lora, lora_hooks
from models.length_groups import in_length_groups, per_example_rows
from models.backbones import Backbone
from models.device import attention_backends

DEFAULT_CAUSAL_TEMPLATE = "{text} It was"
DEFAULT_MASKED_TEMPLATE = "{text} It was {mask}."
DEFAULT_ENCODER_TEMPLATE = "{text}"
Batch = dict[str, torch.Tensor]


def num_examples(encoded: Batch) -> int:
    return int(encoded["input_ids"].shape[0])


def select_rows(encoded: Batch, idx: torch.Tensor | slice | list[int]) -> Batch:
    """Rows ``idx`` of an encoded dataset (any index tensors/slices work)."""
    if isinstance(idx, list):
        idx = torch.tensor(idx, dtype=torch.long)
    return {k: v[idx] for k, v in encoded.items()}


class _TemplateTokenizer:
    """Tokenises ``template.format(text=...)`` piecewise so that truncation only cuts the text.

    ``[prefix specials] + prefix + text[:budget] + suffix + [suffix specials]``; the tokenizer's
    own special tokens are found with a sentinel, so any tokenizer works (BERT: [CLS] .. [SEP],
    Llama: <s> .., GPT-2: none). Causal models drop the trailing specials so the last position
    is the template's last word.
    """

    def __init__(self, tokenizer, template: str, kind: str):
        if template.count("{text}") != 1:
            raise ValueError(f"template must contain '{{text}}' exactly once: {template!r}")
        self.tok = tokenizer
        self.kind = kind
        mask = getattr(tokenizer, "mask_token", None)
        if kind == "masked":
            if mask is None:
                raise ValueError("a masked-LM template needs a tokenizer with a mask token")
            template = template.replace("{mask}", mask).replace("[MASK]", mask)
        prefix, suffix = template.split("{text}")
        self.prefix = self._ids(prefix)
        self.suffix = self._ids(suffix)
        self.sp_pre, self.sp_suf = self._special_wrap()
        if kind == "causal":
            self.sp_suf = []
        self.mask_offset = None
        if kind == "masked":
            hits = [i for i, t in enumerate(self.suffix) if t == tokenizer.mask_token_id]
            if len(hits) != 1 or mask in prefix:
                raise ValueError(f"a masked-LM template needs exactly one mask after {{text}}: {template!r}")
            self.mask_offset = hits[0]
        self.fixed = len(self.sp_pre) + len(self.prefix) + len(self.suffix) + len(self.sp_suf)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def _ids(self, s: str) -> list[int]:
        return list(self.tok(s, add_special_tokens=False)["input_ids"]) if s else []

    def _special_wrap(self) -> tuple[list[int], list[int]]:
        probe = "hello"
        bare = self._ids(probe)
        full = list(self.tok(probe, add_special_tokens=True)["input_ids"])
        for o in range(len(full) - len(bare) + 1):
            if full[o : o + len(bare)] == bare:
                return full[:o], full[o + len(bare) :]
        return [], []

    def __call__(self, texts: list[str], max_length: int) -> Batch:
        budget = max_length - self.fixed
        if budget < 1:
            raise ValueError(f"max_length={max_length} leaves no room for text (template takes {self.fixed})")
        texts = [str(t) for t in texts]
        # verbose=False: the tokenizer's "longer than the model's maximum" warning prints a private text's length
        text_ids = self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
        rows, label_pos = [], []
        for ids in text_ids:
            ids = list(ids)[:budget]
            row = self.sp_pre + self.prefix + ids + self.suffix + self.sp_suf
            if self.kind == "masked":
                label_pos.append(len(self.sp_pre) + len(self.prefix) + len(ids) + self.mask_offset)
            else:
                label_pos.append(len(row) - 1)
            rows.append(row)
        L = max((len(r) for r in rows), default=1)
        input_ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, : len(r)] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "label_pos": torch.tensor(label_pos, dtype=torch.long),
        }


class PromptClassifier(nn.Module):
    """Base class: frozen backbone + template; subclasses implement ``_logits``."""

    default_template = DEFAULT_ENCODER_TEMPLATE

    def __init__(self, backbone: Backbone, labels: list[str], template: str | None = None):
        super().__init__()
        if len(labels) < 2:
            raise ValueError(f"need at least two labels, got {labels!r}")
        self._backbone = backbone  # plain attribute, not a submodule (see module docstring)
        self.labels = [str(l) for l in labels]
        self.template = template or self.default_template
        self._tokenize = _TemplateTokenizer(backbone.tokenizer, self.template, self._template_kind())
        self.row_checks: dict[tuple, bool] = {}  # row_wise_logits' checked batch shapes → row-own (else rows alone)

    def _template_kind(self) -> str:
        return "encoder"

    @property
    def backbone(self) -> Backbone:
        return self._backbone

    @property
    def device(self) -> torch.device:
        return self._backbone.device

    @property
    def embed_dim(self) -> int:
        return self._backbone.embed_dim

    @property
    def n_labels(self) -> int:
        return len(self.labels)

    @property
    def template_tokens(self) -> int:
        """Tokens the template (and the tokenizer's special tokens) add around every text."""
        return self._tokenize.fixed

    def encode(self, texts: list[str], max_length: int = 64) -> Batch:
        """Tokenise ``texts`` with the template (right padding, CPU tensors)."""
        return self._tokenize(list(texts), max_length)

    def forward(self, batch: Batch, prompt: torch.Tensor | None = None) -> torch.Tensor:
        B = num_examples(batch)
        if B == 0:
            return torch.zeros((0, self.n_labels), device=self.device)
        return self._by_length(batch, prompt, self._logits)

    def forward_shaped(self, batch: Batch, prompt: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` in ONE pass of exactly the batch's shape (no length groups, no padding
        columns dropped): the caller chose the shape (:func:`models.scoring.row_wise_logits`)."""
        embeds, attn, pos = self._embed_inputs(batch, prompt, trim=False)
        with self.prompting(prompt, embeds.shape[0]), attention_backends(self.device):
            return self._logits(embeds, attn, pos).to(embeds.device)

    def _by_length(self, batch: Batch, prompt: torch.Tensor | None, head) -> torch.Tensor:
        """``head(embeds, attn, pos)`` of the prompted rows, run on groups of rows of similar
        length (``models.length_groups``: less padding, the same per-row outputs)."""
        per_example = prompt is not None and (prompt.per_example if is_lora(prompt)
                                              else prompt.dim() == (5 if is_prefix(prompt) else 3))

        def run(rows):
            part = batch if rows is None else select_rows(batch, rows)
            p = per_example_rows(prompt, rows, per_example)
            embeds, attn, pos = self._embed_inputs(part, p)
            with self.prompting(p, embeds.shape[0]), attention_backends(self.device):
                # no cuDNN attention on CUDA (batch shapes keep changing); logits back on the input's device
                return head(embeds, attn, pos).to(embeds.device)

        return in_length_groups(batch["attention_mask"].sum(1), run, self.device, self.embed_dim)

    @property
    def _n_prefix(self) -> int:
        """Placeholder positions of the prefix this thread has in place (0: none)."""
        return active_prefix_tokens(self._backbone.model)

    @contextmanager
    def prompting(self, prompt: torch.Tensor | None, batch_size: int):
        """Within the block (in this thread) a prefix prompt's keys and values, or a LoRA's updates,
        are in place (no-op for soft prompts and None): wraps every backbone call on inputs from
        :meth:`_embed_inputs`."""
        if is_lora(prompt):
            with lora_hooks(self._backbone.model, prompt, batch_size):
                yield
            return
        if not is_prefix(prompt):
            yield
            return
        with prefix_hooks(self._backbone.model, prompt.to(self.device), batch_size):
            yield

    def position_ids(self, B: int, T: int, device) -> torch.Tensor | None:
        """Position ids for a (B, T) input: None (the model's default) without a prefix; with one,
        the placeholders take 0 and the text keeps the positions it has without a prompt."""
        n = self._n_prefix
        if not n:
            return None
        return prefix_position_ids(self._backbone.model, B, T, n, device)

    def _position_kwargs(self, embeds: torch.Tensor) -> dict:
        ids = self.position_ids(embeds.shape[0], embeds.shape[1], embeds.device)
        return {} if ids is None else {"position_ids": ids}

    def content_mask(self, attn: torch.Tensor) -> torch.Tensor:
        """``attn`` without the prefix placeholders (what pooling averages over)."""
        if not self._n_prefix:
            return attn
        mask = attn.clone()
        mask[:, : self._n_prefix] = 0
        return mask

    def _logits(self, embeds: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _embed_inputs(self, batch: Batch, prompt: torch.Tensor | None, trim: bool = True):
        """[prompt; token embeddings], attention mask with ones for the prompt, shifted label_pos
        (``trim``: without the columns that are padding for every row)."""
        dev = self.device
        attn = batch["attention_mask"]
        L = int(attn.sum(1).max()) if trim else attn.shape[1]  # drop columns that are padding for every row
        ids = batch["input_ids"][:, :L].to(dev)
        attn = attn[:, :L].to(dev)
        pos = batch["label_pos"].to(dev)
        B = ids.shape[0]
        embeds = self._backbone.model.get_input_embeddings()(ids)
        if is_lora(prompt):  # it changes the layers (:meth:`prompting`), not the input
            prompt = None
        if is_prefix(prompt):  # placeholders whose keys/values the prefix replaces (models.prompts.prefix)
            prompt = torch.zeros((B, prefix_tokens(prompt), embeds.shape[2]), device=dev, dtype=embeds.dtype)
        if prompt is not None:
            prompt = prompt.to(device=dev, dtype=embeds.dtype)
            if prompt.dim() == 2:
                prompt = prompt.unsqueeze(0).expand(B, -1, -1)
            if prompt.dim() != 3 or prompt.shape[0] != B or prompt.shape[2] != embeds.shape[2]:
                raise ValueError(
                    f"prompt must be (n, {embeds.shape[2]}) or ({B}, n, {embeds.shape[2]}), got {tuple(prompt.shape)}"
                )
            n = prompt.shape[1]
            embeds = torch.cat([prompt, embeds], dim=1)
            attn = torch.cat([torch.ones((B, n), dtype=attn.dtype, device=dev), attn], dim=1)
            pos = pos + n
        limit = self._backbone.max_positions
        if limit is not None and embeds.shape[1] > limit:
            raise ValueError(f"prompt + text is {embeds.shape[1]} positions, the model allows {limit}")
        return embeds, attn, pos


def _first_token_ids(tokenizer, words: list[str]) -> list[int]:
    ids = []
    for w in words:
        toks = tokenizer(w, add_special_tokens=False)["input_ids"]
        if not toks:
            raise ValueError(f"label word {w!r} gives no tokens")
        ids.append(int(toks[0]))
    if len(set(ids)) != len(ids):
        raise ValueError(f"label words {words!r} share a first token: {ids}")
    return ids


class _Verbalizer(PromptClassifier):
    """Shared part of the LM verbalizers: label words -> first-token ids -> log-probs."""

    def __init__(
        self,
        backbone: Backbone,
        labels: list[str],
        label_words: dict[str, str] | None = None,
        template: str | None = None,
    ):
        super().__init__(backbone, labels, template)
        words = label_words or {}
        self.label_words = [words.get(l, " " + l) for l in self.labels]
        ids = _first_token_ids(backbone.tokenizer, self.label_words)
        self.register_buffer("label_token_ids", torch.tensor(ids, dtype=torch.long, device=backbone.device))
        self._base = backbone.model.base_model

    def _select(self, vocab_logits: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(vocab_logits.float(), dim=-1)
        return logp[:, self.label_token_ids.to(logp.device)]

    def _vocab_logits(self, embeds: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, embeds, attn, pos):
        return self._select(self._vocab_logits(embeds, attn, pos))

    def vocab_logits(self, batch: Batch, prompt: torch.Tensor | None = None) -> torch.Tensor:
        """(B, V) full-vocabulary logits at the label position: the same forward as
        :meth:`forward`, before the label words are kept (POST's transfer matches these)."""
        return self._by_length(batch, prompt, self._vocab_logits).float()


class VerbalizerCausalLM(_Verbalizer):
    """Next-token log-probs of the label words' first tokens after "{text} It was"."""

    default_template = DEFAULT_CAUSAL_TEMPLATE

    def _template_kind(self) -> str:
        return "causal"

    def _vocab_logits(self, embeds, attn, pos):
        B, T, _ = embeds.shape
        position_ids = self.position_ids(B, T, embeds.device)
        if position_ids is None:
            position_ids = torch.arange(T, device=embeds.device).unsqueeze(0).expand(B, T)
        out = self._base(inputs_embeds=embeds, attention_mask=attn, position_ids=position_ids, use_cache=False)
        hs = out.last_hidden_state  # on the last layer's device when Accelerate spread the model
        h = hs[torch.arange(B, device=hs.device), pos.to(hs.device)]  # last real position
        logits = self._backbone.model.get_output_embeddings()(h)  # LM head on B rows, not B*T
        cap = getattr(self._backbone.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def mlm_head(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The MLM prediction head as a function of hidden states, for common architectures."""
    for attr in ("cls", "lm_head", "predictions"):
        head = getattr(model, attr, None)
        if isinstance(head, nn.Module):
            return head
    if all(hasattr(model, a) for a in ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector")):
        return lambda h: model.vocab_projector(model.vocab_layer_norm(model.activation(model.vocab_transform(h))))
    return None


class VerbalizerMaskedLM(_Verbalizer):
    """Log-probs of the label words at the mask of "{text} It was [MASK]."."""

    default_template = DEFAULT_MASKED_TEMPLATE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head = mlm_head(self._backbone.model)

    def _template_kind(self) -> str:
        return "masked"

    def _vocab_logits(self, embeds, attn, pos):
        rows = torch.arange(embeds.shape[0], device=embeds.device)
        extra = self._position_kwargs(embeds)
        if self._head is None:  # unknown head layout: full vocab logits, then gather
            return self._backbone.model(inputs_embeds=embeds, attention_mask=attn, **extra).logits[rows, pos]
        out = self._base(inputs_embeds=embeds, attention_mask=attn, **extra)
        return self._head(out.last_hidden_state[rows, pos])


class CosineEncoderClassifier(PromptClassifier):
    """scale * cosine(mean-pooled [prompt; text], mean-pooled label description).

    Label descriptions are embedded once, without prompt, and kept as a fixed buffer.
    """

    default_template = DEFAULT_ENCODER_TEMPLATE

    def __init__(
        self,
        backbone: Backbone,
        labels: list[str],
        label_descriptions: dict[str, str] | None = None,
        template: str | None = None,
        scale: float = 20.0,
    ):
        super().__init__(backbone, labels, template)
        self._base = backbone.model.base_model
        self.scale = float(scale)
        desc = label_descriptions or {}
        self.label_descriptions = [desc.get(l, l) for l in self.labels]
        plain = _TemplateTokenizer(backbone.tokenizer, "{text}", "encoder")
        enc = plain(self.label_descriptions, max_length=max(64, plain.fixed + 1))
        with torch.no_grad():
            emb, attn, _ = self._embed_inputs(enc, None)
            label_emb = F.normalize(self._pool(emb, attn), dim=-1)
        self.register_buffer("label_embeddings", label_emb.detach())

    def _pool(self, embeds: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = self._base(inputs_embeds=embeds, attention_mask=attn, **self._position_kwargs(embeds)).last_hidden_state.float()
        m = self.content_mask(attn).unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp_min(1.0)

    def sentence_embeddings(self, batch: Batch, prompt: torch.Tensor | None = None) -> torch.Tensor:
        return self._by_length(batch, prompt, lambda embeds, attn, _pos: self._pool(embeds, attn))

    def _logits(self, embeds, attn, pos):
        text = F.normalize(self._pool(embeds, attn), dim=-1)
        return self.scale * text @ self.label_embeddings.to(text.device).T


def build_classifier(
    backbone: Backbone,
    labels: list[str],
    label_descriptions: dict[str, str] | None = None,
    template: str | None = None,
    **kwargs,
) -> PromptClassifier:
    """Classifier for ``backbone.kind``: causal/masked -> verbalizer (``label_descriptions`` are
    then the label words, default " <label>"), encoder -> cosine to label descriptions."""
    if backbone.kind == "causal":
        return VerbalizerCausalLM(backbone, labels, label_descriptions, template, **kwargs)
    if backbone.kind == "masked":
        return VerbalizerMaskedLM(backbone, labels, label_descriptions, template, **kwargs)
    if backbone.kind == "encoder":
        return CosineEncoderClassifier(backbone, labels, label_descriptions, template, **kwargs)
    raise ValueError(f"unknown backbone kind {backbone.kind!r}")
