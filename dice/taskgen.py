"""A synthetic kernel curriculum: KernelBench-format tasks with CuPy reference solutions.

    python -m dice.taskgen --out DIR [--train 4000] [--valid 90] [--heldout 60] [--rl 600] [--seed 0]
                           [--constants few|wide] [--overwrite]

writes DIR/train.json, DIR/valid.json, DIR/heldout.json and DIR/rl.json (never over existing files
without --overwrite), DICE-style records (`id`, `level`, `ops`, `pytorch_code`, `cuda_code`,
`prefix`, `middle`, `suffix`), usable as SFT data (pytorch_code + cuda_code), as infill RL tasks
(prefix/middle/suffix, the middle being the CUDA source) and as end-to-end RL or evaluation tasks.

Levels (as in KernelBench, easy to hard):
  1  one elementwise op or activation, with varied shapes and constants (`--constants wide`: drawn
     per task from wide ranges, 3 significant digits, so a model can only copy them: issue #65);
  2  one reduction / normalisation / softmax along the last dimension;
  3  a fused chain of 2-4 ops: 2-4 elementwise ops, or 1-3 elementwise ops feeding a level-2 op.
Every `forward` is written one op per line and every kernel mirrors it line by line, so the
mapping from PyTorch to CUDA is learnable by a small model.

Splits. A fixed set of unordered op pairs (26 of the 240 a chain can hold, the same for every
seed, chosen by a hash of the two names: `is_heldout_pair`) never occur together in a training task.
heldout.json holds only level-3 chains that contain such a pair, so no held-out chain is a
training chain, a run inside a longer one, or a reordering of one: each combines two ops that
training never combines. valid.json is in-distribution: compositions whose op pairs may all occur
in training, at all three levels (drawn 30/30/40; de-duplication against train.json removes most
level-1/2 draws). A level-1/2 kernel does not depend on the shape, so most valid level-1/2
kernels (at seed 0, all) equal a training kernel byte for byte: valid measures recall, heldout
composition.
Neither evaluation split holds a task whose output one value matches within the verifier's
tolerance (`passed_by_a_constant`): an output that ignores the input (relu, then a clamp to
[-1, 0], is 0 everywhere), or softmax over thousands of columns, all of whose entries lie within
atol of 0; there a kernel with wrong ops but the right scale passes. train.json keeps such tasks;
their kernels still mirror the forward line by line.
rl.json holds the tasks of the RL phases: in-distribution like valid (drawn 30/30/40, no held-out
pair, none passable by a constant, since a reward a wrong kernel can earn teaches wrong kernels), and
none with the PyTorch source of a train, valid or held-out task. It is small on purpose: the RL
curriculum walks its tasks in ascending level, and over train.json's 823 level-1 tasks (seed 0) a
run of a few dozen steps would never reach level 2.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random
import shutil
import time
from pathlib import Path

import torch

from .cli import ArgumentParser, ProgressLine, at_least, eta, fail_cleanly
from .errors import UsageError, UserError
from .inputs import output_folder
from .tasks.synthetic_ops import ELEMENTWISE, PREFIX, ROW_HELPERS, ROW_OPS, draw_constants
from .verifier.precision import DICE_TOLERANCE

SPLIT_FILES = ("train.json", "valid.json", "heldout.json", "rl.json")

def _elementwise_lines(ops: list[str], rng: random.Random, wide: bool = False) -> tuple[list[str], list[str]]:
    torch_lines, cuda_lines = [], []
    for op in ops:
        t, c, kind = ELEMENTWISE[op]
        k = draw_constants(kind, rng, wide)
        torch_lines.append(t.format(**k))
        cuda_lines.append(c.format(**k))
    return torch_lines, cuda_lines


def _task_source(torch_lines: list[str], shape: tuple[int, ...]) -> str:
    dims = ["batch_size", "dim"] if len(shape) == 2 else ["batch_size", "channels", "dim"]
    body = "\n".join(f"        {line}" for line in torch_lines)
    sizes = "\n".join(f"{n} = {s}" for n, s in zip(dims, shape))
    return (f"import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
            f"    def __init__(self):\n        super().__init__()\n\n"
            f"    def forward(self, x):\n{body}\n        return x\n\n\n{sizes}\n\n\n"
            f"def get_inputs():\n    return [torch.randn({', '.join(dims)})]\n\n\n"
            f"def get_init_inputs():\n    return []\n")


def _elementwise_solution(cuda_lines: list[str]) -> tuple[str, str]:
    body = "\n".join(f"        {line}" for line in cuda_lines)
    middle = (f"_source = r'''\nextern \"C\" __global__ void fused_kernel(const float* x, float* y, long long n) {{\n"
              f"    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
              f"    if (i < n) {{\n        float v = x[i];\n{body}\n        y[i] = v;\n    }}\n}}\n'''")
    suffix = ("\n\n_kernel = cp.RawModule(code=_source).get_function(\"fused_kernel\")\n\n\n"
              "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
              "    def forward(self, x):\n        x = x.contiguous()\n        y = torch.empty_like(x)\n"
              "        n = x.numel()\n"
              "        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n"
              "            _kernel(((n + 255) // 256,), (256,), (x.data_ptr(), y.data_ptr(), cp.int64(n)))\n"
              "        return y\n")
    return middle, suffix


def _row_solution(pre_cuda: list[str], row_op: str) -> tuple[str, str]:
    _, keeps_shape, body = ROW_OPS[row_op]
    pre = "\n".join(f"    {line}" for line in pre_cuda)
    pre_fn = f"__device__ float pre(float v) {{\n{pre}\n    return v;\n}}\n" if pre_cuda else \
        "__device__ float pre(float v) {\n    return v;\n}\n"
    helpers = "\n".join(h.strip() + "\n" for name, h in ROW_HELPERS.items() if f"{name}(" in body)
    middle = (f"_source = r'''\n{pre_fn}\n{helpers}\n"
              f"extern \"C\" __global__ void row_kernel(const float* x, float* y, int cols) {{\n"
              f"    __shared__ float buf[256];\n    long long row = blockIdx.x;\n"
              f"    const float* xr = x + row * cols;\n    float* yr = y + row * cols;\n"
              f"    {body}\n}}\n'''")
    out = "torch.empty_like(x)" if keeps_shape else "torch.empty(x.shape[:-1], device=x.device, dtype=x.dtype)"
    suffix = ("\n\n_kernel = cp.RawModule(code=_source).get_function(\"row_kernel\")\n\n\n"
              "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
              "    def forward(self, x):\n        x = x.contiguous()\n"
              f"        y = {out}\n        cols = x.shape[-1]\n        rows = x.numel() // cols\n"
              "        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n"
              "            _kernel((rows,), (256,), (x.data_ptr(), y.data_ptr(), cp.int32(cols)))\n"
              "        return y\n")
    return middle, suffix


def _shape(rng: random.Random, rows_op: bool) -> tuple[int, ...]:
    """2-D or 3-D input sizes: 1M-16M elements for elementwise tasks (large enough that memory,
    not launch overhead, decides the speed), up to 8M for row operations."""
    if rows_op:
        cols = rng.choice([256, 512, 1024, 2048, 4096, 8192])
        rows = min(rng.choice([512, 1024, 2048, 4096]), 2**23 // cols)
    else:
        cols = rng.choice([1024, 2048, 4096, 8192, 16384])
        rows = rng.choice([2**20, 2**21, 2**22, 2**23, 2**24]) // cols
    if rng.random() < 0.3:
        b = rng.choice([4, 8, 16])
        return (b, max(rows // b, 1), cols)
    return (rows, cols)


def make_task(rng: random.Random, level: int, ops: list[str] | None = None, wide: bool = False) -> dict:
    """One task record of `level`; `ops` fixes the composition (else drawn at random); `wide`:
    constants from wide ranges (`synthetic_ops.draw_wide`)."""
    if ops is None:
        ops = sample_composition(rng, level)
    row_op = ops[-1] if ops[-1] in ROW_OPS else None
    pre = ops[:-1] if row_op else ops
    torch_lines, cuda_lines = _elementwise_lines(pre, rng, wide)
    if row_op:
        torch_lines.append(ROW_OPS[row_op][0])
        middle, suffix = _row_solution(cuda_lines, row_op)
    else:
        middle, suffix = _elementwise_solution(cuda_lines)
    source = _task_source(torch_lines, _shape(rng, row_op is not None))
    return {"level": level, "ops": list(ops), "pytorch_code": source, "cuda_code": PREFIX + middle + suffix,
            "prefix": PREFIX, "middle": middle, "suffix": suffix}


def sample_composition(rng: random.Random, level: int) -> list[str]:
    names = sorted(ELEMENTWISE)
    if level == 1:
        return [rng.choice(names)]
    if level == 2:
        return [rng.choice(sorted(ROW_OPS))]
    if rng.random() < 0.5:
        return rng.sample(names, rng.randint(2, 4))
    return rng.sample(names, rng.randint(1, 3)) + [rng.choice(sorted(ROW_OPS))]


def is_heldout_pair(a: str, b: str) -> bool:
    """A fixed set of unordered op pairs, by a hash of the two names: each pair with probability
    21/256 (~8%); 26 of the 240 pairs a level-3 chain can hold."""
    return hashlib.sha256("|".join(sorted((a, b))).encode()).digest()[0] < 21


def is_heldout_composition(ops: list[str]) -> bool:
    """True when two of the chain's ops form a held-out pair (adjacent or not)."""
    return any(is_heldout_pair(a, b) for a, b in itertools.combinations(ops, 2))


