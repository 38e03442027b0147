"""Soft prompts: a trainable (n_tokens, embed_dim) block prepended to the input embeddings.

Stored as safetensors (one tensor ``prompt`` plus string metadata), so a prompt trained on one
machine can be scored on any backbone with the same embedding width.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

if TYPE_CHECKING:
    from models.backbones import Backbone

PROMPT_KEY = "prompt"


class SoftPrompt(nn.Module):
    """A soft prompt with parameter ``weight`` of shape (n_tokens, embed_dim)."""

    def __init__(self, n_tokens: int, embed_dim: int, init: torch.Tensor | None = None):
        super().__init__()
        if n_tokens < 1 or embed_dim < 1:
            raise ValueError(f"a soft prompt needs n_tokens >= 1 and embed_dim >= 1, got {n_tokens}, {embed_dim}")
        if init is None:
            init = torch.randn(n_tokens, embed_dim) * 0.02
        init = torch.as_tensor(init, dtype=torch.float32)
        if tuple(init.shape) != (n_tokens, embed_dim):
            raise ValueError(f"init has shape {tuple(init.shape)}, expected {(n_tokens, embed_dim)}")
        self.weight = nn.Parameter(init.detach().clone())

    @property
    def n_tokens(self) -> int:
        return self.weight.shape[0]

    @property
    def embed_dim(self) -> int:
        return self.weight.shape[1]

    def forward(self) -> torch.Tensor:
        return self.weight

    def expand(self, batch_size: int) -> torch.Tensor:
        """(batch_size, n_tokens, embed_dim) view of the prompt (shared storage, gradients sum)."""
        return self.weight.unsqueeze(0).expand(batch_size, -1, -1)

    @classmethod
    def init_from_vocab(
        cls,
        backbone: "Backbone",
        text_or_n: str | list[str] | int,
        n_tokens: int | None = None,
        seed: int = 0,
    ) -> "SoftPrompt":
        """Initialise from the backbone's token embeddings.

        ``text_or_n`` a string or word list: the embeddings of its tokens, cycled/truncated to
        ``n_tokens`` (default: as many as the text has tokens). An int: that many random
        (seeded) non-special vocabulary rows; ``n_tokens`` then defaults to it.
        """
        emb = backbone.model.get_input_embeddings().weight.detach()
        ids = init_token_ids(backbone, text_or_n, n_tokens, seed)
        init = emb[torch.tensor(ids, device=emb.device)].float().cpu()
        return cls(len(ids), emb.shape[1], init)

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
        return save_prompt(path, self.weight, metadata or {})

    @classmethod
    def load(cls, path: str | Path) -> tuple["SoftPrompt", dict[str, str]]:
        tensor, meta = load_prompt(path)
        return cls(tensor.shape[0], tensor.shape[1], tensor), meta


def init_token_ids(backbone: "Backbone", text_or_n: str | list[str] | int, n_tokens: int | None = None,
                   seed: int = 0) -> list[int]:
    """Token ids a prompt is initialised from (see :meth:`SoftPrompt.init_from_vocab`)."""
    if isinstance(text_or_n, int):
        return _random_vocab_ids(backbone, n_tokens if n_tokens is not None else text_or_n, seed)
    text = text_or_n if isinstance(text_or_n, str) else " ".join(text_or_n)
    ids = backbone.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"init text {text!r} gives no tokens")
    n = n_tokens if n_tokens is not None else len(ids)
    return [ids[i % len(ids)] for i in range(n)]


class PrefixPrompt(nn.Module):
    """A prefix with parameter ``weight`` of shape (layers, 2, n_tokens, d_kv) (``models.prompts.prefix``)."""

    def __init__(self, init: torch.Tensor):
        super().__init__()
        init = torch.as_tensor(init, dtype=torch.float32)
        if init.dim() != 4 or init.shape[1] != 2:
            raise ValueError(f"a prefix is (layers, 2, n_tokens, d_kv), got {tuple(init.shape)}")
        self.weight = nn.Parameter(init.detach().clone())

    @classmethod
    def init_from_vocab(cls, backbone: "Backbone", text_or_n: str | list[str] | int, n_tokens: int | None = None,
                        seed: int = 0) -> "PrefixPrompt":
        """The keys and values the model computes for the init tokens (real-word activations)."""
        from models.prompts.prefix import prefix_from_tokens

        return cls(prefix_from_tokens(backbone.model, init_token_ids(backbone, text_or_n, n_tokens, seed),
                                      backbone.device))


def _random_vocab_ids(backbone: "Backbone", n: int, seed: int) -> list[int]:
    vocab = backbone.model.get_input_embeddings().weight.shape[0]
    special = set(getattr(backbone.tokenizer, "all_special_ids", []) or [])
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    while len(ids) < n:
        for i in torch.randint(0, vocab, (2 * n,), generator=g).tolist():
            if i not in special and len(ids) < n:
                ids.append(i)
    return ids


def save_prompt(path: str | Path, tensor: torch.Tensor, metadata: dict[str, str] | None = None) -> Path:
    """Write a (n_tokens, embed_dim) prompt as safetensors with string metadata."""
    path = Path(path)
    tensor = torch.as_tensor(tensor).detach()
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if tensor.dim() == 4 and tensor.shape[1] == 2:  # a prefix (models.prompts.prefix)
        meta["kind"] = "prefix"
        meta.setdefault("layers", str(tensor.shape[0]))
        meta.setdefault("n_tokens", str(tensor.shape[2]))
        meta.setdefault("kv_dim", str(tensor.shape[3]))
    elif tensor.dim() == 2:
        meta.setdefault("n_tokens", str(tensor.shape[0]))
        meta.setdefault("embed_dim", str(tensor.shape[1]))
    else:
        raise ValueError(f"a prompt is (n_tokens, embed_dim) or a prefix (layers, 2, n_tokens, d_kv), "
                         f"got shape {tuple(tensor.shape)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({PROMPT_KEY: tensor.to("cpu").contiguous()}, str(path), metadata=meta)
    return path


def load_prompt(path: str | Path) -> tuple[torch.Tensor, dict[str, str]]:
    """Read a prompt written by :func:`save_prompt`: (tensor on CPU, metadata)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = dict(f.metadata() or {})
        if PROMPT_KEY not in f.keys():
            raise ValueError(f"{path} holds no {PROMPT_KEY!r} tensor (keys: {list(f.keys())})")
        tensor = f.get_tensor(PROMPT_KEY)
    return tensor, meta
