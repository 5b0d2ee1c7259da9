"""The expert pager's per-call path (``moetide.vllm.staging``), torch alone: the slot tables, host copies and
counters of one layer, the path compiled as one graph (``torch.compile(fullgraph=True)``, as vLLM's compiled
forward holds it) that follows line moves made between calls without recompiling, the Triton copy's masking under
Triton's interpreter, and, where a GPU is lent (``benchmarks/gpu_checks.sh``), the path captured in a CUDA graph
and replayed across line moves.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from moetide.vllm.staging import ExpertSlots, page_experts, take_counts  # noqa: E402

NUM_EXPERTS, NUM_SLOTS = 6, 3


def layer_weights(device: str, name: str) -> tuple[ExpertSlots, torch.Tensor, torch.Tensor]:
    """A layer of 6 experts and 3 staging slots; returns its slots, its weights and a copy of the experts' rows."""
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS + NUM_SLOTS, 4, 8, generator=gen).to(device)
    w2 = torch.randn(NUM_EXPERTS + NUM_SLOTS, 8, 2, generator=gen).to(device)
    w13[NUM_EXPERTS:] = 0
    w2[NUM_EXPERTS:] = 0
    return ExpertSlots([w13, w2], NUM_EXPERTS, name), w13, w13[:NUM_EXPERTS].clone()


def moe_call(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, name: str) -> torch.Tensor:
    """What vLLM's compiled region holds of one MoE call: the per-call path, then a kernel that reads row
    ``slot`` of the weights for each routed (token, k)."""
    slots = page_experts(topk_ids, name)  # [T, K]
    return torch.einsum("th,tkhf->tf", x, w13[slots])


def reference(x: torch.Tensor, topk_ids: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return torch.einsum("th,tkhf->tf", x, experts[topk_ids])


def lend(w13: torch.Tensor, expert: int) -> None:
    """An offloaded expert's home rows hold someone else's bytes (the KV cache's) while it is out."""
    w13[expert].fill_(1e6)


def check_line_moves(call, slots: ExpertSlots, w13: torch.Tensor, experts: torch.Tensor) -> None:
    """Drive ``call`` through line moves made between calls; every output equals the reference, and the counters
    say what was routed and staged."""
    device = w13.device
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to(device)
    topk = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 4], [0, 5]], device=device)
    assert torch.allclose(call(x, topk), reference(x, topk, experts))
    for expert in (1, 4):  # out, and their home rows lent
        slots.take_out(expert)
        lend(w13, expert)
    assert torch.allclose(call(x, topk), reference(x, topk, experts))
    (counters,) = take_counts([slots])
    assert counters[:NUM_EXPERTS] == [4, 4, 2, 2, 4, 4] and counters[-1] == 2  # tokens routed; calls
    assert counters[NUM_EXPERTS:-1] == [0, 1, 0, 0, 1, 0, 0]  # the second call staged each offloaded expert once
    assert slots.step_counts(counters, ran_forward=True) == ([4, 4, 2, 2, 4, 4], 2, 0)
    slots.bring_home(1)  # back home from its copy; 4 stays out
    slots.take_out(2)
    lend(w13, 2)
    only = torch.tensor([[0, 3], [3, 0], [0, 0], [3, 3], [0, 3]], device=device)  # no offloaded expert routed
    assert torch.allclose(call(x, only), reference(x, only, experts))
    assert torch.allclose(call(x, topk), reference(x, topk, experts))
    (counters,) = take_counts([slots])
    assert counters[NUM_EXPERTS:-1] == [0, 0, 1, 0, 1, 0, 0] and counters[-1] == 2
    assert torch.equal(w13[1], experts[1])  # written home exactly


def test_slots_stage_what_is_routed_and_write_home_exactly():
    slots, w13, experts = layer_weights("cpu", "test.eager")
    check_line_moves(lambda x, ids: moe_call(x, ids, w13, "test.eager"), slots, w13, experts)
    with pytest.raises(ValueError, match="cannot go out"):
        slots.take_out(4)
    slots.take_out(0)  # 2, 4 and 0 out: every slot taken
    with pytest.raises(ValueError, match="no free staging slot"):
        slots.take_out(3)


def test_unstaged_counts_a_forward_that_left_the_path_out_or_did_not_stage():
    slots, w13, experts = layer_weights("cpu", "test.guard")
    x, topk = torch.randn(2, 4), torch.tensor([[0, 1], [1, 2]])
    reference(x, topk, w13[:NUM_EXPERTS])  # a forward without the path: nothing counted
    assert slots.step_counts(take_counts([slots])[0], ran_forward=True)[2] == 0  # nothing was out
    slots.take_out(1)
    reference(x, topk, w13[:NUM_EXPERTS])  # ... now computed from the lent home row
    assert slots.step_counts(take_counts([slots])[0], ran_forward=True)[2] == 1
    assert slots.step_counts(take_counts([slots])[0], ran_forward=False)[2] == 0  # a step with no forward
    moe_call(x, topk, w13, "test.guard")
    assert slots.step_counts(take_counts([slots])[0], ran_forward=True) == ([1, 2, 1, 0, 0, 0], 1, 0)
    slots.routed[1] += 3  # routed with nothing staged
    slots.calls += 1
    assert slots.step_counts(take_counts([slots])[0], ran_forward=True)[2] == 1


@pytest.mark.filterwarnings("error::UserWarning")  # torch warns where an op's output aliases its input
def test_the_per_call_path_is_one_graph_that_follows_line_moves():
    """``fullgraph=True``: no graph break, compiled by Inductor as vLLM compiles its forward. One compilation for
    every call: the line moves between calls change tensors in place, never what the graph holds."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    slots, w13, experts = layer_weights("cpu", "test.compiled")
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(moe_call, backend=counter, fullgraph=True, dynamic=False)
    check_line_moves(lambda x, ids: compiled(x, ids, w13, "test.compiled"), slots, w13, experts)
    assert counter.frame_count == 1


def test_the_triton_copy_copies_only_the_routed_rows():
    """The CUDA copy's kernel under Triton's interpreter, on CPU tensors (the masking and the chunking; the read of
    pinned memory over the bus is the GPU check's)."""
    pytest.importorskip("triton")
    code = """
import torch
from moetide.vllm.staging_kernel import copy_rows_where_cuda
for shape, dtype in (((3, 5, 7), torch.bfloat16), ((3, 1500), torch.float32)):
    src = torch.randn(shape).to(dtype)
    dst = torch.zeros(shape, dtype=dtype)
    copy_rows_where_cuda(torch.tensor([True, False, True]), dst, src)
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2]) and not dst[1].any()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.gpu
def test_the_per_call_path_in_a_cuda_graph_replays_across_line_moves():
    """Captured once, replayed after line moves: the staging reads the pinned host copies, and the remap the slot
    tables as they are at replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    slots, w13, experts = layer_weights("cuda", "test.cuda")
    assert all(host.is_pinned() for host in slots.host)
    x = torch.randn(5, 4, device="cuda")
    ids = torch.zeros(5, 2, dtype=torch.long, device="cuda")
    out = torch.empty(5, 2, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
        moe_call(x, ids, w13, "test.cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(moe_call(x, ids, w13, "test.cuda"))

    def replay(x_now: torch.Tensor, ids_now: torch.Tensor) -> torch.Tensor:
        x.copy_(x_now)
        ids.copy_(ids_now)
        graph.replay()
        return out.clone()

    take_counts([slots])
    check_line_moves(replay, slots, w13, experts)
