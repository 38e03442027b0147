"""Prefix prompts (Li & Liang 2021): trainable keys and values prepended at every attention layer.

A prefix is a tensor of shape ``(L, 2, n, d_kv)``: for each of the model's ``L`` self-attention
layers, ``n`` key vectors (``[l, 0]``) and ``n`` value vectors (``[l, 1]``) in the layer's
key/value projection space (``d_kv`` = the projection's output width, all heads side by side).
A batch of per-example prefixes has shape ``(B, L, 2, n, d_kv)``.

How it is applied, the same way for every architecture: the classifier puts ``n`` placeholder
positions in front of the text (attention mask 1, so the text attends to them) and forward hooks
on each layer's key and value projections replace the projections' outputs at those positions by
the prefix. Every text position therefore sees exactly the prefix's keys and values at every
layer, and nothing else of the placeholders: their hidden states only feed their own (replaced)
keys and values and their own queries, and the classifier excludes them from pooling. The
placeholders take positions 0..n−1 and the text n.. — the layout of a key/value cache holding the
prefix, which is how PEFT's prefix tuning runs (it offsets the text's positions by n), so a
published prefix gives the same outputs as a PEFT adapter (``models.prompts.peft_export``; rotary
models rotate the stored keys by their placeholder position, which the export reads back). This works on encoders (BERT/MiniLM), masked LMs and causal LMs (GPT-2's fused
``c_attn``, Llama's ``k_proj``/``v_proj``) without touching the library's cache classes, whose
encoder support changed across transformers versions.

Per-sample gradients: examples never interact (each row's keys/values are replaced by its own
prefix row), so the gradient of the summed loss w.r.t. a ``(B, L, 2, n, d_kv)`` leaf holding one
copy of the prefix per example is the stack of per-example gradients, for every trainable tensor
of the prefix at once: the soft prompt's expanded-leaf scheme (tested against a per-example loop).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from models.backbones import first_position

# (key module, value module) name pairs of separate projections, by architecture family
_SEPARATE = (("key", "value"), ("k_proj", "v_proj"), ("k_lin", "v_lin"))
_FUSED = ("c_attn",)  # GPT-2: one Conv1D giving [q; k; v]


@dataclass(frozen=True)
class KVSite:
    """Where one layer's keys and values are computed: two modules, or one fused q/k/v module."""

    key: nn.Module
    value: nn.Module | None  # None: fused, ``key`` outputs [q; k; v]
    width: int  # d_kv


def _out_features(module: nn.Module) -> int:
    for attr in ("out_features", "nf"):
        if hasattr(module, attr):
            return int(getattr(module, attr))
    raise ValueError(f"cannot read the output width of {type(module).__name__}")


