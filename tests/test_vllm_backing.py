"""The CPU KV backing of the vLLM plugin (``moetide.vllm.backing``), with no vLLM: pages of the reserve are
committed only while granted, given back to the system on release, and unreadable while ungranted."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from moetide.vllm.shared_rows import SharedRows, StagingArea  # noqa: E402
from moetide.vllm.backing import PAGE, CpuBacking  # noqa: E402
from moetide.vllm.line import LineOp  # noqa: E402

BLOCK = 2 * PAGE  # one block of one layer: whole pages, so protection is exact
NUM_BLOCKS, BASE, LAYERS = 24, 8, 3


def layer_outer() -> list:
    """vLLM's KVCacheTensor fields for a layer-outermost cache: each layer's blocks contiguous."""
    return [SimpleNamespace(offset=0, layer_stride=NUM_BLOCKS * BLOCK, block_stride=BLOCK,
                            layers=[f"l{i}" for i in range(LAYERS)])]


def block_outer() -> list:
    """... and a block-outermost one: each block holds every layer's page."""
    return [SimpleNamespace(offset=0, layer_stride=BLOCK, block_stride=LAYERS * BLOCK,
                            layers=[f"l{i}" for i in range(LAYERS)])]


def write_block(backing: CpuBacking, tensors, block_id: int) -> None:
    t = tensors[0]
    for layer in range(LAYERS):
        start = t.offset + layer * t.layer_stride + block_id * t.block_stride
        backing.buffer[start:start + BLOCK].fill_(7)


@pytest.mark.parametrize("layout", [layer_outer, block_outer])
def test_reserve_pages_are_committed_only_while_granted(layout):
    tensors = layout()
    backing = CpuBacking(NUM_BLOCKS * LAYERS * BLOCK, tensors, num_base_blocks=BASE, num_blocks=NUM_BLOCKS)
    assert backing.reserve_bytes == (NUM_BLOCKS - BASE) * LAYERS * BLOCK
    write_block(backing, tensors, 3)  # the base is ordinary memory
    assert backing.resident_reserve_bytes() == 0
    region = tuple(range(BASE, BASE + 6))
    backing.apply(LineOp(True, region, ((0, 0),)))
    assert backing.resident_reserve_bytes() == 0  # granting commits nothing by itself
    for block_id in region[:4]:
        write_block(backing, tensors, block_id)
    assert backing.resident_reserve_bytes() == 4 * LAYERS * BLOCK
    assert backing.buffer[BASE * tensors[0].block_stride].item() == 7
    backing.apply(LineOp(False, region, ((0, 0),)))
    assert backing.resident_reserve_bytes() == 0  # every page went back
    backing.apply(LineOp(True, region, ((0, 0),)))  # granted again: zeros, as a fresh KV block
    assert backing.buffer[BASE * tensors[0].block_stride].item() == 0
    assert backing.history == [(True, 0, 0, 0), (False, 4 * LAYERS * BLOCK, 0, 0), (True, 0, 0, 0)]


@pytest.mark.parametrize("layout", [layer_outer, block_outer])
def test_granted_blocks_live_in_the_lent_expert_pages(layout):
    """The whole line on the CPU: the KV blocks a region grants are the experts' own pages (what the KV cache
    writes shows in the expert rows), no anonymous memory is taken, expert pages the blocks do not need go back to
    the system, and a give-back returns the pages to the experts."""
    tensors = layout()
    backing = CpuBacking(NUM_BLOCKS * LAYERS * BLOCK, tensors, num_base_blocks=BASE, num_blocks=NUM_BLOCKS)
    experts = SharedRows(torch.full((4, 5 * PAGE), 3, dtype=torch.uint8), capacity=8)  # 5 pages an expert
    assert experts.file_bytes() == 4 * 5 * PAGE
    region = tuple(range(BASE, BASE + 3))  # 3 blocks x LAYERS x 2 pages = 18 pages, of the 20 lent
    lent = [experts.row_pages(0), experts.row_pages(1), experts.row_pages(2), experts.row_pages(3)]
    backing.apply(LineOp(True, region, ((0, 0), (0, 1), (0, 2), (0, 3))), lent)
    assert backing.lent_bytes == 3 * LAYERS * BLOCK
    assert experts.file_bytes() == 3 * LAYERS * BLOCK  # the 2 pages the blocks did not need went back
    for block_id in region:
        write_block(backing, tensors, block_id)
    assert backing.anonymous_reserve_bytes() == 0  # the KV writes landed in the experts' pages
    assert experts.file_bytes() == 3 * LAYERS * BLOCK  # and took no new memory
    rows = experts.view(4)
    assert int((rows == 7).sum()) == 3 * LAYERS * BLOCK
    backing.apply(LineOp(False, region, ((0, 0), (0, 1), (0, 2), (0, 3))))
    assert backing.lent_bytes == 0 and backing.anonymous_reserve_bytes() == 0
    rows.fill_(3)  # the pager writes the experts home
    assert int((rows == 3).sum()) == rows.numel() and experts.file_bytes() == 4 * 5 * PAGE
    assert backing.history == [(True, 0, 0, 3 * LAYERS * BLOCK), (False, 0, 0, 0)]


def test_bad_ops_are_refused_and_change_nothing():
    backing = CpuBacking(NUM_BLOCKS * LAYERS * BLOCK, layer_outer(), num_base_blocks=BASE, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="outside the reserve"):
        backing.apply(LineOp(True, (BASE - 1,), ()))
    backing.apply(LineOp(True, (BASE,), ()))
    with pytest.raises(ValueError, match="granted twice"):
        backing.apply(LineOp(True, (BASE,), ()))
    with pytest.raises(ValueError, match="not granted"):
        backing.apply(LineOp(False, (BASE + 1,), ()))
    assert backing.granted == {BASE}


@pytest.mark.parametrize("block_id, dies", [(BASE + 2, True), (BASE - 1, False)])
def test_touching_an_ungranted_block_kills_the_process(block_id, dies):
    code = f"""
from types import SimpleNamespace
from moetide.vllm.backing import CpuBacking
t = [SimpleNamespace(offset=0, layer_stride={NUM_BLOCKS * BLOCK}, block_stride={BLOCK}, layers=['a'])]
b = CpuBacking({NUM_BLOCKS * BLOCK}, t, num_base_blocks={BASE}, num_blocks={NUM_BLOCKS})
print(int(b.buffer[{block_id * BLOCK}]), flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode == -11) == dies, (done.returncode, done.stderr[-2000:])


def test_every_layers_staging_rows_are_one_memory():
    """Two layers' staging rows mapped onto one staging area: what one layer stages is what the other's rows read,
    and the area holds the rows once."""
    area = StagingArea()
    layers = [SharedRows(torch.full((4, 2 * PAGE), i, dtype=torch.uint8), capacity=8) for i in (1, 2)]
    assert all(rows.share_rows(4, 2, area) for rows in layers)
    views = [rows.view(6) for rows in layers]
    views[0][4:6].fill_(9)  # layer 0 stages two experts
    assert int((views[1][4:6] == 9).sum()) == 2 * 2 * PAGE  # layer 1's staging rows are the same pages
    assert torch.equal(views[1][:4], torch.full((4, 2 * PAGE), 2, dtype=torch.uint8))  # its own rows untouched
    assert area.size == area.file_bytes() == 2 * 2 * PAGE
    odd = SharedRows(torch.zeros((4, PAGE + 8), dtype=torch.uint8), capacity=8)
    assert not odd.share_rows(4, 2, StagingArea())  # rows that are not whole pages keep their own staging rows
