"""How a frozen backbone is loaded: its dtype, its placement across devices, and 8-/4-bit weights.

Everything goes through Transformers' ``from_pretrained`` (``dtype``, ``device_map`` handled by
Accelerate, ``quantization_config`` with bitsandbytes); nothing is placed by hand. The trainable part
never follows the backbone's dtype: soft prompts and prefixes are float32 leaves, cast to the
backbone's dtype only where they enter it, so their per-sample gradients, the clipping and the
noise are float32 (``models.dp_prompt_training``).

* ``dtype``: ``auto`` (no dtype passed: Transformers' default), ``float32``,
  ``bfloat16``, ``float16`` (``fp32`` / ``bf16`` / ``fp16`` accepted).
* ``device_map``: ``null`` (the whole model on the run's device), or Accelerate's ``auto`` /
  ``balanced`` / ``balanced_low_0`` / ``sequential``: layers spread over the visible GPUs, then CPU
  memory (offload) when they do not fit.
* ``quantization``: ``null``, ``8bit`` or ``4bit`` (NF4, double quantisation, compute in bfloat16
  unless ``dtype`` says float16): bitsandbytes on CUDA only. 8-bit runs without LLM.int8's outlier
  decomposition (``llm_int8_threshold=0``): its outlier columns span the batch, which would couple the
  rows of a DP batch; 4-bit keeps large models' accuracy better. The backbone is frozen, so quantised
  weights are never trained; the prompt's gradient flows through them.

:func:`check_placement` refuses, in one line, what cannot apply on this machine (4-bit without CUDA
or without bitsandbytes) before any model is loaded.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

import torch

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
QUANTIZATIONS = ("8bit", "4bit")


class PlacementError(ValueError):
    """A placement that cannot apply here; the message is one line naming the model and the setting."""


@dataclass(frozen=True)
class Placement:
    dtype: str = "auto"
    device_map: str | None = None
    quantization: str | None = None

    def __post_init__(self):
        dtype = DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if dtype not in DTYPES:
            raise PlacementError(f"placement dtype {self.dtype!r} is none of {', '.join(DTYPES)} (or fp32/bf16/fp16)")
        object.__setattr__(self, "dtype", dtype)
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise PlacementError(f"placement device_map {self.device_map!r} is none of null, {', '.join(DEVICE_MAPS)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise PlacementError(f"placement quantization {self.quantization!r} is none of null, 8bit, 4bit")

    @property
    def is_default(self) -> bool:
        return self == Placement()

    @property
    def spread(self) -> bool:
        """Whether Accelerate places the layers (no single ``.to(device)`` afterwards)."""
        return self.device_map is not None or self.quantization is not None

    def key(self) -> tuple:
        return (self.dtype, self.device_map, self.quantization)

    def as_dict(self) -> dict:
        return asdict(self)

    def torch_dtype(self):
        return DTYPES[self.dtype]


DEFAULT = Placement()


def check_placement(placement: Placement, device: torch.device | str) -> None:
    """Refuse (one line) a placement that cannot apply on ``device`` / this machine."""
    dev = torch.device(device)
    if placement.quantization:
        if dev.type != "cuda":
            raise PlacementError(f"{placement.quantization} weights (bitsandbytes) need a CUDA GPU; "
                                 f"this run's device is {dev.type} — set its placement's quantization to null")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise PlacementError(f"{placement.quantization} weights need the bitsandbytes package, "
                                 "which is not installed (pip install bitsandbytes)")
    if placement.device_map and dev.type != "cuda":
        raise PlacementError(f"device_map {placement.device_map!r} spreads a model over GPUs; this "
                             f"run's device is {dev.type} — set its placement's device_map to null")


def from_pretrained_kwargs(placement: Placement, device: torch.device) -> dict:
    """``from_pretrained`` keyword arguments for ``placement`` on ``device`` (checked before)."""
    kw: dict = {} if placement.dtype == "auto" else {"dtype": placement.torch_dtype()}
    if placement.quantization:
        from transformers import BitsAndBytesConfig

        compute = torch.float16 if placement.dtype == "float16" else torch.bfloat16
        if placement.quantization == "4bit":
            kw["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute)
        else:
            # no outlier decomposition (threshold 0): LLM.int8's outlier columns are those above the
            # threshold in ANY row of a batch, so one record would move its companions' bits — in a DP-SGD
            # batch and in every row-own score; without them each token row is its own
            kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
        if placement.dtype == "auto":
            kw["dtype"] = compute
    if placement.device_map:
        kw["device_map"] = placement.device_map
    elif placement.quantization:  # quantised weights cannot be moved afterwards: load them onto the device
        kw["device_map"] = {"": device.index if device.index is not None else 0}
    return kw
