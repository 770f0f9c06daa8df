"""GPU checks of what `evaluate.py --protocol dice | kernelbench` relies on (DESIGN.md §8.6): CUDA's
`torch.topk` tie order (DICE's unmasking order), DICE's decoding in float16 through the cached,
graph-replayed sampler, and the protocols' verifier options through the worker and judge."""
from pathlib import Path

import pytest
import torch

from dice import load_model
from dice.protocols import verify_options
from dice.sampling.sampler import Sampling, generate

pytestmark = pytest.mark.gpu
FIXTURES = Path(__file__).parent / "fixtures"


def test_cuda_topk_takes_the_first_of_equal_confidences():
    """DICE's `torch.topk(confidence, n)` over a block whose masked positions all have confidence 1
    (the rest -inf) returns the lowest masked positions: the order our tie rule reproduces."""
    conf = torch.tensor([-torch.inf, 1.0, 1.0, 1.0], device="cuda")
    assert sorted(torch.topk(conf, 1).indices.tolist()) == [1]
    assert sorted(torch.topk(conf, 2).indices.tolist()) == [1, 2]
    assert sorted(torch.topk(torch.ones(4, device="cuda"), 3).indices.tolist()) == [0, 1, 2]


def test_dices_decoding_through_cuda_graphs_fills_blocks_left_to_right_and_runs_in_float16():
    """float32: every block left to right, as on the CPU; float16 (DICE's weights; a tie for the top
    logit there makes its position's confidence 1/2, so the order is not asserted): it runs."""
    def decode(dtype):
        model = load_model(FIXTURES / "tiny-sdar", device="cuda", dtype=dtype)
        sampling = Sampling(steps_per_block=4, remasking="low_confidence_static", temperature=1.0, top_k=1,
                            confidence="filtered")
        return generate(model, [list(range(3, 11))], max_new_tokens=32, sampling=sampling,
                        seed=0).sequences[0], model.config.mask_token_id

    (exact, _), (half, mask) = decode(torch.float32), decode(torch.float16)
    assert exact.step_map == list(range(1, 33))
    assert len(half.tokens) == 32 and mask not in half.tokens and sorted(half.step_map) == list(range(1, 33))


@pytest.mark.parametrize("protocol", ["dice", "kernelbench"])
def test_protocol_options_verify_a_correct_kernel(verifier, protocol):
    """rel_l2 inf, rules kernelbench and the tolerances reach the judge: an exact CuPy relu is correct."""
    task, candidate = ((FIXTURES / "verifier" / name).read_text() for name in ("relu_task.py", "cupy_relu.py"))
    (result,) = verifier.map([(task, candidate)], timing=False, **verify_options(protocol))
    assert result.status == "correct", result.message
