"""Model folders in the published SDAR / DICE layout (DESIGN.md §2).

A model folder holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`), plus tokenizer
files. Loading builds the model on the meta device and fills it one tensor at a time straight
into the requested dtype/device, so peak host memory is about one tensor, not a second full copy
(an 8B bf16 model loads on a 24 GB machine). Saving writes the same layout, each file atomically.

The model keeps q/k/v and gate/up each as one stacked matrix (`dice.model.sdar`); the published
layout has them apart. `to_published` / `from_published` convert state dicts between the two;
loading and saving go through them, so files on disk always carry the published names.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import UserError, json_kind, json_problem
from .sdar import SDAR, ModelConfig

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(UserError):
    """A model folder that cannot be loaded; the message names the file and the fix."""


# the model's stacked projections and the published tensors they stack along dim 0, in order
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def published_parts(name: str, config: ModelConfig) -> list[tuple[str, int | None]]:
    """[(published tensor name, rows)] that model tensor `name` stacks; [(name, None)] if it is
    not a stacked projection."""
    for fused, parts in FUSED.items():
        if name.endswith(fused):
            prefix = name[:-len(fused)]
            q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
            rows = (q, kv, kv) if fused.startswith("self_attn") else (config.intermediate_size,) * 2
            return [(prefix + part, r) for part, r in zip(parts, rows)]
    return [(name, None)]


def to_published(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A model state dict with the stacked projections split into their published tensors."""
    out = {}
    for name, tensor in tensors.items():
        parts = published_parts(name, config)
        pieces = tensor.split([r for _, r in parts]) if len(parts) > 1 else [tensor]
        out.update({part: piece for (part, _), piece in zip(parts, pieces)})
    return out


def from_published(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published tensors -> a model state dict (the inverse of `to_published`)."""
    out = dict(tensors)
    for name in list(tensors):
        for fused, parts in FUSED.items():
            if name.endswith(parts[0]):
                prefix = name[:-len(parts[0])]
                out[prefix + fused] = torch.cat([out.pop(prefix + part) for part in parts])
    return out


def read_config(path: str | os.PathLike) -> ModelConfig:
    file = Path(path) / CONFIG
    if not file.is_file():
        raise CheckpointError(f"{file} not found: point --model at a folder with an SDAR/DICE config.json")
    try:
        keys = json.loads(file.read_text())
        if not isinstance(keys, dict):
            raise CheckpointError(f"{file} holds {json_kind(keys)}, where a JSON object of config keys was expected; "
                                  "re-download or fix it")
        config = ModelConfig.from_dict(keys)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({json_problem(e)}); re-download or fix it") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{file} is not UTF-8 text; re-download or fix it") from None
    except KeyError as e:
        raise CheckpointError(f"{file} lacks required key(s) {e}; is this an SDAR/DICE config?") from None
    problem = config_problem(config)
    if problem:
        raise CheckpointError(f"{file}: {problem}; fix that key (a published SDAR/DICE config.json has it right)")
    # SDAR configs carry these as null/false; this model implements neither, so it would give wrong logits
    unsupported = [k for k in ("rope_scaling", "use_sliding_window") if config.extra.get(k)]
    if unsupported:
        raise CheckpointError(f"{file} sets {', '.join(unsupported)}, which this implementation does not support "
                              "(SDAR and DICE checkpoints leave them null/false)")
    return config


POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "block_size", "max_position_embeddings")


def config_problem(config: ModelConfig) -> str | None:
    """What makes a config unusable (a wrong type, a size below 1, heads that do not divide, an odd
    head width for RoPE, a mask id outside the vocabulary), in words; None when it is usable."""
    for name in POSITIVE_INTS:
        value = getattr(config, name)
        if type(value) is not int or value < 1:
            return f"{name} must be a whole number >= 1, not {value!r}"
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(config, name)
        if type(value) not in (int, float) or not value > 0:
            return f"{name} must be a number > 0, not {value!r}"
    if type(config.tie_word_embeddings) is not bool:
        return f"tie_word_embeddings must be true or false, not {config.tie_word_embeddings!r}"
    if type(config.mask_token_id) is not int or not 0 <= config.mask_token_id < config.vocab_size:
        return f"mask_token_id must be a token id below vocab_size {config.vocab_size}, not {config.mask_token_id!r}"
    if config.num_attention_heads % config.num_key_value_heads:
        return (f"num_key_value_heads {config.num_key_value_heads} does not divide num_attention_heads "
                f"{config.num_attention_heads}")
    if config.head_dim % 2:
        return f"head_dim must be even (rotate-half RoPE), not {config.head_dim}"
    return None


def weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it; {} when the folder has no weights."""
    path = Path(path)
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path / INDEX} is not valid JSON ({json_problem(e)}); re-download it") from None
        except (KeyError, TypeError):
            raise CheckpointError(f"{path / INDEX} is not a safetensors index (no 'weight_map'); re-download it") from None
        return {name: path / shard for name, shard in weight_map.items()}
    if (path / SINGLE).is_file():
        return {name: path / SINGLE for name in _open(path / SINGLE, "cpu").keys()}
    return {}


