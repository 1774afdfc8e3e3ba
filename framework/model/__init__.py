"""Model executor: llama-family model, paged attention, logits/logprobs, sampler, loader, runner."""

from framework.model.config import ModelConfig
from framework.model.loader import load_tokenizer, resolve_model
from framework.model.logits import LogitsOutput
from framework.model.runner import ModelRunner
from framework.model.sampler import Sampler

__all__ = ["ModelConfig", "ModelRunner", "LogitsOutput", "Sampler", "resolve_model", "load_tokenizer"]
