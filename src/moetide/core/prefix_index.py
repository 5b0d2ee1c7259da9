"""The prefix cache's index: which block holds which chained hash, and which blocks chain after which.

``BlockPool`` (``core.blocks``) owns the blocks, their reference counts and free queues; this index owns only the
hash books, so the pool's queue moves and the index's chain rules can each be read on their own. The pool calls
``register_chain`` when blocks fill, ``unregister_chain`` / ``unregister_leaf`` when it evicts, and moves the
blocks these return between its free queues.

Rules (the pool's module docstring says why):

* Invariant: every registered block's parent hash is registered (or the block heads its chain). So along one
  chain the registered hashes form a prefix, which ``lookup_chain`` finds by binary search.
* Duplicates: one hash may be registered by several blocks (vLLM does not de-duplicate). ``lookup`` returns the
  first holder still registered (vLLM's ``BlockHashToBlockMap.get_one_block``); the hash, and every block chained
  after it, stays registered until its last holder goes.
* Unregistering a hash's last holder unregisters every registered descendant too (iteratively: agent chains run to
  tens of thousands of blocks), since none of them could be hit again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType


class PrefixIndex:
    """Registered blocks: block -> hash and parent hash, hash -> holders, hash -> registered children."""

    def __init__(self) -> None:
        self._hash_of: dict[int, int] = {}  # registered block id -> its hash
        self._parent_of: dict[int, int | None] = {}  # registered block id -> parent's hash (None: chain head)
        self._block_of: dict[int, int] = {}  # hash -> its first registered holder (what lookups return)
        self._dups: dict[int, list[int]] = {}  # hash -> its later holders, in registration order (rare)
        self._children: dict[int, set[int]] = {}  # hash -> registered block ids whose parent it is
        # Read-only view of block -> hash: a membership test on it costs no Python call, which the pool's
        # per-block loops (free, touch) over agent contexts of thousands of blocks need.
        self.hash_by_block: Mapping[int, int] = MappingProxyType(self._hash_of)

    def __len__(self) -> int:
        """Registered blocks, duplicates included."""
        return len(self._hash_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def hash_of(self, block_id: int) -> int | None:
        return self._hash_of.get(block_id)

    def lookup(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash)

    def lookup_chain(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest registered prefix of ``block_hashes`` (a chain). Binary search: O(log n)
        lookups for agent contexts of tens of thousands of blocks."""
        block_of = self._block_of
        lo, hi = 0, len(block_hashes)  # invariant: hashes[:lo] all registered, hashes[hi:] none
        while lo < hi:
            mid = (lo + hi) // 2
            if block_hashes[mid] in block_of:
                lo = mid + 1
            else:
                hi = mid
        return list(map(block_of.__getitem__, block_hashes[:lo]))

    def is_sole_leaf(self, block_id: int) -> bool:
        """Nothing chains after this registered block and no other block holds its hash: unregistering it takes
        it alone (``unregister_leaf``)."""
        block_hash = self._hash_of[block_id]
        return block_hash not in self._children and block_hash not in self._dups

    # ---- registration -------------------------------------------------------------------------------------
    def register_chain(self, block_ids: Sequence[int], block_hashes: Sequence[int], start: int,
                       end: int) -> list[int]:
        """Register blocks ``start..end-1`` of one chain (block i under hash i, parent hash i-1, none for i = 0);
        return the ids newly registered. A block whose parent hash is not registered is skipped (an eviction broke
        the chain: it could never be hit); one already holding its hash stays as it is; one holding another hash
        is an error."""
        block_of, hash_of, parent_of, children = self._block_of, self._hash_of, self._parent_of, self._children
        registered: list[int] = []
        parent_hash = block_hashes[start - 1] if start else None
        for i in range(start, end):
            block_hash = block_hashes[i]
            block_id = block_ids[i]
            if parent_hash is not None and parent_hash not in block_of:
                parent_hash = block_hash
                continue
            if block_id in hash_of:
                if hash_of[block_id] == block_hash:  # (a hit registered again: already there)
                    parent_hash = block_hash
                    continue
                raise ValueError(f"block {block_id} is already cached under another hash")
            hash_of[block_id] = block_hash
            parent_of[block_id] = parent_hash
            if block_hash in block_of:
                self._dups.setdefault(block_hash, []).append(block_id)
            else:
                block_of[block_hash] = block_id
            if parent_hash is not None:
                kids = children.get(parent_hash)
                if kids is None:
                    children[parent_hash] = {block_id}
                else:
                    kids.add(block_id)
            registered.append(block_id)
            parent_hash = block_hash
        return registered

    def descendants(self, block_id: int, limit: int | None = None, skip: Collection[int] = ()) -> list[int]:
        """Registered blocks whose chains pass through this one: what unregistering it takes besides itself
        (nothing while another block holds its hash), each once. Stops after ``limit`` blocks when given; does not
        enter blocks in ``skip``. Children hang under their parent's hash, so a hash held by several blocks (two
        requests that computed the same prefix at once) has one set of children: it is entered once, as
        ``unregister_chain`` descends from it once, when its last holder goes. Entered once per holder, a chain
        computed twice would be walked 2^depth times."""
        block_hash = self._hash_of.get(block_id)
        if block_hash is None or block_hash in self._dups:
            return []
        children, hash_of = self._children, self._hash_of
        stack = list(children.get(block_hash, ()))
        entered = {block_hash}
        out = []
        while stack and (limit is None or len(out) < limit):
            child = stack.pop()
            if child in skip:
                continue
            out.append(child)
            child_hash = hash_of[child]
            if child_hash not in entered:
                entered.add(child_hash)
                stack.extend(children.get(child_hash, ()))
        return out

    # ---- removal and moves --------------------------------------------------------------------------------
    def unregister_leaf(self, block_id: int) -> None:
        """Unregister a block for which ``is_sole_leaf`` holds (the eviction fast path)."""
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        parent_hash = self._parent_of.pop(block_id)
        if parent_hash is not None:
            siblings = self._children[parent_hash]
            if len(siblings) == 1:
                del self._children[parent_hash]
            else:
                siblings.discard(block_id)

    def unregister_chain(self, block_id: int) -> list[int]:
        """Unregister a registered block and, if it was its hash's last holder, every registered descendant;
        return the ids unregistered, in order."""
        out: list[int] = []
        stack = [block_id]
        hash_pop, parent_pop, children = self._hash_of.pop, self._parent_of.pop, self._children
        while stack:
            block_id = stack.pop()
            block_hash = hash_pop(block_id)
            parent_hash = parent_pop(block_id)
            siblings = children.get(parent_hash) if parent_hash is not None else None
            if siblings is not None:  # None when the parent was unregistered in this same cascade
                siblings.discard(block_id)
                if not siblings:
                    del children[parent_hash]
            if not self._drop_holder(block_hash, block_id):  # its last holder: the chain after it is lost
                stack.extend(children.pop(block_hash, ()))
            out.append(block_id)
        return out

    def move(self, block_id: int, target: int) -> None:
        """Give ``block_id``'s registration — its hash and its place in its chain — to the unregistered block
        ``target``; descendants stay (their parent hash is unchanged)."""
        block_hash, parent_hash = self._hash_of.pop(block_id), self._parent_of.pop(block_id)
        self._hash_of[target], self._parent_of[target] = block_hash, parent_hash
        if self._block_of[block_hash] == block_id:
            self._block_of[block_hash] = target
        else:
            dups = self._dups[block_hash]
            dups[dups.index(block_id)] = target
        if parent_hash is not None:
            siblings = self._children[parent_hash]
            siblings.discard(block_id)
            siblings.add(target)

    def _drop_holder(self, block_hash: int, block_id: int) -> bool:
        """Take ``block_id`` off the holders of ``block_hash``; True while another block still holds it."""
        dups = self._dups.get(block_hash)
        if dups is None:
            del self._block_of[block_hash]
            return False
        if self._block_of[block_hash] == block_id:
            self._block_of[block_hash] = dups.pop(0)
        else:
            dups.remove(block_id)
        if not dups:
            del self._dups[block_hash]
        return True

    # ---- checks -------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the hash books disagree with each other."""
        num_dups = sum(len(d) for d in self._dups.values())
        assert len(self._block_of) + num_dups == len(self._hash_of) == len(self._parent_of), "hash maps differ"
        for block_hash, dups in self._dups.items():
            assert dups and self._block_of[block_hash] not in dups, f"duplicate holders of {block_hash} are off"
        for block_id, block_hash in self._hash_of.items():
            assert (self._block_of[block_hash] == block_id or block_id in self._dups.get(block_hash, ())), (
                f"hash of block {block_id} maps elsewhere")
            parent_hash = self._parent_of[block_id]
            if parent_hash is not None:
                assert parent_hash in self._block_of, f"block {block_id}'s parent hash is not registered"
                assert block_id in self._children[parent_hash], f"block {block_id} missing from its parent's children"
        for parent_hash, children in self._children.items():
            assert children, f"empty child set under {parent_hash}"
            for child in children:
                assert self._parent_of[child] == parent_hash, f"child {child} has another parent"
