"""DICE: block-diffusion LLMs that write CUDA kernels (arXiv 2602.11715), a reference implementation."""
from .checkpoint import CheckpointError, load_model, save_model
from .model import SDAR, ModelConfig

__all__ = ["SDAR", "ModelConfig", "CheckpointError", "load_model", "save_model"]
