"""Transfer a soft prompt from a small source model to a large target model using PUBLIC data
only (POST's third step, Wang et al. 2024, Sec. 4.3; ``privprompt retarget`` uses it too).

Given the frozen source classifier (the distilled student) with its trained prompt ``P_s`` and
the frozen target classifier (the teacher / large model), a target prompt ``P_t`` is trained on
public texts -- no labels, no private data -- with::

    L = (1 − α)·KL(softmax(z_s(P_s)/T) ‖ softmax(z_t(P_t)/T))·T²
        +    α ·KL(softmax(Δ_s/T)      ‖ softmax(Δ_t/T))·T²,     Δ = z(P) − z(no prompt)

T = 2, Adam lr 1e-3 (paper Table 9), α per task (Table 10: 0.2-0.8). ``z`` are the classifier's
logits (``logits="labels"``, default): for the verbalizers these are the label words'
log-probabilities at the label position (the mask / the last token), i.e. the label-position
logits RESTRICTED TO THE LABEL WORDS (a log-softmax shifts a row by a constant, which neither
softmax nor Δ sees, so this equals using the raw label-word logits). The paper uses the FULL
vocabulary at the label position; ``logits="vocab"`` does that for causal and masked
verbalizers (source and target must then share the vocabulary, as a distilled student does). For
the cosine sentence-encoder classifier ``z`` is its scaled cosine to the label descriptions.

Everything that does not depend on ``P_t`` -- the prompted and unprompted source outputs and the
unprompted target outputs -- is computed under ``torch.no_grad`` (the reference runs these with
autograd on), once for the whole public set (``cache_fixed``; per batch when the vocabulary
outputs would be too large). Only the prompted target forward is differentiated, and only with
respect to ``P_t`` (both backbones are frozen).

Privacy: the transfer reads only ``P_s`` (the output of the user's, possibly DP, prompt tuning)
and public texts, so it is post-processing and adds no privacy cost.

Selection: ``select_fn(prompt) -> float`` (higher is better) may be called every
``select_every`` steps to keep the best prompt. It must be computed on PUBLIC data only (e.g.
minus :func:`transfer_objective` on held-out public texts, or accuracy on a labelled public
set): choosing the step on the private test set, as the reference does, leaks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from models.classifiers import (
    Batch,
    PromptClassifier,
    VerbalizerCausalLM,
    VerbalizerMaskedLM,
    num_examples,
    select_rows,
)
from models.dp_prompt_training import StepProgress
from models.soft_prompt import SoftPrompt

ProgressFn = Callable[[int, int, float | None], None]
SelectFn = Callable[[torch.Tensor], float]
# cache the fixed (prompt-independent) outputs of the whole public set up to this many bytes
CACHE_LIMIT_BYTES = 512 * 2**20


@dataclass
class TransferConfig:
    """Prompt-transfer settings (paper Tables 9-10: Adam, lr 1e-3, batch 32 (RoBERTa) / 8
    (GPT2-XL), T = 2, α 0.2-0.8).

    ``logits``: "labels" (classifier logits) or "vocab" (full vocabulary at the label position,
    verbalizers only). ``init``: how the target prompt starts when no ``init_prompt`` is given:
    "vocab" = :meth:`SoftPrompt.init_from_vocab` on the TARGET backbone with ``init_words``
    (None: ``n_tokens`` random vocabulary rows) and ``init_seed`` -- pass the same words/seed the
    source prompt was initialised with (the paper starts P_t "with the same initialization of
    P_s"); "source" = copy P_s (embedding widths must match). ``select_every``: steps between
    ``select_fn`` calls (also called on the initial and the final prompt)."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    alpha: float = 0.5
    temperature: float = 2.0
    max_length: int = 64
    seed: int = 0
    logits: str = "labels"
    init: str = "vocab"
    init_words: str | None = None
    init_seed: int = 0
    select_every: int = 100
    cache_fixed: bool = True
    log_every: int = 10

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.logits not in ("labels", "vocab"):
            raise ValueError(f"logits must be 'labels' or 'vocab', got {self.logits!r}")
        if self.init not in ("vocab", "source"):
            raise ValueError(f"init must be 'vocab' or 'source', got {self.init!r}")
        if self.select_every < 0:
            raise ValueError("select_every must be >= 0")


@dataclass
class TransferResult:
    """``prompt``: the returned (n_tokens, d_target) CPU tensor -- the best by ``select_fn`` when
    one was given, else the final one. ``final_prompt``: after the last step. ``history``:
    per-step dicts (step, loss, kl_prompted, kl_delta, batch_size). ``selection``: (step, score)
    dicts of the ``select_fn`` calls; ``best_step`` the step of the returned prompt."""

    prompt: torch.Tensor
    history: list[dict] = field(default_factory=list)
    steps: int = 0
    best_step: int | None = None
    selection: list[dict] = field(default_factory=list)
    final_prompt: torch.Tensor | None = None


class TransferLoss(NamedTuple):
    loss: torch.Tensor  # (1 − α)·kl_prompted + α·kl_delta
    kl_prompted: torch.Tensor  # KL(source prompted ‖ target prompted)·T²
    kl_delta: torch.Tensor  # KL(Δ source ‖ Δ target)·T²


class FixedOutputs(NamedTuple):
    """Prompt-independent outputs of one batch, computed without autograd."""

    source_prompted: torch.Tensor
    source_plain: torch.Tensor | None  # None when α = 0 (not needed)
    target_plain: torch.Tensor | None


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor, T: float) -> torch.Tensor:
    """KL(softmax(p/T) ‖ softmax(q/T))·T², mean over the batch. In float64: over a full
    vocabulary, float32 rounding leaves KL(p ‖ p) at about ±1e-7 (even negative)."""
    log_p = F.log_softmax(p_logits.double() / T, dim=-1)
    log_q = F.log_softmax(q_logits.double() / T, dim=-1)
    return (F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * (T * T)).float()


