"""Allocate+free throughput of the KV block pool with prefix hits: moetide against vLLM v1's ``BlockPool``.

One operation is one request's whole life in the pool: look up its longest cached prefix, take references on the
hits, allocate the remaining blocks, register its full blocks in the prefix cache, and — ``--window`` requests
later — free its blocks tail first. Both implementations run the *same* seeded sequence of requests in the same
process, alternately, each on a fresh pool per repeat; the reported figure is the median over repeats and the
ratio is moetide's median over vLLM's.

Workload (``random.Random(--seed)``): every request has ``blocks_per_request`` full blocks of ``block_size``
tokens. It starts with a system prompt shared by all requests, then the fixed prefix of one of
``num_conversations`` conversations (its length drawn per conversation; the conversation drawn per request with
Zipf weights, so some prefixes stay hot and the rest are evicted and recomputed), then tokens of its own. Block
hashes are computed once per request, outside the timed region, in each implementation's own hash type: Python
ints (``moetide.core.hashing``) and vLLM's ``BlockHash`` bytes from its default hash (sha256 over pickle), so that
each lookup pays its implementation's real key cost.

How vLLM is driven: ``BlockPool`` directly, with the few lines of glue that vLLM's ``KVCacheManager`` →
``FullAttentionManager`` (``SingleTypeKVCacheManager``) run around it for one full-attention group without
events, metrics, spec decode or connectors (``_VllmDriver`` mirrors ``find_longest_cache_hit``,
``get_num_blocks_to_allocate``, ``add_local_computed_blocks``, ``allocate_new_blocks``, ``cache_blocks`` and
``free``). vLLM's full ``KVCacheManager`` with real ``Request`` objects was not used: its coordinator and request
objects carry hybrid-group, spec-decode, connector and event machinery that moetide's ``KVCacheManager`` has no
counterpart for, so it would charge vLLM for features and flatter moetide. The glue gives vLLM the lightest
faithful manager, which makes the ratio conservative for moetide.

Pool sizes match: vLLM reserves block 0 as its null block, so its pool gets ``num_blocks + 1`` ids.

Run: ``PYTHONPATH=src /work/.venv-vllm/bin/python benchmarks/core_blocks.py`` (both) or
``.venv/bin/python benchmarks/core_blocks.py`` (moetide only; prints that vLLM is absent).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import moetide
except ModuleNotFoundError:  # run from a checkout without PYTHONPATH=src
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import moetide

from moetide.core.blocks import BlockPool
from moetide.core.hashing import ROOT_HASH, hash_token_blocks
from moetide.core.kv_manager import KVCacheManager

BENCHMARK = "core_blocks"
VOCAB_SIZE = 151_936  # Qwen3's vocabulary; only the shape of the hashed tuples matters


@dataclass(frozen=True)
class Workload:
    num_blocks: int = 4096
    block_size: int = 16
    blocks_per_request: int = 32
    window: int = 64  # live requests; the oldest is freed before a new one is allocated
    system_blocks: int = 12
    num_conversations: int = 256
    min_conversation_blocks: int = 4
    max_conversation_blocks: int = 16
    zipf_s: float = 1.0  # conversation popularity: weight of rank r is 1 / (r + 1) ** zipf_s

    def __post_init__(self) -> None:
        if self.system_blocks + self.max_conversation_blocks >= self.blocks_per_request:
            raise ValueError("system_blocks + max_conversation_blocks must leave at least one private block")
        if self.window * self.blocks_per_request > self.num_blocks:
            raise ValueError(
                f"window × blocks_per_request = {self.window * self.blocks_per_request} exceeds num_blocks "
                f"= {self.num_blocks}: live requests alone would not fit"
            )

    @property
    def num_tokens(self) -> int:
        return self.blocks_per_request * self.block_size


# ---- hashing (outside the timed region) ------------------------------------------------------------------------
Hasher = Callable[[object, Sequence[Sequence[int]]], list]  # (parent hash or None, token blocks) -> chained hashes


def moetide_hasher(parent: int | None, token_blocks: Sequence[Sequence[int]]) -> list[int]:
    flat = [t for block in token_blocks for t in block]
    return hash_token_blocks(flat, len(token_blocks[0]), parent_hash=ROOT_HASH if parent is None else parent)


def make_vllm_hasher(vllm_utils) -> Hasher:
    hash_fn = vllm_utils.hash_fn  # vLLM's default prefix_caching_hash_algo ("sha256")

    def vllm_hasher(parent: bytes | None, token_blocks: Sequence[Sequence[int]]) -> list[bytes]:
        out = []
        for tokens in token_blocks:
            parent = vllm_utils.hash_block_tokens(hash_fn, parent, tokens, None)
            out.append(parent)
        return out

    return vllm_hasher


def _token_blocks(rng: random.Random, num_blocks: int, block_size: int) -> list[list[int]]:
    return [rng.choices(range(VOCAB_SIZE), k=block_size) for _ in range(num_blocks)]


def build_requests(w: Workload, seed: int, num_requests: int, hashers: dict[str, Hasher]) -> dict[str, list[list]]:
    """Each implementation's block-hash list per request, from one seeded token stream."""
    rng = random.Random(seed)
    system = _token_blocks(rng, w.system_blocks, w.block_size)
    prefixes: dict[str, list[list]] = {name: [] for name in hashers}  # per conversation: system + its prefix
    for _ in range(w.num_conversations):
        blocks = system + _token_blocks(
            rng, rng.randint(w.min_conversation_blocks, w.max_conversation_blocks), w.block_size
        )
        for name, hasher in hashers.items():
            prefixes[name].append(hasher(None, blocks))
    weights = [1.0 / (rank + 1) ** w.zipf_s for rank in range(w.num_conversations)]
    conversation_ids = rng.choices(range(w.num_conversations), weights=weights, k=num_requests)
    out: dict[str, list[list]] = {name: [] for name in hashers}
    for conversation_id in conversation_ids:
        num_private = w.blocks_per_request - len(prefixes[next(iter(hashers))][conversation_id])
        private = _token_blocks(rng, num_private, w.block_size)
        for name, hasher in hashers.items():
            prefix = prefixes[name][conversation_id]
            out[name].append(prefix + hasher(prefix[-1], private))
    return out


