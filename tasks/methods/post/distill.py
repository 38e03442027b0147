"""POST step 1: distil a frozen "teacher" backbone into a smaller "student" (Wang et al. 2024,
Appendix C.1, following DistilBERT, Sanh et al. 2019).

The student is a deep copy of the teacher's architecture that keeps only ``n_layers``
transformer layers: the teacher's FIRST ceil(n/2) and LAST floor(n/2) layers (RoBERTa 12 -> 2:
layers 0 and 11; GPT2-XL 48 -> 4: layers 0, 1, 46, 47), plus the embeddings, final norm, pooler
and LM head, all copied. Only the kept layers are copied (the dropped ones are never
duplicated), and the teacher is left untouched.

Distillation uses public text only::

    causal / masked LM:  L = α_ce·KL(teacher ‖ student)(token logits / T)·T²
                             + α_lm·LM loss of the student
                             + α_cos·(1 − cos(h_teacher, h_student))
    sentence encoder:    L = α_cos·(1 − cos(h_teacher, h_student))
                             + α_pool·pool loss(mean-pooled teacher, mean-pooled student)

``h`` is the last hidden state (per token, padding masked out). The LM loss is next-token cross
entropy for causal LMs and MLM cross entropy on 15% of the (non-special) tokens for masked LMs
(BERT's 80/10/10 [MASK]/random/keep corruption; teacher and student see the same corrupted
input, as in DistilBERT). The logit KL is averaged over all real (non-padding) tokens -- for
masked LMs DistilBERT restricts it to the masked positions; using every token gives more signal
per batch and includes the masked ones.

Sentence encoders (kind ``encoder``, e.g. MiniLM = ``BertModel`` without an LM head) have no
token logits, so ``α_ce``/``α_lm`` do not apply: they are distilled on the per-token hidden
states (cosine) and on the mean-pooled sentence embedding that ``CosineEncoderClassifier`` reads
(``1 − cos`` by default, or MSE), nothing else.

:func:`build_student` returns the student TRAINABLE (``requires_grad`` True); :func:`distill`
trains it in place. The CALLER freezes it afterwards with :func:`freeze` before using it as the
frozen source model of prompt tuning / transfer.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.classifiers import mlm_head
from models.device import resolve_device
from models.dp_prompt_training import StepProgress
from models.backbones import Backbone, Kind, detect_kind, quiet_loading

ProgressFn = Callable[[int, int, float | None], None]
STUDENT_META = "privprompt_student.json"


@dataclass
class StudentBackbone(Backbone):
    """A :class:`Backbone` built by :func:`build_student` (or reloaded by :func:`load_student`).

    ``copied_layers``: the teacher layer indices the student's layers were copied from, in order.
    """

    teacher_name: str = ""
    copied_layers: tuple[int, ...] = ()


def student_layer_indices(n_teacher: int, n_layers: int) -> list[int]:
    """Teacher layers kept: the first ceil(n/2) and the last floor(n/2)."""
    if not 1 <= n_layers <= n_teacher:
        raise ValueError(f"n_layers must be in [1, {n_teacher}] for a {n_teacher}-layer teacher, got {n_layers}")
    first, last = math.ceil(n_layers / 2), n_layers // 2
    return list(range(first)) + list(range(n_teacher - last, n_teacher))


def _layer_container(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(parent, attribute, ModuleList) of the transformer layers: BERT-family ``encoder.layer``,
    GPT-2 ``h``, Llama/Mistral/Qwen ``layers``, OPT-like ``decoder.layers``, ``blocks``."""
    base = getattr(model, "base_model", model)
    candidates = [(getattr(base, "encoder", None), "layer"), (base, "h"), (base, "layers"),
                  (getattr(base, "decoder", None), "layers"), (base, "blocks")]
    for parent, attr in candidates:
        layers = getattr(parent, attr, None) if parent is not None else None
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return parent, attr, layers
    raise ValueError(f"cannot find the transformer layers of {type(model).__name__} "
                     "(looked for encoder.layer, h, layers, decoder.layers, blocks)")