def transfer_loss(
    source_prompted: torch.Tensor,
    source_plain: torch.Tensor | None,
    target_prompted: torch.Tensor,
    target_plain: torch.Tensor | None,
    alpha: float,
    temperature: float = 2.0,
) -> TransferLoss:
    """POST's loss on (B, K) logits. The source is the KL's reference distribution:
    KL(source ‖ target). The unprompted outputs may be None when ``alpha`` is 0."""
    if source_prompted.shape != target_prompted.shape:
        raise ValueError(f"source and target logits differ in shape: {tuple(source_prompted.shape)} "
                         f"vs {tuple(target_prompted.shape)}")
    T = float(temperature)
    src = source_prompted.to(target_prompted.device)
    kl_out = _kl(src, target_prompted, T)
    if alpha > 0:
        if source_plain is None or target_plain is None:
            raise ValueError("alpha > 0 needs the unprompted source and target logits")
        d_s = src.float() - source_plain.to(src.device).float()
        d_t = target_prompted.float() - target_plain.to(target_prompted.device).float()
        kl_delta = _kl(d_s, d_t, T)
    else:
        kl_delta = torch.zeros((), device=target_prompted.device)
    loss = (1.0 - alpha) * kl_out + alpha * kl_delta
    return TransferLoss(loss, kl_out, kl_delta)


def vocab_logits(clf: PromptClassifier, batch: Batch, prompt: torch.Tensor | None) -> torch.Tensor:
    """(B, V) full-vocabulary logits at the label position of a verbalizer classifier (the same
    forward as the classifier's, before it keeps the label words)."""
    if not isinstance(clf, (VerbalizerCausalLM, VerbalizerMaskedLM)):
        raise ValueError(f"logits='vocab' needs a verbalizer classifier, got {type(clf).__name__}")
    return clf.vocab_logits(batch, prompt)


def _scores(clf: PromptClassifier, batch: Batch, prompt: torch.Tensor | None, mode: str) -> torch.Tensor:
    if mode == "vocab":
        return vocab_logits(clf, batch, prompt)
    return clf(batch, prompt).float()


def _prompt_tensor(prompt) -> torch.Tensor:
    if isinstance(prompt, SoftPrompt):
        prompt = prompt.weight
    t = torch.as_tensor(prompt)
    if t.dim() != 2:
        raise ValueError(f"a prompt is (n_tokens, embed_dim), got shape {tuple(t.shape)}")
    return t