# ---- the two drivers ---------------------------------------------------------------------------------------------
class MoetideDriver:
    """moetide's ``KVCacheManager``, as ``core.scheduler`` drives it under the ``vllm`` pressure policy. Its
    allocate never evicts: on ``None`` the caller evicts the shortfall from the cached-free queue, protecting the
    request's own hits (looked up, not yet referenced), and retries — what vLLM's ``get_new_blocks`` does inside,
    after vLLM has touched the hits."""

    name = "moetide"

    def __init__(self, w: Workload) -> None:
        self.pool = BlockPool(range(w.num_blocks))
        self.manager = KVCacheManager(self.pool, w.block_size)
        self.num_tokens = w.num_tokens

    def prepare(self, requests: list[list[int]]) -> list[tuple[str, list[int]]]:
        return [(str(i), block_hashes) for i, block_hashes in enumerate(requests)]

    def run(self, requests: list[tuple[str, list[int]]], window: int) -> list[int]:
        manager, pool, num_tokens = self.manager, self.pool, self.num_tokens
        hit_counts: list[int] = []
        live: deque[str] = deque()
        for request_id, block_hashes in requests:
            if len(live) == window:
                manager.free(live.popleft())
            hits, num_computed = manager.get_computed_blocks(block_hashes, num_tokens)
            while (
                manager.allocate_slots(
                    request_id,
                    num_tokens - num_computed,
                    block_hashes,
                    num_computed_tokens=num_computed,
                    new_computed_blocks=hits,
                )
                is None
            ):
                self._make_room(request_id, num_tokens - num_computed, num_computed, hits)
            hit_counts.append(len(hits))
            live.append(request_id)
        while live:
            manager.free(live.popleft())
        return hit_counts

    def _make_room(self, request_id: str, num_new_tokens: int, num_computed: int, hits: list[int]) -> None:
        shortfall = self.manager.num_blocks_short(request_id, num_new_tokens, num_computed, len(hits))
        if not self.pool.evict(shortfall, protect=frozenset(hits)):  # as Scheduler._apply does for EvictPrefix
            raise RuntimeError(f"moetide pool cannot free {shortfall} blocks: workload does not fit")

    def check(self) -> None:
        self.manager.check_invariants()
        assert self.pool.num_used_blocks == 0, "blocks still in use after every request was freed"


class _VllmRequest:
    """The lightest faithful stand-in for ``vllm.v1.request.Request``: with KV events off (the default),
    ``BlockPool.cache_full_blocks`` reads only ``request.block_hashes`` (a list of ``BlockHash``)."""

    __slots__ = ("request_id", "block_hashes")

    def __init__(self, request_id: str, block_hashes: list[bytes]) -> None:
        self.request_id = request_id
        self.block_hashes = block_hashes


