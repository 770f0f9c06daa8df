"""The tensor rules (DESIGN.md §8.2), run in the workers: exact equality, inputs modified, outputs
sharing memory with inputs, fingerprints for spotting cached outputs, and the comparison with the
reference (`compare_outputs`: allclose plus a relative error of the whole output).

Every torch call a candidate could have replaced goes through `rules.trusted`; the candidate's
worker watches this module's functions like the rest of the harness (`guard.HarnessSnapshot`).
"""
from __future__ import annotations

import torch

from .rules import trusted

def flatten(output) -> list:
    """Leaves of a (nested) tuple/list output; a single tensor is a one-leaf output."""
    if isinstance(output, (tuple, list)):
        return [leaf for item in output for leaf in flatten(item)]
    return [output]


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of `t` with the same bytes, so equality is exact (NaN == NaN, -0 != 0)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and trusted.equal(as_bits(a), as_bits(b))


def modified_inputs(originals: list, inputs: list) -> list[int]:
    return [j for j, (o, x) in enumerate(zip(originals, inputs)) if o is not None and not same_bits(o, x)]


def aliased_outputs(outputs: list, inputs: list) -> list[list[int]]:
    """[output index, input index] pairs whose storages overlap in memory."""
    def span(t):
        s = trusted.untyped_storage(t)
        return t.device, s.data_ptr(), s.data_ptr() + s.nbytes()
    pairs = []
    for i, out in enumerate(outputs):
        for j, x in enumerate(inputs):
            if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.numel() and x.numel():
                (d1, a1, b1), (d2, a2, b2) = span(out), span(x)
                if d1 == d2 and a1 < b2 and a2 < b1:
                    pairs.append([i, j])
    return pairs


def shared_outputs(outputs: list) -> list[list[int]]:
    """[i, j] pairs (i < j) of outputs of one call whose memory overlaps: a view of one output
    returned as another."""
    return [[i, j] for i, j in aliased_outputs(outputs, outputs) if i < j]


def fingerprint(t: torch.Tensor) -> list:
    """Cheap exact summary: bit-pattern sum and 16 sampled bit patterns. Equal tensors give equal
    fingerprints; tensors computed from different random inputs practically never do."""
    bits = as_bits(t.detach()).reshape(-1)
    if bits.numel() == 0:
        return [str(t.dtype), list(t.shape)]
    n, k = bits.numel(), min(bits.numel(), 16)
    # integer spacing: float32 positions round past the last element of a tensor above 2^24 elements
    index = torch.arange(k, device=bits.device) * (n - 1) // max(k - 1, 1)
    return [str(t.dtype), list(t.shape), int(torch.sum(bits, dtype=torch.int64))] + bits[index].tolist()


def compare_outputs(expected: list, got: list, atol: float = 1e-2, rtol: float = 1e-2, rel_l2: float = 1e-2,
                    per_output: list | None = None) -> str | None:
    """None when `got` matches `expected`, else why not: allclose(atol, rtol) with NaN/Inf exactly
    where expected, and for floating outputs also ||g - e||_2 <= rel_l2 * ||e||_2 over the finite
    elements (`relative_error`; complex outputs too), so that an output whose true values all sit
    below atol (a softmax over 65,536 columns) cannot pass with values of the wrong size. `per_output`:
    [atol, rtol, rel_l2] for each output instead (`precision.tolerances`)."""
    if len(got) != len(expected):
        return f"forward returned {len(got)} tensor(s), the reference returns {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        if per_output is not None:
            atol, rtol, rel_l2 = per_output[i]
        label = f"output {i}" if len(expected) > 1 else "output"
        if g.device.type != e.device.type:
            return f"{label} is on {g.device.type}, the reference's is on {e.device.type}"
        if g.dtype != e.dtype:
            return f"{label} has dtype {str(g.dtype)[6:]}, expected {str(e.dtype)[6:]}"
        if g.shape != e.shape:
            return f"{label} has shape {list(g.shape)}, expected {list(e.shape)}"
        problem = layout_problem(e, g)
        if problem:
            return f"{label} {problem}"
        problem = _value_mismatch(e, g, atol, rtol)
        if problem:
            return f"{label}: {problem}"
        if (e.is_floating_point() or e.is_complex()) and e.numel():
            rel = relative_error(e, g)
            if rel > rel_l2:
                return (f"{label}: relative error {rel:.3g} of the whole output (||got - expected|| / ||expected||) "
                        f"exceeds {rel_l2:g}, although every element is within atol={atol:g}, rtol={rtol:g}")
    return None


def layout_problem(e: torch.Tensor, g: torch.Tensor) -> str | None:
    """Why output `g` is laid out in memory as no caller of the reference expects, or None: it must
    be contiguous or have the reference's strides (dimensions of size 1 aside). A stride-0
    `expand` of one computed row, or a view into a smaller buffer, holds the right values for a
    reader but not a full tensor: it skipped the writes, and writing into it changes other elements."""
    if g.numel() <= 1 or g.is_contiguous():
        return None
    if all(a == b for n, a, b in zip(g.shape, g.stride(), e.stride()) if n > 1):
        return None
    return (f"has strides {list(g.stride())}, neither contiguous nor the reference's {list(e.stride())}; "
            "return a full tensor (a stride-0 expand or a view of a smaller buffer is not one)")


def relative_error(e: torch.Tensor, g: torch.Tensor, chunk: int = 2**24) -> float:
    """||g - e|| / ||e|| in float64 over the elements where both are finite (in chunks: outputs of
    10^8 elements stay affordable; complex values as their real and imaginary parts); 0 for an
    all-zero reference, where allclose alone decides."""
    if e.is_complex():
        e, g = torch.view_as_real(e), torch.view_as_real(g)
    diff2 = ref2 = 0.0
    e_flat, g_flat = e.reshape(-1), g.reshape(-1)
    for start in range(0, e_flat.numel(), chunk):
        e64, g64 = e_flat[start:start + chunk].double(), g_flat[start:start + chunk].double()
        finite = torch.isfinite(e64) & torch.isfinite(g64)
        diff2 += float(torch.where(finite, g64 - e64, 0.0).square().sum())
        ref2 += float(torch.where(finite, e64, 0.0).square().sum())
    return (diff2 / ref2) ** 0.5 if ref2 > 0 else 0.0


def _value_mismatch(e: torch.Tensor, g: torch.Tensor, atol: float, rtol: float) -> str | None:
    if e.is_floating_point() or e.is_complex():
        # isclose with equal_nan: NaN only matches NaN, inf only the same inf.
        bad = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
        bad = g != e
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    first = _index(bad.reshape(-1).nonzero()[0].item(), e.shape)
    text = (f"{n_bad} of {e.numel()} elements differ beyond atol={atol:g}, rtol={rtol:g}; "
            f"first at {first} (got {g[first].item():.6g}, expected {e[first].item():.6g})")
    if e.is_floating_point():
        g32, e32 = g.float(), e.float()
        finite = torch.isfinite(g32) & torch.isfinite(e32)
        err = torch.where(finite, (g32 - e32).abs(), torch.zeros((), device=e.device))
        worst = _index(int(err.reshape(-1).argmax()), e.shape)
        rel = err / e32.abs().clamp_min(1e-6)
        text += (f"; max abs error {err[worst].item():.4g} at {worst} (got {g[worst].item():.6g}, "
                 f"expected {e[worst].item():.6g}); max rel error {rel.max().item():.4g}")
    return text


def _index(flat: int, shape) -> tuple:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))