def num_layers(backbone: Backbone) -> int:
    return len(_layer_container(backbone.model)[2])


def _update_config(config, n_teacher: int, kept: list[int]) -> None:
    config.num_hidden_layers = len(kept)  # GPT-2's attribute_map turns this into n_layer
    for key, value in list(vars(config).items()):
        # per-layer lists (e.g. ``layer_types`` of sliding/full attention) follow the kept layers
        if "layer" in key and isinstance(value, (list, tuple)) and len(value) == n_teacher:
            setattr(config, key, type(value)(value[i] for i in kept))


def build_student(teacher: Backbone, n_layers: int, seed: int = 0, name: str | None = None) -> StudentBackbone:
    """A student with ``n_layers`` of the teacher's layers (first ceil(n/2), last floor(n/2)).

    Embeddings, final norm, pooler and LM head are copied from the teacher (tied weights stay
    tied); ``config.num_hidden_layers`` (``n_layer``) and per-layer config lists are updated and
    each kept layer's ``layer_idx`` (KV-cache slot) is renumbered 0..n-1 (a GPT-2 config with
``scale_attn_by_inverse_layer_idx`` -- off in the released GPT-2 checkpoints -- would then scale
a copied layer's attention by its new index, not its teacher index). The copy is exact, so
    ``seed`` only seeds the (unused) torch RNG state around the copy, kept for API symmetry with
    the other builders. Returns a TRAINABLE student (``requires_grad`` True, eval mode) sharing the
    teacher's tokenizer; the caller freezes it (:func:`freeze`) after :func:`distill`. The teacher
    is not modified. ``copied_layers`` records the teacher indices.
    """
    model = teacher.model
    parent, attr, layers = _layer_container(model)
    n_teacher = len(layers)
    kept = student_layer_indices(n_teacher, n_layers)
    # deepcopy with the dropped layers pre-seeded in the memo: they are never copied (a 48-layer
    # teacher is not duplicated to keep 4 layers); their slots come back as None and are removed.
    memo: dict = {id(layers[i]): None for i in range(n_teacher) if i not in set(kept)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student_model = copy.deepcopy(model, memo)
    s_parent, _, s_layers = _layer_container_by_path(student_model, model, parent, attr)
    new_layers = nn.ModuleList([s_layers[i] for i in kept])
    for new_idx, layer in enumerate(new_layers):
        for sub in layer.modules():
            if isinstance(getattr(sub, "layer_idx", None), int):
                sub.layer_idx = new_idx
    setattr(s_parent, attr, new_layers)
    _update_config(student_model.config, n_teacher, kept)
    student_model.requires_grad_(True)
    student_model.eval()
    return StudentBackbone(
        name=name or f"{teacher.name}-student-L{n_layers}",
        kind=teacher.kind,
        model=student_model,
        tokenizer=teacher.tokenizer,
        embed_dim=int(student_model.get_input_embeddings().weight.shape[1]),
        teacher_name=teacher.name,
        copied_layers=tuple(kept),
    )


def _layer_container_by_path(student_model: nn.Module, teacher_model: nn.Module, parent: nn.Module, attr: str):
    """The student's counterpart of the teacher's layer container, found by module path (the
    ModuleList itself holds None slots, so the usual lookup's ``len > 0`` test is not used)."""
    path = next(n for n, m in teacher_model.named_modules() if m is parent)
    s_parent = student_model.get_submodule(path) if path else student_model
    return s_parent, attr, getattr(s_parent, attr)


def freeze(backbone: Backbone) -> Backbone:
    """Eval mode, ``requires_grad`` False; returns the same backbone."""
    backbone.model.requires_grad_(False)
    backbone.model.eval()
    return backbone


@dataclass
class DistillConfig:
    """Distillation settings. Defaults are the paper's Table 6 (α_ce 5, α_lm 2, α_cos 1, lr 2.5e-4,
    batch 5). ``alpha_pool`` weighs the pooled-embedding loss of sentence encoders only
    (``pool_loss`` "cos" = 1 − cos, or "mse"). ``freeze_embeddings`` / ``freeze_head``: the
    paper's Table 11 ablation (a tied LM head and input embedding are one tensor: freezing either
    freezes both). Constant learning rate, AdamW, gradient norm clipped at ``max_grad_norm``
    (DistilBERT: 5.0)."""

    steps: int = 1000
    batch_size: int = 5
    lr: float = 2.5e-4
    max_length: int = 128
    temperature: float = 2.0
    alpha_ce: float = 5.0
    alpha_lm: float = 2.0
    alpha_cos: float = 1.0
    alpha_pool: float = 1.0
    pool_loss: str = "cos"
    mlm_probability: float = 0.15
    weight_decay: float = 0.0
    max_grad_norm: float | None = 5.0
    freeze_embeddings: bool = False
    freeze_head: bool = False
    log_every: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.max_length < 2:
            raise ValueError("steps and batch_size must be >= 1 and max_length >= 2")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.pool_loss not in ("cos", "mse"):
            raise ValueError(f"pool_loss must be 'cos' or 'mse', got {self.pool_loss!r}")
        if not 0 < self.mlm_probability < 1:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}")