class VllmDriver:
    """vLLM's ``BlockPool`` driven as ``KVCacheManager`` + ``FullAttentionManager`` drive it for one group."""

    name = "vllm"

    def __init__(self, w: Workload, vllm_utils) -> None:
        self.pool = vllm_utils.BlockPool(w.num_blocks + 1, enable_caching=True, hash_block_size=w.block_size)
        self.block_size = w.block_size
        self.num_tokens = w.num_tokens

    def prepare(self, requests: list[list[bytes]]) -> list[_VllmRequest]:
        return [_VllmRequest(str(i), block_hashes) for i, block_hashes in enumerate(requests)]

    def run(self, requests: list[_VllmRequest], window: int) -> list[int]:
        pool, block_size, num_tokens = self.pool, self.block_size, self.num_tokens
        group_ids = [0]
        max_hit_blocks = (num_tokens - 1) // block_size  # get_computed_blocks: max_cache_hit_length = n - 1
        num_required = -(-num_tokens // block_size)
        num_full = num_tokens // block_size
        hit_counts: list[int] = []
        live: deque[list] = deque()
        for request in requests:
            if len(live) == window:  # SingleTypeKVCacheManager.free: reverse order, tail evicted first
                pool.free_blocks(reversed(live.popleft()))
            hits = []  # FullAttentionManager.find_longest_cache_hit, phase 1 (no fine-grained phase: sizes match)
            for block_hash in request.block_hashes[:max_hit_blocks]:
                cached = pool.get_cached_block(block_hash, group_ids)
                if not cached:
                    break
                hits.append(cached[0])
            num_new = num_required - len(hits)  # get_num_blocks_to_allocate, with evictable hits counted
            num_evictable = sum(b.ref_cnt == 0 and not b.is_null for b in hits)
            if num_new + num_evictable > pool.get_num_free_blocks():
                raise RuntimeError("vLLM pool cannot fit the request: workload does not fit")
            pool.touch(hits)  # add_local_computed_blocks
            blocks = hits + pool.get_new_blocks(num_new)  # allocate_new_blocks (evicts cached blocks inside)
            pool.cache_full_blocks(request, blocks, len(hits), num_full, block_size, 0)  # cache_blocks
            hit_counts.append(len(hits))
            live.append(blocks)
        while live:
            pool.free_blocks(reversed(live.popleft()))
        return hit_counts

    def check(self) -> None:
        assert self.pool.get_num_free_blocks() == self.pool.num_gpu_blocks - 1, "vLLM blocks still in use"


def load_vllm() -> tuple[object | None, str | None]:
    """vLLM's pool pieces as a namespace, or (None, reason)."""
    try:
        import vllm
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    except Exception as exc:  # ImportError, or a broken install failing at import time
        return None, f"{type(exc).__name__}: {exc}"
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)  # as EngineCore does; sets the chain root NONE_HASH
    ns = argparse.Namespace(
        BlockPool=VllmBlockPool,
        hash_block_tokens=kv_cache_utils.hash_block_tokens,
        hash_fn=hash_fn,
        version=vllm.__version__,
    )
    return ns, None


# ---- measurement -------------------------------------------------------------------------------------------------
def time_once(make_driver: Callable[[], object], requests: list, window: int) -> tuple[float, float, list, object]:
    """(wall seconds, process CPU seconds, hits per request, driver) of one pass on a fresh pool."""
    driver = make_driver()  # a fresh pool: every repeat replays the same sequence from an empty cache
    prepared = driver.prepare(requests)
    gc.collect()
    start_cpu_s, start_s = time.process_time(), time.perf_counter()
    hit_counts = driver.run(prepared, window)
    elapsed_s, cpu_s = time.perf_counter() - start_s, time.process_time() - start_cpu_s
    driver.check()
    return elapsed_s, cpu_s, hit_counts, driver


def measure(drivers: dict[str, Callable[[], object]], requests: dict[str, list], args, w: Workload) -> dict:
    """Warm up, then alternate implementations repeat by repeat so that machine drift hits both alike."""
    for _ in range(args.warmup):
        for name, make in drivers.items():
            time_once(make, requests[name], w.window)
    results: dict[str, dict] = {name: {"ops_per_s": [], "ops_per_cpu_s": []} for name in drivers}
    for _ in range(args.repeat):
        for name, make in drivers.items():
            elapsed_s, cpu_s, hit_counts, driver = time_once(make, requests[name], w.window)
            results[name]["ops_per_s"].append(args.requests / elapsed_s)
            results[name]["ops_per_cpu_s"].append(args.requests / max(cpu_s, 1e-9))
            results[name].update(hit_counts=hit_counts, driver=driver)
    return results


