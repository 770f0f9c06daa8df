"""`python -m dice.bench rl` on the CPU: the replayed programs, the token counts, and one step of a
tiny model with the Python reward (issue 27)."""
import ast
import json
import math
from pathlib import Path

import pytest

from dice.bench.rl import CHARS_PER_TOKEN, ReplayTokenizer, replay_programs, with_device_line
from dice.bench.verify import CUPY_CANDIDATE, INLINE_CANDIDATE, TASK
from dice.tasks import load_tasks

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"


@pytest.fixture
def solutions(tmp_path):
    """A DICE JSON file with a load_inline and a CuPy reference solution."""
    records = []
    for i, candidate in enumerate((INLINE_CANDIDATE, CUPY_CANDIDATE)):
        fields = {"tag": f"t{i}", "scale": f"{1.5 + i}", "shift": "0.25"}
        records.append({"id": i, "level": 1, "pytorch_code": TASK.format(**fields),
                        "cuda_code": candidate.format(**fields)})
    path = tmp_path / "solutions.json"
    path.write_text(json.dumps(records))
    return path


def test_replayed_programs_are_distinct_and_broken_in_the_stated_share(solutions):
    tasks = load_tasks(solutions)
    replay = replay_programs(tasks, group_size=10, broken=0.3, seed=0, run=0)
    kinds = [kind for _, kind in replay]
    assert len(replay) == 20 and kinds.count("compile_error") == kinds.count("incorrect") == 3
    programs = [t.solution for t, _ in replay]
    assert len(set(programs)) == 20 and all(ast.parse(p) for p in programs)
    for (owner, kind), source in zip(replay, [t.solution for t in tasks for _ in range(10)]):
        salt = next(line for line in owner.solution.splitlines() if "dice_bench_salt_" in line)
        lines = owner.solution.splitlines()
        assert "__global__" in lines[lines.index(salt) + 1 + (kind == "compile_error")]
        assert ("dice_bench_undeclared_" in owner.solution) == (kind == "compile_error")
        assert owner.solution.endswith("ModelNew.forward = _dice_bench_off_by_one\n") == (kind == "incorrect")
        assert owner.source == next(t.source for t in tasks if t.solution == source)
    again = replay_programs(tasks, group_size=10, broken=0.3, seed=0, run=1)
    assert [k for _, k in again] == kinds and not {t.solution for t, _ in again} & set(programs)


def test_device_line_goes_above_the_kernels_extern_c_or_template_line():
    program = 'code = r"""\n#include <x>\nextern "C"\n__global__ void k() {}\n"""\n'
    expected = 'code = r"""\n#include <x>\nLINE\nextern "C"\n__global__ void k() {}\n"""\n'
    assert with_device_line(program, "LINE") == expected
    template = "template <int N>\n__global__ void k() {}"
    assert with_device_line(template, "L") == "L\n" + template
    assert with_device_line("import torch\n", "L") is None


def test_estimated_token_counts_and_ids():
    tok = ReplayTokenizer(None, vocab_size=320, mask_id=319)
    text = "x" * 1000
    ids = tok.encode(text)
    assert len(ids) == math.ceil(1000 / CHARS_PER_TOKEN) and ids == tok.encode(text) and ids != tok.encode("y" * 1000)
    assert 319 not in ids and max(ids) < 320 and tok.eos_token_ids == () and tok.decode(ids) == ""


@pytest.mark.slow
def test_one_step_on_a_tiny_model_with_the_python_reward(solutions, capsys):
    """The baseline and the optimised step (--compare) of 2 tasks x 2 samples on the CPU."""
    from dice.bench import main
    main(["rl", "--shape", str(TINY), "--solutions", str(solutions), "--tasks-per-step", "2", "--group-size", "2",
          "--max-new-tokens", "8", "--reward", "python", "--broken", "0.5", "--compare"])
    out = capsys.readouterr().out
    assert "2 tasks x 2 = 4 rollouts" in out and "an estimate of 3.8 chars a token" in out
    lines = out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.strip().startswith("run"))):][:3]
    assert "batch overlap, batch 64, fp32 rollouts, dense update" in table[1]
    assert "stream overlap, batch 4, fp32 rollouts, dense update" in table[2]
    assert all("update (" in row or "generate (" in row for row in table[1:])
    assert out.count("4 rollouts, 32 tokens") == 2 and "reward mean 0.50" in out


def test_verifier_reward_without_a_gpu_is_one_line(solutions, capsys):
    from dice.bench import main
    with pytest.raises(SystemExit, match="--reward verifier needs a CUDA GPU; pass --reward python"):
        main(["rl", "--shape", str(TINY), "--solutions", str(solutions)])
