"""Checkpoint I/O: round trips, tied and sharded layouts, and the errors a user can act on."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dice import CheckpointError, ModelConfig, SDAR, load_model, save_model

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, mask_token_id=63, block_size=4)
    return ModelConfig(**{**base, **kw})


def same_params(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_and_keeps_config_keys(tmp_path, dtype):
    model = load_model(TINY, dtype=dtype)
    save_model(model, tmp_path)
    again = load_model(tmp_path, dtype=dtype)
    assert same_params(model, again)
    original = json.loads((TINY / "config.json").read_text())
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {k: v for k, v in saved.items() if k != "torch_dtype"} == \
           {k: v for k, v in original.items() if k != "torch_dtype"}
    assert saved["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(TINY / "model.safetensors"))


def test_stacked_projections_hold_the_published_tensors_in_order():
    model, stored = load_model(TINY), load_file(TINY / "model.safetensors")
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([stored[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = torch.cat([stored[p + "mlp.gate_proj.weight"], stored[p + "mlp.up_proj.weight"]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)


def test_tied_embeddings_save_one_tensor_and_load_tied(tmp_path):
    model = SDAR(tiny_config(tie_word_embeddings=True)).init_weights(seed=0)
    save_model(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    again = load_model(tmp_path)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    ids = torch.randint(0, 63, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), atol=0, rtol=0)


def test_sharded_checkpoint_round_trip(tmp_path):
    model = load_model(TINY)
    save_model(model, tmp_path, max_shard_bytes=50_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert same_params(model, load_model(tmp_path))
    save_model(model, tmp_path)  # back to one file: the stale shards and index go
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]


def test_sharded_save_replaces_a_single_file_and_its_index_counts_every_byte(tmp_path):
    model = load_model(TINY)
    save_model(model, tmp_path)
    save_model(model, tmp_path, max_shard_bytes=50_000)
    assert not (tmp_path / "model.safetensors").exists()    # a stale single file would shadow the shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    stored = load_file(TINY / "model.safetensors")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())


def test_a_save_that_breaks_partway_leaves_the_old_weights(tmp_path, monkeypatch):
    import dice.model.checkpoint
    model = load_model(TINY)
    save_model(model, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    def half_then_crash(tensors, file, metadata=None):
        Path(file).write_bytes(before[:100])
        raise OSError("disk full")
    monkeypatch.setattr(dice.model.checkpoint, "save_file", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]   # no temp file left


def test_config_derives_head_dim_and_defaults_to_sdar_values():
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, mask_token_id=63)
    config = ModelConfig.from_dict(base)
    assert config.head_dim == 16                                 # hidden_size / attention heads, not KV heads
    # SDAR-1.7B-Chat's published config.json: rope_theta 1e6, rms_norm_eps 1e-6, block_size 4
    assert (config.rope_theta, config.rms_norm_eps, config.block_size) == (1e6, 1e-6, 4)


@pytest.fixture
def folder(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(TINY, dst)
    (dst / "golden.safetensors").unlink()
    return dst


def rewrite(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_or_bad_config(folder):
    config = json.loads((folder / "config.json").read_text())
    for key, value in (("rope_scaling", {"type": "yarn", "factor": 4.0}), ("use_sliding_window", True)):
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(CheckpointError, match=f"sets {key}"):
            load_model(folder)
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": None, "use_sliding_window": False}))
    load_model(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        load_model(folder)
    (folder / "config.json").write_text('{"vocab_size": 3}')
    with pytest.raises(CheckpointError, match=r"lacks required key"):
        load_model(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json not found"):
        load_model(folder)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        load_model(folder)


def test_corrupt_file(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a readable safetensors file"):
        load_model(folder)


def test_shape_mismatch_names_file_and_tensor(folder):
    rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.norm.weight' has shape \(65,\)"):
        load_model(folder)
    rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(64),     # a part of a stacked matrix
                                        "model.layers.0.self_attn.k_proj.weight": torch.ones(8, 64)}))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(8, 64\)"):
        load_model(folder)


def test_unknown_and_missing_tensors(folder):
    rewrite(folder, lambda t: t.update({"model.layers.9.extra.weight": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"'model.layers.9.extra.weight' that an SDAR model does not have"):
        load_model(folder)
    rewrite(folder, lambda t: (t.pop("model.layers.9.extra.weight"), t.pop("model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(folder)


def test_a_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    model = SDAR(tiny_config(tie_word_embeddings=True)).init_weights(seed=0)
    save_model(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    save_file({**stored, "lm_head.weight": torch.zeros_like(stored["model.embed_tokens.weight"])},
              tmp_path / "model.safetensors")
    again = load_model(tmp_path)
    assert again.lm_head.weight is again.model.embed_tokens.weight   # the stored copy is ignored, as in the reference


def test_an_unknown_tensor_is_reported_with_its_shard(tmp_path):
    save_model(load_model(TINY), tmp_path, max_shard_bytes=50_000)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    tensors = load_file(tmp_path / second)
    save_file({**tensors, "model.extra.weight": torch.ones(1)}, tmp_path / second)
    index["weight_map"]["model.extra.weight"] = second
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{second} holds tensor 'model.extra.weight'"):
        load_model(tmp_path)


def test_missing_shard(tmp_path):
    save_model(load_model(TINY), tmp_path, max_shard_bytes=50_000)
    next(tmp_path.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-\d+.safetensors not found"):
        load_model(tmp_path)
