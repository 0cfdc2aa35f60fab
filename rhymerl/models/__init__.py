"""Model folders: built-in models (converted once into a cache) and user HF folders, validated."""

from rhymerl.models.registry import (SUPPORTED_ARCHITECTURES, ModelError, check_backend_support, check_model_use,
                                     has_chat_template, model_shape, resolve_model, validate_model_folder)

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelError", "check_backend_support", "check_model_use", "has_chat_template", "model_shape", "resolve_model", "validate_model_folder"]
