"""PyTorch's own flex_attention test files, run stock and enabled: which tests pass each way, and
how many of the flex_attention calls our lowering saw it took (issue 11: test_flex_decoding.py;
issue 13: test_flex_attention.py's forward tests).

The test files are PyTorch's: fetch them for the GPU run (into the git-ignored .device/pt/),
never commit them. Each file runs twice in fresh processes, stock and with
inductor_cute.enable(flex_decode=True, flex_prefill=..., flex_backward=...), every test under
torch.no_grad() unless --with-grad or --backward (so training graphs become the inference graphs
our kernels serve; --backward runs them as written with our backward offered, issue 15); results come from
pytest's junit XML, the decisions from a hook on the lowering (this file is also the pytest plugin).

    python3 benchmarks/pytorch_flex_tests.py .device/pt/test_flex_decoding.py --out $OUT [-n 8]
        [--prefill] [--with-grad | --backward] [-k EXPR] [--modes stock|enabled|stock,enabled]
        [--where-stock-passed]

Writes <out>/<test file stem>-summary.md: passed/failed/skipped each way, the tests that pass stock
but not enabled, and the calls taken and declined (bf16/fp16 apart, declines by reason). The two
runs may be separate invocations with one --out (--modes): the summary reads what it finds there.
--where-stock-passed runs the enabled mode on the tests the stock run in --out passed only: under
no_grad most of test_flex_attention.py fails stock (its tests call backward), and running those
enabled too took longer than one 10-minute GPU call (thirteenth session).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

_MODE = os.environ.get("ICUTE_PT_MODE")  # set in the pytest processes this script starts
_CURRENT = {"test": ""}


# ---- the plugin half (runs inside the pytest processes)

def pytest_configure(config):
    if _MODE is None:
        return
    import torch

    # every graph lowered in this run, none loaded from a cache: the decisions are counted there
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if _MODE != "enabled":
        return
    import inductor_cute
    from inductor_cute.inductor.flex import lowering

    inductor_cute.enable(flex_decode=True, flex_prefill=os.environ.get("ICUTE_PT_PREFILL") == "1",
                         flex_backward=os.environ.get("ICUTE_PT_BACKWARD") == "1")
    # one file for every worker: each record is one small append, whole on its own line
    record_path = os.environ["ICUTE_PT_DECISIONS"]
    call_reason = lowering._call_reason
    cpu_estimate = os.environ.get("ICUTE_PT_CPU_ESTIMATE") == "1"
    if cpu_estimate:  # decide as on a Hopper GPU, then leave every call stock (no kernel of ours on a CPU)
        lowering._device_reason = lambda device: None

    def recording(problem, query, key):
        reason = call_reason(problem, query, key)
        line = json.dumps({"test": _CURRENT["test"], "kernel": problem.kernel if problem else "?",
                           "dtype": str(problem.dtypes[0]) if problem else "?", "reason": reason}) + "\n"
        fd = os.open(record_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return "--cpu-estimate: every call stays stock" if cpu_estimate else reason

    lowering._call_reason = recording


def pytest_runtest_setup(item):
    _CURRENT["test"] = item.nodeid


@pytest.fixture(autouse=True)
def _inference_only():
    if _MODE is None or os.environ.get("ICUTE_PT_GRAD") == "1":
        yield
        return
    import torch

    with torch.no_grad():
        yield


# ---- the driver half

def _outcomes(junit: str) -> dict:
    """test id -> "passed" | "failed" | "skipped" from a junit XML file ({} where there is none: a
    mode not run, or cut off before pytest wrote it)."""
    out = {}
    if not os.path.exists(junit):
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out


def _node_ids(path: str, outcomes: dict, wanted: str) -> list[str]:
    """pytest node ids (path::Class::test[params]) of the junit results with outcome `wanted`."""
    ids = []
    for name, outcome in outcomes.items():
        if outcome == wanted:
            classname, test = name.split("::", 1)
            cls = classname.rsplit(".", 1)[-1]
            ids.append(f"{path}::{cls}::{test}" if cls != _stem(path) else f"{path}::{test}")
    return sorted(ids)


def _run(path: str, mode: str, out: str, args, only: list[str] | None = None) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ICUTE_PT_MODE=mode, ICUTE_PT_PREFILL="1" if args.prefill else "0",
               ICUTE_PT_GRAD="1" if args.with_grad or args.backward else "0",
               ICUTE_PT_BACKWARD="1" if args.backward else "0",
               ICUTE_PT_CPU_ESTIMATE="1" if args.cpu_estimate else "0",
               ICUTE_PT_DECISIONS=_decisions_path(out, _stem(path)),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    junit = _junit_path(out, _stem(path), mode)
    cmd = [sys.executable, "-m", "pytest", *(only if only is not None else [path]), "-p", "pytorch_flex_tests", "-q",
           "-p", "no:cacheprovider", f"--junitxml={junit}", "-n", str(args.n)] + (["-k", args.k] if args.k else [])
    with open(os.path.join(out, f"{_stem(path)}-{mode}.log"), "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _junit_path(out: str, stem: str, mode: str) -> str:
    return os.path.join(out, f"{stem}-{mode}.xml")


def _decisions_path(out: str, stem: str) -> str:
    """The enabled run's decisions, one JSON line each (the plugin's ICUTE_PT_DECISIONS)."""
    return os.path.join(out, f"{stem}-decisions.jsonl")


def _decisions(out: str, stem: str) -> list:
    path = _decisions_path(out, stem)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]  # a cut-off last line is left out


def summary(stem: str, stock: dict, enabled: dict, decisions: list) -> str:
    lines = [f"# {stem}: stock vs enabled", ""]
    for name, res in (("stock", stock), ("enabled", enabled)):
        counts = ", ".join(f"{n} {k}" for k, n in sorted(collections.Counter(res.values()).items()))
        lines.append(f"- {name}: " + (counts or "no results (not run, or cut off)"))
    regressions = sorted(t for t, r in stock.items() if r == "passed" and enabled.get(t) != "passed")
    lines += [f"- pass stock but not enabled: {len(regressions)}", *(f"  - {t}" for t in regressions), ""]
    half = [d for d in decisions if d["dtype"] in ("torch.bfloat16", "torch.float16")]
    taken = sum(d["reason"] is None for d in half)
    lines.append(f"flex_attention calls our lowering saw: {len(decisions)}; bf16/fp16: {len(half)}, taken {taken}"
                 f" ({100 * taken / max(1, len(half)):.0f}%)")
    for kernel in sorted({d["kernel"] for d in half}):
        n = [d for d in half if d["kernel"] == kernel]
        lines.append(f"- {kernel}: {len(n)} calls, {sum(d['reason'] is None for d in n)} taken")
    lines += ["", "Declined bf16/fp16 calls by reason:"]
    for reason, n in collections.Counter(d["reason"] for d in half if d["reason"]).most_common():
        lines.append(f"- {n} x {reason}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("test_file")
    p.add_argument("--out", default=".")
    p.add_argument("-n", type=int, default=8)
    p.add_argument("-k", default="")
    p.add_argument("--prefill", action="store_true", help="also offer our prefill kernel (enable(flex_prefill=True))")
    p.add_argument("--with-grad", action="store_true", help="run the tests as written (training graphs included)")
    p.add_argument("--backward", action="store_true",
                   help="as written, training graphs through our backward too (enable(flex_backward=True); issue 15)")
    p.add_argument("--cpu-estimate", action="store_true",
                   help="on a machine without a GPU: the enabled run records what the lowering would decide on a "
                        "Hopper GPU and leaves every call stock (the taken share, not the pass/fail, is the result)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--modes", default="stock,enabled",
                   help="which runs to make now; the summary reads every run's results found in --out, so "
                        "the two may be separate calls with one --out")
    p.add_argument("--where-stock-passed", action="store_true",
                   help="the enabled run takes only the tests the stock run in --out passed")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stem = _stem(args.test_file)
    for mode in args.modes.split(","):
        only = None
        if mode == "enabled":  # this run's decisions only
            with contextlib.suppress(FileNotFoundError):
                os.remove(_decisions_path(args.out, stem))
            if args.where_stock_passed:
                only = _node_ids(args.test_file, _outcomes(_junit_path(args.out, stem, "stock")), "passed")
                if not only:
                    raise SystemExit(f"--where-stock-passed: no stock run passed a test in {args.out}")
        _run(args.test_file, mode, args.out, args, only)
    stock, enabled = (_outcomes(_junit_path(args.out, stem, mode)) for mode in ("stock", "enabled"))
    text = summary(stem, stock, enabled, _decisions(args.out, stem))
    with open(os.path.join(args.out, f"{stem}-summary.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