@torch.no_grad()
def fixed_outputs(
    source_clf: PromptClassifier,
    source_prompt: torch.Tensor,
    target_clf: PromptClassifier,
    source_batch: Batch,
    target_batch: Batch,
    logits: str = "labels",
    need_plain: bool = True,
) -> FixedOutputs:
    """Prompted and unprompted source outputs and unprompted target outputs of one batch, under
    ``torch.no_grad`` (on the target's device)."""
    dev = target_clf.device
    p_s = _prompt_tensor(source_prompt).detach()
    src_p = _scores(source_clf, source_batch, p_s, logits).to(dev)
    if not need_plain:
        return FixedOutputs(src_p, None, None)
    src_0 = _scores(source_clf, source_batch, None, logits).to(dev)
    tgt_0 = _scores(target_clf, target_batch, None, logits).to(dev)
    return FixedOutputs(src_p, src_0, tgt_0)


def _check_pair(source_clf: PromptClassifier, target_clf: PromptClassifier, config: TransferConfig) -> None:
    if config.logits == "labels" and list(source_clf.labels) != list(target_clf.labels):
        raise ValueError(f"source and target classifiers have different labels: {source_clf.labels} vs {target_clf.labels}")
    if config.logits == "vocab":
        for c in (source_clf, target_clf):
            if not isinstance(c, (VerbalizerCausalLM, VerbalizerMaskedLM)):
                raise ValueError(f"logits='vocab' needs verbalizer classifiers, got {type(c).__name__}")
        v_s = source_clf.backbone.model.get_input_embeddings().weight.shape[0]
        v_t = target_clf.backbone.model.get_input_embeddings().weight.shape[0]
        if v_s != v_t:
            raise ValueError(f"logits='vocab' needs a shared vocabulary, source has {v_s} rows, target {v_t}")


def _encode_pair(source_clf, target_clf, texts: list[str], max_length: int) -> tuple[Batch, Batch]:
    texts = [str(t) for t in texts]
    if not texts:
        raise ValueError("no public texts")
    return source_clf.encode(texts, max_length), target_clf.encode(texts, max_length)


def _all_fixed(source_clf, source_prompt, target_clf, enc_s, enc_t, config: TransferConfig) -> FixedOutputs:
    N, bs, need_plain = num_examples(enc_s), config.batch_size, config.alpha > 0
    parts = [
        fixed_outputs(source_clf, source_prompt, target_clf, select_rows(enc_s, slice(i, i + bs)),
                      select_rows(enc_t, slice(i, i + bs)), config.logits, need_plain)
        for i in range(0, N, bs)
    ]
    src_p = torch.cat([p.source_prompted for p in parts])
    if not need_plain:
        return FixedOutputs(src_p, None, None)
    return FixedOutputs(src_p, torch.cat([p.source_plain for p in parts]), torch.cat([p.target_plain for p in parts]))


def _cacheable(source_clf, target_clf, n: int, config: TransferConfig) -> bool:
    if not config.cache_fixed:
        return False
    width = target_clf.n_labels
    if config.logits == "vocab":
        width = int(target_clf.backbone.model.get_input_embeddings().weight.shape[0])
    return 3 * n * width * 4 <= CACHE_LIMIT_BYTES


def init_target_prompt(target_clf: PromptClassifier, source_prompt, config: TransferConfig) -> SoftPrompt:
    """The starting P_t: a copy of P_s (``init="source"``) or :meth:`SoftPrompt.init_from_vocab`
    on the target backbone with ``config.init_words`` / ``config.init_seed`` and P_s's length."""
    p_s = _prompt_tensor(source_prompt).detach().float().cpu()
    n = int(p_s.shape[0])
    if config.init == "source":
        if p_s.shape[1] != target_clf.embed_dim:
            raise ValueError(f"init='source' needs equal widths: source prompt {p_s.shape[1]}, target {target_clf.embed_dim}")
        return SoftPrompt(n, p_s.shape[1], p_s)
    src = config.init_words if config.init_words else n
    return SoftPrompt.init_from_vocab(target_clf.backbone, src, n_tokens=n, seed=config.init_seed)


