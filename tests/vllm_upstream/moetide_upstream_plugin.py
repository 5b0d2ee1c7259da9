"""A pytest plugin for vLLM's own scheduler tests (tests/v1/core of vLLM's source), loaded from outside vLLM's tree:
``pytest -p moetide_upstream_plugin --moetide-upstream {stock,moetide} --moetide-upstream-report OUT.json``.

``moetide`` mode builds moetide's scheduler wherever vLLM's tests build the stock one through their factories:
``create_scheduler`` (tests/v1/core/utils.py), ``create_scheduler_with_priority`` and
``_create_encoder_decoder_scheduler`` (test_scheduler.py). For the
duration of one factory call the factory's module sees

* ``VllmConfig`` that adds ``kv_transfer_config=PluginSettings(policy="vllm").kv_transfer_config()`` (moetide's
  connector, as ``vllm serve --kv-transfer-config`` gives it) where the test configured none,
* ``SchedulerConfig`` with ``scheduler_cls=SCHEDULER_CLS`` (``--scheduler-cls``, which the connector checks), and
* ``Scheduler`` / ``AsyncScheduler`` = ``MoetideScheduler`` / ``MoetideAsyncScheduler``,

with moetide's vLLM plugin registered in the process (``moetide.vllm.plugin.register``), as vLLM would load it.
Everything else the factory does is vLLM's. A factory call that configures its own KV connector (Mock/Example/...:
one connector per engine, and moetide's scheduler needs its own) or passes its own ``scheduler_cls`` (diffusion
schedulers) is left stock, and recorded as such; so are the few tests that construct ``Scheduler`` themselves.

``stock`` mode changes nothing (``VLLM_PLUGINS=""`` keeps moetide's entry point out: the script sets it).

Both modes skip a test that builds a scheduler for a multimodal model (LLaVA-1.5, Qwen2.5-VL) where torchvision
cannot be imported: vLLM's processors for them need it, and the only torchvision wheels these machines' registries
have are CUDA builds that do not load against the CPU torch.

The report maps each test id to its outcome and to what each factory call built (``moetide`` or ``stock:<why>``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from pathlib import Path

import pytest

MULTIMODAL_MODELS = ("llava-hf/llava-1.5-7b-hf", "Qwen/Qwen2.5-VL-3B-Instruct")
# vLLM's scheduler factories: (module, function); each builds the scheduler from its module's names
FACTORIES = (("tests.v1.core.utils", "create_scheduler"),
             ("tests.v1.core.test_scheduler", "create_scheduler_with_priority"),
             ("tests.v1.core.test_scheduler", "_create_encoder_decoder_scheduler"))
_state: dict = {"mode": "stock", "current": None, "built": {}, "results": {}, "patched": set()}


def pytest_addoption(parser):
    group = parser.getgroup("moetide-upstream")
    group.addoption("--moetide-upstream", choices=("stock", "moetide"), default="stock",
                    help="stock: vLLM's schedulers; moetide: moetide's scheduler (policy vllm) in their place")
    group.addoption("--moetide-upstream-report", default=None, help="write per-test outcomes here (JSON)")


def pytest_configure(config):
    _state["mode"] = config.getoption("--moetide-upstream")
    if _state["mode"] == "moetide":
        from moetide.vllm import plugin

        plugin.register()
        plugin.check_supported()  # raises unless registered on a supported vLLM


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or a CUDA build's RuntimeError against the CPU torch
        return False
    return True


@contextlib.contextmanager
def _swapped(module, **names):
    old = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


def _wrap(module, factory):
    signature = inspect.signature(factory)

    def build(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("model") in MULTIMODAL_MODELS and not _torchvision_loads():
            pytest.skip(f"moetide-upstream: {a['model']} needs torchvision, which does not load on this machine "
                        f"(the registries here have CUDA builds only)")
        record = _state["built"].setdefault(_state["current"], [])
        if _state["mode"] == "stock":
            record.append("stock")
            return factory(*args, **kwargs)
        if a.get("use_kv_connector"):
            record.append("stock:own-kv-connector")
            return factory(*args, **kwargs)
        if a.get("scheduler_cls") is not None:
            record.append(f"stock:scheduler_cls={a['scheduler_cls'].__name__}")
            return factory(*args, **kwargs)
        from vllm.config import KVTransferConfig

        from moetide.vllm.scheduler import MoetideAsyncScheduler, MoetideScheduler, _MoetideScheduling
        from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings

        real_config, real_scheduler_config = module.VllmConfig, module.SchedulerConfig

        def scheduler_config(*c_args, **c_kwargs):
            c_kwargs.setdefault("scheduler_cls", SCHEDULER_CLS)
            return real_scheduler_config(*c_args, **c_kwargs)

        def vllm_config(*c_args, **c_kwargs):
            if c_kwargs.get("kv_transfer_config") is None:
                c_kwargs["kv_transfer_config"] = KVTransferConfig(**PluginSettings(policy="vllm").kv_transfer_config())
            return real_config(*c_args, **c_kwargs)

        names = dict(VllmConfig=vllm_config, SchedulerConfig=scheduler_config, Scheduler=MoetideScheduler)
        if hasattr(module, "AsyncScheduler"):
            names["AsyncScheduler"] = MoetideAsyncScheduler
        with _swapped(module, **names):
            scheduler = factory(*args, **kwargs)
        assert isinstance(scheduler, _MoetideScheduling), type(scheduler)
        assert scheduler.moetide.policy.name == "vllm", scheduler.moetide.policy.name
        record.append(f"moetide:{type(scheduler).__name__}")
        return scheduler

    build.__wrapped__ = factory
    build.__signature__ = signature
    return build


def _patch_factories() -> None:
    """Point every binding of the factories (the defining module's and each test module's import of it) at the
    wrapper; again after each collected module, so later imports are caught too."""
    originals = {}
    for module_name, name in FACTORIES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        factory = getattr(module, name)
        factory = getattr(factory, "__wrapped__", factory)
        if (module_name, name) not in _state["patched"]:
            setattr(module, name, _wrap(module, factory))
            _state["patched"].add((module_name, name))
        originals[id(factory)] = (factory, getattr(module, name))
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("tests.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in originals and originals[id(value)][0] is value:
                setattr(module, attr, originals[id(value)][1])


def pytest_collection_modifyitems(session, config, items):
    _patch_factories()


def pytest_runtest_setup(item):
    _state["current"] = item.nodeid
    _patch_factories()


def pytest_runtest_logreport(report):
    result = _state["results"].setdefault(report.nodeid, {"outcome": "passed"})
    if report.when == "call":
        if result["outcome"] == "passed":
            result["outcome"] = report.outcome
    elif report.outcome == "failed":  # setup or teardown
        result["outcome"] = "error"
    elif report.outcome == "skipped":
        result["outcome"] = "skipped"
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        result["reason"] = str(report.longrepr[2])[:300]
    elif report.outcome == "failed":
        text = getattr(report, "longreprtext", "") or str(report.longrepr)
        lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
        result.setdefault("message", "\n".join(lines[:8])[:1500] or text[-800:])


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--moetide-upstream-report")
    if not path:
        return
    for nodeid, built in _state["built"].items():
        if nodeid in _state["results"]:
            _state["results"][nodeid]["built"] = built
    Path(path).write_text(json.dumps({"mode": _state["mode"], "tests": _state["results"]}, indent=1,
                                     sort_keys=True) + "\n")
