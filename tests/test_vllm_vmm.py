"""The line's one memory on an accelerator (``moetide.vllm.vmm``, ``moetide.vllm.vmm_backing``), with torch alone: on
the CPU through ``HostDriver`` (the driver's calls done with ``memfd`` and ``mmap``), and where a GPU is lent
through ``CudaDriver`` (``benchmarks/gpu_checks.sh``). The ledger: the driver's own count of the chunks that exist
never passes what existed when start-up ended, through grants, stagings and give-backs; the experts' rows and the
KV cache's bytes come back intact; 1,000 cycles leak nothing.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from moetide.vllm.line import LineOp  # noqa: E402
from moetide.vllm.line_memory import lendable_bytes  # noqa: E402
from moetide.vllm.staging import ExpertSlots  # noqa: E402
from moetide.vllm.vmm import (  # noqa: E402
    DeviceMemory,
    HostDriver,
    OverBudget,
    SharedStaging,
    VmmRows,
    move_experts,
)
from moetide.vllm.vmm_backing import VmmBacking, spare_granules  # noqa: E402

GRANULE = 64 << 10
NUM_EXPERTS, NUM_SLOTS, LAYERS = 8, 4, 2
W13_ROW, W2_ROW = (96, 256), (256, 48)  # 96 KiB and 48 KiB rows of float32: granules cut rows
NUM_BLOCKS, BASE, KV_LAYERS, PAGE = 48, 16, 2, 24 << 10  # a block: 24 KiB per layer, granules cut blocks


def driver(kind: str):
    if kind == "host":
        return HostDriver(GRANULE)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from moetide.vllm.cuda_driver import CudaDriver

    return CudaDriver()


DRIVERS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


def chunk_bytes(drv) -> int:
    """The device memory that exists now, counted by the driver (HostDriver), else by the device: what is in use
    less what torch's caching allocator holds (the driver's chunks are not torch's)."""
    if isinstance(drv, HostDriver):
        return drv.chunk_bytes
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


class Line:
    """Two MoE layers of paged experts and a KV backing over one ``DeviceMemory``: the plugin's memory on a device,
    line moves made as ``vllm.pager.apply_line_op`` makes them."""

    def __init__(self, drv) -> None:
        self.memory = DeviceMemory(drv)
        device = "cpu" if isinstance(drv, HostDriver) else "cuda"
        gen = torch.Generator().manual_seed(0)
        staging = SharedStaging(self.memory)
        self.layers, self.originals = [], []
        for layer in range(LAYERS):
            weights = [torch.randn(NUM_EXPERTS, *shape, generator=gen).to(device) for shape in (W13_ROW, W2_ROW)]
            rows = [VmmRows(self.memory, w, NUM_EXPERTS, NUM_SLOTS, staging) for w in weights]
            slots = ExpertSlots([r.tensor for r in rows], NUM_EXPERTS, f"vmm-test.{layer}")
            self.layers.append((slots, rows))
            self.originals.append([w.clone() for w in weights])
            del weights
        tensors = [SimpleNamespace(offset=0, layer_stride=NUM_BLOCKS * PAGE, block_stride=PAGE,
                                   layers=[f"kv{i}" for i in range(KV_LAYERS)])]
        self.backing = VmmBacking(NUM_BLOCKS * PAGE * KV_LAYERS, tensors, self.memory, num_base_blocks=BASE,
                                  num_blocks=NUM_BLOCKS)
        self.budget = chunk_bytes(drv)
        self.granted: list[tuple[tuple[int, ...], dict[int, set[int]]]] = []

    def out(self, layer: int) -> set[int]:
        return set(self.layers[layer][0].out)

    def grant(self, region: dict[int, set[int]], num_blocks: int) -> tuple[int, ...]:
        first = BASE + sum(len(ids) for ids, _ in self.granted)
        ids = tuple(range(first, first + num_blocks))
        for layer, experts in region.items():
            move_experts(*self.layers[layer], self.out(layer) | experts)
        self.backing.apply(LineOp(True, ids, ()))
        self.granted.append((ids, region))
        return ids

    def give_back(self) -> None:
        ids, region = self.granted.pop()
        self.backing.apply(LineOp(False, ids, ()))
        for layer, experts in region.items():
            move_experts(*self.layers[layer], self.out(layer) - experts)

    def experts_intact(self) -> bool:
        return all(torch.equal(rows.tensor[:NUM_EXPERTS][sorted(set(range(NUM_EXPERTS)) - self.out(layer))],
                               original[sorted(set(range(NUM_EXPERTS)) - self.out(layer))])
                   for layer, ((_, pair), originals) in enumerate(zip(self.layers, self.originals))
                   for rows, original in zip(pair, originals))


