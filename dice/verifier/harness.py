"""What both worker roles do with task and candidate source: modules from source, seeded models
and inputs, the CUDA context (DESIGN.md §8). Runs only inside worker processes.

Trial inputs. Every correctness trial draws `get_inputs()` under its own seed and then gives its
floating-point tensors a structure (`TRIAL_KINDS`), the same in the judge and the worker:
- "iid": every element times (1 + JITTER u), u uniform in [-1, 1): new values on every trial even
  for a task whose inputs are drawn once at import (one recorded output cannot be replayed);
- "spiked": about one element in SPIKE_EVERY times SPIKE, the rest as drawn: the spikes decide
  most of a reduction of squares (an MSE, a norm) wherever they fall, so an estimate from a
  subsample, which sees about its share of them, is off by ~20% (sd); two spiked trials let such
  an estimate through with a chance of about 0.1-0.4%, by task (DESIGN.md §8.2);
- "hot": one element per tensor kept as drawn (the largest in magnitude of HOT_DRAWS random
  ones, so it is not near zero), every other times HOT_FADE / numel, so the hot element decides
  a sum or mean by a factor of ~256: an estimate from a subsample of any fraction f < 1 either
  misses it (off by its whole share) or holds it (off by 1/f times its share), whatever the
  subsample's pattern. Where that factor is below the dtype's smallest normal (fp16 tensors of
  more than 64 elements) the fade is sparse instead (`faded`: a random few at the smallest
  normal, the rest zero, the same expected sum), so the hot element decides just as much;
- "scaled": the whole tensor times 1/4 or 4: a constant output, or one off by a scale, fails;
- "light": as "iid", for a "spiked" or "scaled" trial whose heavy element (below) the task's
  reference cannot take;
- "plain": get_inputs() as drawn, for a trial whose structure the task's own reference cannot take
  (`plans.TrialPlans`: e.g. float indices that jitter pushes past their table).
Trials "spiked" and "scaled" and every timed call also get one heavy element per floating tensor
(`with_heavy`): the tensor's largest magnitude times its element count (at most half the dtype's
range), so it carries about half of a sum; the other elements look as they always do, so no
sample of a few elements tells these inputs from any others, and an estimate from part of a
tensor fails whatever part it reads (the hot trial's faded elements are easy to spot). The "iid"
trial has none: the outputs a heavy element reaches set the scale of a trial's error bounds (the
reference's own error, the whole-output norm), so the iid trial is where every output element is
held to the precision rule at its ordinary scale. Complex tensors take every structure through
their real and imaginary parts.
Signs and zeros are left alone, and integer and boolean tensors (indices, labels, masks) keep
their values in new places (a permutation per trial), so inputs stay in the task's domain; their
values are new draws on every trial and timed call (`make_inputs` with the task's source: the
task imported anew under a seed of the trial's, so even integers drawn once at import change and
an output that ignores their order, a sum or a histogram, cannot be recorded once and replayed).
Timed calls use "timed" inputs from their own seeds (`timed_inputs`), each call a draw of its own
(`call_draws`: the task imported anew where it draws at import): no two timed calls see the same
inputs, signs or large elements, so outputs cached on any property of them cannot beat the clock.
For a task checked on "plain" inputs, timed calls permute every tensor instead ("permuted"); on
"light" ones they are jittered without a heavy element ("jittered").
"""
from __future__ import annotations

import hashlib
import linecache
import math
import random
import sys
import traceback
import types

import numpy
import torch
from torch import nn

from .rules import trusted

TASK_IMPORT_SEED = 0            # module-level randomness of a task is the same in every process
TRIAL_KINDS = ("iid", "spiked", "hot", "scaled", "spiked")   # trials 1-5; later trials are "iid"
HEAVY_KINDS = ("spiked", "scaled", "timed")                    # kinds that also get a heavy element (`with_heavy`)
DOMINATED_KINDS = ("hot",) + HEAVY_KINDS   # one element decides most of a sum (`precision.SERIAL_DOMINATED`)
JITTER = 2**-3
HOT_FADE, HOT_DRAWS = 2**-8, 8
SPIKE, SPIKE_EVERY = 64.0, 4096


