"""Property tests: random operation sequences on the pool and manager keep every book consistent."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from moetide.core.blocks import BlockPool
from moetide.core.hashing import hash_token_blocks
from moetide.core.kv_manager import KVCacheManager

BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12, []]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(range(16))
        self.manager = KVCacheManager(self.pool, BS)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_request = 0
        self.next_block_id = 16

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=10))
    def admit(self, prefix, suffix):
        tokens = prefix + suffix
        if not tokens:
            return
        request_id = f"r{self.next_request}"
        self.next_request += 1
        hashes = hash_token_blocks(tokens, BS)
        hits, num_computed = self.manager.get_computed_blocks(hashes, len(tokens))
        assert num_computed < len(tokens)
        free_before = self.pool.num_uncached_free_blocks
        new = self.manager.allocate_slots(
            request_id, len(tokens) - num_computed, hashes, num_computed_tokens=num_computed, new_computed_blocks=hits
        )
        if new is None:
            assert self.pool.num_uncached_free_blocks == free_before
            assert self.manager.get_blocks(request_id) == []
            return
        assert all(self.pool.ref_count(b) == 1 for b in new)
        self.tokens[request_id] = tokens
        self.computed[request_id] = len(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[request_id]
        tokens.append(token)
        hashes = hash_token_blocks(tokens, BS)
        if self.manager.allocate_slots(request_id, 1, hashes, num_computed_tokens=self.computed[request_id]) is None:
            tokens.pop()
            return
        self.computed[request_id] += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(request_id)
        del self.tokens[request_id], self.computed[request_id]

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        cached_free = self.pool.num_cached_free_blocks
        evicted = self.pool.evict(n)
        assert len(evicted) >= min(n, cached_free)
        assert all(self.pool.is_free(b) and self.pool.block_hash(b) is None for b in evicted)

    @rule(n=st.integers(1, 4))
    def grow(self, n):
        ids = list(range(self.next_block_id, self.next_block_id + n))
        self.next_block_id += n
        self.pool.add_blocks(ids)

    @precondition(lambda self: self.pool.num_blocks)
    @rule(data=st.data())
    def shrink(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.pool.block_ids()), max_size=4, unique=True))
        all_free = all(self.pool.is_free(b) for b in ids)
        before = self.pool.num_blocks
        assert self.pool.remove_blocks(ids) == all_free
        assert self.pool.num_blocks == before - (len(ids) if all_free else 0)

    @invariant()
    def books_agree(self):
        self.manager.check_invariants()
        held = {b for r in self.tokens for b in self.manager.get_blocks(r)}
        assert self.pool.num_used_blocks == len(held)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
