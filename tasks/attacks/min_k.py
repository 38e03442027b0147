"""Min-K% prob (Shi et al. 2024) for causal language models: the mean log-probability of a text's
least likely ``audit.min_k`` share of tokens is higher for a member. No score for other backbones."""

from __future__ import annotations

from . import Attack, register_attack


@register_attack
class MinKAttack(Attack):
    name = "min_k"
    default_position = 2

    def statistics(self, scoring):
        from models.scoring import min_k_percent_scores

        if scoring.classifier.backbone.kind != "causal":
            return {}
        return {"min_k": min_k_percent_scores(scoring.classifier, scoring.encoded, scoring.prompt,
                                              k=scoring.audit.min_k, batch_size=scoring.batch_size).numpy()}

    def scores(self, target, shadows):
        return {"min_k": target["min_k"]} if "min_k" in target else {}
