"""The replay's clock: modeled step time with the exposed staging of offloaded experts, and the prices ``vamp``
reads off it (MODELED: ``perf``'s roofline and staging models).

The step-time callable is also the step mix vamp prices an offload over, so the policy sees the very staging model
the replay charges (``core.pressure.vamp_params.StepStats``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from moetide.core.expert_line import ExpertLine
from moetide.core.pressure import VampParams
from moetide.core.pressure.step_costs import RecordSteps
from moetide.perf import StepTimeModel
from moetide.perf.routing_profile import read_rank_shares
from moetide.perf.staging import CPU, StagingConfig, StagingModel
from moetide.specs import get_host

if TYPE_CHECKING:
    from moetide.sim.setup import ReplayConfig

# vamp prices staging over the step mix of the last ~10 horizons of step time, not one: while admissions are
# blocked the recent mix is decode-only and staging looks cheap, yet the KV a growth frees brings back the prefill
# chunks that touch every offloaded expert, and a line grown on the decode-only price collapses (docs/vamp.md)
STAGING_MIX_HORIZONS = 10


class StepTimeWithStaging:
    """Modeled step time plus the exposed staging of the experts offloaded at that moment; counts staged bytes.

    It also keeps the recent step mix — steps grouped by the octave of their token count *and* of their
    staging-free modeled time, each group's weighted count, tokens and time, weights decaying as
    e^(−age/``mix_tau_s``) over step time — so that ``vamp`` prices an offload with the very staging model charged
    here, over the steps that actually run (``core.pressure.vamp_params.StepStats``). The time matters as much as
    the tokens: it sets the compute that prefetch hides behind, and exposed staging is convex in it, so a group
    that averaged an 8K chunk at 1K context with one at 100K would price the short one's exposure at the long
    one's cover (on the whole WEKA trace, 5x below what the replay then charged). Before any step it prices a
    reference decode step. Only a policy that reads it needs the mix: ``track_mix=False`` skips it (the replay's
    other policies). ``record``: a cost record's ``RecordSteps``, told each step's tokens, where vamp is priced from a
    record instead (``ReplayConfig.vamp_costs``)."""

    def __init__(self, step_model: StepTimeModel, staging: StagingModel, line: ExpertLine, num_layers: int, *,
                 mix_tau_s: float = 300.0, reference_step: tuple[int, float] = (32, 0.014),
                 track_mix: bool = True, record: RecordSteps | None = None) -> None:
        self.step_model, self.staging, self.line, self.num_layers = step_model, staging, line, num_layers
        self.record = record
        self.track_mix = track_mix
        self.staged_bytes = 0.0
        self.busy = 0.0
        self.mix_tau_s = mix_tau_s
        self.reference_step = reference_step
        self._origin = 0.0  # a step's weight is e^((busy − origin) / tau); rescaled before it overflows
        self._mix: dict[tuple[int, int], list[float]] = {}  # (token octave, time octave) -> [count, tokens, s]
        self._shares: dict[int, float] = {}
        self._shares_at = -1.0

    def __call__(self, num_tokens: int, num_seqs: int, num_decode: int, kv_read: int, pairs: int) -> float:
        base = self.step_model.step_time_s(num_tokens, num_seqs, num_decode, kv_read, pairs)
        duration = base
        if self.line.residency.num_offloaded:
            staged, exposed = self.staging.step(num_tokens, self.line.offloaded_per_layer, base / self.num_layers)
            self.staged_bytes += staged
            duration += exposed
        self.busy += duration
        if self.record is not None:
            self.record.record(num_tokens)
        if not self.track_mix:
            return duration
        x = (self.busy - self._origin) / self.mix_tau_s
        if x > 600.0:
            self._rescale()
            x = 0.0
        w = math.exp(x)
        key = (num_tokens.bit_length(), math.frexp(base)[1])
        group = self._mix.get(key)
        if group is None:
            group = self._mix[key] = [0.0, 0.0, 0.0]
        group[0] += w
        group[1] += w * num_tokens
        group[2] += w * base
        return duration

    def _rescale(self) -> None:
        f = math.exp(-(self.busy - self._origin) / self.mix_tau_s)
        for group in self._mix.values():
            group[:] = [v * f for v in group]
        self._origin = self.busy

    # ---- StepStats (what vamp reads) ------------------------------------------------------------------------
    def busy_s(self) -> float:
        return self.busy

    def time_weighted_tokens(self) -> float:
        """Tokens per step over the recent mix, each group's mean tokens weighted by its (staging-free) time."""
        seconds = sum(group[2] for group in self._mix.values())
        if seconds <= 0:
            return 0.0
        return sum(group[1] / group[0] * group[2] for group in self._mix.values() if group[0] > 0) / seconds

    def staging_share(self, num_offloaded: int) -> float:
        """Exposed staging seconds per second of (staging-free) step time over the recent mix, with
        ``num_offloaded`` experts spread evenly over the MoE layers."""
        if self._shares_at != self.busy:
            self._shares.clear()
            self._shares_at = self.busy
        share = self._shares.get(num_offloaded)
        if share is None:
            share = self._shares[num_offloaded] = self._share(num_offloaded)
        return share

    def _share(self, num_offloaded: int) -> float:
        if num_offloaded <= 0:
            return 0.0
        groups = [(c, t / c, b / c) for c, t, b in self._mix.values() if c > 0]
        if not groups:
            tokens, base = self.reference_step
            groups = [(1.0, tokens, base)]
        layers = self.staging.num_moe_layers
        per_layer, extra = divmod(num_offloaded, layers)
        overlap = self.staging.config.effective_overlap_layers
        exposed_s = base_s = 0.0
        for count, tokens, base in groups:
            window = overlap * base / self.num_layers
            tokens = max(round(tokens), 1)
            exposed = (layers - extra) * self.staging.layer(tokens, per_layer, window)[1]
            if extra:
                exposed += extra * self.staging.layer(tokens, per_layer + 1, window)[1]
            exposed_s += count * exposed
            base_s += count * base
        return exposed_s / base_s


