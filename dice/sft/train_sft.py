"""Masked block-diffusion SFT (DESIGN.md §4), and `--phase init`'s from-scratch model folder.

The loop: rows of packed examples from a reproducible stream (`dice.sft.data.RowStream`), each row
noised with its own generator (seed, step, row), the doubled-sequence loss (`dice.sft.diffusion`),
AdamW with warm-up (`dice.runtime`), checkpoints and metrics through `dice.run_folder`.

A step's loss, as LLaMA-Factory/HF Trainer run SDAR with gradient accumulation and DDP:
`--loss-norm batch` (default) is the mean over the step's micro-batches (all processes) of SDAR's
per-micro-batch loss (its masked-token CE/p sum over its response tokens), so `--grad-accum G` on
one process gives what G processes give with the same --batch-size, and `--batch-size 1` with
G x processes = 8 micro-batches is DICE's setting (`per_device_train_batch_size: 1` on 8 GPUs);
`--loss-norm sample` is the mean over the step's samples of each sample's own token mean.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from ..config import TrainConfig
from ..errors import DataError
from ..model.checkpoint import INDEX, SINGLE
from ..model.sdar import ModelConfig
from ..model.tokenizer import load_tokenizer, train_tokenizer
from ..run_folder import (TOKENIZER_FILES, MetricsLog, check_resume, check_run_folder, checkpoint_step, digest,
                          make_logger, progress_line, resume, run_settings, save_checkpoint, save_final, start_run)
from ..runtime import build_model, lr_at, make_optimizer, row_generator, setup_runtime
from ..sampling.completion import one_shot_style
from ..tasks.prompts import thinks
from .data import RowStream, collate, read_records, record_texts, tokenize_records, with_pad_targets
from .diffusion import count_samples, diffusion_loss

# what a resumed SFT run must keep (besides data, model, row length and micro-batches per step)
RESUME_FIELDS = ("phase", "seed", "batch_size", "loss_norm", "lr", "schedule", "warmup", "warmup_ratio",
                 "min_lr_ratio", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip", "sft_infill",
                 "sft_pad_targets")


# DICE's SFT (training/sft/llama_factory_sdar/examples/train_full_sdar/sdar_8b_full.yaml): rows of
# `cutoff_len: 6144` packed tokens, `per_device_train_batch_size: 1`, no accumulation, on 8 GPUs
DICE_SFT_ROW, DICE_SFT_ROWS_PER_STEP = 6144, 8


def sft_sizes(cfg: TrainConfig, device: torch.device, world: int = 1) -> tuple[TrainConfig, str | None]:
    """`cfg` with --max-len and --grad-accum resolved (auto, 0): on CUDA DICE's rows of 6144 tokens
    (one per micro-batch: --batch-size 1), 8 / processes micro-batches (8 rows a step on 1, 2, 4 or 8
    GPUs), so no example DICE trains is skipped; on a CPU rows of 1024, one micro-batch, and the line
    that says so. A CPU builds dense masks and attention over the doubled row, memory ~ batch x
    (2 x length)^2: for dice-tiny 1 x 1024 takes about 1.5 GB, 8 x 2048 17 GB."""
    cuda = device.type == "cuda"
    length = cfg.max_len or (DICE_SFT_ROW if cuda else 1024)
    accum = cfg.grad_accum or (max(1, DICE_SFT_ROWS_PER_STEP // world) if cuda else 1)
    note = None if cuda or cfg.max_len else (f"no CUDA GPU: --max-len {length}, which fits in a few GB of memory "
                                             "on a CPU (pass the flag to change it)")
    return dataclasses.replace(cfg, max_len=length, grad_accum=accum), note


def load_examples(cfg: TrainConfig, tok, row_len: int, one_shot: str | None, log, block_size: int = 1) -> list:
    """The tokenised examples of --data, in DICE's think-block format when the model's chat template
    has one (`dice.tasks.prompts.thinks`), with DICE's trained pads under --sft-pad-targets
    (`dice.sft.data.with_pad_targets`); a file without records, or whose records are all too long, is
    an error that says so."""
    records = read_records(cfg.data)
    if not records:
        raise DataError(f"{cfg.data} holds no records; give --data a JSON list (or JSONL lines) of SFT records")
    think = thinks(tok)
    if think:
        log("answers are trained in DICE's format (an empty <think> block first), as the model's chat template has it")
    examples, skipped = tokenize_records(records, tok, row_len, source=cfg.data, one_shot=one_shot,
                                         infill_copies=cfg.sft_infill, think=think)
    if not examples:
        raise DataError(f"all {skipped} examples of {cfg.data} are longer than --max-len {row_len} tokens "
                        "(prompt + response); pass a larger --max-len")
    if skipped:
        log(f"skipped {skipped} examples longer than --max-len {row_len} (prompt + response)")
    return with_pad_targets(examples, block_size, tok.pad_token_id) if cfg.sft_pad_targets else examples


def train_sft(cfg: TrainConfig) -> Path:
    """Masked block-diffusion SFT (DESIGN.md §4); returns the final model folder."""
    rt = setup_runtime(offload=cfg.offload == "cpu")
    log = make_logger(rt)
    out = Path(cfg.out)
    check_run_folder(out, cfg.resume, cfg.overwrite)
    cfg, size_note = sft_sizes(cfg, rt.device, rt.world)
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg, rt, log)
    bs = model.config.block_size
    row_len = cfg.max_len - cfg.max_len % bs
    examples = load_examples(cfg, tok, row_len, one_shot_style(model), log, bs)
    stream = RowStream(examples, row_len, bs, tok.pad_token_id, cfg.seed)
    rows_per_step = cfg.batch_size * cfg.grad_accum * rt.world
    total = cfg.steps or math.ceil(max(cfg.epochs, 1e-9) * stream.epoch_length(0) / rows_per_step)
    settings = run_settings(cfg, RESUME_FIELDS, **{"the data's sha256": digest(cfg.data),
                                                   "the model": str(Path(cfg.model).resolve()),
                                                   "the row length": row_len,
                                                   "micro-batches per step (--grad-accum x processes)":
                                                       cfg.grad_accum * rt.world})
    start = checkpoint_step(out) if cfg.resume else 0
    if cfg.resume:
        check_resume(out, settings, start, total, hashed={"the data's sha256": f"--data {cfg.data}"})
    optimizer = make_optimizer(model, cfg)
    start_run(out, cfg.overwrite, settings, rt)
    if cfg.resume:
        resume(out, model, optimizer, log)
    metrics = MetricsLog(out, start, rt.main)
    mask_id = model.config.mask_token_id
    if size_note:
        log(size_note)
    log(f"SFT: {len(examples)} examples, {stream.epoch_length(0)} rows of {row_len} tokens per epoch, "
        f"{rows_per_step} rows per step, steps {start + 1}..{total}, device {rt.device} x{rt.world}")
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and rt.device.type == "cuda")
    started = time.perf_counter()
    for step in range(start, total):
        t0 = time.perf_counter()
        lr = lr_at(step, total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_rows = stream.rows(step * rows_per_step, rows_per_step)
        # each micro-batch's share of the step's loss (module docstring)
        share = (1 / (cfg.grad_accum * rt.world) if cfg.loss_norm == "batch" else
                 1 / sum(count_samples(r["loss_mask"][None], r["sample_ids"][None]) for r in step_rows))
        loss_value, tokens = 0.0, 0
        for micro in range(cfg.grad_accum):
            first = (micro * rt.world + rt.rank) * cfg.batch_size
            rows = step_rows[first:first + cfg.batch_size]
            gens = [row_generator(cfg.seed, step, step * rows_per_step + first + i) for i in range(len(rows))]
            with rt.autocast(cfg.dtype):
                loss = diffusion_loss(model, collate(rows), gens, mask_id, norm=cfg.loss_norm, use_flex=use_flex)
            (loss * share * rt.world).backward()   # FSDP averages gradients over processes
            loss_value += loss.item() * share
            tokens += sum(int((r["sample_ids"] >= 0).sum()) for r in rows)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = rt.all_sum(loss_value)
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


# what --phase init writes into --out, or with --overwrite removes first (weights of another config)
INIT_ENTRIES = ("config.json", *TOKENIZER_FILES, SINGLE, INDEX)


def init_model_folder(cfg: TrainConfig) -> Path:
    """`--phase init`: train a byte-level BPE on the prompts and responses of --data and write a
    model folder with it and a config.json (no weights: SFT then starts from scratch). Prompts
    carry no one-shot example (`dice_one_shot: null`), which keeps them short for small models.
    With --overwrite the INIT_ENTRIES of an earlier model folder are removed first."""
    out = Path(cfg.out)
    texts = ["".join(record_texts(r, f"{cfg.data}: record {i}", one_shot=None)[0])
             for i, r in enumerate(read_records(cfg.data))]
    for name in INIT_ENTRIES if cfg.overwrite else ():
        (out / name).unlink(missing_ok=True)
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
