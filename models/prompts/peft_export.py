"""Soft prompts and prefixes as PEFT adapters (peft 0.21 format), loadable with
``PeftModel.from_pretrained(base, folder)`` outside PrivPrompt.

* a soft prompt ``(n, d)`` is a prompt-tuning adapter: one tensor ``prompt_embeddings`` (n, d),
  prepended to the input embeddings by PEFT exactly as PrivPrompt's classifiers prepend it;
* a prefix ``(L, 2, n, d_kv)`` is a prefix-tuning adapter without projection: one tensor
  ``prompt_embeddings`` (n, L · 2 · d_kv), per layer the keys then the values, heads side by side.
  PEFT hands these to the model as its key/value cache, used as they are. PrivPrompt's own forward
  places the prefix at positions 0..n−1 and the text at n.. (``models.prompts.prefix``), as PEFT
  does; a rotary model (Llama) rotates the keys it computes at positions 0..n−1, so the exported
  keys are those the model itself caches for the prefix (read from a forward pass with the prefix
  in place), not the raw stored ones. The test compares PEFT's forward with PrivPrompt's;
* a LoRA (``models.prompts.lora``) is a LoRA adapter: ``lora_A`` / ``lora_B`` of every targeted
  module, dropout 0, no bias, PEFT's ``LoraConfig`` with the layout's rank, α and targets.

What PEFT cannot express is not exported here: a text prompt is a template (:func:`save_text_template`).

No training data is written: the folder holds the prompt tensor and a config naming the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TEMPLATE_FILE = "template.json"
PEFT_KEY = "prompt_embeddings"  # the one tensor PEFT's prompt-learning adapters save


class PeftExportError(ValueError):
    """The prompt cannot be written as a PEFT adapter (one line: why)."""


def task_type(kind: str) -> str:
    """PEFT task type of a PrivPrompt backbone kind: a causal LM is ``CAUSAL_LM``; an encoder or
    masked LM (whose output PrivPrompt reads at hidden states or at the mask) ``FEATURE_EXTRACTION``
    (PEFT's wrapper that passes the base model's outputs through unchanged)."""
    return "CAUSAL_LM" if kind == "causal" else "FEATURE_EXTRACTION"


def _model_dims(model: torch.nn.Module) -> tuple[int, int]:
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not layers or not heads:
        raise PeftExportError(f"{type(model).__name__}: the config names no layer / head count")
    return int(layers), int(heads)


def prefix_cache_tensor(model: torch.nn.Module, prefix: torch.Tensor) -> torch.Tensor:
    """(L, 2, n, d_kv) keys and values as the model caches them for ``prefix`` at positions 0..n−1:
    for rotary models the rotated keys, for absolute-position models the prefix itself."""
    from models.prompts.prefix import kv_sites, prefix_hooks, prefix_position_ids

    prefix = prefix.detach().float()
    if prefix.dim() != 4 or prefix.shape[1] != 2:
        raise PeftExportError(f"a prefix is (layers, 2, n, d_kv), got {tuple(prefix.shape)}")
    L, _, n, d = prefix.shape
    sites = kv_sites(model)
    if len(sites) != L or sites[0].width != d:
        raise PeftExportError(f"a prefix of shape {tuple(prefix.shape)} does not fit {type(model).__name__} "
                              f"({len(sites)} layers, key/value width {sites[0].width})")
    cfg = model.config
    rotary = any(getattr(cfg, a, None) is not None for a in ("rope_theta", "rope_parameters", "rotary_dim"))
    if not rotary:
        return prefix.clone()
    device = next(model.parameters()).device
    embed = model.get_input_embeddings()
    zeros = torch.zeros((1, n, embed.weight.shape[1]), device=device, dtype=embed.weight.dtype)
    with torch.no_grad(), prefix_hooks(model, prefix.to(device), 1):
        out = model.base_model(inputs_embeds=zeros, attention_mask=torch.ones((1, n), dtype=torch.long, device=device),
                               position_ids=prefix_position_ids(model, 1, n, n, device), use_cache=True)
    cache = getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != L:
        raise PeftExportError(f"{type(model).__name__} is a rotary model that returned no key/value cache: "
                              "its prefix cannot be exported as PEFT prefix tuning")
    kv = []
    for layer in layers:  # keys/values (1, kv_heads, n, head_dim) → (n, d_kv)
        kv.append(torch.stack([t[0].transpose(0, 1).reshape(n, d).float().cpu() for t in (layer.keys, layer.values)]))
    return torch.stack(kv)


def peft_prompt_embeddings(prompt: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The ``prompt_embeddings`` tensor PEFT loads for ``prompt`` (soft (n, d) or prefix (L, 2, n, d_kv))."""
    from models.prompts.prefix import is_prefix

    prompt = torch.as_tensor(prompt).detach().float().cpu()
    if is_prefix(prompt) and prompt.dim() == 4:
        cached = prefix_cache_tensor(model, prompt)
        L, _, n, d = cached.shape
        return cached.permute(2, 0, 1, 3).reshape(n, L * 2 * d).contiguous()
    if prompt.dim() == 2:
        width = model.get_input_embeddings().weight.shape[1]
        if prompt.shape[1] != width:
            raise PeftExportError(f"a soft prompt of width {prompt.shape[1]} does not fit {type(model).__name__} "
                                  f"(embedding width {width})")
        return prompt.contiguous()
    raise PeftExportError(f"a prompt of shape {tuple(prompt.shape)} is neither a soft prompt nor a prefix")


