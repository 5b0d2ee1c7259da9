"""The CPU KV backing of the vLLM plugin (``moetide.vllm.backing``), with no vLLM: pages of the reserve are
committed only while granted, given back to the system on release, and unreadable while ungranted."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

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
    assert backing.history == [(True, 0, 0), (False, 4 * LAYERS * BLOCK, 0), (True, 0, 0)]


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
