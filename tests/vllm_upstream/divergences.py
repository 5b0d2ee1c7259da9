"""vLLM 0.32.0's tests (``-m cpu_test v1/core``) that pass on stock vLLM and not with moetide's scheduler, each with
its cause (``check.py`` fails on any other). None is a difference in what the scheduler decides: two read a
connector moetide legitimately configures, and two read the scheduler class ``--scheduler-cls`` legitimately
overrides.
"""

_DIFFUSION = ("asserts that vLLM picks DiffusionScheduler for a diffusion model when no --scheduler-cls is given; "
              "moetide is configured by --scheduler-cls moetide.vllm.scheduler.MoetideScheduler, which vLLM honours "
              "over its default, so get_scheduler_cls() is moetide's; moetide's scheduler, which is not a diffusion "
              "scheduler, refuses a diffusion model at start in one line.")

EXPLAINED: dict[str, str] = {
    **{f"tests/v1/core/test_scheduler.py::test_diffusion_scheduler_is_selected_by_default[{p}]": _DIFFUSION
       for p in ("False", "True")},
    "tests/v1/core/test_scheduler.py::test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request": (
        "its helper _step_until_done asserts len(output.kv_connector_metadata.requests) == 0 whenever a connector "
        "is configured, i.e. it assumes the ExampleConnector's metadata; moetide's connector's metadata "
        "(MoetideConnectorMetadata: line ops) has no .requests (AttributeError). The stats it checks are not "
        "reached; the scheduling up to there matched."),
    "tests/v1/core/test_scheduler.py::test_reset_connector_cache_no_connector_is_no_op_success": (
        "asserts scheduler.connector is None (the no-connector case); moetide's scheduler runs with moetide's "
        "connector configured, by design."),
}
