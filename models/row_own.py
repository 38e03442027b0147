"""Forward passes batched in shapes that are public and each row's own.

Batched, a row's outputs move by float rounding with its companions' lengths, padding and the
batch size (matrix products pick their kernels by shape): at a near-tie, adding one record could
flip ANOTHER row's prediction — a count moving by two where its noise is calibrated for one. Run
alone, a row's outputs are its own, but on a GPU one pass of one row costs tens of milliseconds of
launch overhead whatever its length (a 7B model on an H100: 37 ms; DP-OPT's query of 205 rows 8.2×
the batched one, bench/RESULTS.md).

:func:`run_row_own` batches rows so that the SHAPE of every pass is a function of each row alone:
a row is padded to its length rounded up to ``width`` (capped), the rows of one padded length go in
batches of exactly :func:`row_batch` rows (a function of that length alone), each holding at least
one fill row (one public token), the last filled with them. The fill row keeps padding in EVERY
pass: Transformers drops the attention mask of a batch with no padding at all, and without a mask a
half-precision model on CUDA may run flash attention instead of the masked kernel — so rows that all
fill their padded length could compute other bits than the same rows beside a shorter companion;
the probe batches of the check always hold padding too. For a fixed shape a forward
pass computes each row from that row alone (products reduce along the row; attention and norms are
per sequence) — CHECKED on the device, bit for bit, the first time each shape runs, on public probe
rows: the batch in reverse order, and its first row beside fill rows. A shape that fails runs its rows alone (a batch of one,
at the same padded length). Which path a shape takes depends on the device, the model and the
shape, never on the data.

Used by DP-OPT's engine (``tasks.methodkit.causal_engine``) and the classifiers' holdout scoring
(:func:`models.scoring.row_wise_logits`). On a CPU both run every row alone at its own length
instead (no padding, no fill rows, no checks: DP-OPT's queries are 3-5× cheaper so there,
bench/bench_dpopt.py --mixed). A model whose rows mix by their values at a fixed shape
(:func:`rows_mix`) runs every row alone on every device.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

import torch

Row = TypeVar("Row")

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def batch_rows_default(device: torch.device | str, model: torch.nn.Module | None = None,
                       requested: bool | None = None) -> bool:
    """Whether rows are batched in row-own shapes: as ``requested`` (None: on an accelerator, not on
    a CPU), and never for a model whose rows mix at a fixed shape (:func:`rows_mix`)."""
    wanted = torch.device(device).type != "cpu" if requested is None else bool(requested)
    return wanted and not (model is not None and rows_mix(model))


def rows_mix(model: torch.nn.Module) -> str | None:
    """Why a forward pass of ``model`` can make one row's outputs depend on its companions' VALUES at a
    fixed shape — which no check on public probe rows can rule out — or None:

    * LLM.int8 (bitsandbytes 8-bit with an outlier threshold): the outlier columns are the columns
      above the threshold in ANY row of the pass, and run in fp16 for every row (G2);
    * a mixture of experts: each expert's product covers the tokens routed to it from the whole batch,
      a shape set by the data (G3)."""
    if int8_outliers(model):
        return "8-bit (LLM.int8) weights pick outlier columns over the whole batch"
    experts = expert_count(getattr(model, "config", None))
    if experts:
        return f"a mixture of {experts} experts routes tokens over the whole batch"
    return None


def int8_outliers(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs 8-bit weights with LLM.int8's outlier decomposition (threshold > 0, the
    default of bitsandbytes and of checkpoints saved in 8-bit): a coupling of a batch's rows far above
    float rounding — in a DP training batch too, where one record would move the others' gradients."""
    q = getattr(model, "quantization_config", None) or getattr(getattr(model, "config", None), "quantization_config", None)
    get = (lambda k: q.get(k)) if isinstance(q, dict) else (lambda k: getattr(q, k, None))
    if getattr(model, "is_loaded_in_8bit", False) or (q is not None and get("load_in_8bit")):
        return float(get("llm_int8_threshold") if get("llm_int8_threshold") is not None else 6.0) > 0
    return False


