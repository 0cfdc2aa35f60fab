from rhymerl.data.prompts import few_shot_pool, render_prompt
from rhymerl.data.records import DatasetError, PromptRecord, load_records
from rhymerl.data.sampler import Batch, EpochSampler

__all__ = ["Batch", "DatasetError", "EpochSampler", "PromptRecord", "few_shot_pool", "load_records", "render_prompt"]