def init_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # create the CUDA context now, not inside the first candidate
    return device


def cuda_context_broken(device: torch.device) -> bool:
    """True once a kernel fault (illegal address, device-side assert) has made this process's
    CUDA context unusable: every later CUDA call would fail, so the process must be replaced."""
    if device.type != "cuda":
        return False
    try:
        trusted.cuda_synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return False
    except Exception:
        return True


CANDIDATE_FILE = "candidate.py"   # the file name a candidate's module runs under (its frames, its tracebacks)


def load_module(source: str, filename: str, module_name: str) -> types.ModuleType:
    """Execute `source` as a fresh module; tracebacks then show its lines under `filename`."""
    code = compile(source, filename, "exec")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module  # some libraries (dataclasses, pickling) look modules up here
    exec(code, module.__dict__)
    return module


def load_task(source: str, module_name: str, import_seed: int = TASK_IMPORT_SEED) -> types.ModuleType:
    """The task module, imported under a fixed seed. Some tasks draw their inputs at import time
    (`x = torch.randn(...)` at module level, returned by get_inputs); unseeded, the judge and each
    candidate worker would hold different tensors and compare outputs of different inputs."""
    trusted.manual_seed(import_seed)
    random.seed(import_seed)
    numpy.random.seed(import_seed % 2**32)
    return load_module(source, "task.py", module_name)


def describe_exception(exc: BaseException, filename: str = CANDIDATE_FILE) -> str:
    """`Type: message` (first lines) plus the deepest line of `filename` in the traceback."""
    lines = f"{type(exc).__name__}: {exc}".strip().splitlines()
    text = "\n".join(lines[:3])  # CUDA errors append generic debugging hints after these
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    if frames:
        text += f"\n  at {filename} line {frames[-1].lineno}: {frames[-1].line}"
    return text


def to_device(values, device: torch.device) -> list:
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def build_model(task: types.ModuleType, cls: type, init_seed: int, device: torch.device) -> nn.Module:
    """cls(*get_init_inputs()) with weights drawn after manual_seed(init_seed), as for the reference."""
    with trusted.no_grad():
        trusted.manual_seed(init_seed)
        init_inputs = to_device(task.get_init_inputs(), device)
        trusted.manual_seed(init_seed)
        return cls(*init_inputs).to(device)


def make_inputs(task: types.ModuleType, seed: int, device: torch.device, source: str | None = None) -> list:
    """get_inputs() under `seed` (`draw`). With the task's `source`, a draw holding integer or boolean
    tensors is made again from the task imported anew under a seed from `seed`: their values are
    then a new draw even where the task draws them once at import (a permutation of one draw
    keeps the multiset, and a task whose output ignores the order, a sum or a histogram of
    integers, would give the same output on every trial and timed call)."""
    inputs = draw(task, seed, device)
    if source is None or not any(isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex())
                                 for x in inputs):
        return inputs
    return draw(load_task(source, "dice_task_draw", import_seed=stable_seed(seed, "import")), seed, device)


def draw(task: types.ModuleType, seed: int, device: torch.device) -> list:
    """get_inputs() under `seed`, its tensors on `device`. On CUDA the task's tensor factories draw
    on the GPU (the device as torch's default device): a CPU draw of a 2^28-element input costs a
    core seconds, and the judge and every worker draw each trial's inputs. A get_inputs that cannot
    run so (it calls .numpy(), say) draws on the CPU instead, the same way in every process."""
    if device.type == "cuda":
        trusted.manual_seed(seed)
        try:
            with device:
                return to_device(list(task.get_inputs()), device)
        except Exception:
            pass
    trusted.manual_seed(seed)
    return to_device(list(task.get_inputs()), device)