def staging_config(config: ReplayConfig, model) -> StagingConfig:
    """The staging model's settings from the replay's (a cold expert computed on the CPU needs the host's facts)."""
    on_cpu = config.cold_experts == CPU
    tflops = config.cpu_matmul_tflops
    return StagingConfig(mode=config.staging_mode, routing_zipf_s=config.routing_zipf_s,
                         routing_shares=routing_shares(config, model), host_link_shared_by=config.host_link_shared_by,
                         cold_experts=config.cold_experts, host=get_host(config.cpu) if on_cpu else None,
                         gpus_per_socket=config.gpus_per_socket,
                         cpu_matmul_flops_per_s=None if tflops is None else tflops * 1e12)


def routing_shares(config: ReplayConfig, model) -> tuple[float, ...] | None:
    if config.routing_profile is None:
        return None
    return read_rank_shares(config.routing_profile, model.num_experts, model.num_experts_per_tok)


REFERENCE_CONTEXT_TOKENS = 16384  # context of the reference decode step (priced until steps have run)
REFERENCE_DECODE_BATCH = 32
LONG_CONTEXT_TOKENS = 131072  # second point of the linear re-prefill fit (agent contexts: p50 ~104K, WEKA)


def reference_decode(config: ReplayConfig, step_model: StepTimeModel) -> tuple[int, float]:
    batch, ctx = min(config.max_num_seqs, REFERENCE_DECODE_BATCH), REFERENCE_CONTEXT_TOKENS
    return batch, step_model.step_time_s(batch, batch, batch, batch * (ctx + 1), batch * (ctx + 1))


def vamp_params(config: ReplayConfig, step_model: StepTimeModel, step_time: StepTimeWithStaging):
    """VAMP's coefficients from the perf model (modeled seconds). Re-prefill of one token at context x is
    a + b·x: a full chunk's time per token at context 0 and at ``LONG_CONTEXT_TOKENS`` (attention's work and KV
    reads grow linearly with the context, so two points fit the model's own curve)."""
    chunk = config.max_num_batched_tokens

    def per_token_s(ctx: int) -> float:
        return step_model.step_time_s(chunk, 1, 0, ctx + chunk, chunk * ctx + chunk * (chunk + 1) // 2) / chunk

    at_zero = per_token_s(0)
    per_context = max(per_token_s(LONG_CONTEXT_TOKENS) - at_zero, 0.0) / LONG_CONTEXT_TOKENS
    return VampParams(prefill_s_per_token=at_zero, prefill_s_per_token_per_context=per_context, steps=step_time,
                      block_size=config.block_size, horizon_s=config.vamp_horizon_s,
                      token_budget=config.max_num_batched_tokens)
