"""RAPT's model side: frozen backbone + soft prompt + task head (+ reconstruction head while tuning).

``H = f([P; Z])`` for privatised ids Z = ``[CLS] k' x' [SEP]``. The task head reads only the
text positions G_{m:m+n} (paper eq. 8), mean-pooled: a BERT-like backbone with an MLM head scores
the label words' first tokens with it (the verbalizer, as the paper's "language modeling head"),
a plain encoder (MiniLM) scores cosine similarity to its embeddings of label descriptions. The
reconstruction head reads G_{1:m}, the plain-token positions. :meth:`RaptModel.inference` returns
a :class:`RaptClassifier` without the reconstruction head (the paper discards it after tuning).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.classifiers import _first_token_ids, mlm_head
from models.length_groups import in_length_groups
from .encoding import PrivatizedEncoding
from .head import ReconstructionHead
from models.backbones import Backbone
from models.prompts.prefix import prefix_hooks, prefix_position_ids, prefix_shape
from models.soft_prompt import PrefixPrompt, SoftPrompt


def _pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class VerbalizerHead(nn.Module):
    """MLM-head log-probabilities of the label words' first tokens at the pooled text state."""

    def __init__(self, backbone: Backbone, labels: list[str], label_words: dict[str, str] | None = None):
        super().__init__()
        head = mlm_head(backbone.model)
        self.__dict__["_head"] = head  # the backbone's frozen, shared head: not a submodule of ours
        if head is None:
            raise ValueError(f"backbone {backbone.name!r} has no MLM head: use CosineLabelHead")
        words = [(label_words or {}).get(l, l) for l in labels]
        self.register_buffer("label_token_ids", torch.tensor(_first_token_ids(backbone.tokenizer, words)))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self._head(pooled).float(), dim=-1)[:, self.label_token_ids]


class CosineLabelHead(nn.Module):
    """scale · cosine(pooled text state, the frozen backbone's mean-pooled label description)."""

    def __init__(self, backbone: Backbone, labels: list[str], label_descriptions: dict[str, str] | None = None,
                 scale: float = 20.0):
        super().__init__()
        tok = backbone.tokenizer
        texts = [(label_descriptions or {}).get(l, l) for l in labels]
        enc = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            base = backbone.model.base_model
            h = base(input_ids=enc["input_ids"].to(backbone.device),
                     attention_mask=enc["attention_mask"].to(backbone.device)).last_hidden_state.float()
            label = F.normalize(_pool(h, enc["attention_mask"].to(h.device)), dim=-1)
        self.register_buffer("label_embeddings", label)
        self.scale = float(scale)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.scale * F.normalize(pooled.float(), dim=-1) @ self.label_embeddings.T


def build_task_head(backbone: Backbone, labels: list[str], label_words: dict[str, str] | None = None) -> nn.Module:
    """Verbalizer for a backbone with an MLM head, else cosine to label descriptions."""
    if len(labels) < 2:
        raise ValueError(f"need at least two labels, got {labels!r}")
    if mlm_head(backbone.model) is not None:
        return VerbalizerHead(backbone, labels, label_words)
    return CosineLabelHead(backbone, labels, label_words)


class RaptClassifier(nn.Module):
    """Inference: backbone (not a submodule: shared, frozen) + prompt + task head. Holds no
    reconstruction head. Takes only :class:`PrivatizedEncoding` inputs."""

    def __init__(self, backbone: Backbone, prompt: SoftPrompt | PrefixPrompt, task_head: nn.Module, n_plain: int):
        super().__init__()
        if isinstance(prompt, PrefixPrompt):  # prefix tuning: keys/values at every layer
            expected = prefix_shape(backbone.model, prompt.weight.shape[2])
            if tuple(prompt.weight.shape) != expected:
                raise ValueError(f"prefix shape {tuple(prompt.weight.shape)} differs from the backbone's {expected}")
        elif prompt.embed_dim != backbone.embed_dim:
            raise ValueError(f"prompt width {prompt.embed_dim} differs from the backbone's {backbone.embed_dim}")
        self._backbone = backbone
        self.prompt = prompt
        self.task_head = task_head
        self.n_plain = int(n_plain)

    @property
    def device(self) -> torch.device:
        return self._backbone.device

    def _check(self, batch: PrivatizedEncoding) -> None:
        if not isinstance(batch, PrivatizedEncoding):
            raise TypeError(f"RAPT's model side takes privatised inputs (PrivatizedEncoding), got {type(batch).__name__}")
        if batch.n_plain != self.n_plain:
            raise ValueError(f"inputs carry {batch.n_plain} plain tokens, the model was built for {self.n_plain}")

    def hidden_states(self, batch: PrivatizedEncoding) -> torch.Tensor:
        """G (B, L, h): output states of the input positions (prompt positions dropped), computed
        on groups of rows of similar length (``models.length_groups``); L: the longest row."""
        self._check(batch)
        if not len(batch):
            return self._states(batch)
        return in_length_groups(batch.attention_mask.sum(1),
                                lambda rows: self._states(batch if rows is None else batch.rows(rows)), self.device,
                                self._backbone.embed_dim)

    def _states(self, batch: PrivatizedEncoding) -> torch.Tensor:
        dev = self.device
        L = int(batch.attention_mask.sum(1).max()) if len(batch) else batch.input_ids.shape[1]
        ids = batch.input_ids[:, :L].to(dev)
        attn = batch.attention_mask[:, :L].to(dev)
        B = ids.shape[0]
        embeds = self._backbone.model.get_input_embeddings()(ids)
        prefix = isinstance(self.prompt, PrefixPrompt)
        # a prefix takes n placeholder positions whose keys/values it replaces (models.prompts.prefix)
        n = self.prompt.weight.shape[2] if prefix else self.prompt.n_tokens
        front = (torch.zeros((B, n, embeds.shape[2]), device=dev, dtype=embeds.dtype) if prefix
                 else self.prompt.expand(B).to(dev, embeds.dtype))
        embeds = torch.cat([front, embeds], dim=1)
        attn = torch.cat([torch.ones((B, n), dtype=attn.dtype, device=dev), attn], dim=1)
        limit = self._backbone.max_positions
        if limit is not None and embeds.shape[1] > limit:
            raise ValueError(f"prompt + input is {embeds.shape[1]} positions, the model allows {limit}")
        if not prefix:
            return self._backbone.model.base_model(inputs_embeds=embeds, attention_mask=attn).last_hidden_state[:, n:]
        positions = prefix_position_ids(self._backbone.model, B, embeds.shape[1], n, dev)
        with prefix_hooks(self._backbone.model, self.prompt.weight, B):
            out = self._backbone.model.base_model(inputs_embeds=embeds, attention_mask=attn, position_ids=positions)
        return out.last_hidden_state[:, n:]

    def task_logits_from_hidden(self, hidden: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """Eq. 8: the task head on the text positions only (mean-pooled)."""
        return self.task_head(_pool(hidden, text_mask[:, :hidden.shape[1]].to(hidden.device)))

    def pooled_text(self, batch: PrivatizedEncoding) -> torch.Tensor:
        """(B, h) mean of the text positions' output states (attribute-inference features)."""
        h = self.hidden_states(batch)
        return _pool(h, batch.text_mask[:, :h.shape[1]].to(h.device))

    def forward(self, batch: PrivatizedEncoding) -> torch.Tensor:
        return self.task_logits_from_hidden(self.hidden_states(batch), batch.text_mask)

    @torch.no_grad()
    def predict(self, batch: PrivatizedEncoding, batch_size: int = 64) -> torch.Tensor:
        preds = [self(batch.rows(slice(s, s + batch_size))).argmax(-1).cpu() for s in range(0, len(batch), batch_size)]
        return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)


