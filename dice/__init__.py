"""DICE: block-diffusion LLMs that write CUDA kernels (arXiv 2602.11715), a reference implementation."""
from .checkpoint import CheckpointError, load_model, save_model
from .model import SDAR, ModelConfig
from .prompts import chat_prompt, extract_code, kernel_prompt
from .sampler import GenerationResult, generate
from .tokenizer import Tokenizer, TokenizerError, load_tokenizer, train_tokenizer

__all__ = ["SDAR", "ModelConfig", "CheckpointError", "load_model", "save_model", "generate", "GenerationResult",
           "Tokenizer", "TokenizerError", "load_tokenizer", "train_tokenizer", "chat_prompt", "kernel_prompt",
           "extract_code"]
