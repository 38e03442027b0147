"""Training a soft prompt on a frozen classifier: non-private, or DP-SGD.

DP-SGD here does NOT use Opacus. A soft prompt is an *input* of the frozen model, so its
per-sample gradient is simply the gradient of the summed loss with respect to a copy of the
prompt expanded over the batch::

    P_batch = prompt.detach().expand(B, n, d).clone().requires_grad_()
    loss = sum_i CE(classifier(batch, P_batch)_i, y_i)
    grad(loss, P_batch)[i] == d CE_i / d prompt          # shape (B, n, d)

Examples do not interact in the forward pass (eval mode, padding masked), so row i of that
gradient depends on example i only. One ordinary backward pass, no hooks.

Why not PEFT prompt tuning under Opacus: ``PeftModel.get_prompt`` runs the prompt encoder on ONE
row and repeats it over the batch, so Opacus's ``grad_sample`` has batch dimension 1 and it clips
the whole batch as one sample while reporting an ε (shared NOTES.md; reproduced in
``tests/pipeline/test_peft_export.py``, which also uses Opacus' hooks on PEFT's prefix tuning as an
independent reference for the prefix gradients here). So every DP step below checks that the
per-sample gradient's batch dimension equals the number of sampled examples (RuntimeError
otherwise), and the tests compare these gradients to a per-example autograd loop. What is published
is still usable with PEFT: ``models.prompts.peft_export`` writes it as a PEFT adapter.

Sampling is Poisson (each example independently with probability ``sample_rate``), which is
what the accountants assume; empty batches still take the noise-only step (skipping them would
leak that the batch was empty). The noisy sum is divided by the EXPECTED batch size
``sample_rate * N``, not the realised one (which is data dependent).

User-level DP (``units``: each example's privacy unit, e.g. the person who wrote it): Poisson
sampling draws UNITS (each with probability ``sample_rate``) and takes all their examples; each
sampled unit's examples' per-sample gradients are combined (mean, or sum: ``DPConfig.unit_combine``)
into ONE gradient per unit, which is then clipped to C; the noise is σ·C and the expected batch is
``sample_rate × units``. Adding or removing one unit moves the clipped sum by at most C, so the
step is the subsampled Gaussian mechanism over units (the accountant's q and steps are over units).
Without ``units`` every example is its own unit: exactly the record-level step above.

A LoRA (``kind="lora"``, ``models.prompts.lora``) is trained by the same code: its adapters are one
flat vector θ, per-example copies of which give per-sample gradients in one backward pass as a
soft prompt's do; every step clips and noises the whole of θ.

A method changes a DP step only through :class:`DPStepHook` (hook points of the step, e.g.
Privacy-Flat's AWP, frozen prefix layers and regulariser); this module knows no method.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from models.classifiers import PromptClassifier, num_examples, select_rows
from models.memory import choose as choose_physical_batch
from models.prompts.lora import LoraPrompt, init_lora, is_lora, lora_layout
from models.soft_prompt import PrefixPrompt, SoftPrompt

ProgressFn = Callable[[int, int, float | None], None]


@dataclass
class PromptTrainingConfig:
    """Soft-prompt training settings.

    ``batch_size``: minibatch size (non-private) / expected batch size ``sample_rate * N`` (DP;
    the caller turns it into ``DPConfig.sample_rate``). ``steps`` overrides ``epochs``.
    ``max_length`` is the tokenisation length the caller encodes with (kept here for the record).
    ``init_words``: words whose token embeddings initialise the prompt (cycled to ``n_tokens``);
    None: random vocabulary rows. ``physical_batch_size`` bounds memory (micro-batches of one
    logical step; None: chosen by :func:`models.memory.choose` from the device's free memory).
    """

    n_tokens: int = 10
    lr: float = 0.05
    epochs: float = 1.0
    steps: int | None = None
    batch_size: int = 32
    max_length: int = 64
    seed: int = 0
    init_words: str | None = None
    optimizer: str = "adam"  # "adam" | "sgd"
    log_every: int = 10
    physical_batch_size: int | None = 64
    kind: str = "soft"  # "soft" (n_tokens, embed_dim) | "prefix" (layers, 2, n_tokens, d_kv) | "lora"
    # a LoRA's rank, α (updates scaled by α / r) and target modules (None: PEFT's for the architecture)
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.n_tokens < 1 or self.batch_size < 1 or (self.physical_batch_size is not None
                                                        and self.physical_batch_size < 1):
            raise ValueError("n_tokens, batch_size and physical_batch_size must be >= 1")
        if self.steps is None and not self.epochs > 0:
            raise ValueError("give epochs > 0 or steps")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.kind not in ("soft", "prefix", "lora"):
            raise ValueError(f"kind must be 'soft', 'prefix' or 'lora', got {self.kind!r}")


@dataclass
class DPConfig:
    """DP-SGD parameters, computed by the caller from the privacy core (accountant/calibration)."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    # the planned expected batch q·n the noised sum is divided by, from the RELEASED n (None: q·N
    # of the rows given, for callers without a released size): an exact N would scale the output
    expected_batch: float | None = None
    # with privacy units: how a unit's examples' gradients make its one gradient before clipping
    unit_combine: str = "mean"  # "mean" | "sum"

    def __post_init__(self):
        if self.unit_combine not in ("mean", "sum"):
            raise ValueError(f"unit_combine must be 'mean' or 'sum', got {self.unit_combine!r}")
        if self.expected_batch is not None and not self.expected_batch > 0:
            raise ValueError(f"expected_batch must be > 0, got {self.expected_batch}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")


@dataclass
class TrainResult:
    """``prompt``: trained (n_tokens, embed_dim) CPU tensor (a prefix's, or a ``LoraPrompt``). ``steps``: optimizer steps taken
    (what the accountant composes). ``history``: per-step dicts (step, loss, batch_size, ...).

    The losses and clipping statistics in ``history`` are computed from the private data without
    noise: they are for the operator, and publishing them is NOT covered by the DP guarantee.
    """

    prompt: torch.Tensor | LoraPrompt
    history: list[dict] = field(default_factory=list)
    steps: int = 0
    empty_batches: int = 0
    private: bool = False


class DPStepHook:
    """The points of a DP-SGD step (``train_prompt(..., dp=..., hooks=[...])``) where a method may
    act; every default leaves the step plain DP-SGD, so a hook overrides only what it changes.
    Called in this order:

    * :meth:`trainable_mask` — once, before the first step: a 0/1 tensor of the prompt's shape
      marking its trainable entries (None: all). Each per-sample gradient is multiplied by it
      BEFORE clipping, and so is the noise: frozen entries get no gradient, no noise, no
      sensitivity, and do not move.
    * :meth:`gradient_point` — every step, after the Poisson batch ``idx`` is drawn: where the
      per-sample gradients of this step are taken (default: the current weights). The update is
      still applied to the current weights.
    * :meth:`adjust_gradient` — every step, after the noise: the noised mean gradient may get
      further terms before the optimizer step (default: unchanged).

    A hook that reads private data without noise (at any point) voids the DP guarantee: the
    method that passes it must say so in its plan (``guarantee``)."""

    def trainable_mask(self, shape: torch.Size, device) -> torch.Tensor | None:
        return None

    def gradient_point(self, step: int, classifier: PromptClassifier, encoded: dict[str, torch.Tensor],
                       labels: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                       sample_rate: float) -> torch.Tensor:
        return weight

    def adjust_gradient(self, grad: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return grad


def _combined_mask(hooks: Sequence[DPStepHook], shape, device) -> torch.Tensor | None:
    mask = None
    for hook in hooks:
        m = hook.trainable_mask(shape, device)
        if m is not None:
            mask = m if mask is None else mask * m
    return mask


def per_sample_prompt_gradients(
    classifier: PromptClassifier,
    batch: dict[str, torch.Tensor],
    labels: torch.Tensor,
    prompt: torch.Tensor,
    *,
    return_losses: bool = False,
):
    """Per-example gradients of the cross-entropy w.r.t. the prompt: a (B, *prompt.shape) tensor,
    for a (n, d) soft prompt, a (L, 2, n, d_kv) prefix or a (P,) LoRA (``LoraPrompt``).

    The prompt is an input, so the gradient of sum_i loss_i w.r.t. a per-example copy
    ``P_batch[i]`` is example i's gradient (see module docstring). With ``return_losses`` also
    returns the (B,) per-example losses (detached).
    """
    layout = prompt.layout if is_lora(prompt) else None
    prompt = (prompt.weight if layout is not None else prompt).detach()
    if prompt.dim() not in ((1,) if layout is not None else (2, 4)):
        raise ValueError(f"prompt must be (n, d), a prefix (L, 2, n, d) or a LoRA, got {tuple(prompt.shape)}")
    B = num_examples(batch)
    dev = classifier.device
    if B == 0:
        g = torch.zeros((0, *prompt.shape), device=dev)
        return (g, torch.zeros(0, device=dev)) if return_losses else g
    # A leaf holding one copy of the prompt per example; NOT prompt.expand(...) of a parameter
    # (that would sum the examples' gradients into one (n, d) tensor).
    p_batch = prompt.to(device=dev, dtype=torch.float32).unsqueeze(0).expand(B, *prompt.shape).clone().requires_grad_()
    with torch.enable_grad():
        logits = classifier(batch, p_batch if layout is None else LoraPrompt(layout, p_batch))
        losses = F.cross_entropy(logits.float(), labels.to(dev), reduction="none")
        losses.sum().backward()
    grads = p_batch.grad
    return (grads, losses.detach()) if return_losses else grads


def combine_per_unit(grads: torch.Tensor, unit_pos: torch.Tensor, n_units: int,
                     out: torch.Tensor | None = None, counts: torch.Tensor | None = None):
    """Add per-example gradients ``grads`` (B, ...) into per-unit sums ``out`` (n_units, ...) at
    rows ``unit_pos`` (B,) and count the examples per unit in ``counts``; returns (out, counts).
    Call :func:`finish_per_unit` once every example of the sampled units is in."""
    if out is None:
        out = torch.zeros((n_units, *grads.shape[1:]), device=grads.device, dtype=grads.dtype)
        counts = torch.zeros(n_units, device=grads.device, dtype=grads.dtype)
    unit_pos = unit_pos.to(grads.device)
    out.index_add_(0, unit_pos, grads)
    counts.index_add_(0, unit_pos, torch.ones(len(unit_pos), device=grads.device, dtype=grads.dtype))
    return out, counts


def finish_per_unit(summed: torch.Tensor, counts: torch.Tensor, combine: str = "mean") -> torch.Tensor:
    """One gradient per unit: the sum of its examples' gradients, or their mean."""
    if combine == "sum":
        return summed
    return summed / counts.clamp(min=1).view(-1, *[1] * (summed.dim() - 1))


def per_unit_prompt_gradients(classifier: PromptClassifier, batch: dict[str, torch.Tensor], labels: torch.Tensor,
                              prompt: torch.Tensor, units, combine: str = "mean") -> torch.Tensor:
    """One gradient per unit of the batch, units numbered in order of first appearance: its
    examples' per-sample gradients combined (``mean`` | ``sum``), before any clipping."""
    index: dict[int, int] = {}
    pos = torch.tensor([index.setdefault(int(u), len(index)) for u in torch.as_tensor(units).tolist()],
                       dtype=torch.long)
    grads = per_sample_prompt_gradients(classifier, batch, labels, prompt)
    out, counts = combine_per_unit(grads, pos, len(index))
    return finish_per_unit(out, counts, combine)


def _check_per_sample_shape(grads: torch.Tensor, batch_size: int, prompt_shape: torch.Size) -> None:
    if grads.dim() != 1 + len(prompt_shape) or grads.shape[0] != batch_size or tuple(grads.shape[1:]) != tuple(prompt_shape):
        raise RuntimeError(
            f"per-sample prompt gradients have shape {tuple(grads.shape)}, expected "
            f"({batch_size}, {', '.join(map(str, prompt_shape))}): the batch dimension must equal the "
            "number of sampled examples, otherwise clipping bounds the whole batch, not each example, "
            "and the DP guarantee is void"
        )


class LoraParams(torch.nn.Module):
    """A LoRA's flat θ as the trained parameter ``weight`` (P,), and its layout."""

    def __init__(self, layout, init: torch.Tensor):
        super().__init__()
        self.layout = layout
        self.weight = torch.nn.Parameter(LoraPrompt(layout, torch.as_tensor(init).float()).weight.detach().clone())

    def wrap(self, weight: torch.Tensor) -> LoraPrompt:
        return LoraPrompt(self.layout, weight)


def _as_prompt(prompt, weight: torch.Tensor):
    """What the classifier takes for the trained ``weight``: the tensor itself, or a LoRA."""
    return prompt.wrap(weight) if isinstance(prompt, LoraParams) else weight


def _initial_prompt(classifier: PromptClassifier, config: PromptTrainingConfig, init_prompt, seed: int):
    if config.kind == "lora":
        layout = lora_layout(classifier.backbone.model, config.lora_r, config.lora_alpha, config.lora_targets)
        if init_prompt is not None and (not is_lora(init_prompt) or init_prompt.layout != layout):
            raise ValueError("a LoRA's initial value must be a LoRA of the same layout")
        init = init_prompt.weight.detach().cpu() if init_prompt is not None else init_lora(layout, seed)
        return LoraParams(layout, init).to(classifier.device)
    if config.kind == "prefix":
        from models.prompts.prefix import prefix_shape

        if init_prompt is not None:
            sp = PrefixPrompt(torch.as_tensor(init_prompt).detach().float().cpu())
        else:
            src = config.init_words if config.init_words else config.n_tokens
            sp = PrefixPrompt.init_from_vocab(classifier.backbone, src, n_tokens=config.n_tokens, seed=seed)
        expected = prefix_shape(classifier.backbone.model, sp.weight.shape[2])
        if tuple(sp.weight.shape) != expected:
            raise ValueError(f"prefix shape {tuple(sp.weight.shape)} != the model's {expected}")
        return sp.to(classifier.device)
    if init_prompt is not None:
        t = torch.as_tensor(init_prompt).detach().float().cpu()
        sp = SoftPrompt(t.shape[0], t.shape[1], t)
    else:
        src = config.init_words if config.init_words else config.n_tokens
        sp = SoftPrompt.init_from_vocab(classifier.backbone, src, n_tokens=config.n_tokens, seed=seed)
    if sp.embed_dim != classifier.embed_dim:
        raise ValueError(f"prompt width {sp.embed_dim} != model embedding width {classifier.embed_dim}")
    return sp.to(classifier.device)


def _optimizer(params, config: PromptTrainingConfig) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    return torch.optim.Adam(params, lr=config.lr)


class StepProgress:
    """Calls ``fn(step, total, mean loss since last call)`` every ``every`` steps, whenever
    ``seconds`` passed since the last call (slow steps leave no minutes of silence), and at the end."""

    def __init__(self, fn: ProgressFn | None, every: int, total: int, seconds: float = 15.0):
        self.fn, self.every, self.total, self.seconds = fn, max(1, every), total, seconds
        self._sum, self._n = 0.0, 0
        self._last = time.monotonic()

    def __call__(self, step: int, loss: float | None) -> None:
        if loss is not None:
            self._sum, self._n = self._sum + loss, self._n + 1
        now = time.monotonic()
        if self.fn is not None and (step % self.every == 0 or step == self.total or now - self._last >= self.seconds):
            self.fn(step, self.total, self._sum / self._n if self._n else None)
            self._sum, self._n, self._last = 0.0, 0, now


def _physical_batch(classifier, max_length: int, prompt) -> int:
    """The physical batch size chosen for this device (:func:`models.memory.choose`), its probe
    one pass of per-sample gradients on PUBLIC rows of ``max_length`` tokens — the longest a private
    row can be — never on private rows: sized on them, a device's out-of-memory could be decided by
    one long record. Nothing of the probe is kept or released."""

    def probe(n: int) -> None:
        public = classifier.encode(["the " * max_length] * n, max_length=max_length)
        per_sample_prompt_gradients(classifier, public, torch.zeros(n, dtype=torch.long),
                                    _as_prompt(prompt, prompt.weight))

    return choose_physical_batch(None, classifier.device, probe)


def train_prompt(
    classifier: PromptClassifier,
    encoded_train: dict[str, torch.Tensor],
    labels: torch.Tensor,
    config: PromptTrainingConfig,
    dp: DPConfig | None = None,
    progress: ProgressFn | None = None,
    seed: int | None = None,
    init_prompt: torch.Tensor | None = None,
    sample_generator: torch.Generator | None = None,
    noise_generator: torch.Generator | None = None,
    hooks: Sequence[DPStepHook] = (),
    units: torch.Tensor | None = None,
) -> TrainResult:
    """Train a soft prompt on the frozen ``classifier``; DP-SGD when ``dp`` is given.

    ``encoded_train``: ``classifier.encode(texts)``; ``labels``: (N,) long tensor of label
    indices. ``seed`` (default ``config.seed``) drives init and non-private shuffling. The DP
    streams — Poisson sampling and noise — come from ``sample_generator`` / ``noise_generator``;
    when not given they are SECRET (seeded from OS entropy), never derived from ``seed``
    (:func:`secret_generator`). :func:`seeded_dp_generators` gives reproducible ones for tests.
    ``hooks``: :class:`DPStepHook` s acting at the hook points of each DP step (none: plain
    DP-SGD); ignored without ``dp``. ``units``: (N,) privacy unit index (0..U-1) of each example
    for user-level DP-SGD (module docstring); None: every example is its own unit.
    """
    seed = config.seed if seed is None else seed
    labels = torch.as_tensor(labels, dtype=torch.long).cpu()
    N = num_examples(encoded_train)
    if labels.shape != (N,):
        raise ValueError(f"labels must have shape ({N},), got {tuple(labels.shape)}")
    if N == 0 and dp is None:
        raise ValueError("empty training set")
    # DP-SGD on an EXACTLY empty training set still runs its planned steps (every batch empty: noise
    # alone): refusing it would be a 0-vs-1 test of one record outside ε
    if N and (labels.min() < 0 or labels.max() >= classifier.n_labels):
        raise ValueError(f"labels must be in [0, {classifier.n_labels})")
    classifier.eval()
    prompt = _initial_prompt(classifier, config, init_prompt, seed)
    opt = _optimizer([prompt.weight], config)
    if config.physical_batch_size is None:  # memory only: the logical step is the same at any size
        config = replace(config, physical_batch_size=_physical_batch(classifier, config.max_length, prompt))
    if dp is None:
        return _train_nonprivate(classifier, encoded_train, labels, config, prompt, opt, progress, seed)
    if units is not None and N:
        units = torch.as_tensor(units, dtype=torch.long).cpu()
        if units.shape != (N,) or units.min() < 0:
            raise ValueError(f"units must be ({N},) non-negative unit indices, got shape {tuple(units.shape)}")
        if torch.unique(units).numel() != int(units.max()) + 1:
            raise ValueError("units must index the units 0..U-1, each with at least one example")
    g_sample = sample_generator if sample_generator is not None else secret_generator()
    g_noise = noise_generator if noise_generator is not None else secret_generator()
    return _train_dp(classifier, encoded_train, labels, config, dp, prompt, opt, progress, g_sample, g_noise,
                     tuple(hooks), units)


def secret_generator() -> torch.Generator:
    """A CPU generator seeded with 63 bits of OS entropy (``secrets``). torch has no CSPRNG: the
    seed is secret and never logged, the stream itself is torch's default (Mersenne Twister)."""
    import secrets

    return torch.Generator().manual_seed(secrets.randbits(63))


def seeded_dp_generators(seed: int) -> tuple[torch.Generator, torch.Generator]:
    """(sampling, noise) generators derived from ``seed``: reproducible, for tests and the
    debug switch only — a run using them has no privacy guarantee (the seed is logged)."""
    return torch.Generator().manual_seed(2 * seed), torch.Generator().manual_seed(2 * seed + 1)


def _train_nonprivate(classifier, enc, labels, config, prompt, opt, progress, seed) -> TrainResult:
    N = num_examples(enc)
    per_epoch = math.ceil(N / config.batch_size)
    total = config.steps if config.steps is not None else max(1, math.ceil(config.epochs * per_epoch))
    g = torch.Generator().manual_seed(seed)
    report = StepProgress(progress, config.log_every, total)
    history, step = [], 0
    dev = classifier.device
    while step < total:
        for idx in torch.randperm(N, generator=g).split(config.batch_size):
            if step >= total:
                break
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for chunk in idx.split(config.physical_batch_size):  # gradient accumulation
                logits = classifier(select_rows(enc, chunk), _as_prompt(prompt, prompt.weight))
                loss = F.cross_entropy(logits.float(), labels[chunk].to(dev), reduction="sum")
                (loss / len(idx)).backward()
                loss_sum += float(loss.detach())
            opt.step()
            step += 1
            mean_loss = loss_sum / len(idx)
            history.append({"step": step, "loss": mean_loss, "batch_size": len(idx)})
            report(step, mean_loss)
    return TrainResult(_as_prompt(prompt, prompt.weight.detach().cpu().clone()), history, step, 0, private=False)


@dataclass
class _Batch:
    """One Poisson-sampled step: the examples drawn (``idx``) and ``B``, the units sampled
    (examples, without units); with units, each example's position among the sampled units."""

    idx: torch.Tensor
    B: int
    unit_pos: torch.Tensor | None = None


@dataclass
class _ClippedSum:
    """The sum of one step's clipped gradients (one per example, or one per unit) and its
    diagnostics (statistics of private data: kept in the private history only)."""

    summed: torch.Tensor
    seen: int = 0
    losses: list = field(default_factory=list)
    clipped: int = 0
    norm_sum: float = 0.0
    nonfinite: int = 0

    def add_clipped(self, grads: torch.Tensor, C: float) -> None:
        """Clip each row of ``grads`` to norm ``C`` and add them up."""
        norms = grads.flatten(1).norm(dim=1)
        factor = (C / (norms + 1e-6)).clamp(max=1.0)
        self.summed += (grads * factor.view(-1, *[1] * (grads.dim() - 1))).sum(0)
        self.clipped += int((norms > C).sum())
        self.norm_sum += float(norms.sum())


def _poisson_batch(g_sample: torch.Generator, q: float, U: int, units: torch.Tensor | None) -> _Batch:
    """Poisson sampling of units (of examples without units): every example of each sampled unit."""
    drawn = torch.rand(U, generator=g_sample) < q
    if units is None:
        idx = drawn.nonzero().squeeze(1)
        return _Batch(idx, int(idx.numel()))
    idx = drawn[units].nonzero().squeeze(1)
    sampled_units = drawn.nonzero().squeeze(1)
    B = int(sampled_units.numel())
    unit_pos = torch.full((U,), -1, dtype=torch.long)
    unit_pos[sampled_units] = torch.arange(B)
    return _Batch(idx, B, unit_pos)


def _clipped_gradient_sum(classifier, enc, labels, config, dp: DPConfig, at, batch: _Batch, mask,
                          units: torch.Tensor | None, shape) -> _ClippedSum:
    """Per-sample gradients of the batch at ``at`` (physical chunks), masked, non-finite rows
    zeroed, clipped to ``dp.max_grad_norm`` per example, or combined per unit and clipped once per
    unit; summed."""
    C, idx, B = dp.max_grad_norm, batch.idx, batch.B
    out = _ClippedSum(torch.zeros(shape, device=classifier.device))
    per_unit = counts = None
    for chunk in idx.split(config.physical_batch_size):
        grads, loss = per_sample_prompt_gradients(
            classifier, select_rows(enc, chunk), labels[chunk], at, return_losses=True
        )
        _check_per_sample_shape(grads, int(chunk.numel()), shape)
        if mask is not None:
            grads = grads * mask  # frozen (removed) layers: no gradient, no sensitivity
        finite = torch.isfinite(grads.flatten(1)).all(dim=1)
        if not bool(finite.all()):  # an example whose gradient overflowed contributes nothing
            grads = torch.where(finite.view(-1, *[1] * len(shape)), grads, torch.zeros_like(grads))
            out.nonfinite += int((~finite).sum())
        out.seen += grads.shape[0]
        out.losses.append(loss)
        if units is not None:  # combined per unit, then clipped once per unit (below)
            per_unit, counts = combine_per_unit(grads, batch.unit_pos[units[chunk]], B, per_unit, counts)
            continue
        out.add_clipped(grads, C)
    if out.seen != int(idx.numel()):
        raise RuntimeError(f"per-sample gradients cover {out.seen} examples, the Poisson batch has {int(idx.numel())}")
    if units is not None and B:
        per_unit = finish_per_unit(per_unit, counts, dp.unit_combine)
        if per_unit.shape[0] != B or bool((counts < 1).any()):
            raise RuntimeError(f"per-unit gradients cover {per_unit.shape[0]} units, the Poisson batch has {B}")
        out.add_clipped(per_unit, C)  # one clipped gradient per unit
    return out


def _noised_update(prompt, opt, summed: torch.Tensor, dp: DPConfig, expected_batch: float, mask, hooks,
                   g_noise: torch.Generator, step: int, check_update: bool) -> bool:
    """Add the Gaussian noise (σ·C) to the clipped sum, scale by the expected batch, apply the
    hooks' terms and take the optimizer step; returns whether the update was checked to move the
    prompt (the first step with a non-zero gradient is: opacus#820-style "never updates")."""
    shape = prompt.weight.shape
    noise = torch.normal(0.0, dp.noise_multiplier * dp.max_grad_norm, size=tuple(shape), generator=g_noise)
    noise = noise.to(summed.device)
    if mask is not None:
        noise = noise * mask  # frozen layers do not move
    grad = (summed + noise) / expected_batch
    for hook in hooks:  # hook point 3: terms added to the noised gradient
        grad = hook.adjust_gradient(grad, prompt.weight.detach(), mask)
    moving = check_update and bool(grad.abs().max() > 0)
    before = prompt.weight.detach().clone() if moving else None
    opt.zero_grad(set_to_none=True)
    prompt.weight.grad = grad.to(prompt.weight.dtype)
    opt.step()
    if not torch.isfinite(prompt.weight).all():
        raise RuntimeError(f"prompt became non-finite at DP step {step}")
    if before is not None:
        if torch.equal(before, prompt.weight.detach()):
            raise RuntimeError(f"the prompt did not change after DP step {step}: the optimizer is not updating it")
        return True
    return False


def _train_dp(classifier, enc, labels, config, dp: DPConfig, prompt, opt, progress,
              g_sample: torch.Generator, g_noise: torch.Generator,
              hooks: tuple[DPStepHook, ...] = (), units: torch.Tensor | None = None) -> TrainResult:
    N = num_examples(enc)
    if N == 0:
        units = None  # no example, no unit: every Poisson batch is empty
    U = N if units is None else int(units.max()) + 1  # privacy units: examples, or the given units
    q = dp.sample_rate
    total = config.steps if config.steps is not None else max(1, round(config.epochs / q))
    expected_batch = dp.expected_batch if dp.expected_batch is not None else q * U
    # Separate CPU streams for sampling and noise (device independent), secret unless the caller
    # injected seeded ones (tests, the debug switch).
    report = StepProgress(progress, config.log_every, total)
    shape = prompt.weight.shape
    history, empty, update_checked = [], 0, False
    mask = _combined_mask(hooks, shape, classifier.device)  # hook point 1: the trainable part (None: all of it)
    for step in range(1, total + 1):
        batch = _poisson_batch(g_sample, q, U, units)
        at = prompt.weight  # hook point 2: where the per-sample gradients are taken (the noise is added below)
        for hook in hooks:
            at = hook.gradient_point(step, classifier, enc, labels, batch.idx, at, q)
        step_sum = _clipped_gradient_sum(classifier, enc, labels, config, dp, _as_prompt(prompt, at), batch, mask,
                                         units, shape)
        B = batch.B
        if B == 0:
            empty += 1  # still step: noise only (skipping would reveal the empty batch)
        update_checked |= _noised_update(prompt, opt, step_sum.summed, dp, expected_batch, mask, hooks, g_noise,
                                         step, not update_checked)
        mean_loss = float(torch.cat(step_sum.losses).mean()) if B else None
        history.append(
            {
                "step": step,
                "loss": mean_loss,
                "batch_size": B,  # units sampled (examples, without units)
                **({"batch_examples": int(batch.idx.numel())} if units is not None else {}),
                "clipped_frac": step_sum.clipped / B if B else None,
                "mean_grad_norm": step_sum.norm_sum / B if B else None,
                "nonfinite_examples": step_sum.nonfinite,
            }
        )
        report(step, mean_loss)
    return TrainResult(_as_prompt(prompt, prompt.weight.detach().cpu().clone()), history, total, empty, private=True)