def kv_sites(model: nn.Module) -> list[KVSite]:
    """The self-attention key/value projections of ``model``, in layer order."""
    sites = []
    for name, module in model.named_modules():
        if "crossattention" in name or "encoder_attn" in name:
            continue
        for k_name, v_name in _SEPARATE:
            k, v = getattr(module, k_name, None), getattr(module, v_name, None)
            if isinstance(k, nn.Module) and isinstance(v, nn.Module) and not list(k.children()):
                sites.append(KVSite(k, v, _out_features(k)))
                break
        else:
            for f_name in _FUSED:
                fused = getattr(module, f_name, None)
                if isinstance(fused, nn.Module) and not getattr(module, "is_cross_attention", False):
                    width = _out_features(fused)
                    if width % 3:
                        raise ValueError(f"{name}.{f_name} is not a fused q/k/v projection (width {width})")
                    sites.append(KVSite(fused, None, width // 3))
                    break
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if sites and n_layers is not None and len({id(s.key) for s in sites}) < n_layers:
        raise ValueError(f"{type(model).__name__} shares its attention modules across layers ({len(sites)} "
                         f"projection(s) for {n_layers} layers, e.g. ALBERT): a prefix per layer cannot be placed")
    if not sites:
        raise ValueError(f"{type(model).__name__}: no self-attention key/value projections found "
                         f"(looked for {', '.join(a + '/' + b for a, b in _SEPARATE)} and {', '.join(_FUSED)}); "
                         "prefix tuning does not support this architecture")
    return sites


def prefix_shape(model: nn.Module, n_tokens: int) -> tuple[int, int, int, int]:
    sites = kv_sites(model)
    widths = {s.width for s in sites}
    if len(widths) != 1:
        raise ValueError(f"layers have different key/value widths {sorted(widths)}")
    return (len(sites), 2, int(n_tokens), widths.pop())


def prefix_position_ids(model: nn.Module, batch_size: int, T: int, n: int, device) -> torch.Tensor:
    """Position ids for n placeholders then T − n text positions: consecutive from the model's
    first position (after RoBERTa-style padding offsets), the placeholders first, as for a prefix
    held in a key/value cache (PEFT's prefix tuning)."""
    start = first_position(getattr(model, "config", None))
    return (start + torch.arange(T, device=device)).unsqueeze(0).expand(batch_size, T)


def is_prefix(tensor) -> bool:
    """Prefix tensors are (L, 2, n, d) or per-example (B, L, 2, n, d); soft prompts are 2-/3-D."""
    return isinstance(tensor, torch.Tensor) and tensor.dim() in (4, 5) and tensor.shape[-3] == 2


def prefix_tokens(prefix: torch.Tensor) -> int:
    return int(prefix.shape[-2])


def _replace_front(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out`` (B, T, d) with its first n positions replaced by ``rows`` (B, n, d)."""
    n = rows.shape[1]
    return torch.cat([rows.to(out.dtype), out[:, n:]], dim=1)


# The hooks are installed once per model and read the prefix of the CURRENT THREAD: the backbone is
# shared (cached per process), so threads (audit shadows on a threaded Dask worker, say) each see
# only their own prefix, and a forward without one passes through untouched.
_ACTIVE = threading.local()
_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
_INSTALL_LOCK = threading.Lock()


def _active_rows(model: nn.Module):
    state = getattr(_ACTIVE, "state", None)
    return state[1] if state is not None and state[0] is model else None


def active_prefix_tokens(model: nn.Module) -> int:
    """n of the prefix this thread has in place on ``model`` (0: none)."""
    rows = _active_rows(model)
    return 0 if rows is None else int(rows.shape[3])


def _install(model: nn.Module, sites: list[KVSite]) -> None:
    with _INSTALL_LOCK:
        if model in _INSTALLED:
            return

        def separate(layer, slot):
            def hook(module, args, out):
                rows = _active_rows(model)
                return out if rows is None else _replace_front(out, rows[:, layer, slot])
            return hook

        def fused(layer, width):
            def hook(module, args, out):
                rows = _active_rows(model)
                if rows is None:
                    return out
                q, k, v = out.split(width, dim=2)
                return torch.cat([q, _replace_front(k, rows[:, layer, 0]), _replace_front(v, rows[:, layer, 1])], dim=2)
            return hook

        handles = []
        for layer, site in enumerate(sites):
            if site.value is None:
                handles.append(site.key.register_forward_hook(fused(layer, site.width)))
            else:
                handles.append(site.key.register_forward_hook(separate(layer, 0)))
                handles.append(site.value.register_forward_hook(separate(layer, 1)))
        _INSTALLED[model] = handles


@contextmanager
def prefix_hooks(model: nn.Module, prefix: torch.Tensor, batch_size: int):
    """Within the block, in this thread, every self-attention layer's keys and values at the
    first ``n`` positions are the prefix's (see module docstring)."""
    sites = kv_sites(model)
    if prefix.dim() == 4:
        prefix = prefix.unsqueeze(0).expand(batch_size, *prefix.shape)
    if prefix.dim() != 5 or prefix.shape[0] != batch_size or prefix.shape[1] != len(sites) \
            or prefix.shape[2] != 2 or prefix.shape[4] != sites[0].width:
        raise ValueError(f"prefix must be ({len(sites)}, 2, n, {sites[0].width}) or "
                         f"({batch_size}, {len(sites)}, 2, n, {sites[0].width}), got {tuple(prefix.shape)}")
    _install(model, sites)
    if getattr(_ACTIVE, "state", None) is not None:
        raise RuntimeError("prefix_hooks do not nest: a prefix is already in place in this thread")
    _ACTIVE.state = (model, prefix)
    try:
        yield
    finally:
        _ACTIVE.state = None


@torch.no_grad()
def prefix_from_tokens(model: nn.Module, token_ids: list[int], device) -> torch.Tensor:
    """A (L, 2, n, d) prefix initialised from real-word activations (Li & Liang's initialisation):
    the keys and values the model computes for ``token_ids`` at each layer."""
    sites = kv_sites(model)
    captured: list[list[torch.Tensor]] = [[None, None] for _ in sites]
    handles = []

    def grab(layer, slot, width=None):
        def hook(module, args, out):
            if width is None:
                captured[layer][slot] = out[0].detach().float()
            else:
                captured[layer][0] = out[0, :, width:2 * width].detach().float()
                captured[layer][1] = out[0, :, 2 * width:].detach().float()
        return hook

    try:
        for layer, site in enumerate(sites):
            if site.value is None:
                handles.append(site.key.register_forward_hook(grab(layer, 0, site.width)))
            else:
                handles.append(site.key.register_forward_hook(grab(layer, 0)))
                handles.append(site.value.register_forward_hook(grab(layer, 1)))
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([torch.stack(kv) for kv in captured]).cpu()
