"""Helpers the core scheduler scenarios share: requests of 4-token blocks, and one checked step."""

from moetide.core.request import Request

BS = 4


def req(request_id, tokens, out=2):
    return Request.from_tokens(request_id, tokens, out, BS)


def run_step(sched):
    """One scheduler step whose every scheduled request samples token 7, books checked after; its output."""
    out = sched.schedule()
    sched.update(out, {r.request_id: 7 for r, _ in out.scheduled})
    sched.kv.check_invariants()
    return out