def _as_json(cfg) -> dict:
    data = cfg.to_dict()
    for key, value in list(data.items()):  # enums and sets as JSON
        if isinstance(value, set):
            data[key] = sorted(value)
        elif hasattr(value, "value"):
            data[key] = value.value
    return data


def lora_adapter_config(lora, model: torch.nn.Module, kind: str, base_model: str, revision: str | None = None) -> dict:
    """adapter_config.json of PEFT's ``LoraConfig`` for ``lora``'s layout (``fan_in_fan_out`` for
    GPT-2's ``Conv1D``, whose weight is stored (in, out))."""
    from peft import LoraConfig

    layout = lora.layout
    named = dict(model.named_modules())
    conv1d = any(type(named[name]).__name__ == "Conv1D" for name in layout.modules)
    return _as_json(LoraConfig(r=layout.r, lora_alpha=layout.alpha, target_modules=list(layout.targets),
                               lora_dropout=0.0, bias="none", task_type=task_type(kind), inference_mode=True,
                               fan_in_fan_out=conv1d,
                               base_model_name_or_path=base_model, revision=revision))


def adapter_config(prompt: torch.Tensor, model: torch.nn.Module, kind: str, base_model: str,
                   revision: str | None = None) -> dict:
    """adapter_config.json of PEFT's own config class (``to_dict``), for a soft prompt or a prefix."""
    from peft import PrefixTuningConfig, PromptTuningConfig

    from models.prompts.prefix import is_prefix

    layers, heads = _model_dims(model)
    common = dict(task_type=task_type(kind), base_model_name_or_path=base_model, revision=revision,
                  inference_mode=True, num_layers=layers, num_transformer_submodules=1)
    if is_prefix(prompt):
        L, _, n, d = prompt.shape
        head_dim = getattr(model.config, "head_dim", None) or model.get_input_embeddings().weight.shape[1] // heads
        cfg = PrefixTuningConfig(num_virtual_tokens=int(n), token_dim=int(d), num_attention_heads=int(d // head_dim),
                                 prefix_projection=False, **common)
    else:
        cfg = PromptTuningConfig(num_virtual_tokens=int(prompt.shape[0]), token_dim=int(prompt.shape[1]),
                                 num_attention_heads=heads, prompt_tuning_init="RANDOM", **common)
    return _as_json(cfg)


def save_peft_adapter(directory: str | Path, prompt: torch.Tensor, model: torch.nn.Module, kind: str,
                      base_model: str, revision: str | None = None) -> Path:
    """Write ``prompt`` as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
    for backbone ``model`` (a PrivPrompt backbone ``kind``: causal / masked / encoder), whose HF id or
    local path is ``base_model``."""
    from models.prompts.lora import check_fits, is_lora

    directory = Path(directory)
    if is_lora(prompt):
        try:
            check_fits(model, prompt)
        except ValueError as exc:
            raise PeftExportError(str(exc)) from None
        weights, config = prompt.state_dict(), lora_adapter_config(prompt, model, kind, base_model, revision)
    else:
        weights = {PEFT_KEY: peft_prompt_embeddings(prompt, model)}
        config = adapter_config(torch.as_tensor(prompt), model, kind, base_model, revision)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return directory


def save_text_template(directory: str | Path, template: str, labels: list[str], label_words: list[str]) -> Path:
    """A text prompt is no PEFT adapter: it is the template the instruction sits in (``{text}`` is
    the input), with the labels and the words scored for them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TEMPLATE_FILE
    path.write_text(json.dumps({"template": template, "labels": list(labels), "label_words": list(label_words)},
                               indent=2))
    return path
