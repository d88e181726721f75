"""The trainer's attention over shared-prompt parts against SDPA under the whole mask, and what it keeps."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainer.backends.part_attention import dense_mask, parts_attention, row_parts

HEADS, KV_HEADS, DIM = 9, 3, 64  # the bundled model's: 3 query heads per key head


class _Attention(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _row(spec: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, list[list[int]]]:
    """segments and part bounds of a row whose parts are (shared tokens, each rollout's rest length)."""
    segments: list[int] = []
    bounds = []
    for shared, rests in spec:
        begin = len(segments)
        segments += [0] * shared + [r + 1 for r, n in enumerate(rests) for _ in range(n)]
        bounds.append([begin, len(segments)])
    return torch.tensor([segments]), bounds


def _inputs(n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """q (1, H, N, d), k and v (1, KV, N, d), strided as a model's projections leave them, and an output grad."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, heads, DIM, generator=g).to(dtype).transpose(1, 2).requires_grad_()
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    return [q, k, v, torch.randn(1, n, HEADS, DIM, generator=g).to(dtype)]


def _run(kernel: str, segments: torch.Tensor, bounds: list[list[int]], inputs: list[torch.Tensor],
         ) -> list[torch.Tensor]:
    """The output and the gradients of q, k and v, in fp64, of one kernel over the row."""
    q, k, v, grad = inputs
    if kernel == "parts":
        out = parts_attention(_Attention(), q, k, v, None, parts=row_parts(segments, bounds), dropout=0.0,
                              scaling=DIM ** -0.5)[0]
    else:
        mask = dense_mask(segments, bounds).to(q.dtype)
        out = sdpa_attention_forward(_Attention(), q, k, v, mask, dropout=0.0, scaling=DIM ** -0.5)[0]
    (out.double() * grad.double()).sum().backward()
    result = [out.detach().double(), *(x.grad.double() for x in (q, k, v))]
    for x in (q, k, v):
        x.grad = None
    return result


ROW = [(60, [30, 41, 17, 48, 35, 22, 39, 28]),  # a group: a prompt, then 8 rollouts of different lengths
       (0, [5, 9]),                             # a one-token prompt shares nothing
       (1, [1]),                                # a one-token rest
       (75, [12] * 8)]


def test_parts_attention_equals_sdpa_under_the_whole_rows_mask_values_and_gradients():
    segments, bounds = _row(ROW)
    inputs = _inputs(segments.shape[1], torch.float32)
    ours, sdpa = _run("parts", segments, bounds, inputs), _run("sdpa", segments, bounds, inputs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name


def test_parts_attention_in_bf16_is_as_close_to_the_exact_values_as_sdpa():
    # Scores, softmax and the probabilities' gradient in fp32, the products in bf16: the same precision as SDPA's
    # flash kernel, measured against both computed exactly (fp64) from the same bf16 inputs.
    segments, bounds = _row(ROW)
    inputs = _inputs(segments.shape[1], torch.bfloat16, seed=1)
    exact_inputs = [x.detach().double().requires_grad_(x.requires_grad) for x in inputs]
    exact = _run("sdpa", segments, bounds, exact_inputs)
    ours, sdpa = _run("parts", segments, bounds, inputs), _run("sdpa", segments, bounds, inputs)
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), ours, sdpa, exact, strict=True):
        ours_error, sdpa_error = (a - e).abs().mean(), (b - e).abs().mean()
        assert ours_error <= 1.5 * sdpa_error, (name, float(ours_error), float(sdpa_error))


class _NonFiniteOperands(TorchDispatchMode):
    """Records each matrix product that reads an inf or NaN operand."""

    PRODUCTS = frozenset({torch.ops.aten.bmm, torch.ops.aten.mm, torch.ops.aten.matmul})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.PRODUCTS and any(
                isinstance(a, torch.Tensor) and a.is_floating_point() and not torch.isfinite(a).all() for a in args):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parts_attention_multiplies_no_inf_or_nan_of_its_padding(dtype):
    # Rollouts shorter than their part's longest are padded; the padding rows' probabilities must be 0, not inf or
    # NaN. A product row reads only its own row, yet on a CPU with AMX the bf16 matmul carried a padding row's NaN
    # into the rollout's last token: NaN losses in every bf16 run with rollouts of unequal length.
    segments, bounds = _row(ROW)
    inputs = _inputs(segments.shape[1], dtype)
    with _NonFiniteOperands() as products:
        _run("parts", segments, bounds, inputs)
    assert not products.seen, products.seen


def test_parts_attention_keeps_memory_linear_in_a_parts_length():
    # A long branched part: a 2,000-token shared history and 2 rollouts of 1,000 tokens. Scores kept for backward
    # would be 9 heads x 4,000 x 3,000 (the multi-turn run that grew a trainer to 14 GB kept such matrices).
    segments, bounds = _row([(2000, [1000, 1000])])
    n = segments.shape[1]
    q, k, v, _ = _inputs(n, torch.bfloat16)
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        parts_attention(_Attention(), q, k, v, None, parts=row_parts(segments, bounds), dropout=0.0)
    # q, the shared keys and values, the padded rests, the output, log-sum-exps: a few times the inputs
    assert 0 < sum(saved) <= 8 * n * HEADS * DIM


def test_parts_attention_refuses_dropout():
    segments, bounds = _row([(4, [2, 3])])
    q, k, v, _ = _inputs(segments.shape[1], torch.float32)
    with pytest.raises(ValueError, match="share_prompt=false"):
        parts_attention(_Attention(), q, k, v, None, parts=row_parts(segments, bounds), dropout=0.1)