def _level_mix(n: int) -> list[int]:
    """Levels 1/2/3 drawn 30/30/40."""
    return [1] * (n * 3 // 10) + [2] * (n * 3 // 10) + [3] * (n - 2 * (n * 3 // 10))


def passed_by_a_constant(task: dict) -> bool:
    """True when one value c written everywhere passes the verifier's check |c - y| <= atol + rtol |y|
    at its loosest (DICE's 1e-2, `precision="dice"`) against the task's output y on its own
    get_inputs() (seed 0): then a kernel with the wrong ops but the right scale is called correct
    too (one writing c itself is caught, its outputs repeat across trials). Such a c exists iff
    max(y - s) <= min(y + s), s = atol + rtol |y|.
    That holds for an output that ignores the input, and for softmax or L2 normalisation over
    thousands of columns, whose entries all lie within atol of one value."""
    ns: dict = {}
    exec(task["pytorch_code"], ns)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        y = ns["Model"](*ns["get_init_inputs"]())(*ns["get_inputs"]()).float()
    return one_value_matches(y)


def one_value_matches(y: torch.Tensor, tol: float = DICE_TOLERANCE) -> bool:
    """max(y - s) <= min(y + s), s = tol + tol |y|. Most outputs fail it already at their extremes
    (max(y - s) >= hi - s(hi), min(y + s) <= lo + s(lo)), which one pass over y finds."""
    lo, hi = torch.aminmax(y)
    # the same float operations as below on two of its entries: a reject here is one there too
    if hi - (tol + tol * hi.abs()) > lo + (tol + tol * lo.abs()):
        return False
    slack = tol + tol * y.abs()
    return bool((y - slack).max() <= (y + slack).min())


def _draw(rng: random.Random, levels: list[int], heldout: bool, seen: set[str], evaluation: bool,
          drawn=lambda: None, wide: bool = False) -> list[dict]:
    """Tasks at `levels` whose composition is (heldout) or is not (not heldout) a held-out one;
    a task whose PyTorch source is already in `seen`, or an evaluation task whose output one value
    matches (`passed_by_a_constant`), is dropped, so the count can fall short. `drawn()` is called
    as each draw starts."""
    tasks = []
    for level in levels:
        drawn()
        while True:
            ops = sample_composition(rng, level)
            if is_heldout_composition(ops) == heldout:
                break
        task = make_task(rng, level, ops, wide)
        if task["pytorch_code"] not in seen and not (evaluation and passed_by_a_constant(task)):
            seen.add(task["pytorch_code"])
            tasks.append(task)
    return tasks


def generate_split(n_train: int, n_valid: int, n_heldout: int, seed: int = 0, *, n_rl: int = 0,
                   drawn=lambda: None, constants: str = "few") -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """(train, valid, heldout, rl) task records, without a PyTorch source twice: train, valid and
    rl mix levels 30/30/40 (before de-duplication) over compositions free of held-out pairs, heldout
    is level 3 with one; no valid, heldout or rl task has an output one value matches (module
    docstring). rl is drawn last, so it changes none of the other three splits. `drawn()` is
    called as each of the n_train + n_valid + n_heldout + n_rl draws starts (progress). `constants`:
    "few" (each op's few values, dice-tiny's curriculum) or "wide" (`synthetic_ops.draw_wide`)."""
    rng, wide = random.Random(seed), constants == "wide"
    seen: set[str] = set()
    train = _draw(rng, _level_mix(n_train), False, seen, evaluation=False, drawn=drawn, wide=wide)
    valid = _draw(rng, _level_mix(n_valid), False, seen, evaluation=True, drawn=drawn, wide=wide)
    heldout = _draw(rng, [3] * n_heldout, True, seen, evaluation=True, drawn=drawn, wide=wide)
    rl = _draw(rng, _level_mix(n_rl), False, seen, evaluation=True, drawn=drawn, wide=wide)
    for split, tasks in (("train", train), ("valid", valid), ("heldout", heldout), ("rl", rl)):
        for i, t in enumerate(tasks):
            t["id"] = f"{split}-{i:05d}-L{t['level']}-{'-'.join(t['ops'])}"
    return train, valid, heldout, rl


# bytes a task record takes in the written JSON (indent=1): about 3.2 KB on average over 200 drawn
# tasks (2.0-5.1 KB), rounded up so the estimate errs towards refusing too early
BYTES_PER_TASK = 4096


def check_disk(out: Path, count: int) -> None:
    """Refuse, before drawing, `count` tasks whose files would not fit the free space of the disk that
    holds `out` (its nearest existing folder), estimated at BYTES_PER_TASK each."""
    folder = out.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    need, free = count * BYTES_PER_TASK, shutil.disk_usage(folder).free
    if need > free:
        raise UserError(f"{count} tasks take about {need / 2**20:,.0f} MiB in --out {out}, whose disk has "
                        f"{free / 2**20:,.0f} MiB free; draw fewer (--train, --valid, --heldout, --rl), free some "
                        "disk space, or choose an --out on another disk")


def main(argv=None) -> None:
    p = ArgumentParser(prog="python -m dice.taskgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for train.json, valid.json, heldout.json and rl.json")
    p.add_argument("--train", type=at_least(0), default=4000, help="training tasks drawn (fewer after de-duplication)")
    p.add_argument("--valid", type=at_least(0), default=90, help="in-distribution validation tasks drawn")
    p.add_argument("--heldout", type=at_least(0), default=60, help="held-out level-3 tasks drawn")
    p.add_argument("--rl", type=at_least(0), default=600, help="RL-phase tasks drawn (fewer after de-duplication)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes the same files")
    p.add_argument("--constants", choices=("few", "wide"), default="few",
                   help="each op's constants: few (a handful of values, dice-tiny's curriculum) or wide (drawn per "
                   "task from wide ranges, so a model must copy them from the task)")
    p.add_argument("--overwrite", action="store_true", help="replace train.json, valid.json, heldout.json and "
                   "rl.json where --out holds them already")
    args = p.parse_args(argv)
    if not args.train + args.valid + args.heldout + args.rl:
        p.error("--train, --valid, --heldout and --rl are all 0, so there is nothing to draw; give one of them a count")
    out = Path(args.out)
    try:
        output_folder(out, "--out", SPLIT_FILES, overwrite=args.overwrite)
    except UsageError as e:
        p.error(str(e))
    check_disk(out, args.train + args.valid + args.heldout + args.rl)
    total, done, started, line = args.train + args.valid + args.heldout + args.rl, [0], time.perf_counter(), \
        ProgressLine()

    def drawn():
        done[0] += 1
        rate = done[0] / max(time.perf_counter() - started, 1e-9)
        line.update(f"drawing tasks: {done[0]}/{total} | {rate:.0f}/s | ETA {eta(total - done[0], rate)}")

    train, valid, heldout, rl = generate_split(args.train, args.valid, args.heldout, args.seed, n_rl=args.rl,
                                               drawn=drawn, constants=args.constants)
    line.close()
    out.mkdir(parents=True, exist_ok=True)
    for name, tasks in zip(SPLIT_FILES, (train, valid, heldout, rl)):
        (out / name).write_text(json.dumps(tasks, indent=1))
    print(f"wrote {len(train)} train, {len(valid)} valid, {len(heldout)} held-out and {len(rl)} RL tasks to {out}")


if __name__ == "__main__":
    fail_cleanly(main)