def grantable(region: dict[int, set[int]]) -> int:
    """Blocks the scheduler grants for a region: its experts' lendable bytes (``lendable_bytes``) in blocks."""
    lend = lendable_bytes(W13_ROW[0] * W13_ROW[1] * 4, GRANULE) + lendable_bytes(W2_ROW[0] * W2_ROW[1] * 4, GRANULE)
    return sum(map(len, region.values())) * lend // (PAGE * KV_LAYERS)


def block_bytes_of(backing: VmmBacking, ids) -> list[torch.Tensor]:
    return [backing.buffer[s:e] for s, e in backing.spans.intervals(ids)]


@pytest.mark.parametrize("kind", DRIVERS)
def test_grants_stagings_and_give_backs_stay_within_the_start_up_budget(kind):
    line = Line(driver(kind))
    memory, backing = line.memory, line.backing
    assert memory.budget_bytes == memory.held_bytes
    for view in block_bytes_of(backing, range(BASE)):
        view.fill_(7)
    region = {0: {1, 2, 5}, 1: {3}}
    ids = line.grant(region, grantable(region))
    assert chunk_bytes(memory.driver) <= line.budget
    assert sum(len(weight.lent) for _, rows in line.layers for weight in rows) >= len(backing.granted) * PAGE * \
        KV_LAYERS // GRANULE  # the grant is backed by the experts' own chunks (and at most the spare besides)
    for view in block_bytes_of(backing, ids):
        assert int(view.abs().sum()) == 0  # granted chunks come zeroed
        view.fill_(9)
    x = torch.randn(3, W13_ROW[0], device=line.layers[0][1][0].tensor.device)
    topk = torch.tensor([[1, 2], [5, 0], [2, 1]], dtype=torch.int32, device=x.device)
    slots, (w13, _) = line.layers[0]
    mapped = slots.route(topk)  # stages experts 1, 2 and 5 into the shared staging rows
    reference = torch.einsum("th,tkhf->tf", x, line.originals[0][0][topk.long()])
    assert torch.equal(torch.einsum("th,tkhf->tf", x, w13.tensor[mapped.long()]), reference)
    assert chunk_bytes(memory.driver) <= line.budget
    line.give_back()
    assert chunk_bytes(memory.driver) <= line.budget
    assert line.experts_intact() and not line.out(0) and not line.out(1)
    assert all(bool((view == 7).all()) for view in block_bytes_of(backing, range(BASE)))
    assert max(held for _, held in backing.history) <= memory.budget_bytes


