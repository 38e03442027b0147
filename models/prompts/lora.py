"""LoRA (Hu et al. 2021) as a prompt kind: low-rank updates of the frozen model's linear layers,
applied without changing the model.

A LoRA prompt is one flat tensor θ holding every adapter's entries, and its :class:`LoraLayout`:
for each targeted module m, in the model's module order, ``A_m`` (r, in_m) then ``B_m`` (out_m, r);
the module's output becomes ``W x + (α / r) · B_m A_m x`` — PEFT's LoRA with dropout 0, so a
published θ is a PEFT LoRA adapter (``models.prompts.peft_export``). θ is flat so that the DP
trainer (``models.dp_prompt_training``) clips and noises one vector, as it does a soft prompt.

Per-sample gradients: a ``(B, P)`` θ gives example i its own adapters (one batched matmul per
module), and examples never interact in the frozen model's forward, so the gradient of the summed
loss w.r.t. a ``(B, P)`` leaf holding one copy of θ per example is the stack of per-example
gradients: the expanded-leaf scheme of soft prompts and prefixes. Per module it is what Opacus'
``GradSampleModule`` computes for a ``Linear`` (activations times backprops, summed over
positions); the tests compare both with a per-example autograd loop.

Applied by forward hooks on the targeted modules, installed once per model, that read the LoRA of
the CURRENT THREAD (the backbone is shared and cached per process, as for prefixes): the model's
weights are never changed, a forward without a LoRA passes through untouched, and PEFT's in-place
injection (which would change the cached model for every other user of it) is never needed.

Target modules: PEFT's defaults per architecture (``model_type``), matched as PEFT matches them
(a module name equal to a target or ending in ``.target``), on ``nn.Linear`` and GPT-2's ``Conv1D``.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

KIND = "lora"


@dataclass(frozen=True)
class LoraLayout:
    """Where θ's entries go: ``modules`` (names in the model), their (in, out) ``shapes``, the rank
    ``r``, ``alpha`` (the update is scaled by α / r) and the ``targets`` they were matched by."""

    modules: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    r: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self):
        if self.r < 1 or len(self.modules) != len(self.shapes) or not self.modules:
            raise ValueError(f"a LoRA layout needs r ≥ 1 and one (in, out) shape per module, got r={self.r}, "
                             f"{len(self.modules)} modules, {len(self.shapes)} shapes")

    @property
    def scaling(self) -> float:
        return float(self.alpha) / self.r

    @property
    def size(self) -> int:
        return sum(self.r * (i + o) for i, o in self.shapes)

    def spans(self) -> list[tuple[int, int, int]]:
        """(start of A, start of B, end of B) of each module's entries in θ."""
        out, at = [], 0
        for i, o in self.shapes:
            out.append((at, at + self.r * i, at + self.r * (i + o)))
            at += self.r * (i + o)
        return out

    def to_json(self) -> str:
        return json.dumps({"modules": list(self.modules), "shapes": [list(s) for s in self.shapes], "r": self.r,
                           "alpha": self.alpha, "targets": list(self.targets)})

    @classmethod
    def from_json(cls, text: str) -> "LoraLayout":
        d = json.loads(text)
        return cls(tuple(d["modules"]), tuple(tuple(int(x) for x in s) for s in d["shapes"]), int(d["r"]),
                   float(d["alpha"]), tuple(d["targets"]))


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """PEFT's LoRA target modules for ``model``'s architecture (its ``config.model_type``)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULTS:
        raise ValueError(f"PEFT has no default LoRA target modules for model type {model_type!r}: "
                         "name them (target_modules)")
    return tuple(DEFAULTS[model_type])


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of an ``nn.Linear`` or a transformers ``Conv1D`` (weight (in, out)); None otherwise."""
    if isinstance(module, nn.Linear):
        return int(module.in_features), int(module.out_features)
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def lora_layout(model: nn.Module, r: int, alpha: float, targets=None) -> LoraLayout:
    """The layout of rank-``r`` adapters on ``model``'s ``targets`` (default: PEFT's for it)."""
    targets = tuple(targets) if targets else default_targets(model)
    modules, shapes = [], []
    for name, module in model.named_modules():
        if not any(name == t or name.endswith("." + t) for t in targets):
            continue
        shape = _linear_shape(module)
        if shape is None:
            raise ValueError(f"LoRA target {name!r} is a {type(module).__name__}, not a linear layer")
        modules.append(name)
        shapes.append(shape)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no module named {', '.join(targets)}: no LoRA target")
    return LoraLayout(tuple(modules), tuple(shapes), int(r), float(alpha), targets)


