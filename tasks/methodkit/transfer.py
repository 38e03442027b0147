"""A soft prompt moved to another model on PUBLIC texts, from a config's transfer settings: POST's
transfer step and ``privprompt retarget`` share it (the torch code is ``models.prompt_transfer``).
Post-processing of the source prompt: nothing private is read, no ε is spent."""

from __future__ import annotations


def transfer_config(cfg, block):
    """``models.prompt_transfer``'s settings from ``block`` (a method block with ``transfer`` and
    ``tuning`` settings): the target prompt initialised like the source prompt."""
    from models.prompt_transfer import TransferConfig

    t = block.transfer
    return TransferConfig(steps=t.steps, batch_size=t.batch_size, lr=t.lr, alpha=t.alpha,
                          max_length=cfg.models.max_length, seed=cfg.seed, init="vocab",
                          init_words=block.tuning.init, init_seed=cfg.seed, select_every=t.select_every)


def transfer_on_public(cfg, block, source_clf, source_prompt, target_clf, texts: list[str], progress=None, *,
                       key: str):
    """The transfer as ``block.transfer`` asks: a fixed number of steps, or with ``select_every``
    the prompt with the lowest transfer loss on ``select_size`` held-out public texts. ``texts`` are
    public; ``key``: the settings' config key, named in a refusal."""
    import numpy as np

    from models.prompt_transfer import PublicObjective, transfer_prompt

    from ..errors import ConfigError

    t, config = block.transfer, transfer_config(cfg, block)
    report = None if progress is None else (lambda step, total, *_: progress(step, total))
    if not t.select_every:
        return transfer_prompt(source_clf, source_prompt, target_clf, texts, config, progress=report)
    if len(texts) <= t.select_size:
        raise ConfigError(f"{key}.select_size = {t.select_size} leaves no public texts to "
                          f"train on ({len(texts)} in public); lower it or raise public.size")
    order = np.random.default_rng(cfg.seed).permutation(len(texts))  # files may be sorted by label
    held_out = [texts[i] for i in order[: t.select_size]]
    train = [texts[i] for i in sorted(order[t.select_size:])]
    objective = PublicObjective(source_clf, source_prompt, target_clf, held_out, config)  # encoded once
    return transfer_prompt(source_clf, source_prompt, target_clf, train, config, progress=report,
                           select_fn=lambda prompt: -objective(prompt))