@dataclass
class DistillResult:
    """``history``: per-step dicts (step, loss and each weighted-in term, unweighted). ``steps``:
    optimizer steps taken. The student was trained in place."""

    history: list[dict] = field(default_factory=list)
    steps: int = 0


def _forward(backbone: Backbone, input_ids, attention_mask) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(token logits or None for encoders, last hidden state), both float32."""
    model = backbone.model
    if backbone.kind == "encoder":
        return None, model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
    if backbone.kind == "masked":
        head = mlm_head(model)
        if head is None:
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            return out.logits.float(), out.hidden_states[-1].float()
        h = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return head(h).float(), h.float()
    h = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(h)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float(), h.float()


def _mask_tokens(input_ids, attention_mask, tokenizer, vocab_size: int, prob: float, g: torch.Generator):
    """BERT corruption: select ``prob`` of the real non-special tokens (at least one per batch);
    80% -> [MASK], 10% -> random token, 10% unchanged. Returns (corrupted ids, labels with -100)."""
    special = torch.tensor(sorted(set(getattr(tokenizer, "all_special_ids", []) or [])), dtype=torch.long)
    eligible = attention_mask.bool() & ~torch.isin(input_ids, special)
    selected = (torch.rand(input_ids.shape, generator=g) < prob) & eligible
    if not selected.any() and eligible.any():
        cand = eligible.flatten().nonzero().squeeze(1)
        selected.view(-1)[cand[torch.randint(len(cand), (1,), generator=g)]] = True
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    r = torch.rand(input_ids.shape, generator=g)
    ids = input_ids.clone()
    ids[selected & (r < 0.8)] = tokenizer.mask_token_id
    rand_pos = selected & (r >= 0.8) & (r < 0.9)
    ids[rand_pos] = torch.randint(vocab_size, (int(rand_pos.sum()),), generator=g)
    return ids, labels


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp_min(1.0)


def distill_losses(teacher: Backbone, student: Backbone, input_ids, attention_mask, config: DistillConfig,
                   mlm_labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The distillation loss on one tokenised batch (teacher forward under ``torch.no_grad``).

    ``mlm_labels``: -100 except at the masked positions (masked LMs; ``input_ids`` already
    corrupted). Returns (weighted total, dict of the unweighted terms)."""
    dev_t, dev_s = teacher.device, student.device
    with torch.no_grad():
        t_logits, t_h = _forward(teacher, input_ids.to(dev_t), attention_mask.to(dev_t))
    ids, attn = input_ids.to(dev_s), attention_mask.to(dev_s)
    s_logits, s_h = _forward(student, ids, attn)
    t_h = t_h.to(dev_s)
    real = attn.bool()
    terms: dict[str, torch.Tensor] = {}
    weights: dict[str, float] = {}
    cos = F.cosine_similarity(s_h, t_h, dim=-1)  # (B, L)
    terms["cos"], weights["cos"] = _masked_mean(1.0 - cos, real), config.alpha_cos
    if student.kind == "encoder":
        m = attn.unsqueeze(-1).float()
        s_pool = (s_h * m).sum(1) / m.sum(1).clamp_min(1.0)
        t_pool = (t_h * m).sum(1) / m.sum(1).clamp_min(1.0)
        if config.pool_loss == "cos":
            terms["pool"] = (1.0 - F.cosine_similarity(s_pool, t_pool, dim=-1)).mean()
        else:
            terms["pool"] = F.mse_loss(s_pool, t_pool)
        weights["pool"] = config.alpha_pool
    else:
        T = config.temperature
        t_logits = t_logits.to(dev_s)
        if t_logits.shape[-1] != s_logits.shape[-1]:
            raise ValueError(f"teacher and student vocabularies differ: {t_logits.shape[-1]} vs {s_logits.shape[-1]}")
        kl_tok = F.kl_div(F.log_softmax(s_logits / T, -1), F.log_softmax(t_logits / T, -1),
                          log_target=True, reduction="none").sum(-1)  # KL(teacher ‖ student) per token
        terms["ce"], weights["ce"] = _masked_mean(kl_tok, real) * T * T, config.alpha_ce
        if student.kind == "causal":
            labels = ids[:, 1:].masked_fill(~real[:, 1:], -100)
            lm_logits = s_logits[:, :-1]
        else:
            if mlm_labels is None:
                raise ValueError("a masked LM needs mlm_labels")
            labels, lm_logits = mlm_labels.to(dev_s), s_logits
        if (labels != -100).any():
            terms["lm"] = F.cross_entropy(lm_logits.reshape(-1, lm_logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        else:
            terms["lm"] = s_logits.sum() * 0.0
        weights["lm"] = config.alpha_lm
    total = sum(weights[k] * v for k, v in terms.items() if weights[k] != 0)
    if not isinstance(total, torch.Tensor):
        raise ValueError("all distillation weights are zero")
    return total, {k: float(v.detach()) for k, v in terms.items()}


def distill(teacher: Backbone, student: Backbone, texts: list[str], config: DistillConfig,
            progress: ProgressFn | None = None) -> DistillResult:
    """Train ``student`` in place to mimic the frozen ``teacher`` on public ``texts``.

    Batches are drawn without replacement (reshuffled every epoch, seeded by ``config.seed``);
    the student runs in train mode (dropout on, seeded by ``config.seed`` too: a run replays its
    student, and torch's global generator is left untouched) and is left in eval mode, still trainable:
    call :func:`freeze` before using it as a frozen model. ``progress(step, total, mean loss)``
    every ``config.log_every`` steps and at the end.
    """
    texts = _check_pair(teacher, student, texts)
    params = _trainable(student, config)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    g = torch.Generator().manual_seed(config.seed)
    vocab = int(student.model.get_input_embeddings().weight.shape[0])
    report = StepProgress(progress, config.log_every, config.steps)
    history: list[dict] = []
    order: list[int] = []
    student.model.train()
    device = next(student.model.parameters()).device
    # dropout draws from torch's global generator: seed it (public data, the logged seed) inside a
    # fork, so a seeded run replays its student and the caller's global stream is left as it was
    fork = torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])
    fork.__enter__()
    torch.manual_seed(config.seed)
    try:
        for step in range(1, config.steps + 1):
            if len(order) < config.batch_size:
                order += torch.randperm(len(texts), generator=g).tolist()
            idx, order = order[: config.batch_size], order[config.batch_size :]
            value, terms = _distill_step(teacher, student, [texts[i] for i in idx], config, opt, params, vocab, g)
            if not math.isfinite(value):
                raise RuntimeError(f"distillation loss is not finite at step {step}")
            history.append({"step": step, "loss": value, **terms, "batch_size": len(idx)})
            report(step, value)
    finally:
        fork.__exit__(None, None, None)
        student.model.eval()
    return DistillResult(history, config.steps)


