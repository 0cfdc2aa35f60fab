import json
import shutil

import pytest

from rhymerl.config import ModelConfig
from rhymerl.models import ModelError, model_shape, resolve_model, validate_model_folder

pytestmark = pytest.mark.cpu


def test_tiny_model_is_deterministic_and_loads(tiny_model_dir, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("RHYMERL_CACHE", str(tmp_path))
    again = resolve_model(ModelConfig(path="builtin:tiny"))
    from safetensors.torch import load_file

    a = load_file(str(tiny_model_dir / "model.safetensors"))
    b = load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert model_shape(tiny_model_dir).num_attention_heads == 4


def test_folder_validation_errors(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    validate_model_folder(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="supported"):
        validate_model_folder(d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="safetensors"):
        validate_model_folder(d)
    with pytest.raises(ModelError, match="config.json"):
        validate_model_folder(tmp_path)
    with pytest.raises(ModelError, match="unknown built-in"):
        resolve_model(ModelConfig(path="builtin:gpt5"))


def test_qwen3_is_refused_for_megatron_before_any_data_loads(tiny_model_dir, tmp_path):
    from rhymerl.models import check_backend_support

    d = tmp_path / "qwen3"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    validate_model_folder(d)  # a supported architecture...
    with pytest.raises(ModelError, match=r"Qwen3ForCausalLM.*not supported by the Megatron backend.*parallel.backend=deepspeed"):
        check_backend_support(d, "megatron")
    check_backend_support(d, "deepspeed")  # ...that DeepSpeed trains
    check_backend_support(tiny_model_dir, "megatron")
