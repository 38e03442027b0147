"""Batched, gradient-free scoring of a (prompted) classifier."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.classifiers import PromptClassifier, num_examples, select_rows


@torch.no_grad()
def predict_logits(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """(N, n_labels) logits on CPU; ``prompt`` is None or (n, d)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    classifier.eval()
    N = num_examples(encoded)
    out = [
        classifier(select_rows(encoded, slice(i, i + batch_size)), prompt).float().cpu()
        for i in range(0, N, batch_size)
    ]
    return torch.cat(out) if out else torch.zeros((0, classifier.n_labels))


@torch.no_grad()
def row_wise_logits(classifier: PromptClassifier, texts: list[str], max_length: int,
                    prompt: torch.Tensor | None = None, batch_rows: bool | None = None) -> torch.Tensor:
    """(N, n_labels) logits, each row's a function of that row (and the model and prompt) only —
    not of the other rows' lengths, padding or batch — so adding or removing one text changes no
    other row's output, bit for bit. (Batched as :func:`predict_logits` batches, a row's logits move
    by float rounding with its neighbours: 2e-6 on MiniLM.) For counts whose sensitivity must be
    one per row (a private selection's holdout scores, the comparison with no prompt).

    ``batch_rows`` (default: on an accelerator, and on a CPU for an encoder — not for a causal model)
    runs the rows in batches of public, row-own shapes, each shape checked bit for bit on the device the
    first time it runs (:func:`models.row_own.run_row_own`): on a GPU one pass of one row costs tens of
    milliseconds whatever its length (672 rows on a 7B shape: 1.0 s against 19 s); on a CPU MiniLM's
    rows run 1.6–3.5× faster so (2 × 800 SST-2 rows, two runs beside other work: 14.2 s against 22.5 s,
    9.4 s against 32.6 s) while SmolLM2's gain nothing (0.96×).
    Without it every row is encoded and run alone."""
    from models.row_own import batch_rows_default, probe_tokens, run_row_own

    classifier.eval()
    if not texts:
        return torch.zeros((0, classifier.n_labels))
    model = classifier.backbone.model
    if batch_rows is None and classifier.backbone.kind != "causal":
        batch_rows = True  # an encoder's rows (BERT-like: no cache) batch faster on a CPU too
    if not batch_rows_default(classifier.device, model, batch_rows):
        return torch.cat([classifier(classifier.encode([text], max_length=max_length), prompt).float().cpu()
                          for text in texts])
    enc = classifier.encode(texts, max_length=max_length)
    lengths = enc["attention_mask"].sum(1).tolist()
    rows = [(enc["input_ids"][i, :n].tolist(), int(enc["label_pos"][i])) for i, n in enumerate(lengths)]
    pad = classifier._tokenize.pad_id
    vocab = int(model.get_input_embeddings().num_embeddings)  # probe ids the model can embed

    def forward(batch, length):
        ids = torch.full((len(batch), length), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (r, _) in enumerate(batch):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r, dtype=torch.long), 1
        shaped = {"input_ids": ids, "attention_mask": mask, "label_pos": torch.tensor([p for _, p in batch])}
        return classifier.forward_shaped(shaped, prompt).float().cpu()

    width = 16  # rows padded to their length rounded up to 16 positions

    def probes(size, length):
        return [(t, len(t) - 1) for t in probe_tokens(size, length, vocab, width)]

    key = ("prompt", None if prompt is None else tuple(prompt.shape))  # with (batch, length): the pass's shape
    # padded lengths within max_length and the positions the prompt leaves (preflight checks both agree)
    positions = classifier.backbone.max_positions
    cap = max_length if positions is None else max(1, min(max_length, positions - prompt_positions(prompt)))
    return torch.stack(run_row_own(rows, lengths, forward, ([pad], 0), probes, classifier.row_checks, key=key,
                                   width=width, cap=cap))


def prompt_positions(prompt: torch.Tensor | None) -> int:
    """Positions a prompt takes before the text: a soft prompt's tokens, a prefix's placeholders."""
    from models.prompts.lora import is_lora
    from models.prompts.prefix import is_prefix, prefix_tokens

    if prompt is None or is_lora(prompt):
        return 0
    return prefix_tokens(prompt) if is_prefix(prompt) else int(prompt.shape[-2])


