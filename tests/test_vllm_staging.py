"""The expert pager's host copies and staging (``moetide.vllm.staging``), torch alone: on the CPU, and on CUDA
(pinned host copies, a copy stream ordered against the compute stream) where a GPU is lent
(``benchmarks/gpu_checks.sh``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moetide.vllm.staging import Stager, host_copy  # noqa: E402


def check_staging(device: str) -> None:
    weights = torch.arange(6 * 4 * 8, dtype=torch.float32, device=device).view(6, 4, 8)  # 4 experts + 2 slots
    copies = {e: host_copy(weights[e]) for e in (1, 3)}
    assert all(c.device.type == "cpu" for c in copies.values())
    if device == "cuda":
        assert all(c.is_pinned() for c in copies.values())
    weights[1].zero_()  # the home rows are not read while the experts are out
    weights[3].zero_()
    stager = Stager(weights.device)
    staged = stager.stage([(weights[4], copies[1]), (weights[5], copies[3])])
    assert staged == 2 * weights[0].nbytes
    after = (weights[4] + weights[5]).sum().item()  # on the compute stream: must see the copies
    expected = torch.arange(6 * 4 * 8, dtype=torch.float32).view(6, 4, 8)
    assert after == (expected[1] + expected[3]).sum().item()
    assert torch.equal(weights[4].cpu(), expected[1]) and torch.equal(weights[5].cpu(), expected[3])


def test_staging_on_the_cpu():
    check_staging("cpu")


@pytest.mark.gpu
def test_staging_on_cuda_copies_pinned_rows_on_a_copy_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_staging("cuda")
    assert Stager(torch.device("cuda")).stream is not None