def result_line(name: str, result: dict, args, w: Workload, version: str) -> dict:
    ops = result["ops_per_s"]
    hit_counts = result["hit_counts"]
    line = {
        "benchmark": BENCHMARK,
        "impl": name,
        "version": version,
        "ops_per_s": round(statistics.median(ops), 1),
        "ops_per_s_min": round(min(ops), 1),
        "ops_per_s_max": round(max(ops), 1),
        "ops_per_cpu_s": round(statistics.median(result["ops_per_cpu_s"]), 1),
        "op": "lookup + touch hits + allocate rest + register full blocks + free tail first (one request)",
        "requests": args.requests,
        "blocks_per_request": w.blocks_per_request,
        "hit_rate": round(sum(hit_counts) / (len(hit_counts) * w.blocks_per_request), 4),
        "repeat": args.repeat,
        "warmup": args.warmup,
        "seed": args.seed,
    }
    driver = result["driver"]
    if name == "moetide":
        line["num_evicted_blocks"] = driver.pool.num_evicted_blocks
    return line


def profile(drivers: dict[str, Callable[[], object]], requests: dict[str, list], w: Workload) -> None:
    """One pass of each implementation under cProfile; the top functions by own time go to stderr."""
    import cProfile
    import pstats

    for name, make in drivers.items():
        driver = make()
        profiler = cProfile.Profile()
        profiler.runcall(driver.run, driver.prepare(requests[name]), w.window)
        print(f"==== cProfile: {name} (sorted by own time) ====", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=20_000, help="requests per timed pass")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per implementation (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes per implementation first")
    parser.add_argument("--num-blocks", type=int, default=Workload.num_blocks)
    parser.add_argument("--window", type=int, default=Workload.window, help="live requests")
    parser.add_argument("--no-vllm", action="store_true", help="measure moetide only, even if vLLM is installed")
    parser.add_argument("--profile", action="store_true", help="also cProfile one pass of each, to stderr")
    args = parser.parse_args(argv)
    if args.requests <= 0 or args.repeat <= 0 or args.warmup < 0:
        parser.error("--requests and --repeat must be positive, --warmup non-negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        w = Workload(num_blocks=args.num_blocks, window=args.window)
    except ValueError as exc:
        print(f"core_blocks: {exc}", file=sys.stderr)
        return 2
    vllm_utils, reason = (None, "--no-vllm given") if args.no_vllm else load_vllm()
    hashers: dict[str, Hasher] = {"moetide": moetide_hasher}
    drivers: dict[str, Callable[[], object]] = {"moetide": lambda: MoetideDriver(w)}
    if vllm_utils is None:
        print(json.dumps({"benchmark": BENCHMARK, "peer": "vllm", "status": "absent", "reason": reason}))
    else:
        hashers["vllm"] = make_vllm_hasher(vllm_utils)
        drivers["vllm"] = lambda: VllmDriver(w, vllm_utils)
    requests = build_requests(w, args.seed, args.requests, hashers)
    print(json.dumps({"benchmark": BENCHMARK, "workload": asdict(w), "python": platform.python_version()}))
    if args.profile:
        profile(drivers, requests, w)
    results = measure(drivers, requests, args, w)
    versions = {"moetide": getattr(moetide, "__version__", "src"), "vllm": getattr(vllm_utils, "version", "")}
    for name, result in results.items():
        print(json.dumps(result_line(name, result, args, w, versions[name])))
    if "vllm" in results:
        print(json.dumps(comparison(results)))
    return 0


def comparison(results: dict) -> dict:
    """The ratio of medians, plus the per-repeat ratios (each pair ran back to back, so drift mostly cancels)."""
    ours, theirs = results["moetide"], results["vllm"]
    paired = [a / b for a, b in zip(ours["ops_per_s"], theirs["ops_per_s"])]
    return {
        "benchmark": BENCHMARK,
        "ratio": "moetide/vllm",
        "value": round(statistics.median(ours["ops_per_s"]) / statistics.median(theirs["ops_per_s"]), 3),
        "formula": "median ops_per_s(moetide) / median ops_per_s(vllm), same requests, same process, alternated",
        "paired_min": round(min(paired), 3),
        "paired_median": round(statistics.median(paired), 3),
        "paired_max": round(max(paired), 3),
        "cpu_value": round(statistics.median(ours["ops_per_cpu_s"]) / statistics.median(theirs["ops_per_cpu_s"]), 3),
        "requests_with_different_hits": sum(a != b for a, b in zip(ours["hit_counts"], theirs["hit_counts"])),
        "hit_blocks_vllm_minus_moetide": sum(theirs["hit_counts"]) - sum(ours["hit_counts"]),
    }


if __name__ == "__main__":
    sys.exit(main())
