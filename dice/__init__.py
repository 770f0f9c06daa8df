"""DICE: block-diffusion LLMs that write CUDA kernels (arXiv 2602.11715), a reference implementation."""
from .model.checkpoint import CheckpointError, load_model, save_model
from .model.sdar import SDAR, ModelConfig
from .model.tokenizer import Tokenizer, TokenizerError, load_tokenizer, train_tokenizer
from .sampling.sampler import Engine, GenerationResult, Sampling, generate
from .tasks.prompts import chat_prompt, extract_code, kernel_prompt

__all__ = ["SDAR", "ModelConfig", "CheckpointError", "load_model", "save_model", "generate", "Sampling", "Engine",
           "GenerationResult", "Tokenizer", "TokenizerError", "load_tokenizer", "train_tokenizer", "chat_prompt", "kernel_prompt",
           "extract_code"]
