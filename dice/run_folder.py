"""A run's folder: checkpoints written atomically and resumed exactly, the settings a resume must
match (run.json), the metrics log and the progress line (DESIGN.md §4, §7; the processes and devices
a run trains on: `dice.runtime`).

Run directory layout (`--out DIR`):
    DIR/metrics.jsonl                 one JSON object per optimiser step
    DIR/checkpoints/step_000100/      a model folder (config.json, safetensors, tokenizer files)
                                      plus trainer_state.pt (optimiser, step); written to a
                                      temporary folder first and renamed, so a kill never leaves
                                      a half-written checkpoint
    DIR/checkpoints/latest            the name of the newest complete checkpoint
    DIR/final/                        the model folder after the last step
    DIR/run.json                      the settings a --resume must match (data hash, batch, seed, ...)
    DIR/plot.png                      an RL run's curves, drawn at its end (`dice.plot.plot_run`)
A run never overwrites another: an --out holding any of these is refused, untouched, unless
--resume (continue it; every setting in run.json must match, --steps may grow, and every file it
reads is checked first) or --overwrite (delete them, just before the first step) says what to do
with it; the rule of every command's outputs (`dice.inputs`).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import time
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .config import TrainConfig
from .errors import UsageError, UserError, json_problem
from .inputs import output_folder, replaceable
from .model.checkpoint import CheckpointError, from_published, save_model
from .runtime import Runtime

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def full_state_dicts(model, optimizer):
    """Full (unsharded, CPU) model and optimiser state dicts, keyed by parameter names, so that
    checkpoints load on any number of processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict   # lazy: ~2 s of start-up
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(out: Path, step: int, model, optimizer, tokenizer_dir: str, rt: Runtime,
                    keep: int, extra: dict | None = None, moments: bool = True) -> None:
    """checkpoints/step_N written as a temporary folder, then renamed; then `latest` updated and
    all but the `keep` newest checkpoints (by step number, never step_N itself) deleted. An
    existing step_N (left by a run killed before `latest` named it) is moved aside, not deleted,
    until the new one is in place. Without `moments` the optimiser's per-parameter state is left
    out (RL's `--optimizer-state step` forgets it before every update, as DICE saves only the model):
    the checkpoint is then a third of the size."""
    model_state, optim_state = full_state_dicts(model, optimizer)
    if not moments:
        optim_state = {**optim_state, "state": {}}
    if rt.main:
        ckpts = out / "checkpoints"
        final, tmp, aside = (ckpts / name for name in (f"step_{step:06d}", f".step_{step:06d}.tmp",
                                                       f".step_{step:06d}.old"))
        shutil.rmtree(tmp, ignore_errors=True)
        write_model_folder(model, tmp, tokenizer_dir, state_dict=model_state)
        torch.save({"step": step, "optimizer": optim_state, **(extra or {})}, tmp / "trainer_state.pt")
        shutil.rmtree(aside, ignore_errors=True)
        if final.exists():
            os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
        (ckpts / ".latest.tmp").write_text(final.name)
        os.replace(ckpts / ".latest.tmp", ckpts / "latest")
        if keep > 0:
            older = [path for _, path in checkpoint_folders(ckpts) if path != final]
            for path in older[:max(len(older) - (keep - 1), 0)]:
                shutil.rmtree(path, ignore_errors=True)
    rt.barrier()