def test_a_grant_its_experts_and_the_spare_cannot_cover_changes_nothing():
    line = Line(driver("host"))
    memory, backing = line.memory, line.backing
    free, held = memory.free_chunks, line.memory.driver.chunk_bytes
    too_many = (free + 1) * GRANULE // PAGE  # more granules than the free list has, no expert out
    with pytest.raises(OverBudget, match="granules"):
        backing.apply(LineOp(True, tuple(range(BASE, BASE + too_many // KV_LAYERS)), ()))
    assert not backing.granted and memory.free_chunks == free and line.memory.driver.chunk_bytes == held
    assert backing.mapped_bytes == sum(size for _, size, _ in backing._base)


@pytest.mark.parametrize("kind", DRIVERS)
def test_a_thousand_cycles_leak_nothing(kind):
    line = Line(driver(kind))
    memory = line.memory
    held, free = chunk_bytes(memory.driver), memory.free_chunks
    regions = [{0: {0, 1}, 1: {7}}, {1: {2, 3, 4}}, {0: {6}}]
    for cycle in range(1000):
        region, nested = regions[cycle % len(regions)], regions[(cycle + 1) % len(regions)]
        line.grant(region, grantable(region))
        if cycle % 2:
            line.grant(nested, grantable(nested))
            line.give_back()
        line.give_back()
    assert chunk_bytes(memory.driver) == held and memory.free_chunks == free
    assert memory.peak_bytes == memory.budget_bytes and line.experts_intact()


def test_an_unmapped_expert_granule_faults():
    """An offloaded expert's granules are gone from the expert range: reading them kills the process, as a CUDA
    kernel touching an unmapped address faults."""
    code = (
        "import torch\n"
        "from moetide.vllm.vmm import DeviceMemory, HostDriver, SharedStaging, VmmRows\n"
        "memory = DeviceMemory(HostDriver(64 << 10))\n"
        "rows = VmmRows(memory, torch.ones(4, 64, 256), 4, 1, SharedStaging(memory))\n"
        "rows.lend({1})\n"
        "print(float(rows.tensor[0].sum()), flush=True)\n"
        "print(float(rows.tensor[1].sum()), flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode < 0 and result.stdout.split() == ["16384.0"]


def test_host_driver_refuses_what_the_cuda_driver_refuses():
    drv = HostDriver(GRANULE)
    address = drv.reserve(4 * GRANULE)
    chunk = drv.create(GRANULE)
    with pytest.raises(ValueError, match="aligned"):
        drv.map(address + 4096, GRANULE, chunk)
    drv.map(address, GRANULE, chunk)
    with pytest.raises(ValueError, match="already mapped"):
        drv.map(address, GRANULE, drv.create(GRANULE))
    with pytest.raises(ValueError, match="while mapped"):
        drv.release(chunk)
    with pytest.raises(ValueError, match="outside"):
        drv.map(address + 8 * GRANULE, GRANULE, chunk)
    drv.map(address + GRANULE, GRANULE, chunk)  # one chunk at two addresses is one memory
    drv.set_access(address, 2 * GRANULE)
    view = drv.view(address, 2 * GRANULE)
    view[:GRANULE].fill_(5)
    assert int(view[GRANULE:].sum()) == 5 * GRANULE
    with pytest.raises(ValueError, match="one mapping"):  # cuMemUnmap takes one mapping's whole range
        drv.unmap(address, 2 * GRANULE)


@pytest.mark.parametrize("row", [1 << 20, 3 << 20, 6 << 20, 5632 << 10, 224 << 20, 96 << 10])
def test_lendable_bytes_is_the_fewest_whole_granules_any_row_holds(row):
    granule = 2 << 20
    fewest = min((e + 1) * row // granule + (-e * row // granule) for e in range(64)) * granule
    assert lendable_bytes(row, granule) == max(fewest, 0)


def test_the_spare_is_one_granule_per_kv_range_and_one():
    layer_outer = SimpleNamespace(layers=["a", "b", "c"], layer_stride=1 << 30, block_stride=1 << 16)
    block_outer = SimpleNamespace(layers=["a", "b", "c"], layer_stride=1 << 16, block_stride=3 << 16)
    assert spare_granules([layer_outer]) == 4 and spare_granules([block_outer]) == 2


@pytest.mark.parametrize("kind", DRIVERS)
def test_the_kv_range_maps_the_base_in_few_chunks_and_the_reserve_only_while_granted(kind):
    drv = driver(kind)
    memory = DeviceMemory(drv)
    block = 3 * drv.granule // 4  # one layer's block: granules cut blocks
    tensors = [SimpleNamespace(offset=0, layer_stride=NUM_BLOCKS * block, block_stride=block,
                               layers=["l0", "l1"])]
    lent = [memory.create(drv.granule) for _ in range(8)]  # what experts will lend, held from the start
    backing = VmmBacking(NUM_BLOCKS * 2 * block, tensors, memory, num_base_blocks=BASE, num_blocks=NUM_BLOCKS,
                         spare_chunks=0)
    assert len(backing._base) == 2  # one chunk per layer's run of base granules
    base_bytes = backing.mapped_bytes
    backing.buffer[:BASE * block].fill_(3)
    with pytest.raises(OverBudget):  # nothing lent, no spare: no grant
        backing.apply(LineOp(True, (BASE,), ()))
    for chunk in lent:
        memory.put(chunk)
    region = tuple(range(BASE, BASE + 4))
    backing.apply(LineOp(True, region, ()))
    assert backing.mapped_bytes > base_bytes
    start = BASE * block
    assert int(backing.buffer[start:start + 4 * block].abs().sum()) == 0
    backing.buffer[start:start + 4 * block].fill_(5)
    backing.apply(LineOp(False, region, ()))
    assert backing.mapped_bytes == base_bytes and memory.free_chunks == 8
    assert int(backing.buffer[:BASE * block].float().mean()) == 3
    with pytest.raises(ValueError, match="outside the reserve"):
        backing.apply(LineOp(True, (1,), ()))
    with pytest.raises(ValueError, match="not granted"):
        backing.apply(LineOp(False, (BASE,), ()))
    backing.close()


def moe_reference(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """What a fused-MoE kernel does with row ``ids[t, k]`` of the weights, reduced: ``x @ w13[id]`` summed over k."""
    return torch.einsum("th,tkhf->tf", x, w13[ids.long()])


@pytest.mark.parametrize("kind", DRIVERS)
def test_the_per_call_path_over_moved_chunks_replays_across_line_moves(kind):
    """The pager's per-call path and a reference MoE over ``VmmRows`` (captured once in a CUDA graph on a GPU, called
    as is on the CPU) while regions are granted and given back: the granules of offloaded experts leave the expert
    range under the captured pointers, and every output equals the all-resident reference."""
    line = Line(driver(kind))
    slots, (w13, _) = line.layers[0]
    device = w13.tensor.device
    x = torch.randn(6, W13_ROW[0], device=device)
    ids = torch.zeros(6, 2, dtype=torch.int32, device=device)
    out = torch.empty(6, W13_ROW[1], device=device)

    def body() -> None:
        out.copy_(moe_reference(x, slots.route(ids), w13.tensor))

    call = body
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        call = graph.replay
    gen = torch.Generator().manual_seed(3)
    for step, region in enumerate([{0: {0, 1}}, {0: {5, 6}}, None, {0: {3}}, None, None, {0: {7, 4}}]):
        if region is None:
            line.give_back()
        else:
            line.grant(region, grantable(region))
        x.copy_(torch.randn(6, W13_ROW[0], generator=gen))
        ids.copy_(torch.randint(0, NUM_EXPERTS, (6, 2), generator=gen, dtype=torch.int32))
        call()
        expected = moe_reference(x, ids, line.originals[0][0].to(device))
        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-3), f"step {step}"
    assert chunk_bytes(line.memory.driver) <= line.budget


def dequantize(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-FP8 weights ``[..., n, k]`` and their ``[..., n/128, k/128]`` scales as float32, as vLLM dequantizes
    them."""
    n, k = fp8.shape[-2:]
    return fp8.float() * scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]


def fp8_moe(x: torch.Tensor, ids: torch.Tensor, fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize-and-apply over rows ``ids`` only (a kernel reads no other row: an offloaded expert's home rows
    are not mapped)."""
    rows = ids.long()
    return torch.einsum("th,tkfh->tf", x, dequantize(fp8[rows], scale[rows]))


@pytest.mark.parametrize("kind", DRIVERS)
def test_fp8_experts_and_their_scales_paged_give_the_dequantized_reference(kind):
    """An FP8 layer as vLLM's FP8 MoE methods hold it (``float8_e4m3fn`` rows, ``float32`` block scales), paged as
    the pager pages it (every per-expert tensor a ``VmmRows``, staged together): the dequantize-and-apply MoE over
    the slots the path returns equals it over the original tensors, while experts are out."""
    from moetide.engine.testmodel_fp8 import quantize_block

    drv = driver(kind)
    memory = DeviceMemory(drv)
    device = "cpu" if isinstance(drv, HostDriver) else "cuda"
    gen = torch.Generator().manual_seed(0)
    quantized = [quantize_block(torch.randn(256, 128, generator=gen)) for _ in range(NUM_EXPERTS)]
    fp8 = torch.stack([q for q, _ in quantized]).to(device)
    scale = torch.stack([s for _, s in quantized]).to(device)
    staging = SharedStaging(memory)
    rows = [VmmRows(memory, t, NUM_EXPERTS, NUM_SLOTS, staging) for t in (fp8, scale)]
    VmmBacking(16 * GRANULE, [SimpleNamespace(offset=0, layer_stride=GRANULE, block_stride=GRANULE, layers=["a"])],
               memory, num_base_blocks=4, num_blocks=16)  # seals the memory, as the plugin's allocation does
    slots = ExpertSlots([r.tensor for r in rows], NUM_EXPERTS, f"vmm-fp8-{kind}")
    x = torch.randn(5, 128, generator=gen).to(device)
    ids = torch.tensor([[0, 1], [2, 3], [1, 6], [7, 0], [3, 5]], dtype=torch.int32, device=device)
    reference = fp8_moe(x, ids, fp8, scale)
    for offloaded in ({1, 3}, {0, 1, 3, 7}, {6}, set()):
        move_experts(slots, rows, offloaded)
        assert torch.equal(fp8_moe(x, slots.route(ids), rows[0].tensor, rows[1].tensor), reference)
    assert memory.held_bytes <= memory.budget_bytes
