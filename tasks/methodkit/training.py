"""Soft-prompt and prefix training shared by the methods that tune one (DP-SGD and non-private
prompt / prefix tuning, POST's DP tuning on its student, Privacy-Flat, DPZero's w_nor): a method's
settings → ``models.dp_prompt_training`` on the private rows, tokenised here."""

from __future__ import annotations

import math

from privacy import accountant as acct
from privacy import events as ev


def dpsgd_settings(block, n: int, target_epsilon: float, delta: float, unit: str = "record") -> dict:
    """Poisson rate, steps and the calibrated noise multiplier of DP-SGD on ``n`` privacy units:
    examples, or with a user ``unit`` (``data.privacy_unit``) the released number of units — q =
    B/n and the steps are then over units (``batch_size``: the expected number of units a step
    samples), and the accountant composes the subsampled Gaussian mechanism over units."""
    q = min(1.0, block.batch_size / n)
    steps = max(1, math.ceil(block.epochs / q))
    sigma = acct.calibrate_noise_multiplier(target_epsilon, delta, q, steps)
    settings = {"sample_rate": q, "steps": steps, "noise_multiplier": sigma, "max_grad_norm": block.max_grad_norm,
                "expected_batch": q * n}
    if unit != "record":
        settings["unit"] = unit
    return settings


def dpsgd_event(settings: dict):
    return ev.dpsgd_event(settings["sample_rate"], settings["noise_multiplier"], settings["steps"])


def dpsgd_params(settings: dict) -> dict:
    params = {"dpsgd.sample_rate": settings["sample_rate"], "dpsgd.noise_multiplier": settings["noise_multiplier"],
              "dpsgd.steps": settings["steps"], "dpsgd.max_grad_norm": settings["max_grad_norm"]}
    if "unit" in settings:  # q and steps are over units; one clipped gradient (its rows' mean) per unit
        params.update({"dpsgd.sampled": "units", "dpsgd.unit_gradient": "mean of its rows' gradients, clipped"})
    return params


def nonprivate_steps(block, n_train: int) -> int:
    """The step count of non-private training (``epochs`` passes of batches of ``batch_size``) on
    ``n_train`` rows: the plan's n, the RELEASED size, never the exact one (a baseline's
    ``train.steps`` and its progress's total are published; with batch_size 1 an exact count would
    be n_train itself)."""
    return max(1, math.ceil(block.epochs * math.ceil(n_train / block.batch_size)))


def fit_soft_prompt(cfg, block, model_name: str, rows, seed: int, dp: dict | None = None,
                    randomness=None, progress=None, kind: str = "soft", init_prompt=None, hooks=(),
                    steps: int | None = None, shape: dict | None = None):
    """Train a soft prompt (or, with ``kind="prefix"``, a prefix; with ``kind="lora"`` a LoRA whose
    rank, α and targets ``shape`` gives as ``PromptTrainingConfig`` fields) of ``block``'s settings on
    ``model_name`` with private ``rows`` (DP-SGD when ``dp`` holds the plan's settings; ``hooks``:
    ``models.dp_prompt_training.DPStepHook`` s of the DP step, e.g. Privacy-Flat's; ``steps``: the
    non-private step count, :func:`nonprivate_steps` of the plan's n). Returns ``models``'
    ``TrainResult``."""
    from models.dp_prompt_training import DPConfig, PromptTrainingConfig, train_prompt

    from .classifiers import classifier_for, label_indices

    clf = classifier_for(cfg, model_name)
    enc = clf.encode(rows.texts, max_length=cfg.models.max_length)
    y = label_indices(rows.labels, cfg.data.labels)
    shape = shape if shape is not None else {"n_tokens": block.n_tokens, "init_words": block.init}
    tc = PromptTrainingConfig(lr=block.lr, epochs=block.epochs, batch_size=block.batch_size,
                              max_length=cfg.models.max_length, seed=seed, kind=kind, steps=steps,
                              physical_batch_size=cfg.models.physical_batch_size, **shape)
    dp_config, generators = None, {}
    if dp is not None:
        dp_config = DPConfig(noise_multiplier=dp["noise_multiplier"], max_grad_norm=dp["max_grad_norm"],
                             sample_rate=dp["sample_rate"], expected_batch=dp.get("expected_batch"))
        tc.steps = dp["steps"]
        sample, noise = randomness.torch_generators()
        generators = {"sample_generator": sample, "noise_generator": noise}
        generators.update(unit_tensor(cfg, rows))
    report = None if progress is None else (lambda step, total, *_: progress(step, total))
    if hooks:
        generators["hooks"] = hooks
    result = train_prompt(clf, enc, y, tc, dp=dp_config, progress=report, seed=seed, init_prompt=init_prompt,
                          **generators)
    if dp is not None and result.steps != dp["steps"]:
        raise RuntimeError(f"DP training took {result.steps} steps, {dp['steps']} were accounted")
    return result