def init_lora(layout: LoraLayout, seed: int) -> torch.Tensor:
    """θ as PEFT initialises LoRA: A ~ kaiming-uniform (a = √5, i.e. U(±1/√in)), B = 0 (the
    adapted model starts as the frozen one)."""
    g = torch.Generator().manual_seed(int(seed))
    theta = torch.zeros(layout.size)
    for (a, b, _), (i, _o) in zip(layout.spans(), layout.shapes):
        bound = 1.0 / math.sqrt(i)
        theta[a:b] = (torch.rand(b - a, generator=g) * 2 - 1) * bound
    return theta


class LoraPrompt:
    """θ (``(P,)``, or ``(B, P)``: one copy per example) and its layout."""

    kind = KIND

    def __init__(self, layout: LoraLayout, weight: torch.Tensor):
        if weight.dim() not in (1, 2) or weight.shape[-1] != layout.size:
            raise ValueError(f"a LoRA of {len(layout.modules)} modules at r={layout.r} has {layout.size} entries "
                             f"((P,) or (B, P)), got {tuple(weight.shape)}")
        self.layout, self.weight = layout, weight

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dim(self) -> int:
        return self.weight.dim()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def per_example(self) -> bool:
        return self.weight.dim() == 2

    def __getitem__(self, rows) -> "LoraPrompt":
        if not self.per_example:
            raise TypeError("only a per-example LoRA (B, P) has rows")
        return LoraPrompt(self.layout, self.weight[rows])

    def to(self, *args, **kwargs) -> "LoraPrompt":
        return LoraPrompt(self.layout, self.weight.to(*args, **kwargs))

    def detach(self) -> "LoraPrompt":
        return LoraPrompt(self.layout, self.weight.detach())

    def adapters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) of every module, (r, in) and (out, r) or with a batch dimension in front: views
        from one split of θ, whose backward writes θ's gradient once, where a slice per module
        writes a θ-sized gradient per slice (for a (B, P) θ, 2 × modules zero-filled (B, P) tensors
        a step: most of DP LoRA's cost over a non-private step)."""
        r, lead = self.layout.r, self.weight.shape[:-1]
        parts = torch.split(self.weight, [n for i, o in self.layout.shapes for n in (r * i, o * r)], dim=-1)
        return [(parts[2 * k].reshape(*lead, r, i), parts[2 * k + 1].reshape(*lead, o, r))
                for k, (i, o) in enumerate(self.layout.shapes)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT's adapter weights (``adapter_model.safetensors`` keys) of a (P,) θ."""
        if self.per_example:
            raise ValueError("a per-example LoRA is not an adapter")
        out = {}
        for name, (A, B) in zip(self.layout.modules, self.adapters()):
            out[f"base_model.model.{name}.lora_A.weight"] = A.detach().float().cpu().contiguous()
            out[f"base_model.model.{name}.lora_B.weight"] = B.detach().float().cpu().contiguous()
        return out


def is_lora(prompt) -> bool:
    return isinstance(prompt, LoraPrompt)


def check_fits(model: nn.Module, lora: LoraPrompt) -> None:
    """ValueError (one line) unless every module of ``lora``'s layout is in ``model`` with its shape."""
    named = dict(model.named_modules())
    for name, shape in zip(lora.layout.modules, lora.layout.shapes):
        module = named.get(name)
        if module is None or _linear_shape(module) != tuple(shape):
            have = None if module is None else _linear_shape(module)
            raise ValueError(f"a LoRA adapter of {name!r} {tuple(shape)} does not fit {type(model).__name__} "
                             f"({'no such module' if module is None else f'its shape is {have}'})")


# one public sentence twice: a batch of 2 rows of equal length (one length group), more positions than rows
_PROBE_TEXT = "a public probe sentence of several words, to see how each adapted layer is called"


def check_batch_first(clf, layout: LoraLayout) -> None:
    """ValueError (one line) unless every module of ``layout`` is called by ``clf``'s forward, on
    inputs (rows, positions, features) with the rows first: per-example adapters give row i of a
    (B, P) θ to row i of each input, so a layer that sees a 2-D input cannot take them, and a
    sequence-first layer (positions, rows, features) whose positions equal the batch would give one
    example's adapter to every example's position and mix their gradients silently. Checked on a
    public probe batch of 2 rows with more positions than rows, once, before any private row."""
    model = clf.backbone.model
    named = dict(model.named_modules())
    seen: dict[str, list[tuple[int, ...]]] = {name: [] for name in layout.modules}
    handles = [named[name].register_forward_pre_hook(
        lambda module, args, name=name: seen[name].append(tuple(args[0].shape)) if args else None)
        for name in layout.modules]
    enc = clf.encode([_PROBE_TEXT, _PROBE_TEXT])
    rows, width = (int(n) for n in enc["attention_mask"].shape)
    try:
        with torch.no_grad():
            clf(enc, LoraPrompt(layout, torch.zeros(layout.size)))
    finally:
        for h in handles:
            h.remove()
    for name in layout.modules:
        if not seen[name]:
            raise ValueError(f"LoRA target {name!r} is not called by the classifier's forward: its adapter "
                             "would be noise only; choose other target_modules")
        for shape in seen[name]:
            if len(shape) != 3 or not shape[0] <= rows < shape[1]:
                raise ValueError(f"LoRA target {name!r} sees inputs of shape {shape} on a public probe of {rows} rows "
                                 f"of {width} positions, not (rows, positions, features): per-example adapters need "
                                 "batch-first 3-D inputs; choose other target_modules")


# The hooks are installed once per (model, module) and read the LoRA of the current thread.
_ACTIVE = threading.local()
_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()
_INSTALL_LOCK = threading.Lock()


def _active(model: nn.Module):
    state = getattr(_ACTIVE, "state", None)
    return state[1] if state is not None and state[0] is model else None


def _delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    A, B = A.to(device=x.device, dtype=x.dtype), B.to(device=x.device, dtype=x.dtype)
    if A.dim() == 2:
        return scaling * (x @ A.T) @ B.T
    if x.dim() != 3 or x.shape[0] != A.shape[0]:
        raise RuntimeError("a per-example LoRA met an input that is not (rows, positions, features) of its rows")
    return scaling * torch.bmm(torch.bmm(x, A.transpose(1, 2)), B.transpose(1, 2))


def _install(model: nn.Module, names: tuple[str, ...]) -> None:
    with _INSTALL_LOCK:
        done = _INSTALLED.setdefault(model, set())
        named = dict(model.named_modules())
        for name in names:
            if name in done:
                continue

            def hook(module, args, out, name=name):
                lora = _active(model)
                index = None if lora is None else lora.index.get(name)
                if index is None:
                    return out
                A, B = lora.adapters(index)
                return out + _delta(args[0], A, B, lora.prompt.layout.scaling).to(out.dtype)

            named[name].register_forward_hook(hook)
            done.add(name)


@dataclass(frozen=True)
class _Active:
    """The LoRA in place in a thread, its modules' indices, and its (A, B) pairs: split once for the
    block (views of θ), again only when θ's version or the grad mode changed since."""

    prompt: LoraPrompt
    index: dict
    split: dict = field(default_factory=dict)

    def adapters(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.prompt.weight._version, torch.is_grad_enabled())
        if self.split.get("key") != key:
            self.split.clear()
            self.split.update(key=key, pairs=self.prompt.adapters())
        return self.split["pairs"][index]


@contextmanager
def lora_hooks(model: nn.Module, lora: LoraPrompt, batch_size: int):
    """Within the block, in this thread, every module of ``lora``'s layout adds its low-rank update."""
    if lora.per_example and lora.weight.shape[0] != batch_size:
        raise ValueError("a per-example LoRA whose rows are not the batch's")
    _install(model, lora.layout.modules)
    if getattr(_ACTIVE, "state", None) is not None:
        raise RuntimeError("lora_hooks do not nest: a LoRA is already in place in this thread")
    _ACTIVE.state = (model, _Active(lora, {name: k for k, name in enumerate(lora.layout.modules)}))
    try:
        yield
    finally:
        _ACTIVE.state = None


def save_lora(path, lora: LoraPrompt, metadata: dict[str, str]) -> None:
    """θ as safetensors (the prompt file's key) with its layout in the metadata."""
    from safetensors.torch import save_file

    from models.soft_prompt import PROMPT_KEY

    if lora.per_example:
        raise ValueError("a per-example LoRA is not saved")
    meta = {**metadata, "kind": KIND, "lora.layout": lora.layout.to_json()}
    save_file({PROMPT_KEY: lora.weight.detach().float().cpu().contiguous()}, str(path), metadata=meta)


def from_file(tensor: torch.Tensor, meta: dict[str, str]) -> LoraPrompt:
    if "lora.layout" not in meta:
        raise ValueError("a LoRA prompt file without its layout (metadata 'lora.layout')")
    return LoraPrompt(LoraLayout.from_json(meta["lora.layout"]), tensor)