def checkpoint_folders(ckpts: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoints/step_N folder, in ascending step order."""
    found = [(int(match.group(1)), path) for path in ckpts.glob("step_*")
             if (match := re.fullmatch(r"step_(\d+)", path.name))]
    return sorted(found)


class RunFolderError(UserError):
    """An --out whose earlier run this one would not continue exactly, or whose files a resume cannot read."""


RUN_ENTRIES = ("final", "metrics.jsonl", "checkpoints", "run.json", "plot.png")


def check_run_folder(out: Path, resuming: bool, overwriting: bool, *, also: tuple[str, ...] = (),
                     inputs: dict | None = None, flag: str = "--out") -> None:
    """Refuse, touching nothing, an --out holding an earlier run unless --resume or --overwrite says
    what to do with it (a UsageError, as for every output: `dice.inputs`), an --out that is a file,
    unwritable or inside an input, and `also` (other entries the run writes, e.g. tasks.json) where
    they exist already. With --resume: refuse a folder that holds no run, or a run without
    checkpoints, and any of its files that a resume reads but cannot (`check_resumable`). `flag` names
    the folder in a refusal: "--out", or a phrase for a default the user never gave (`dice.inputs`)."""
    if resuming:
        if not out.is_dir():
            raise UsageError(f"--resume: {out} does not exist, so there is no run to continue; check --out, or drop "
                             "--resume to start a new run")
        if not any((out / name).exists() for name in RUN_ENTRIES):
            raise UsageError(f"--resume: {out} holds no run (no {', '.join(RUN_ENTRIES)}); check --out, or drop "
                             "--resume to start a new run there")
    output_folder(out, flag, () if resuming else also, overwrite=overwriting, inputs=inputs or {})
    if resuming:
        if latest_checkpoint(out) is None:
            raise RunFolderError(f"{out} holds a run without checkpoints (it ran with --save-every 0), so --resume "
                                 "has nothing to continue from; pass --overwrite to replace it or choose another --out")
        check_resumable(out)
        return
    found = [name for name in RUN_ENTRIES if (out / name).exists()]
    replaceable(out, found if overwriting else (), flag, inputs or {})
    if found and not overwriting:
        raise UsageError(f"{out} holds an earlier run ({', '.join(found)}); pass --resume to continue it, "
                         "--overwrite to replace it, or choose another --out")


def _problem(error: ValueError, line: int | None = None) -> str:
    """What is wrong with a JSON text: where it stops parsing (`json_problem`), or the check it failed."""
    return json_problem(error, line) if isinstance(error, json.JSONDecodeError) else str(error)


def check_resumable(out: Path) -> None:
    """Every file a --resume reads, read before anything is written: run.json, each line of
    metrics.jsonl, and the checkpoint `latest` names (its trainer_state.pt and safetensors files
    complete); one that is cut or corrupt is an error naming it (and the line) and the fix."""
    settings = out / "run.json"
    if settings.is_file():
        try:
            if not isinstance(json.loads(settings.read_text()), dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise RunFolderError(f"{settings} is not a JSON object of the run's settings ({_problem(e)}); restore "
                                 "it, or start a new run with --overwrite or another --out") from None
    metrics = out / "metrics.jsonl"
    for number, line in enumerate(metrics.read_bytes().splitlines() if metrics.is_file() else [], 1):
        try:
            record = json.loads(line) if line.strip() else {"step": 0}
            if not isinstance(record, dict) or type(record.get("step")) is not int:
                raise ValueError("no whole-number step")
        except ValueError as e:   # UnicodeDecodeError too
            raise RunFolderError(f"{metrics} line {number} is not a metrics record ({_problem(e, number)}); a run "
                                 "killed while writing cuts its last line: delete that line and resume again") from None
    checkpoint = latest_checkpoint(out)
    files = [checkpoint / "trainer_state.pt", *sorted(checkpoint.glob("*.safetensors"))]
    for file in files:
        try:
            if file.suffix == ".pt":
                zipfile.ZipFile(file).close()   # torch.save's zip: a cut file has no central directory
            else:
                safe_open(str(file), framework="pt")
        except (zipfile.BadZipFile, SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} is cut or corrupt ({e}); write the name of an earlier complete step_* "
                                  f"folder into {out / 'checkpoints' / 'latest'} to resume from it, or start again "
                                  "with --overwrite") from None


def digest(path: str | Path) -> str:
    """sha256 of a data file, or of a folder's .py files (a KernelBench folder) with their paths."""
    path, h = Path(path), hashlib.sha256()
    for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
        h.update(str(f.relative_to(path)).encode() if path.is_dir() else b"")
        h.update(f.read_bytes())
    return h.hexdigest()


def run_settings(cfg: TrainConfig, names: tuple[str, ...], **derived) -> dict:
    """What a --resume must match, keyed as the user sees it: `--flag` for fields, else a phrase."""
    return {"--" + name.replace("_", "-"): getattr(cfg, name) for name in names} | derived


def check_resume(out: Path, settings: dict, start: int, total: int, hashed: dict | None = None) -> None:
    """--resume at checkpoint step `start`: every setting must be the one in run.json (a run started
    before run.json existed is not checked), and `total` steps must reach the checkpoint. A refusal
    names the setting and both values in the user's terms: `hashed` maps a setting that is an input's
    sha256 to that input as the user gave it ("--data FILE"), named instead of two hashes."""
    saved_file = out / "run.json"
    saved = json.loads(saved_file.read_text()) if saved_file.is_file() else settings
    for key, value in settings.items():
        if saved.get(key) == value:
            continue
        if key in (hashed or {}):
            raise RunFolderError(f"{saved_file}: {hashed[key]} holds other data than the run was started with (its "
                                 "contents' sha256 differs from the one run.json keeps); resume with the data the run "
                                 "started with, or start a new run in another --out")
        # a flag's fix is the flag with its old value; a derived setting names the flags behind it
        fix = f"{key} {saved.get(key)}" if key.startswith(("--", "torchrun ")) else "the same setting"
        raise RunFolderError(f"{saved_file}: {key}: the run was started with {saved.get(key)}, this one has {value}; "
                             f"resume with {fix}, or start a new run in another --out")
    if total < start:
        raise RunFolderError(f"--steps {total} is below step {start}, where the newest checkpoint in "
                             f"{out / 'checkpoints'} stands; pass --steps {start} or more to continue the run")


def start_run(out: Path, overwrite: bool, settings: dict, rt: Runtime) -> None:
    """Just before the first step: with --overwrite delete the earlier run's entries; create --out
    and write run.json (kept as it is by a resumed run)."""
    if rt.main:
        for path in [out / name for name in RUN_ENTRIES] if overwrite else []:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "run.json").exists():
            (out / "run.json").write_text(json.dumps(settings, indent=1) + "\n")
    rt.barrier()