class PublicObjective:
    """The mean POST loss over a fixed set of public texts as a function of the target prompt.
    The texts are encoded and their prompt-independent outputs computed once (when they fit in
    ``CACHE_LIMIT_BYTES``), so a ``select_fn`` can evaluate it at every selection step cheaply."""

    def __init__(self, source_clf: PromptClassifier, source_prompt, target_clf: PromptClassifier,
                 public_texts: list[str], config: TransferConfig):
        _check_pair(source_clf, target_clf, config)
        self.source_clf, self.target_clf, self.config = source_clf, target_clf, config
        self.source_prompt = _prompt_tensor(source_prompt).detach()
        self.enc_s, self.enc_t = _encode_pair(source_clf, target_clf, public_texts, config.max_length)
        n = num_examples(self.enc_s)
        self.fixed = _all_fixed(source_clf, self.source_prompt, target_clf, self.enc_s, self.enc_t, config) \
            if _cacheable(source_clf, target_clf, n, config) else None

    @torch.no_grad()
    def __call__(self, target_prompt) -> float:
        config = self.config
        p_t = _prompt_tensor(target_prompt).detach()
        N, bs = num_examples(self.enc_s), config.batch_size
        total = 0.0
        for i in range(0, N, bs):
            rows = slice(i, i + bs)
            b_t = select_rows(self.enc_t, rows)
            if self.fixed is not None:
                fixed = FixedOutputs(*(None if x is None else x[rows] for x in self.fixed))
            else:
                fixed = fixed_outputs(self.source_clf, self.source_prompt, self.target_clf,
                                      select_rows(self.enc_s, rows), b_t, config.logits, config.alpha > 0)
            z_t = _scores(self.target_clf, b_t, p_t, config.logits)
            terms = transfer_loss(fixed.source_prompted, fixed.source_plain, z_t, fixed.target_plain,
                                  config.alpha, config.temperature)
            total += float(terms.loss) * num_examples(b_t)
        return total / N


def transfer_objective(
    source_clf: PromptClassifier,
    source_prompt,
    target_clf: PromptClassifier,
    public_texts: list[str],
    target_prompt,
    config: TransferConfig,
) -> float:
    """Mean POST loss of ``target_prompt`` over ``public_texts`` (no gradients). Minus this on
    HELD-OUT public texts is a valid ``select_fn``; to evaluate many prompts on the same texts,
    build one :class:`PublicObjective`."""
    return PublicObjective(source_clf, source_prompt, target_clf, public_texts, config)(target_prompt)


def transfer_prompt(
    source_clf: PromptClassifier,
    source_prompt,
    target_clf: PromptClassifier,
    public_texts: list[str],
    config: TransferConfig,
    init_prompt: torch.Tensor | None = None,
    progress: ProgressFn | None = None,
    select_fn: SelectFn | None = None,
) -> TransferResult:
    """Train a target prompt for ``target_clf`` that reproduces ``source_clf`` + ``source_prompt``
    on ``public_texts`` (the only data input; no labels). See the module docstring.

    ``source_prompt``: (n, d_source) tensor or :class:`SoftPrompt` (never modified, no gradient
    reaches it). ``init_prompt``: (n', d_target) start for P_t, overriding ``config.init``.
    ``progress(step, total, mean loss)``; ``select_fn(prompt) -> float`` on PUBLIC data only,
    higher is better, called on the initial prompt, every ``config.select_every`` steps and on
    the final prompt; the best one is returned (ties keep the earlier).
    """
    _check_pair(source_clf, target_clf, config)
    source_clf.eval()
    target_clf.eval()
    p_s = _prompt_tensor(source_prompt).detach()
    enc_s, enc_t = _encode_pair(source_clf, target_clf, public_texts, config.max_length)
    N = num_examples(enc_s)
    prompt = _start_prompt(target_clf, p_s, init_prompt, config)
    opt = torch.optim.Adam([prompt.weight], lr=config.lr)
    cached = _all_fixed(source_clf, p_s, target_clf, enc_s, enc_t, config) if _cacheable(
        source_clf, target_clf, N, config) else None
    need_plain = config.alpha > 0
    selector = _Selector(select_fn, prompt)
    g = torch.Generator().manual_seed(config.seed)
    report = StepProgress(progress, config.log_every, config.steps)
    history: list[dict] = []
    order: list[int] = []
    selector(0)
    for step in range(1, config.steps + 1):
        if len(order) < min(config.batch_size, N):
            order += torch.randperm(N, generator=g).tolist()
        idx, order = order[: config.batch_size], order[config.batch_size :]
        rows = torch.tensor(idx, dtype=torch.long)
        b_t = select_rows(enc_t, rows)
        if cached is not None:
            fixed = FixedOutputs(*(None if x is None else x[rows.to(x.device)] for x in cached))
        else:
            fixed = fixed_outputs(source_clf, p_s, target_clf, select_rows(enc_s, rows), b_t, config.logits, need_plain)
        history.append({"step": step, **_transfer_step(target_clf, b_t, prompt, opt, fixed, config, step),
                        "batch_size": len(idx)})
        report(step, history[-1]["loss"])
        if select_fn is not None and config.select_every and step % config.select_every == 0 and step != config.steps:
            selector(step)
    selector(config.steps)
    final = prompt.weight.detach().cpu().clone()
    if select_fn is None:
        return TransferResult(final, history, config.steps, None, selector.selection, final)
    return TransferResult(selector.best_prompt, history, config.steps, selector.best_step, selector.selection, final)


