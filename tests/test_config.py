"""Each default of `TrainConfig` is set once (issue 66): a field's default is its dataclass value, and
every value a phase or the embedded run uses instead stands in one table, `dice.config.DEFAULTS`."""
import dataclasses
import os
import re
from pathlib import Path

import pytest

from dice.config import AUTO, CHOICES, DEFAULTS, EMBEDDED_MODEL, TrainConfig, config_from_args, with_embedded_defaults
from dice.config_help import HELP

ROOT = Path(__file__).resolve().parents[1]
DATACLASS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}

# Where a value differs from the dataclass default, as a reader should find it (DESIGN.md §4, §7; dice-tiny's card)
RL = {"lr": 1e-6, "grad_clip": 32.0, "loss_norm": "step"}
EMBEDDED_RL = {"steps": 6, "tasks_per_step": 32, "group_size": 8, "max_new_tokens": 704, "lr": 1e-4,
               "rows_per_update": 64, "rollout_batch": 256, "update_tokens": 65536, "verify_timeout": 5.0,
               "save_every": 2, "verifier_workers": max(1, min(14, (os.cpu_count() or 4) - 2)),
               "task_order": "interleaved"}
DIFFERS = {"init": {}, "sft": {}, "infill": RL, "e2e": RL,
           "sft embedded": {"steps": 30, "save_every": 10}, "infill embedded": {**RL, **EMBEDDED_RL},
           "e2e embedded": {**RL, **EMBEDDED_RL}}


def differences(cfg: TrainConfig) -> dict:
    return {name: value for name, value in dataclasses.asdict(cfg).items()
            if name not in ("phase", "model") and value != DATACLASS[name]}


@pytest.mark.parametrize("phase", CHOICES["phase"])
def test_the_fields_that_differ_from_their_dataclass_default_and_where(phase):
    """Per phase, the values that are not the dataclass default: the phase's (TrainConfig and train.py's
    parser alike), and the embedded run's (`train.py --phase P` with neither --model nor --data)."""
    assert differences(TrainConfig(phase=phase)) == differences(config_from_args(["--phase", phase])[0]) \
        == DIFFERS[phase]
    if phase != "init":
        embedded = with_embedded_defaults(*config_from_args(["--phase", phase]))
        assert differences(embedded) == DIFFERS[f"{phase} embedded"] and embedded.model == str(EMBEDDED_MODEL)
    assert TrainConfig(phase=phase, lr=1e-5).lr == 1e-5      # a value given wins, even the dataclass default


def test_no_default_is_set_in_two_places():
    """The table never restates what a field has anyway (a phase row its dataclass default, an embedded
    row its phase's), and no code fills a field in when it is empty (`cfg.x or ...`,
    `if not cfg.x: cfg.x = ...`) but the AUTO fields, whose 0 the machine resolves, and those whose 0
    means another flag, which their --help says."""
    for where, row in DEFAULTS.items():
        phase = where.removesuffix(" embedded")
        underneath = DATACLASS | (DEFAULTS.get(phase, {}) if where.endswith(" embedded") else {})
        assert {name for name, value in row.items() if underneath[name] == value} == set(), where
    assert not hasattr(TrainConfig, "__post_init__")
    zero_means = {"steps": "--epochs", "warmup": "--warmup-ratio", "updates_per_step": "--rows-per-update",
                  "out": "runs/<phase>-<time>"}
    filled = set()
    for path in [ROOT / "train.py", *(ROOT / "dice").rglob("*.py")]:
        text = path.read_text()
        filled |= set(re.findall(r"(?:=|return)\s+(?:cfg|self)\.(\w+) or\b", text))
        filled |= {a for a, b in re.findall(r"if not (?:cfg|self)\.(\w+):\s*\n\s*(?:cfg|self)\.(\w+) =", text)
                   if a == b}
    assert filled & DATACLASS.keys() == {"max_len", "grad_accum"} | zero_means.keys()
    for name, meaning in zero_means.items():
        assert meaning in HELP[name], name
    for name in AUTO:
        assert DATACLASS[name] == 0 and "auto" in HELP[name], name
