"""Shared pieces of the discrete-prompt methods (dp_opt, opt, dln1, icl): the local causal LM's
engine, DP-OPT's forward pass (labels predicted with the current instruction), meta-prompt bodies,
scoring candidates on validation rows, and decoding."""

from __future__ import annotations

import numpy as np


def engine_for(cfg, max_batch: int = 32):
    from ...methodkit.causal_engine import causal_engine_for

    return causal_engine_for(cfg, max_batch)


def label_words(cfg) -> list[str]:
    return [" " + label for label in cfg.data.labels]


def input_template(cfg) -> str:
    return cfg.models.template or "Input: {text}\n\nOutput:"


def forward_text_budget(engine, cfg, instruction: str | None) -> int | None:
    """Tokens a text may take in the forward template with ``instruction`` (None: the model states no
    bounded context): the room the instruction and the template leave in the model's context, so a
    long record scored alone (ŷ, the DP-argmax's holdout rows) never outgrows it. Public (the model,
    the instruction — the initial one or a released candidate —, the template); at least one token."""
    from ...methodkit.token_budget import JUNCTION, SEAM, model_context, template_tokens
    from .templates import eval_prefix

    context = model_context(engine.model)
    if context is None:
        return None
    head = len(engine.tok(eval_prefix(instruction), add_special_tokens=True, verbose=False)["input_ids"])
    template = template_tokens(engine, input_template(cfg))  # its two sides apart
    return max(1, context - head - template - 2 * JUNCTION - SEAM)  # SEAM: margin (a measured prompt filled 256 of 256 at the worst seam)


def meta_text_budget(engine, cfg, instruction: str, rows: int, max_new_tokens: int,
                     method: str = "dp_opt") -> int | None:
    """Tokens each private text of a backward meta-prompt may take (None: no bounded context): the
    shared head, ``rows`` demos in their template (an error's, the longer one, for every label pair),
    the slot and ``max_new_tokens`` generated tokens always fit. Public; settings without room are
    refused with one line."""
    from ...methodkit.token_budget import JUNCTION, model_context, text_budget
    from .templates import backward_body, backward_head

    context = model_context(engine.model)
    if context is None:
        return None
    labels = list(cfg.data.labels)
    head = len(engine.tok(backward_head(instruction), add_special_tokens=True, verbose=False)["input_ids"])
    fixed = len(engine.ids(backward_body([])))
    overhead = max(len(engine.ids(f"Input: \nStudent Output: {a}\nCorrect Output: {b}\n\n")) for a in labels
                   for b in labels)
    return text_budget(context, head + fixed + max_new_tokens + JUNCTION, rows, overhead,
                       f"{method}: up to {rows} demos per meta-prompt, max_new_tokens={max_new_tokens} and the "
                       "instruction")


def label_logprobs(engine, cfg, instruction: str | None, texts: list[str], rowwise: bool = False,
                   room: int | None | object = ...):
    """(N, n_labels) log-probabilities of the labels under the forward template with ``instruction``;
    each text within 48 words and the room the instruction leaves (:func:`forward_text_budget`; pass
    its answer as ``room``, an int or None, when scoring the same instruction row by row): a cut of the text alone.
    ``rowwise``: each row's from that row alone (CausalEngine.last_logits_rowwise)."""
    from ...methodkit.token_budget import clip_text
    from .templates import eval_prefix

    template = input_template(cfg)
    if room is ...:
        room = forward_text_budget(engine, cfg, instruction)
    return engine.label_logprobs(eval_prefix(instruction), [clip_text(engine, t, room) for t in texts],
                                 label_words(cfg), lambda t: template.replace("{text}", t), rowwise=rowwise)


def predictions(engine, cfg, instruction: str | None, texts: list[str], rowwise: bool = False) -> list[str]:
    """DP-OPT's forward pass: the label each text gets under ``instruction`` (one per example)."""
    if not texts:
        return []
    best = label_logprobs(engine, cfg, instruction, texts, rowwise).argmax(dim=1).tolist()
    return [cfg.data.labels[i] for i in best]


def correct_counts(engine, cfg, candidates: list[str], texts: list[str], labels: list[str],
                   units: np.ndarray | None = None) -> np.ndarray:
    """How many validation rows each candidate labels correctly (monotone, sensitivity 1). With
    ``units`` (unit index per row, a user privacy unit): the sum over units of the fraction of the
    unit's rows labelled correctly — each unit adds at most one to each count (:func:`per_unit_counts`).

    Each row is scored as a function of itself alone (``rowwise``: alone on a CPU, row-own public
    shapes on an accelerator, :meth:`CausalEngine.last_logits_rowwise`): batched as evaluation
    batches, a row's log-probabilities move by float rounding with its neighbours' lengths and
    padding, so adding one record could flip another row's prediction — a count moving by more than
    one, or down, which the DP-argmax's monotone, sensitivity-1 calibration does not cover (the same
    fix as the selection's holdout scoring)."""
    y = np.array([cfg.data.labels.index(l) for l in labels])

    def scored(c):  # the candidate's room computed once (public), every row its own
        room = forward_text_budget(engine, cfg, c)
        return label_logprobs(engine, cfg, c, texts, rowwise=True, room=room).argmax(dim=1).numpy()
    correct = (np.stack([scored(c) == y for c in candidates]) if len(texts)
               else np.zeros((len(candidates), 0), dtype=bool))
    return per_unit_counts(correct, units)


