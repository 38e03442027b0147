"""PrivPrompt's generic model layer: the torch code that knows no method.

Frozen backbones (``backbones``: loading, caching), prompt kinds (``soft_prompt``, ``prompts``: soft, prefix, text,
and the remote completions endpoint for text prompts), prompt classifiers that prepend a prompt
to the input (``classifiers``), non-private and DP-SGD prompt training with per-sample gradients
and step hooks (``dp_prompt_training``), batched scoring (``scoring``), loss-landscape measures
(``landscape``) and device/seed helpers (``device``). Outside PrivPrompt: soft prompts and prefixes as
PEFT adapters (``prompts.peft_export``) and portable backbone references (``backbone_ref``). A
method's own torch code lives in its package (``tasks/methods/<name>/``).

No Prefect or MLflow here: flows call these plain functions and log what they return.
"""

from models.classifiers import (
    CosineEncoderClassifier,
    PromptClassifier,
    VerbalizerCausalLM,
    VerbalizerMaskedLM,
    build_classifier,
    num_examples,
    select_rows,
)
from models.device import default_device, seed_everything
from models.dp_prompt_training import (
    DPConfig,
    PromptTrainingConfig,
    TrainResult,
    per_sample_prompt_gradients,
    train_prompt,
)
from models.backbones import Backbone, ModelLoadError, clear_backbone_cache, load_backbone
from models.scoring import accuracy, per_example_loss, predict_logits
from models.soft_prompt import SoftPrompt, load_prompt, save_prompt

__all__ = [
    "Backbone",
    "CosineEncoderClassifier",
    "DPConfig",
    "ModelLoadError",
    "PromptClassifier",
    "PromptTrainingConfig",
    "SoftPrompt",
    "TrainResult",
    "VerbalizerCausalLM",
    "VerbalizerMaskedLM",
    "accuracy",
    "build_classifier",
    "clear_backbone_cache",
    "default_device",
    "load_backbone",
    "load_prompt",
    "num_examples",
    "per_example_loss",
    "per_sample_prompt_gradients",
    "predict_logits",
    "save_prompt",
    "seed_everything",
    "select_rows",
    "train_prompt",
]