def expert_count(config, depth: int = 3) -> int | None:
    """The number of experts of a mixture-of-experts config (searched in its sub-configs too: a
    multimodal model's text config, DBRX's ``ffn_config``), or None."""
    if config is None or depth < 0:
        return None
    items = config.items() if isinstance(config, dict) else vars(config).items() if hasattr(config, "__dict__") else []
    for k, v in items:
        if k in _EXPERT_COUNTS and isinstance(v, int) and v > 1:
            return v
    for k, v in items:
        if isinstance(v, dict) or (hasattr(v, "to_dict") and hasattr(v, "__dict__")):
            found = expert_count(v, depth - 1)
            if found:
                return found
    return None


def padded_length(n: int, width: int, cap: int | None = None) -> int:
    """A row of ``n`` positions padded to a multiple of ``width`` (at most ``cap``, at least ``n``)."""
    length = -(-n // width) * width
    return max(n, min(length, cap)) if cap is not None else length


def row_batch(length: int, max_batch: int = 32, tokens_per_pass: int = 2048) -> int:
    """The batch size for rows padded to ``length``: a function of the length alone (about
    ``tokens_per_pass`` tokens a pass, at least 8 rows, at most ``max_batch``)."""
    return max(1, min(max_batch, max(8, tokens_per_pass // max(1, length))))


def run_row_own(rows: Sequence[Row], lengths: Sequence[int], forward: Callable[[list, int], torch.Tensor],
                fill: Row, probes: Callable[[int, int], list], checked: dict, key: Hashable = (),
                width: int = 16, cap: int | None = None, max_batch: int = 32) -> list[torch.Tensor]:
    """Each row's output (``forward(batch, padded_length)[i]`` for its place ``i``), in input order.

    ``lengths[i]``: row i's own length; ``forward(batch, L)``: one pass of the rows of ``batch``
    padded to ``L`` (a tensor with one leading entry per row); ``fill``: a public row that fills a
    batch; ``probes(size, L)``: ``size`` distinct public rows that fit ``L``; ``checked``: the
    verdicts of the shapes checked so far ((size, L) + ``key`` → safe), kept by the caller across
    calls; ``key``: what else fixes the pass's shape (a shared head's length, a prompt's)."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for j, n in enumerate(lengths):
        groups.setdefault(padded_length(int(n), width, cap), []).append(j)
    for length, idx in groups.items():
        size = row_batch(length, max_batch)
        per_pass = size - 1 if size > 1 else 1  # a multi-row pass always holds a fill row (below)
        for start in range(0, len(idx), per_pass):
            batch = idx[start:start + per_pass]
            members = [rows[j] for j in batch] + [fill] * (size - len(batch))
            shape = (size, length) + (key if isinstance(key, tuple) else (key,))
            if size > 1 and shape not in checked:
                checked[shape] = rows_independent(forward, probes(size, length), fill, length)
            if size > 1 and not checked[shape]:
                outputs = torch.cat([forward([m], length) for m in members[:len(batch)]])
            else:
                outputs = forward(members, length)
            for i, j in enumerate(batch):
                out[j] = outputs[i]
    return out  # type: ignore[return-value]


def rows_independent(forward: Callable[[list, int], torch.Tensor], probes: list, fill, length: int) -> bool:
    """Whether a pass of ``len(probes)`` rows padded to ``length`` gives each row the same bits
    whatever its companions and its place: the probes, the probes reversed, and the first probe
    beside fill rows."""
    batch = forward(probes, length)
    reverse = forward(probes[::-1], length).flip(0)
    beside_fill = forward([probes[0]] + [fill] * (len(probes) - 1), length)
    return bool(torch.equal(reverse, batch) and torch.equal(beside_fill[0], batch[0]))


def probe_tokens(size: int, length: int, vocab: int, width: int) -> list[list[int]]:
    """``size`` distinct public token rows of lengths within ``length``'s bucket (fixed patterns)."""
    return [[(101 + 31 * k + 7 * i) % vocab for i in range(max(1, length - k % width))] for k in range(size)]