def write_model_folder(model, path: Path, tokenizer_dir: str, state_dict: dict | None = None) -> None:
    """A loadable model folder: config + weights + the tokenizer files of the source folder."""
    save_model(model, path, state_dict=state_dict)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file() and Path(tokenizer_dir).resolve() != path.resolve():
            shutil.copy2(Path(tokenizer_dir) / name, path / name)


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint `latest` names; None without `latest`. One it names that is missing or
    incomplete is an error, not a silent restart at step 0."""
    pointer = out / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text(errors="replace").strip()
    path = out / "checkpoints" / name
    if not re.fullmatch(r"step_\d+", name) or not (path / "trainer_state.pt").is_file():
        raise CheckpointError(f"{pointer} names {name}, which is missing or incomplete; write the name of a "
                              "complete step_* folder there to resume from it, or choose another --out")
    return path


def checkpoint_step(out: Path) -> int:
    """The step of the checkpoint `latest` names (its folder is step_N), 0 without one."""
    path = latest_checkpoint(out)
    return 0 if path is None else int(path.name.removeprefix("step_"))


def resume(out: Path, model, optimizer, log) -> tuple[int, dict]:
    """Load the newest checkpoint into model and optimiser; returns (steps done, trainer state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict   # lazy: ~2 s of start-up
    path = latest_checkpoint(out)
    if path is None:
        raise RunFolderError(f"--resume: {out / 'checkpoints'} holds no checkpoint to continue from")
    try:
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(f))
        if not isinstance(state, dict) or not {"step", "optimizer"} <= state.keys():
            raise KeyError("step and optimizer")
    except (RuntimeError, OSError, EOFError, KeyError, TypeError, pickle.UnpicklingError, SafetensorError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {str(e)[:120]}); write the name of an "
                              f"earlier complete step_* folder into {out / 'checkpoints' / 'latest'}, or start again "
                              "with --overwrite") from None
    weights = from_published(weights)
    if model.config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    log(f"resumed from {path} after step {state['step']}; next step {state['step'] + 1}")
    return state["step"], state


class MetricsLog:
    """DIR/metrics.jsonl, truncated to the resumed step so a resumed run has no duplicate steps."""

    def __init__(self, out: Path, start_step: int, enabled: bool):
        self.file, self.enabled = out / "metrics.jsonl", enabled
        if enabled and self.file.exists():
            kept = [l for l in self.file.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= start_step]
            self.file.write_text("".join(l + "\n" for l in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.file.open("a") as f:
                f.write(json.dumps(record) + "\n")


def progress_line(step: int, total: int, started: float, first_step: int, fields: dict) -> str:
    done = step + 1 - first_step
    eta = (time.perf_counter() - started) / max(done, 1) * (total - step - 1)
    shown = " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
    return f"step {step + 1}/{total} | {shown} | ETA {int(eta // 60)}m{int(eta % 60):02d}s"


def make_logger(rt: Runtime):
    def log(msg: str) -> None:
        if rt.main:
            print(msg, file=sys.stderr, flush=True)
    return log


def save_final(model, optimizer, out: Path, tokenizer_dir: str, rt: Runtime, log) -> Path:
    """DIR/final: the trained model folder, written once (by rank 0) from the full state."""
    state, _ = full_state_dicts(model, optimizer)
    if rt.main:
        write_model_folder(model, out / "final", tokenizer_dir, state_dict=state)
        log(f"wrote {out / 'final'}")
    rt.barrier()
    return out / "final"
