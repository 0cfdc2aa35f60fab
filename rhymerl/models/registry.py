"""Resolve ``model.path`` to a validated HF folder, building built-in models once."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from rhymerl.outputs.atomic import atomic_folder
from rhymerl.config import ModelConfig, ModelShape
from rhymerl.models.errors import ModelError
from rhymerl.models.tiny import TinyShape, write_tiny_model

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "MistralForCausalLM": "llama"}
BUILTIN_SMOLLM2 = "builtin:smollm2-135m-instruct"
BUILTIN_TINY = "builtin:tiny"


def cache_root(model_cfg: ModelConfig) -> Path:
    """Where converted built-in models are kept: $RHYMERL_CACHE, else ~/.cache/rhymerl."""
    env = os.environ.get("RHYMERL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rhymerl"


def validate_model_folder(folder: Path) -> dict:
    """Check an HF folder has what every loader needs; return its config.json."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"model.path: {folder} is not a folder")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"model.path: {folder} has no config.json")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"model.path: {cfg_file} is not valid JSON: {e}") from None
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelError(
            f"model.path: {folder} has architecture {archs or 'unknown'}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    weights = list(folder.glob("*.safetensors"))
    if not weights:
        raise ModelError(f"model.path: {folder} has no *.safetensors weights (convert .bin checkpoints to safetensors)")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(n for n in names if not (folder / n).is_file())
        if missing:
            raise ModelError(f"model.path: {folder} is missing weight shards {missing}")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise ModelError(f"model.path: {folder} has no tokenizer (tokenizer.json or tokenizer.model)")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if key not in config:
            raise ModelError(f"model.path: {cfg_file} lacks {key!r}")
    return config


def model_shape(folder: Path) -> ModelShape:
    c = validate_model_folder(folder)
    return ModelShape(num_attention_heads=c["num_attention_heads"],
                      num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                      num_hidden_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"],
                      hidden_size=c["hidden_size"], intermediate_size=c.get("intermediate_size", 4 * c["hidden_size"]),
                      max_position_embeddings=c.get("max_position_embeddings"))


# SmolLM2-135M-Instruct's config.json (the shape the GGUF converts to).
SMOLLM2_SHAPE = ModelShape(num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152,
                           hidden_size=576, intermediate_size=1536, max_position_embeddings=8192)


def builtin_shape(model_cfg: ModelConfig) -> ModelShape:
    """A built-in model's shape, known without building it (preflight runs on login nodes)."""
    if model_cfg.path == BUILTIN_SMOLLM2:
        return SMOLLM2_SHAPE
    if model_cfg.path == BUILTIN_TINY:
        t = TinyShape()
        return ModelShape(num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                          num_hidden_layers=t.num_hidden_layers, vocab_size=384, hidden_size=t.hidden_size,
                          intermediate_size=t.intermediate_size, max_position_embeddings=t.max_position_embeddings)
    raise ModelError(f"model.path: unknown built-in {model_cfg.path!r}; allowed: {BUILTIN_SMOLLM2!r}, "
                     f"{BUILTIN_TINY!r}, or an HF folder")


def check_backend_support(folder: Path, backend: str) -> None:
    """Refuse, before any data loads, a model the backend cannot build (Megatron: Llama/Qwen2 shapes only)."""
    if backend != "megatron":
        return
    from rhymerl.resharding.layout import LayoutError, ModelLayout

    cfg_file = Path(folder) / "config.json"
    try:
        ModelLayout.from_hf_config(validate_model_folder(folder), where=str(cfg_file))
    except LayoutError as e:
        raise ModelError(f"model.path: {e}; parallel.backend=deepspeed trains it") from None


def has_chat_template(folder: Path) -> bool:
    """Whether the folder's tokenizer carries a chat template (in any of transformers' places)."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    tok_cfg = folder / "tokenizer_config.json"
    try:
        return bool(json.loads(tok_cfg.read_text()).get("chat_template")) if tok_cfg.is_file() else False
    except json.JSONDecodeError as e:
        raise ModelError(f"model.path: {tok_cfg} is not valid JSON: {e}") from None


def check_model_use(folder: Path, backend: str, chat_template: bool) -> None:
    """Start-up checks of the model against the run's settings, before any data loads."""
    check_backend_support(folder, backend)
    if chat_template and not has_chat_template(folder):
        raise ModelError(f"model.path: {folder} has no chat template (chat_template.jinja or tokenizer_config.json's "
                         f"'chat_template') but data.chat_template is true; add one, or set "
                         f"data.chat_template=false for plain 'user:/assistant:' prompts")


def _tiny_key(tiny: TinyShape, dtype: str) -> str:
    blob = json.dumps({**asdict(tiny), "dtype": dtype, "v": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def resolve_model(model_cfg: ModelConfig, tiny: TinyShape = TinyShape()) -> Path:
    """The model folder ``model.path`` names (a built-in one made on first use; ``tiny``: its shape)."""
    path = model_cfg.path
    if path == BUILTIN_TINY:
        folder = cache_root(model_cfg) / f"tiny-{tiny.architecture}-{_tiny_key(tiny, model_cfg.dtype)}"
        if not (folder / "config.json").is_file():
            with atomic_folder(folder) as tmp:
                write_tiny_model(tmp, tiny, model_cfg.dtype)
    elif path == BUILTIN_SMOLLM2:
        from rhymerl.models.smollm2 import convert_smollm2

        folder = cache_root(model_cfg) / f"smollm2-135m-instruct-{model_cfg.dtype}"
        if not (folder / "config.json").is_file():
            with atomic_folder(folder) as tmp:
                convert_smollm2(tmp, model_cfg.dtype)
    elif path.startswith("builtin:"):
        raise ModelError(f"model.path: unknown built-in {path!r}; allowed: {BUILTIN_SMOLLM2!r}, {BUILTIN_TINY!r}, or an HF folder")
    else:
        folder = Path(path).expanduser()
    validate_model_folder(folder)
    return folder