def has_weights(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX).is_file() or (Path(path) / SINGLE).is_file()


def _open(file: Path, device: str):
    if not file.is_file():
        raise CheckpointError(f"{file} not found (listed in the checkpoint); re-download the model folder")
    try:
        return safe_open(str(file), framework="pt", device=device)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}); re-download it") from None


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> SDAR:
    """Load an SDAR/DICE model folder. With `tie_word_embeddings`, `lm_head.weight` is the
    embedding (a stored `lm_head.weight` is then ignored, as in the reference)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist: pass a folder with config.json and "
                              "model.safetensors (a downloaded SDAR/DICE checkpoint)")
    config = read_config(path)
    files = weight_files(path)
    if not files:
        raise CheckpointError(f"{path} has no {SINGLE} or {INDEX}: download the weights into it")
    with torch.device("meta"):
        model = SDAR(config)
    expected = dict(model.named_parameters())  # tied weights appear once, as the embedding
    parts_of = {name: published_parts(name, config) for name in expected}
    published = {part: (name, rows) for name, parts in parts_of.items() for part, rows in parts}
    unknown = sorted(set(files) - set(published) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if unknown:
        raise CheckpointError(f"{files[unknown[0]]} holds tensor {unknown[0]!r} that an SDAR model does not "
                              f"have ({len(unknown)} unknown in all); is this a different architecture?")
    missing = sorted(set(published) - set(files))
    if missing:
        raise CheckpointError(f"{path} lacks tensor {missing[0]!r} ({len(missing)} missing in all); "
                              "the checkpoint is incomplete: re-download it")
    load_device = str(device) if str(device).startswith("cuda") else "cpu"
    handles = {}

    def read(part: str) -> torch.Tensor:
        file = files[part]
        if file not in handles:
            handles[file] = _open(file, load_device)
        try:
            tensor = handles[file].get_tensor(part)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: tensor {part!r} cannot be read ({e}); re-download the file") from None
        name, rows = published[part]
        want = (rows or expected[name].shape[0], *expected[name].shape[1:])
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{file}: tensor {part!r} has shape {tuple(tensor.shape)} but config.json "
                                  f"implies {want}; config and weights do not belong together")
        return tensor.to(device=device, dtype=dtype)

    for name in expected:
        parts = [read(part) for part, _ in parts_of[name]]
        _set_parameter(model, name, parts[0] if len(parts) == 1 else torch.cat(parts))
    return model.tie_weights().eval()


def _set_parameter(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(tensor))


def _atomic_write(file: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_model(model: SDAR, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
               dtype: torch.dtype | None = None, state_dict: dict | None = None) -> None:
    """Write config.json and safetensors weights (sharded with an index above `max_shard_bytes`).

    `state_dict` lets distributed training pass full tensors it gathered; `dtype` casts on save.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = to_published(state_dict if state_dict is not None else model.state_dict(), model.config)
    tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in tensors.items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    config = model.config.to_dict()
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    _atomic_write(path / CONFIG, lambda f: Path(f).write_text(json.dumps(config, indent=2) + "\n"))

    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    meta = {"format": "pt"}
    stale = [path / INDEX, path / SINGLE, *path.glob("model-*-of-*.safetensors")]
    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _atomic_write(path / name, lambda f, s=shard: save_file(s, f, metadata=meta))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {t: n for n, s in zip(names, shards) for t in s}}
        _atomic_write(path / INDEX, lambda f: Path(f).write_text(json.dumps(index, indent=2) + "\n"))
    for old in stale:
        if old.name not in names and old.name != (INDEX if len(shards) > 1 else None) and old.exists():
            old.unlink()
