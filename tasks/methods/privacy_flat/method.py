"""privacy_flat: Privacy-Flat (white-box, Algorithm 1) on DP prefix tuning — within-layer (AWP),
cross-layer (sharpness-guided sparse prefix layers) and cross-model (‖w − w_nor‖₂ to a
non-private copy) weight flattening; the torch code is ``flat.py``.

Honest labels: AWP's perturbation, the sharpness selection on private data (Definition 1 uses
∇L(w|D)) and w_nor all read private data WITHOUT noise, so a run with any of them has no formal
guarantee (``none``: opt-in, recorded as non-private use, the prefix stays under private/).
Sparse selection on public data (``sparse_data: public``, labels = the frozen model's zero-shot
predictions) keeps the DP guarantee. With everything off it is ``prefix_dpsgd``, step for step (both
extend the toolkit's ``PrefixDPSGDMethod``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field

from dataclasses import replace

from ...methodkit.prompt_methods import DPSGD_TRAITS, PREFIX_REPORT, PrefixDPSGDConfig, PrefixDPSGDMethod, prefix_extras
from ...schema import Block
from .. import register_method
from ..base import MethodSpec, settings_of


class FlatConfig(Block):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    awp: bool = Field(False, description="within-layer flattening: AWP in the first awp_epochs")
    awp_epochs: float = Field(1.0, ge=0, description="E: epochs (of DP steps) with AWP")
    awp_gamma: float = Field(0.01, gt=0, description="relative size of the AWP perturbation per layer")
    sparse: bool = Field(False, description="cross-layer flattening: greedy elimination of prefix layers")
    layers: int | None = Field(None, gt=0, description="prefix layers to keep (default: half of them)")
    sparse_data: Literal["private", "public"] = Field(
        "private", description="data of the sharpness selection; public keeps the DP guarantee")
    sharpness_examples: int = Field(256, gt=0, description="examples the sharpness is computed on")
    regularizer: bool = Field(False, description="cross-model flattening: λ‖w − w_nor‖₂")
    lam: float = Field(0.01, gt=0, alias="lambda", description="λ of the regulariser")
    nor_epochs: float = Field(1.0, gt=0, description="T_nor: epochs of the non-private copy w_nor")

    def reads_private_without_noise(self) -> list[str]:
        return [name for name, on in (("awp", self.awp), ("sparse", self.sparse and self.sparse_data == "private"),
                                      ("regularizer", self.regularizer)) if on]


class PrivacyFlatConfig(PrefixDPSGDConfig):
    flat: FlatConfig = Field(default_factory=FlatConfig)


def run_label(cfg) -> str:
    """A Privacy-Flat run's rung of the ladder: dp_prefix plus the flattening it adds."""
    f = cfg.methods.privacy_flat.flat
    parts = [p for p, on in (("awp", f.awp), ("sparse" + ("(public)" if f.sparse_data == "public" else ""), f.sparse),
                             ("reg", f.regularizer)) if on]
    return "dp_prefix+" + "+".join(parts) if parts else "dp_prefix"


def uses_public_data(cfg) -> bool:
    f = cfg.methods.privacy_flat.flat
    return f.sparse and f.sparse_data == "public"