def _check_pair(teacher: Backbone, student: Backbone, texts: list[str]) -> list[str]:
    """The non-empty texts to distil on, once teacher and student are checked to be a pair."""
    if student.model is teacher.model:
        raise ValueError("student and teacher are the same model")
    if student.kind != teacher.kind:
        raise ValueError(f"student kind {student.kind!r} != teacher kind {teacher.kind!r}")
    texts = [str(t) for t in texts if str(t).strip()]
    if not texts:
        raise ValueError("no (non-empty) texts to distil on")
    if student.kind == "masked" and getattr(student.tokenizer, "mask_token_id", None) is None:
        raise ValueError("masked-LM distillation needs a tokenizer with a mask token")
    return texts


def _trainable(student: Backbone, config: DistillConfig) -> list:
    """The student's parameters that train (embeddings and head frozen as ``config`` says)."""
    if config.freeze_embeddings:
        student.model.get_input_embeddings().requires_grad_(False)
    if config.freeze_head and student.model.get_output_embeddings() is not None:
        student.model.get_output_embeddings().requires_grad_(False)
    params = [p for p in student.model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the student has no trainable parameters (was it frozen?)")
    return params


def _distill_step(teacher: Backbone, student: Backbone, batch: list[str], config: DistillConfig, opt, params,
                  vocab: int, g: torch.Generator) -> tuple[float, dict]:
    """One AdamW step of the student on a batch of texts (masked LMs: tokens masked from ``g``):
    the loss and its terms."""
    tok = student.tokenizer
    enc = tok(batch, padding=True, truncation=True, max_length=config.max_length, return_tensors="pt")
    ids, attn = enc["input_ids"], enc["attention_mask"]
    mlm_labels = None
    if student.kind == "masked":
        ids, mlm_labels = _mask_tokens(ids, attn, tok, vocab, config.mlm_probability, g)
    loss, terms = distill_losses(teacher, student, ids, attn, config, mlm_labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if config.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    opt.step()
    return float(loss.detach()), terms


def save_student(backbone: Backbone, directory: str | Path) -> Path:
    """``save_pretrained`` of model and tokenizer plus ``privprompt_student.json`` (name, kind,
    teacher name, copied layers), so :func:`load_student` can rebuild the backbone and the caller
    can log the directory as a model artifact."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backbone.model.save_pretrained(str(directory))
    backbone.tokenizer.save_pretrained(str(directory))
    meta = {
        "format": 1,
        "name": backbone.name,
        "kind": backbone.kind,
        "teacher_name": getattr(backbone, "teacher_name", ""),
        "copied_layers": list(getattr(backbone, "copied_layers", ()) or ()),
        "n_layers": num_layers(backbone),
        "embed_dim": backbone.embed_dim,
    }
    (directory / STUDENT_META).write_text(json.dumps(meta, indent=2) + "\n")
    return directory


def load_student(directory: str | Path, device: str | torch.device | None = None,
                 trainable: bool = False) -> StudentBackbone:
    """Reload a :func:`save_student` directory (local files only). Frozen (eval, no grad) unless
    ``trainable``. Not cached: each call builds a new model."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    quiet_loading()
    directory = Path(directory)
    meta_path = directory / STUDENT_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} holds no {STUDENT_META} (not a saved student)")
    meta = json.loads(meta_path.read_text())
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    kind: Kind = meta.get("kind") or detect_kind(config)
    cls = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM, "encoder": AutoModel}[kind]
    model = cls.from_pretrained(str(directory), config=config, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if tokenizer.pad_token is None and (tokenizer.eos_token or tokenizer.unk_token) is not None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    model.to(resolve_device(device))
    bb = StudentBackbone(
        name=meta.get("name") or directory.name,
        kind=kind,
        model=model,
        tokenizer=tokenizer,
        embed_dim=int(model.get_input_embeddings().weight.shape[1]),
        teacher_name=meta.get("teacher_name", ""),
        copied_layers=tuple(meta.get("copied_layers") or ()),
    )
    if trainable:
        model.requires_grad_(True)
        model.eval()
        return bb
    return freeze(bb)


__all__ = [
    "DistillConfig",
    "DistillResult",
    "StudentBackbone",
    "build_student",
    "distill",
    "distill_losses",
    "freeze",
    "load_student",
    "num_layers",
    "save_student",
    "student_layer_indices",
]
