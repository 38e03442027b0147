"""LiRA (Carlini et al. 2022), online and offline, on the true-label logit: the audited prompt's
statistic against its distribution over the shadow prompts trained with (online) and without each
example. A unit's score is the sum of its records' log-likelihood ratios."""

from __future__ import annotations

import numpy as np

from privacy import audit as stats

from . import Attack, register_attack


@register_attack
class LiraAttack(Attack):
    name = "lira"
    default_position = 1
    needs_shadows = True
    unit_reduction = "sum"

    def statistics(self, scoring):
        from models.scoring import true_label_logit_scores

        return {"logit": true_label_logit_scores(scoring.classifier, scoring.encoded, scoring.labels, scoring.prompt,
                                                 scoring.batch_size).numpy()}

    def scores(self, target, shadows):
        shadow_logit = np.stack([s["logit"] for s in shadows.statistics])
        return {"lira": stats.lira_scores_online(target["logit"], shadow_logit, shadows.in_mask),
                "lira_offline": stats.lira_scores_offline(target["logit"], shadow_logit, shadows.in_mask)}