def rewritten_in_place(previous: list, fresh: list) -> list:
    """`fresh` inputs written into the tensors of `previous` where they have the same shape, dtype
    and device (the next call of a training loop that reuses its buffers: outputs memoised by input
    address, `data_ptr`, then answer with the last call's values), else copied: every tensor
    returned is the harness's own, never one the task's get_inputs() holds."""
    out = []
    for j, x in enumerate(fresh):
        old = previous[j] if j < len(previous) else None
        if not isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(old, torch.Tensor) and (old.shape, old.dtype, old.device) == (x.shape, x.dtype, x.device):
            out.append(old.copy_(x))      # `old` is a clone: dense, never overlapping itself
        else:
            out.append(trusted.clone(x))
    return out


def nbytes(values: list) -> int:
    return sum(x.numel() * x.element_size() for x in values if isinstance(x, torch.Tensor))


def trial_kinds(trials: int) -> list[str]:
    return [TRIAL_KINDS[i] if i < len(TRIAL_KINDS) else "iid" for i in range(trials)]


def stable_seed(*parts) -> int:
    """A 63-bit seed from `parts`, the same in every process (Python's hash() is not)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def structured(inputs: list, kind: str, seed: int) -> list:
    """`inputs` with the trial kind's structure given to their floating tensors (module docstring);
    a complex tensor takes it through its real and imaginary parts."""
    if kind == "plain":
        return list(inputs)
    out = []
    for j, x in enumerate(inputs):
        if not (isinstance(x, torch.Tensor) and x.numel() > 1):
            out.append(x)
            continue
        g = torch.Generator(device=x.device).manual_seed(stable_seed(seed, j, kind))
        if x.is_complex():
            out.append(torch.view_as_complex(_structured_one(torch.view_as_real(x).contiguous(), kind, g)))
        else:
            out.append(_structured_one(x, kind, g))
    return out


def _structured_one(x: torch.Tensor, kind: str, g: torch.Generator) -> torch.Tensor:
    if not x.is_floating_point() or kind == "permuted":
        # integers and booleans (indices, labels, masks) keep their values, in new places
        return x.reshape(-1)[torch.randperm(x.numel(), generator=g, device=x.device)].view(x.shape)
    if kind in ("iid", "timed", "light", "jittered"):
        u = torch.rand(x.shape, generator=g, device=x.device)
        return x * (1 + JITTER * (2 * u - 1)).to(x.dtype)
    if kind == "hot":
        pick = torch.randint(x.numel(), (HOT_DRAWS,), generator=g, device=x.device)
        hot = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        hot[pick[x.reshape(-1)[pick].abs().argmax()]] = True
        return torch.where(hot.view(x.shape), x, faded(x, HOT_FADE / x.numel(), g))
    if kind == "spiked":
        spike = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        spike[torch.randint(x.numel(), (max(1, x.numel() // SPIKE_EVERY),), generator=g, device=x.device)] = True
        return torch.where(spike.view(x.shape), x * SPIKE, x)
    if kind == "scaled":
        return x * (0.25 if torch.rand((), generator=g, device=x.device) < 0.5 else 4.0)
    raise ValueError(f"unknown trial kind {kind!r}")


def with_heavy(inputs: list, kind: str, seed: int) -> list:
    """`inputs` of a trial kind in HEAVY_KINDS with one heavy element per floating (or complex)
    tensor: at the largest in magnitude of HOT_DRAWS random elements, with its sign, the tensor's
    largest magnitude times its element count, or half the dtype's largest value if that is less
    (fp16), so it carries about as much of a sum, a mean, a norm or a loss as all the others
    together (fp16 tensors of 2^20 elements: ~6%). The other elements stay as the kind made them,
    so a few samples of the tensor look like any other trial's, and an estimate from a fraction f
    of it either misses the heavy element or holds it scaled by 1/f: it fails whatever it reads
    first, on every trial and timed call (module docstring)."""
    if kind not in HEAVY_KINDS:
        return list(inputs)
    out = []
    for j, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.numel() > 1 and (x.is_floating_point() or x.is_complex()):
            g = torch.Generator(device=x.device).manual_seed(stable_seed(seed, j, "heavy"))
            real = torch.view_as_real(x) if x.is_complex() else x
            heavy = _heavy_one(real.contiguous(), g)
            x = torch.view_as_complex(heavy) if x.is_complex() else heavy
        out.append(x)
    return out


def _heavy_one(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    flat = x.reshape(-1)
    pick = torch.randint(flat.numel(), (HOT_DRAWS,), generator=g, device=x.device)
    at = pick[flat[pick].abs().argmax()]
    peak = float(flat.abs().max())
    if not 0 < peak < math.inf:
        return x
    heavy = flat.clone()
    heavy[at] = math.copysign(min(peak * flat.numel(), float(torch.finfo(x.dtype).max) / 2), float(flat[at]))
    return heavy.view(x.shape)


def faded(x: torch.Tensor, fade: float, g: torch.Generator) -> torch.Tensor:
    """x times `fade`; where `fade` is below the dtype's smallest normal `tiny` (fp16 tensors of
    more than 64 elements) a sparse fade with the same expected sum instead: each element kept
    with probability fade / tiny, times tiny, the others zero (x * fade would round to zero)."""
    tiny = torch.finfo(x.dtype).tiny
    if fade >= tiny:
        return x * fade
    keep = torch.rand(x.shape, generator=g, device=x.device) < fade / tiny
    return torch.where(keep, x * tiny, torch.zeros((), dtype=x.dtype, device=x.device))


def call_draws(task: types.ModuleType, source: str, seed: int, device: torch.device, pristine: list):
    """A function giving timed call k its own draw of get_inputs() under a seed from (seed, k), so
    no property of the inputs (values, signs, which elements are large, integers' multiset) repeats
    from call to call and an output cached on any of them answers a later call wrongly; a task that
    draws at import (its get_inputs gives the timing draw's values again under another seed) is
    imported anew for each call's draw. None for a task whose draws change shape or type (every
    call then derives from `pristine`: new float values by jitter)."""
    again = make_inputs(task, stable_seed(seed, "probe"), device, source)
    if len(again) != len(pristine) or any(
            isinstance(a, torch.Tensor) != isinstance(p, torch.Tensor)
            or isinstance(a, torch.Tensor) and (a.shape, a.dtype) != (p.shape, p.dtype) for a, p in zip(again, pristine)):
        return None
    at_import = all(not isinstance(a, torch.Tensor) or trusted.equal(a, p) for a, p in zip(again, pristine))

    def one(call: int) -> list:
        call_seed = stable_seed(seed, call)
        if at_import:
            return draw(load_task(source, "dice_task_draw", import_seed=stable_seed(call_seed, "import")), call_seed,
                        device)
        return make_inputs(task, call_seed, device, source)
    return one


def trial_inputs(task: types.ModuleType, seed: int, kind: str, device: torch.device, source: str | None = None) -> list:
    """The inputs of one correctness trial: get_inputs() under `seed` (`make_inputs`), then its
    structure and its heavy element (`with_heavy`)."""
    return with_heavy(structured(make_inputs(task, seed, device, source), kind, seed), kind, seed)


def timed_inputs(pristine: list, seed: int, call: int, kind: str = "timed") -> list:
    """The inputs of timed call `call`: the timing draw `pristine` with new values per call and a
    heavy element ("timed"), or, for a task whose reference takes no jitter, every tensor permuted
    ("permuted")."""
    return with_heavy(structured(pristine, kind, stable_seed(seed, call)), kind, stable_seed(seed, call))
