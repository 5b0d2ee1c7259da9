"""``--worker-extension-cls moetide.vllm.worker.MoetideWorkerExtension``: the KV backing's and the host tier's
state, by RPC.

vLLM splices the class into its worker's bases, so ``LLM.collective_rpc("moetide_backing_stats")`` (or the engine
core's) asks every worker, in-process or in worker processes, what its backing holds (``vllm.backing``).
"""

from __future__ import annotations


class MoetideWorkerExtension:
    def moetide_backing_stats(self) -> dict | None:
        """This worker's ``CpuBacking.stats()`` with the expert pager's counts, or None where the plugin did not
        allocate its KV cache."""
        from moetide.vllm import pager
        from moetide.vllm.backing import registered_backing

        backing = registered_backing()
        return None if backing is None else {**backing.stats(), "pager": pager.stats()}

    def moetide_host_tier_stats(self) -> dict | None:
        """This worker's host tier (``HostTier.stats``: blocks written and used, the split's counters), or None
        without one."""
        from moetide.vllm.host_tier import installed

        tier = installed()
        return None if tier is None else tier.stats()
