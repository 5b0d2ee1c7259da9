"""The CUDA KV backing of the vLLM plugin (``moetide.vllm.cuda_backing``): device memory mapped only for the base
and granted blocks, released on give-back. Needs a CUDA device (torch alone; no vLLM), so it runs on a lent GPU
machine through ``benchmarks/gpu_checks.sh`` and skips elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from moetide.vllm.line import LineOp  # noqa: E402

NUM_BLOCKS, BASE, LAYERS = 32, 8, 2
BLOCK = 1 << 20  # one layer's block: half a 2 MiB granule, so neighbours share chunks


def tensors():
    return [SimpleNamespace(offset=0, layer_stride=NUM_BLOCKS * BLOCK, block_stride=BLOCK,
                            layers=[f"l{i}" for i in range(LAYERS)])]


def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_cuda_vmm_backing_maps_only_base_and_granted_chunks():
    needs_cuda()
    from moetide.vllm.cuda_backing import CudaVmmBacking

    free_before = torch.cuda.mem_get_info()[0]
    backing = CudaVmmBacking(NUM_BLOCKS * LAYERS * BLOCK, tensors(), num_base_blocks=BASE, num_blocks=NUM_BLOCKS)
    base_bytes = backing.mapped_bytes
    assert base_bytes < NUM_BLOCKS * LAYERS * BLOCK  # the reserve is not mapped
    backing.buffer[: BASE * BLOCK].fill_(3)  # base blocks of layer 0
    region = tuple(range(BASE, BASE + 8))
    backing.apply(LineOp(True, region, ((0, 0),)))
    assert backing.mapped_bytes > base_bytes
    start = BASE * BLOCK
    assert int(backing.buffer[start:start + 8 * BLOCK].sum()) == 0  # granted chunks come zeroed
    backing.buffer[start:start + 8 * BLOCK].fill_(5)
    torch.cuda.synchronize()
    backing.apply(LineOp(False, region, ((0, 0),)))
    assert backing.mapped_bytes == base_bytes  # every chunk only the region used went back
    assert int(backing.buffer[: BASE * BLOCK].float().mean()) == 3  # the base is untouched
    backing.close()
    assert torch.cuda.mem_get_info()[0] >= free_before - (4 << 20)


@pytest.mark.gpu
def test_cuda_vmm_backing_refuses_bad_ops():
    needs_cuda()
    from moetide.vllm.cuda_backing import CudaVmmBacking

    backing = CudaVmmBacking(NUM_BLOCKS * LAYERS * BLOCK, tensors(), num_base_blocks=BASE, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="outside the reserve"):
        backing.apply(LineOp(True, (1,), ()))
    with pytest.raises(ValueError, match="not granted"):
        backing.apply(LineOp(False, (BASE,), ()))
    backing.close()