class RaptModel(RaptClassifier):
    """Tuning: :class:`RaptClassifier` + an optional :class:`ReconstructionHead`.
    loss = task + λ · reconstruction (eq. 10 has λ = 1; ``reconstruction_weight``)."""

    def __init__(self, backbone: Backbone, prompt: SoftPrompt, task_head: nn.Module, n_plain: int,
                 reconstruction_head: ReconstructionHead | None = None, reconstruction_weight: float = 1.0):
        super().__init__(backbone, prompt, task_head, n_plain)
        if reconstruction_head is not None and n_plain < 1:
            raise ValueError("a reconstruction head needs plain tokens (n_plain >= 1)")
        if not reconstruction_weight >= 0:
            raise ValueError(f"reconstruction_weight must be >= 0, got {reconstruction_weight}")
        # on the backbone's device (the head is built on the CPU; on CUDA its product with the hidden
        # states failed: "mat2 is on cpu")
        self.reconstruction_head = reconstruction_head.to(self.device) if reconstruction_head is not None else None
        self.reconstruction_weight = float(reconstruction_weight)

    def losses(self, batch: PrivatizedEncoding, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """{'task', 'reconstruction' (when a head is present), 'total'}; per-batch means."""
        h = self.hidden_states(batch)
        task = F.cross_entropy(self.task_logits_from_hidden(h, batch.text_mask).float(), labels.to(h.device))
        out = {"task": task, "total": task}
        if self.reconstruction_head is not None:
            plain_hidden = h[:, 1:1 + self.n_plain]  # after [CLS]: the m plain positions
            rec = self.reconstruction_head.loss(plain_hidden, torch.tensor(batch.plain_ids, device=h.device))
            out["reconstruction"] = rec
            out["total"] = task + self.reconstruction_weight * rec
        return out

    def inference(self) -> RaptClassifier:
        """The inference model: same prompt and task head, no reconstruction head."""
        return RaptClassifier(self._backbone, self.prompt, self.task_head, self.n_plain)


def train_rapt(model: RaptModel, data: PrivatizedEncoding, labels: torch.Tensor, steps: int, batch_size: int = 32,
               lr: float = 3e-3, generator: torch.Generator | None = None,
               on_step: Callable[[int, dict[str, float]], None] | None = None) -> RaptModel:
    """Adam on the prompt (and the reconstruction head) over privatised data. Not DP: RAPT's
    guarantee is local d_X privacy of the inputs, so batches are plain shuffles (``generator``).
    ``on_step(step, losses)`` receives exact losses of PRIVATE data: for tests and local
    diagnostics, never for publication."""
    if not isinstance(data, PrivatizedEncoding):
        raise TypeError(f"train_rapt takes privatised inputs (PrivatizedEncoding), got {type(data).__name__}")
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.shape != (len(data),):
        raise ValueError(f"labels must have shape ({len(data)},), got {tuple(labels.shape)}")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"need steps >= 1 and batch_size >= 1, got {steps}, {batch_size}")
    if len(data) == 0:  # no privatized row (an exactly empty split): nothing to tune on
        return model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    order = torch.randperm(len(data), generator=generator)
    cursor = 0
    for step in range(steps):
        if cursor + batch_size > len(data):
            order, cursor = torch.randperm(len(data), generator=generator), 0
        idx = order[cursor:cursor + batch_size]
        cursor += batch_size
        losses = model.losses(data.rows(idx), labels[idx])
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        opt.step()
        if on_step is not None:
            on_step(step, {k: float(v.detach()) for k, v in losses.items()})
    return model
