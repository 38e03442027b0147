"""A model's frozen classifier for the config's labels, prompts of any kind on it, and the
encodings the methods and the stages feed it (moved here from ``tasks/stages.py``: methods sit
above this module, the stages beside them)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from ..config import PrivPromptConfig

_CLASSIFIERS: dict = {}


def classifier_for(cfg: "PrivPromptConfig", model_name: str, template: str | None = None):
    """The frozen classifier of ``model_name`` for the config's labels (cached per process);
    ``template`` overrides the config's (a text prompt extends it)."""
    from models.classifiers import build_classifier
    from models.backbones import load_backbone

    template = template or cfg.models.template
    key = (model_name, tuple(cfg.data.labels), json.dumps(cfg.models.label_descriptions, sort_keys=True),
           template, cfg.seed)
    if key not in _CLASSIFIERS:
        backbone = load_backbone(model_name, seed=cfg.seed, placement=cfg.models.placement_of(model_name))
        _CLASSIFIERS[key] = build_classifier(backbone, list(cfg.data.labels),
                                             cfg.models.label_descriptions or None, template)
    return _CLASSIFIERS[key]


def prompted(cfg: "PrivPromptConfig", model_name: str, prompt):
    """(classifier, what its forward takes as prompt) for a prompt of any kind: a text prompt is
    part of the template (the tokens change), a soft prompt goes to the forward pass."""
    if prompt is not None and getattr(prompt, "kind", None) == "text":
        base = classifier_for(cfg, model_name)
        return classifier_for(cfg, model_name, prompt.template(base.template)), None
    return classifier_for(cfg, model_name), prompt


def input_length(cfg: "PrivPromptConfig", model_name: str, classifier) -> int:
    """The max_length to encode with under ``classifier``'s template: ``models.max_length`` bounds
    the input under the model's own template, and a text prompt's instruction comes on top, so a
    long prompt (ICL's demos) never eats the text's budget or leaves it none."""
    base = classifier_for(cfg, model_name)
    length = cfg.models.max_length + max(0, classifier.template_tokens - base.template_tokens)
    # within the model's positions: a long text prompt (dp_fewshot's demonstrations) then cuts every
    # text to the room it leaves, instead of one long private record overflowing them
    limit = classifier.backbone.max_positions
    return length if limit is None else min(length, limit)


def label_indices(names: list[str], labels: list[str]):
    """Label names → a long tensor of their indices in the config's ``labels``."""
    import torch

    index = {name: i for i, name in enumerate(labels)}
    return torch.tensor([index[n] for n in names], dtype=torch.long)


def encode_split(classifier, path: str, labels: list[str], max_length: int, limit: int | None = None,
                 rng: "np.random.Generator | None" = None, size: int | None = None):
    """A partition split's rows (all, or ``limit`` of them drawn by ``rng``, in file order, or
    exactly ``size``: :func:`pool_indices`, a pool of a public size) encoded for ``classifier``,
    with their label indices."""
    import numpy as np

    texts, names = read_split(path)
    idx = np.arange(len(texts))
    if size is not None:
        idx = np.sort(pool_indices(len(idx), size, rng or np.random.default_rng(0)))
    elif limit is not None and len(idx) > limit:
        idx = np.sort((rng or np.random.default_rng(0)).choice(len(idx), size=limit, replace=False))
    y = label_indices([names[i] for i in idx], labels)
    return classifier.encode([texts[i] for i in idx], max_length=max_length), y


def read_split(path: str) -> tuple[list[str], list[str]]:
    """(texts, label names) of a partition split file: its ``text`` and ``label`` columns, as
    ``tasks.data`` writes them (read here without ``tasks.data``, which sits above the toolkit with
    the config schema)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["text", "label"])
    return table.column("text").to_pylist(), table.column("label").to_pylist()


def pool_indices(n_rows: int, size: int, rng: "np.random.Generator") -> "np.ndarray":
    """``size`` indices of the ``n_rows`` rows (or units) of a split, for an audit pool whose size
    is public (from the RELEASED sizes, never the exact ones): ``size`` of them drawn without
    replacement when the split holds at least that many (the usual case), and when it holds fewer
    (the noise drew its released size above its exact size) every row ⌊size / n_rows⌋ times and
    ``size mod n_rows`` of them once more: copies, so that no published pool count, base rate or
    ratio's denominator is the split's exact size."""
    import numpy as np

    if size < 0:
        raise ValueError(f"a pool size is a count >= 0, got {size}")
    if n_rows >= size:
        return np.arange(size) if n_rows == size else rng.choice(n_rows, size=size, replace=False)
    if n_rows == 0:
        raise ValueError("a pool cannot be drawn from an empty split")
    extra = rng.choice(n_rows, size=size % n_rows, replace=False)
    return np.concatenate([np.tile(np.arange(n_rows), size // n_rows), extra])