def trained_metrics(result) -> dict:
    """What a trainer's run logs of its training: the steps taken and the trainable parameters (the
    prompt's, prefix's or adapters' size: public, a function of the settings and the model)."""
    weight = getattr(result.prompt, "weight", result.prompt)
    return {"train.steps": result.steps, "train.trainable_parameters": int(weight.numel())}


def fit_nonprivate(cfg, block, model_name: str, rows, seed: int, n_train: int, progress=None,
                   kind: str = "soft", shape: dict | None = None):
    """The non-private trainer: a soft prompt (or prefix) of ``block``'s settings on ``model_name``
    with private ``rows``, without DP — :func:`nonprivate_steps` of the plan's (released) ``n_train``
    steps. No guarantee: a run using it is labelled ``none``."""
    return fit_soft_prompt(cfg, block, model_name, rows, seed, progress=progress, kind=kind,
                           steps=nonprivate_steps(block, n_train), shape=shape)


def unit_tensor(cfg, rows) -> dict:
    """``{"units": (N,) unit index per row}`` for a DP trainer when ``data.privacy_unit`` names a
    person (the trainer then samples, combines and clips per unit); {} with ``record``. Rows
    without their units under a user unit are refused: a record-level step would state a
    per-record ε as a per-person one."""
    import torch

    if not cfg.data.user_unit:
        return {}
    index = rows.unit_index()
    if index is None:
        raise RuntimeError(f"data.privacy_unit is {cfg.data.privacy_unit!r} but the private rows carry no units: "
                           "the DP step would bound a record, not a person")
    return {"units": torch.tensor(index[0], dtype=torch.long)}


def nonprivate_copy(mctx, clf, init, rows, block, kind: str, epochs: float):
    """Privacy-Flat's w_nor (its cross-model flattening; DPZero's regulariser too): the prompt trained NON-privately from the same initialisation on the
    private rows (no guarantee: a run using it is labelled ``none``). Cached under private/ per
    seed, model, settings and rows, so the runs of one seed at several ε share it; never published."""
    import hashlib

    from models.dp_prompt_training import PromptTrainingConfig, train_prompt
    from models.soft_prompt import load_prompt, save_prompt

    from .classifiers import label_indices
    from ..state import digest_key, made_once, make_private_dir, private_file

    cfg = mctx.cfg
    rows_digest = hashlib.sha256("\x1e".join(t + "\x1f" + l for t, l in zip(rows.texts, rows.labels)).encode())
    key = digest_key({
        "model": cfg.models.local, "seed": mctx.seed, "max_length": cfg.models.max_length, "kind": kind,
        "n_tokens": block.n_tokens, "init": block.init, "lr": block.lr, "batch_size": block.batch_size,
        "epochs": epochs, "labels": cfg.data.labels, "rows": rows_digest.hexdigest()})
    path = mctx.paths.private / "w_nor" / f"{kind}-{key}.safetensors"  # private: never published

    def train():
        enc = clf.encode(rows.texts, max_length=cfg.models.max_length)
        tc = PromptTrainingConfig(n_tokens=block.n_tokens, lr=block.lr, epochs=epochs, batch_size=block.batch_size,
                                  max_length=cfg.models.max_length, seed=mctx.seed, kind=kind,
                                  physical_batch_size=cfg.models.physical_batch_size)
        return train_prompt(clf, enc, label_indices(rows.labels, cfg.data.labels), tc, seed=mctx.seed,
                            init_prompt=init).prompt

    def save(w_nor, target):
        make_private_dir(target.parent)
        tmp = target.with_name(target.name + ".tmp")
        save_prompt(tmp, w_nor, {"what": "w_nor: trained without DP"})
        private_file(tmp).replace(target)

    # runs of one seed on parallel Dask workers train it once
    return made_once(path, train, lambda p: load_prompt(p)[0], save)


def cross_model_pull(weight, w_nor, lam: float, mask=None):
    """The gradient of Privacy-Flat's cross-model regulariser λ‖w − w_nor‖₂ (not squared):
    ``λ (w − w_nor) / ‖w − w_nor‖`` over the trainable entries (``mask``; None: all), zero at
    w = w_nor. Added to the NOISED gradient: a function of w and w_nor alone, it adds no privacy
    cost of its own (w_nor's does: it reads private data without noise)."""
    import torch

    diff = weight - w_nor.to(weight.device)
    if mask is not None:
        diff = diff * mask
    norm = diff.norm()
    if norm == 0:
        return torch.zeros_like(weight)
    return lam * diff / norm