class PrivacyFlat(PrefixDPSGDMethod):
    """DP prefix tuning (the toolkit's mechanism, ``prefix_dpsgd``'s too) with Privacy-Flat's step
    additions and honest labels."""

    def guarantee(self, cfg):
        if settings_of(cfg, self).flat.reads_private_without_noise():
            return "none"
        return super().guarantee(cfg)

    def extra_params(self, cfg) -> dict:
        f = settings_of(cfg, self).flat
        return {**super().extra_params(cfg), "flat.awp": f.awp, "flat.sparse": f.sparse,
                "flat.regularizer": f.regularizer, "flat.lambda": f.lam, "flat.awp_epochs": f.awp_epochs,
                "flat.awp_gamma": f.awp_gamma, "flat.layers": f.layers if f.sparse else None,
                "flat.sparse_data": f.sparse_data if f.sparse else None}

    def note(self, cfg, guarantee) -> str:
        noiseless = settings_of(cfg, self).flat.reads_private_without_noise()
        if noiseless:
            return (f"Privacy-Flat with {', '.join(noiseless)} reads private data without noise (AWP's perturbation, "
                    "the sharpness selection, the non-private copy w_nor): no formal guarantee; the prefix stays "
                    "under private/ and only its evaluation and audit statistics are reported")
        return super().note(cfg, guarantee)

    def step_additions(self, mctx, plan, rows, progress=None) -> dict:
        from .flat import FlatStepHook
        from models.memory import CPU_DEFAULT
        from models.soft_prompt import PrefixPrompt

        from ...methodkit.classifiers import classifier_for

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        f = block.flat
        if not (f.awp or f.sparse or f.regularizer):
            return {}
        clf = classifier_for(cfg, cfg.models.local)
        init = PrefixPrompt.init_from_vocab(clf.backbone, block.init or block.n_tokens, n_tokens=block.n_tokens,
                                            seed=mctx.seed).weight.detach().cpu()
        n_layers = init.shape[0]
        out = {"init_prompt": init, "metrics": {}, "history": []}
        layers = None
        if f.sparse:
            public = f.sparse_data == "public"
            # on private data the number of rounds (it stops when the sharpness stops falling) is a
            # statistic of that data: no progress reports, and the selection stays in the private history
            layers, rounds = self._select_layers(mctx, clf, init, rows, f, progress if public else None)
            out["history"] += [{"flat.sharpness_round": i + 1, **r} for i, r in enumerate(rounds)]
            if public:  # a function of public data only: publishable
                out["metrics"]["flat.layers_kept"] = len(layers)
                out["metrics"].update({f"flat.layer_kept.{l}": 1.0 for l in layers})
        w_nor = None
        if f.regularizer:  # trained once per seed and reused across ε (cached under private/)
            from ...methodkit.training import nonprivate_copy

            w_nor = nonprivate_copy(mctx, clf, init, rows, block, "prefix", f.nor_epochs)
        q, steps = plan.settings["sample_rate"], plan.settings["steps"]
        awp_steps = min(steps, math.ceil(f.awp_epochs / q)) if f.awp else 0
        out["metrics"]["flat.awp_steps"] = awp_steps
        out["hooks"] = [FlatStepHook(layers=layers if layers is not None and len(layers) < n_layers else None,
                                      awp_steps=awp_steps, awp_gamma=f.awp_gamma, w_nor=w_nor,
                                      lam=f.lam if f.regularizer else 0.0,
                                      # AWP's ascent: a mean gradient, lighter than the per-sample pass
                                      physical_batch_size=cfg.models.physical_batch_size or CPU_DEFAULT)]
        return out

    # ---- cross-layer: Definition 1 and the greedy elimination -----------------------------------
    def _select_layers(self, mctx, clf, init, rows, f: FlatConfig, progress):
        import numpy as np
        import torch

        from models.landscape import mean_gradient, mean_loss, prefix_sharpness
        from models.scoring import predict_logits

        from ...methodkit.classifiers import label_indices
        from .flat import eliminate_layers

        cfg = mctx.cfg
        if f.sparse_data == "public":
            from ...data import public_texts

            texts = public_texts(cfg, mctx.paths.private)
            texts = texts[: f.sharpness_examples]
            enc = clf.encode(texts, max_length=cfg.models.max_length)
            y = predict_logits(clf, enc, None, cfg.models.eval_batch_size).argmax(1)  # zero-shot labels
        else:
            idx = np.random.default_rng(mctx.seed).permutation(len(rows))[: f.sharpness_examples]
            enc = clf.encode([rows.texts[i] for i in idx], max_length=cfg.models.max_length)
            y = label_indices([rows.labels[i] for i in idx], cfg.data.labels)
        bs = cfg.models.eval_batch_size
        w = init.to(clf.device)
        # every candidate is the same w with other layers frozen: L(w) and ∇L(w) are computed once
        base, grad = mean_loss(clf, enc, y, w, bs), mean_gradient(clf, enc, y, w, bs)

        def sharpness_of(kept):
            mask = torch.zeros_like(w)
            mask[kept] = 1.0
            return prefix_sharpness(lambda p: base if p is w else mean_loss(clf, enc, y, p, bs), lambda p: grad,
                                    w, mask)

        n_layers = init.shape[0]
        keep = f.layers if f.layers is not None else max(1, n_layers // 2)
        return eliminate_layers(sharpness_of, n_layers, keep, progress)

    def check_model(self, cfg, n_layers: int) -> None:
        f = settings_of(cfg, self).flat
        if f.sparse and f.layers is not None and f.layers > n_layers:
            from ...errors import ConfigError

            raise ConfigError(f"methods.privacy_flat.flat.layers = {f.layers}: model {cfg.models.local!r} has "
                              f"{n_layers} prefix layers")


_REPORT = replace(PREFIX_REPORT, run_label=run_label)
PRIVACY_FLAT = register_method(MethodSpec(
    name="privacy_flat", config_class=PrivacyFlatConfig, mechanism=PrivacyFlat(), prompt_kind="prefix",
    label="Privacy-Flat (DP prefix tuning + flattening)", report=_REPORT,
    traits=replace(DPSGD_TRAITS, test_settings={
        **DPSGD_TRAITS.test_settings,
        "flat": {"awp": True, "sparse": True, "layers": 1, "regularizer": True, "sharpness_examples": 8}}),
    extras=prefix_extras("privacy_flat", _REPORT, uses_public_data=uses_public_data)))