def per_unit_counts(correct: np.ndarray, units: np.ndarray | None = None) -> np.ndarray:
    """(C,) scores of a (C, N) 0/1 matrix of candidates × rows: the count of correct rows, or with
    ``units`` Σ_units (mean of the unit's row column): adding or removing one unit moves every
    score by at most one, in the same direction (monotone, sensitivity 1 per unit)."""
    correct = np.asarray(correct, dtype=float)
    if units is None:
        return correct.sum(axis=1)
    units = np.asarray(units, dtype=np.int64)
    size = np.bincount(units)
    weights = 1.0 / size[units]
    return correct @ weights


def label_loglik(engine, cfg, candidates: list[str], texts: list[str], labels: list[str]) -> np.ndarray:
    """Σ log p(y | x, candidate) over validation rows (DLN-1's selection score)."""
    idx = np.array([cfg.data.labels.index(l) for l in labels])
    return np.array([float(label_logprobs(engine, cfg, c, texts).numpy()[np.arange(len(idx)), idx].sum())
                     for c in candidates])


def body_ids(engine, demos: list[tuple[str, str, str]], tokens: int | None = None) -> list[int]:
    """A meta-prompt's body: each private text within 48 words and ``tokens`` (the public budget of
    :func:`meta_text_budget`; None: the word clip only) — each a cut of the text alone."""
    from ...methodkit.token_budget import clip_text
    from .templates import backward_body

    return engine.ids(backward_body([(clip_text(engine, x, tokens), y, yhat) for x, y, yhat in demos]))


def decode(engine, tokens: list[int]) -> str:
    text = engine.tok.decode(tokens, skip_special_tokens=True)
    return " ".join(text.replace("\n", " ").split())


def split_validation(rows, fraction: float, seed: int):
    """(generation rows, validation rows): the run's own validation split when it has one (the
    partition's holdout), else a seeded split of ``rows`` (audit shadows)."""
    from ..base import PrivateRows

    if rows.validation is not None:
        return rows, rows.validation
    index = rows.unit_index()
    if index is not None:  # a user unit: whole units on each side, with their units
        unit_of, n_units = np.asarray(index[0]), index[1]
        order = np.random.default_rng(seed).permutation(n_units)
        held = np.isin(unit_of, order[:max(1, int(round(fraction * n_units)))])
        return rows.subset(np.flatnonzero(~held)), rows.subset(np.flatnonzero(held))
    order = np.random.default_rng(seed).permutation(len(rows))
    cut = max(1, int(round(fraction * len(rows))))
    val, gen = order[:cut], order[cut:]
    pick = lambda ix: PrivateRows([rows.texts[i] for i in ix], [rows.labels[i] for i in ix])  # noqa: E731
    return pick(gen), pick(val)


def with_initial(candidates: list[str], instruction: str) -> list[str]:
    """The candidates a selection chooses among: the generated ones, then the initial instruction
    (what the run would publish with nothing generated), then NO instruction (what zero-shot uses:
    the forward template without an instruction line). Both are public (the config's or the
    dataset's default, and the empty string), so adding them changes no count's sensitivity: each
    candidate's correct-count still moves by at most one per record, monotonically, and the
    DP-argmax's event (Gumbel on monotone counts) is the same for any number of candidates. A
    generated candidate equal to either is kept once. So the published prompt is never a
    generated one that scored below no instruction on the holdout, beyond the vote's noise."""
    fixed = [instruction] + ([""] if instruction.strip() else [])
    return [c for c in candidates if c not in fixed and c.strip()] + fixed


PROMPT_SOURCE = "prompt.source"        # the run record's param: generated | initial | none
PROMPT_GENERATED = "prompt.generated"  # the training metric it is read from (1: generated, 0: initial)
PROMPT_NONE = "prompt.no_instruction"  # 1: no instruction won (the published prompt is zero-shot's)


def source_metric(chosen: str, instruction: str) -> dict[str, float]:
    """Whether the published prompt is a generated candidate, the initial instruction, or no
    instruction at all (a function of the released choice and public text: publishable)."""
    return {PROMPT_GENERATED: float(chosen.strip() != "" and chosen != instruction),
            PROMPT_NONE: float(chosen.strip() == "" and instruction.strip() != "")}


def source_of(metrics: dict) -> str | None:
    """``generated`` / ``initial`` / ``none`` (no instruction) from a training's metrics (None: the
    method selects nothing)."""
    if PROMPT_GENERATED not in metrics:
        return None
    if float(metrics.get(PROMPT_NONE, 0.0)) >= 0.5:
        return "none"
    return "generated" if float(metrics[PROMPT_GENERATED]) >= 0.5 else "initial"
