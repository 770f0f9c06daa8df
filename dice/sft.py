"""Masked block-diffusion SFT (DESIGN.md §4), and `--phase init`'s from-scratch model folder.

The loop: rows of packed examples from a reproducible stream (`dice.data.RowStream`), each row
noised with its own generator (seed, step, row), the doubled-sequence loss (`dice.diffusion`),
AdamW with warm-up, checkpoints and metrics through `dice.runtime`.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from .config import TrainConfig
from .data import RowStream, collate, read_records, record_texts, tokenize_records
from .diffusion import count_samples, diffusion_loss
from .model import ModelConfig
from .rollout import one_shot_style
from .runtime import (MetricsLog, build_model, lr_at, make_logger, make_optimizer, progress_line, refuse_to_mix_runs,
                      resume, row_generator, save_checkpoint, save_final, setup_runtime)
from .tokenizer import load_tokenizer


def train_sft(cfg: TrainConfig) -> Path:
    """Masked block-diffusion SFT (DESIGN.md §4); returns the final model folder."""
    rt = setup_runtime()
    log = make_logger(rt)
    out = Path(cfg.out)
    refuse_to_mix_runs(out, cfg.resume)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg, rt, log)
    bs = model.config.block_size
    row_len = cfg.max_len - cfg.max_len % bs
    examples, skipped = tokenize_records(read_records(cfg.data), tok, row_len, source=cfg.data,
                                         one_shot=one_shot_style(model), infill_copies=cfg.sft_infill)
    if skipped:
        log(f"skipped {skipped} examples longer than --max-len {cfg.max_len} (prompt + response)")
    stream = RowStream(examples, row_len, bs, tok.pad_token_id, cfg.seed)
    rows_per_step = cfg.batch_size * cfg.grad_accum * rt.world
    total = cfg.steps or math.ceil(max(cfg.epochs, 1e-9) * stream.epoch_length(0) / rows_per_step)
    optimizer = make_optimizer(model, cfg)
    start = resume(out, model, optimizer, log)[0] if cfg.resume else 0
    metrics = MetricsLog(out, start, rt.main)
    mask_id = model.config.mask_token_id
    log(f"SFT: {len(examples)} examples, {stream.epoch_length(0)} rows of {row_len} tokens per epoch, "
        f"{rows_per_step} rows per step, steps {start}..{total}, device {rt.device} x{rt.world}")
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and rt.device.type == "cuda")
    started = time.perf_counter()
    for step in range(start, total):
        t0 = time.perf_counter()
        lr = lr_at(step, total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_rows = stream.rows(step * rows_per_step, rows_per_step)
        global_samples = sum(count_samples(r["loss_mask"][None], r["sample_ids"][None]) for r in step_rows)
        loss_sum, tokens = 0.0, 0
        for micro in range(cfg.grad_accum):
            first = (micro * rt.world + rt.rank) * cfg.batch_size
            rows = step_rows[first:first + cfg.batch_size]
            gens = [row_generator(cfg.seed, step, step * rows_per_step + first + i) for i in range(len(rows))]
            with rt.autocast(cfg.dtype):
                loss = diffusion_loss(model, collate(rows), gens, mask_id, use_flex=use_flex)
            # FSDP averages gradients over processes: scale so the step's gradient is the mean
            # over the global batch's samples
            (loss * rt.world / global_samples).backward()
            loss_sum += loss.item()
            tokens += sum(int((r["sample_ids"] >= 0).sum()) for r in rows)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = rt.all_sum(loss_sum) / global_samples
        tokens = int(rt.all_sum(tokens))
        dt = time.perf_counter() - t0
        record = {"step": step + 1, "loss": loss_value, "lr": lr, "tokens_per_s": tokens / dt,
                  "grad_norm": float(grad_norm), "step_time_s": dt}
        metrics.write(record)
        log(progress_line(step, total, started, start, {"loss": loss_value, "lr": lr,
                                                        "tok/s": round(tokens / dt)}))
        if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == total):
            save_checkpoint(out, step + 1, model, optimizer, cfg.model, rt, cfg.keep_checkpoints)
    return save_final(model, optimizer, out, cfg.model, rt, log)


def init_model_folder(cfg: TrainConfig) -> Path:
    """`--phase init`: train a byte-level BPE on the prompts and responses of --data and write a
    model folder with it and a config.json (no weights: SFT then starts from scratch). Prompts
    carry no one-shot example (`dice_one_shot: null`), which keeps them short for small models."""
    from .tokenizer import train_tokenizer
    out = Path(cfg.out)
    texts = ["".join(record_texts(r, f"{cfg.data}: record {i}", one_shot=None)[0])
             for i, r in enumerate(read_records(cfg.data))]
    tok = train_tokenizer(texts, cfg.vocab_size, out)
    config = ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, mask_token_id=tok.mask_token_id, block_size=cfg.block_size,
        tie_word_embeddings=True, max_position_embeddings=8192,
        extra={"dice_one_shot": None, "eos_token_id": tok.im_end_id, "pad_token_id": tok.pad_token_id})
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    print(f"wrote {out}: tokenizer of {tok.vocab_size} tokens trained on {len(texts)} records, config with "
          f"{config.num_parameters() / 1e6:.2f}M parameters (no weights)", file=sys.stderr)
    return out