def _start_prompt(target_clf: PromptClassifier, p_s: torch.Tensor, init_prompt, config: TransferConfig) -> SoftPrompt:
    """P_t's start, on the target's device: ``init_prompt`` when given, else from ``config.init``."""
    if init_prompt is not None:
        t = _prompt_tensor(init_prompt).detach().float().cpu()
        prompt = SoftPrompt(t.shape[0], t.shape[1], t)
    else:
        prompt = init_target_prompt(target_clf, p_s, config)
    if prompt.embed_dim != target_clf.embed_dim:
        raise ValueError(f"target prompt width {prompt.embed_dim} != target embedding width {target_clf.embed_dim}")
    return prompt.to(target_clf.device)


class _Selector:
    """Scores snapshots of the prompt with ``select_fn`` (public data only; higher is better) and
    keeps the best one (ties keep the earlier); a no-op without ``select_fn``."""

    def __init__(self, select_fn: SelectFn | None, prompt: SoftPrompt):
        self.select_fn, self.prompt = select_fn, prompt
        self.selection: list[dict] = []
        self.best_score, self.best_step, self.best_prompt = -math.inf, None, None

    def __call__(self, step: int) -> None:
        if self.select_fn is None:
            return
        snapshot = self.prompt.weight.detach().cpu().clone()
        score = float(self.select_fn(snapshot.clone()))
        self.selection.append({"step": step, "score": score})
        if score > self.best_score or self.best_prompt is None:
            self.best_score, self.best_step, self.best_prompt = score, step, snapshot


def _transfer_step(target_clf: PromptClassifier, b_t, prompt: SoftPrompt, opt, fixed: FixedOutputs,
                   config: TransferConfig, step: int) -> dict:
    """One Adam step on the POST loss of a batch; its loss terms."""
    z_t = _scores(target_clf, b_t, prompt.weight, config.logits)
    terms = transfer_loss(fixed.source_prompted, fixed.source_plain, z_t, fixed.target_plain,
                          config.alpha, config.temperature)
    opt.zero_grad(set_to_none=True)
    terms.loss.backward()
    opt.step()
    value = float(terms.loss.detach())
    if not math.isfinite(value):
        raise RuntimeError(f"transfer loss is not finite at step {step}")
    return {"loss": value, "kl_prompted": float(terms.kl_prompted.detach()), "kl_delta": float(terms.kl_delta.detach())}


__all__ = [
    "FixedOutputs",
    "PublicObjective",
    "TransferConfig",
    "TransferLoss",
    "TransferResult",
    "fixed_outputs",
    "init_target_prompt",
    "transfer_loss",
    "transfer_objective",
    "transfer_prompt",
    "vocab_logits",
]
