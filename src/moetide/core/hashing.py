"""Chained block hashes: over token ids (the engine) and over externally supplied block keys (recorded traces).

A block's hash covers its parent's hash, so a hit on block i implies a hit on blocks 0..i-1 — the property prefix
caching rests on, as in vLLM v1 (``hash_block_tokens``). Losing block i therefore loses every block after it.

Hashes are Python ints from the builtin tuple hash, which is deterministic across runs for tuples of ints (only
``str``/``bytes`` hashing is salted by PYTHONHASHSEED, and ``hash(None)`` is address-based before Python 3.12), so
nothing hashed here is a str or None: scopes are turned into ints with blake2b first, and the chain starts at
``ROOT_HASH``. The builtin hash is 64-bit and not collision-resistant against an adversary; vLLM offers sha256 for
multi-tenant deployments where a crafted prompt could poison the cache. Collisions between honest inputs are
~n²/2⁶⁴ and ignored.

Traces give block keys at their own granularity (512 tokens for Mooncake, 64 for WEKA) while the pool may use
another ``block_size``. ``external_block_hashes`` maps them consistently: pool block j covers tokens
[j·b, (j+1)·b); its key is the tuple of trace keys whose blocks overlap that range plus the offset of the range
inside the first of them. Equal trace-key prefixes therefore give equal pool-block hash prefixes whatever the two
block sizes are. A pool block that reaches past the last full trace block (the tail of a prompt, or generated
tokens) has no shared identity in the trace; it is salted with the request's own salt, so it can only hit for the
same request (e.g. when a preempted request resumes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ROOT_HASH = 0x6D6F6574696465  # "moetide": the parent of every chain's first block
_TAIL = 1  # tags inside hashed tuples (ints, never str: see the module docstring)
_KEYED = 2


def scope_hash(scope: str) -> int:
    """A stable int for a namespace string (e.g. a WEKA session id whose block ids are session-local)."""
    return int.from_bytes(hashlib.blake2b(scope.encode(), digest_size=8).digest(), "little")


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH, start_block: int = 0
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` from block index ``start_block`` on.

    ``parent_hash`` is the hash of block ``start_block - 1`` (``ROOT_HASH`` when starting at 0), which lets a
    request extend its hash list incrementally as tokens are generated.
    """
    hashes: list[int] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent_hash = hash((parent_hash, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent_hash)
    return hashes


def external_block_hashes(
    keys: Sequence[int],
    key_block_size: int,
    block_size: int,
    num_tokens: int,
    *,
    scope: int = 0,
    salt: int = 0,
    reuse: Sequence[int] = (),
) -> list[int]:
    """Chained hashes of the ``num_tokens // block_size`` full pool blocks of a prompt described by trace keys.

    ``keys`` are the trace's ids of the prompt's full ``key_block_size``-token blocks (in order); ``scope``
    namespaces them (see ``scope_hash``); ``salt`` identifies the request for blocks the keys do not cover.
    ``reuse`` is an earlier result for a prompt whose keys share a prefix with these, already cut to the pool blocks
    that lie entirely inside the shared keys: they are copied rather than recomputed (a session's next turn).
    """
    if key_block_size <= 0 or block_size <= 0:
        raise ValueError(f"block sizes must be positive, got key_block_size={key_block_size}, block_size={block_size}")
    num_blocks = num_tokens // block_size
    hashes = list(reuse[:num_blocks])
    parent = hashes[-1] if hashes else hash((ROOT_HASH, scope))
    keyed_tokens = len(keys) * key_block_size
    first = len(hashes)
    num_keyed = min(num_blocks, keyed_tokens // block_size)
    if first < num_keyed:
        key_lo = (first * block_size) // key_block_size
        window = tuple(keys[key_lo : (num_keyed * block_size - 1) // key_block_size + 1])  # one slice, not n
        for j in range(first, num_keyed):
            start = j * block_size
            lo = start // key_block_size
            hi = (start + block_size - 1) // key_block_size
            parent = hash((parent, (_KEYED, start - lo * key_block_size, window[lo - key_lo : hi - key_lo + 1])))
            hashes.append(parent)
    for j in range(max(first, num_keyed), num_blocks):
        parent = hash((parent, (_TAIL, salt, j)))
        hashes.append(parent)
    return hashes


def extend_salted_hashes(hashes: list[int], num_blocks: int, salt: int) -> None:
    """Append request-private hashes until ``hashes`` has ``num_blocks`` entries (generated tokens in replay)."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for j in range(len(hashes), num_blocks):
        parent = hash((parent, (_TAIL, salt, j)))
        hashes.append(parent)