def accuracy(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    labels: torch.Tensor,
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> float:
    """Fraction of examples whose argmax logit is the label."""
    return accuracy_by_class(classifier, encoded, labels, prompt, batch_size)["accuracy"]


def accuracy_by_class(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    labels: torch.Tensor,
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> dict:
    """Accuracy, the recall of each class present (index → fraction of its examples predicted as
    it) and their mean, the balanced accuracy: a classifier that predicts one label for everything
    scores 1/(number of classes) there, whatever the classes' shares."""
    labels = torch.as_tensor(labels, dtype=torch.long).cpu()
    if labels.numel() == 0:
        raise ValueError("accuracy of an empty set")
    pred = predict_logits(classifier, encoded, prompt, batch_size).argmax(dim=1)
    right = pred == labels
    recall = {int(c): float(right[labels == c].float().mean()) for c in torch.unique(labels)}
    return {"accuracy": float(right.float().mean()), "recall": recall,
            "balanced_accuracy": sum(recall.values()) / len(recall),
            "predicted_classes": int(torch.unique(pred).numel())}


def per_example_loss(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    labels: torch.Tensor,
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """(N,) cross-entropy per example (for loss-threshold membership inference)."""
    labels = torch.as_tensor(labels, dtype=torch.long).cpu()
    logits = predict_logits(classifier, encoded, prompt, batch_size)
    return F.cross_entropy(logits, labels, reduction="none")


@torch.no_grad()
def true_label_logit_scores(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    labels: torch.Tensor,
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """(N,) LiRA statistic: logit of the true label's probability, log p_y − log(1 − p_y),
    computed from the log-softmax so it stays finite for confident models."""
    labels = torch.as_tensor(labels, dtype=torch.long).cpu()
    logp = F.log_softmax(predict_logits(classifier, encoded, prompt, batch_size).double(), dim=1)
    true = logp.gather(1, labels[:, None]).squeeze(1)
    others = logp.clone()
    others.scatter_(1, labels[:, None], float("-inf"))
    return (true - torch.logsumexp(others, dim=1)).float()


@torch.no_grad()
def min_k_percent_scores(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    prompt: torch.Tensor | None = None,
    k: float = 0.2,
    batch_size: int = 32,
) -> torch.Tensor:
    """(N,) Min-K% Prob (Shi et al. 2024): the mean of the lowest k-fraction token log-probs of
    each text under the (prompted) causal LM. Higher = more likely a training member.
    Only for causal LMs (verbalizer classifiers on a causal backbone)."""
    if classifier.backbone.kind != "causal":
        raise ValueError(f"Min-K% needs a causal LM, model {classifier.backbone.name!r} is {classifier.backbone.kind!r}")
    if not 0 < k <= 1:
        raise ValueError(f"k must lie in (0, 1], got {k}")
    classifier.eval()
    model = classifier.backbone.model
    scores = []
    N = num_examples(encoded)
    for start in range(0, N, batch_size):
        batch = select_rows(encoded, slice(start, start + batch_size))
        embeds, attn, _ = classifier._embed_inputs(batch, prompt)
        B, T, _ = embeds.shape
        with classifier.prompting(prompt, B):
            position_ids = classifier.position_ids(B, T, embeds.device)
            if position_ids is None:
                position_ids = torch.arange(T, device=embeds.device).unsqueeze(0).expand(B, T)
            logits = model(inputs_embeds=embeds, attention_mask=attn, position_ids=position_ids,
                           use_cache=False).logits
        n_prompt = T - int(batch["attention_mask"].sum(1).max())
        L = T - n_prompt
        ids = batch["input_ids"][:, :L].to(embeds.device)
        mask = batch["attention_mask"][:, :L].to(embeds.device).bool()
        # token i (i >= 1) is predicted at sequence position n_prompt + i - 1
        logp = F.log_softmax(logits[:, n_prompt:n_prompt + L - 1].float(), dim=-1)
        tok = logp.gather(2, ids[:, 1:, None]).squeeze(2)
        valid = mask[:, 1:]
        for row, ok in zip(tok, valid):
            vals = row[ok]
            if vals.numel() == 0:
                scores.append(0.0)
                continue
            m = max(1, int(math.ceil(k * vals.numel())))
            scores.append(float(vals.sort().values[:m].mean()))
    return torch.tensor(scores)


@torch.no_grad()
def peft_label_scores(classifier: PromptClassifier, adapter_folder, encoded: dict[str, torch.Tensor],
                      prompt: torch.Tensor) -> torch.Tensor | None:
    """(N, n_labels) label-word log-probs of PEFT's own forward (``PeftModel.from_pretrained`` on a
    copy of the classifier's backbone with the adapter folder), read at the classifier's label
    position — shifted by the virtual tokens PEFT puts in front for a soft prompt (a prefix adds
    none). None for a classifier that reads no label words (the cosine encoder)."""
    import copy

    from peft import PeftModel

    if not hasattr(classifier, "label_token_ids"):
        return None
    model = PeftModel.from_pretrained(copy.deepcopy(classifier.backbone.model), str(adapter_folder)).eval()
    device = classifier.device
    T = int(encoded["attention_mask"].sum(1).max())
    out = model(input_ids=encoded["input_ids"][:, :T].to(device),
                attention_mask=encoded["attention_mask"][:, :T].to(device)).logits
    shift = int(prompt.shape[0]) if torch.as_tensor(prompt).dim() == 2 else 0
    position = encoded["label_pos"].to(device) + shift
    rows = torch.arange(out.shape[0], device=device)
    return F.log_softmax(out[rows, position].float(), -1)[:, classifier.label_token_ids.to(device)].cpu()
