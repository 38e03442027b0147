"""PrivPrompt's model layer: everything that touches torch.

Frozen backbones (``registry``), soft prompts (``soft_prompt``), prompt classifiers that
prepend a soft prompt to the input embeddings (``classifiers``), non-private and DP-SGD
prompt training (``dp_prompt_training``), batched scoring (``scoring``) and device/seed
helpers (``device``).

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
from models.registry import Backbone, ModelLoadError, clear_backbone_cache, load_backbone
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
