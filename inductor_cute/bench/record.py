"""Benchmark records: the JSON format of DESIGN.md, plus a Markdown table and a PNG plot made from it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

BACKENDS = ("inductor_cute", "triton", "aten")
METHOD = ("median of 100 runs, CUDA events around each call, L2 flushed before each, the host queued "
          "ahead of the GPU so times are device time only; the backends of a case interleaved in 5 "
          "rounds of 20 runs (the order rotating) so all meet the same clocks; host cost per call is "
          "reported apart")


def environment() -> dict:
    import torch

    from ..runtime.dsl import versions

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version,
            "cutlass_dsl": versions()["cutlass_dsl"], "inductor_cute": versions()["inductor_cute"],
            "commit": _commit()}


def _commit() -> str:
    if os.environ.get("INDUCTOR_CUTE_COMMIT"):
        return os.environ["INDUCTOR_CUTE_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[2]
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+changes" if changed else "")  # the code that ran is not exactly HEAD
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def new_record(suite: str, ceilings: dict) -> dict:
    return {"suite": suite, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "env": environment(), "ceilings": ceilings, "method": METHOD, "cases": []}


class RecordError(ValueError):
    """A file that is not a benchmark record this module can render; the message is one line."""


# What markdown() and plot() read; a record missing any of it cannot be rendered.
_REQUIRED = {"suite": str, "created": str, "env": dict, "ceilings": dict, "cases": list}
_REQUIRED_ENV = ("gpu", "torch", "triton", "cutlass_dsl", "inductor_cute", "commit")
_REQUIRED_CEILINGS = ("copy_TBps", "bf16_mm_TFLOPs")
_REQUIRED_CASE = {"name": str, "bound_us": (int, float), "times_us": dict}


def check(record) -> None:
    """Raise RecordError naming the first field a renderable record lacks."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, found {type(record).__name__}")
    for name, kind in _REQUIRED.items():
        if not isinstance(record.get(name), kind):
            raise RecordError(f"no {name!r} field" if name not in record else f"{name!r} is not a {kind.__name__}")
    for group, names in (("env", _REQUIRED_ENV), ("ceilings", _REQUIRED_CEILINGS)):
        missing = [n for n in names if n not in record[group]]
        if missing:
            raise RecordError(f"{group!r} lacks {', '.join(map(repr, missing))}")
    for i, case in enumerate(record["cases"], 1):
        for name, kind in _REQUIRED_CASE.items():
            if not isinstance(case, dict) or not isinstance(case.get(name), kind):
                raise RecordError(f"case {i} has no valid {name!r}")


def load(path: str | os.PathLike) -> dict:
    """The record in a JSON file, checked; RecordError (one line) if unreadable or not a record."""
    try:
        with open(path) as f:
            record = json.load(f)
    except OSError as e:
        raise RecordError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for a binary file
        raise RecordError(f"{path} is not JSON: {e}") from None
    try:
        check(record)
    except RecordError as e:
        raise RecordError(f"{path} is not a benchmark record: {e}") from None
    return record


def plot_unavailable() -> str | None:
    """Why no PNG plot can be drawn here, or None if it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    return None


def gpu_slug(name: str | None) -> str:
    if not name:
        return "cpu"
    return name.lower().replace("nvidia", "").strip().replace(" ", "-")


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def speedups(record: dict, baseline: str) -> list[float | None]:
    """Per case: baseline time / inductor_cute time (> 1 means we are faster)."""
    out = []
    for case in record["cases"]:
        ours, base = case["times_us"].get("inductor_cute"), case["times_us"].get(baseline)
        out.append(base / ours if ours and base else None)
    return out


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(record: dict) -> str:
    env, ceil = record["env"], record["ceilings"]
    lines = [f"# {record['suite']} on {env['gpu']} ({record['created']})", "",
             f"torch {env['torch']}, triton {env['triton']}, CuTe DSL {env['cutlass_dsl']}, "
             f"inductor-cute {env['inductor_cute']} ({env['commit']}); ceilings measured in this run: "
             f"copy {ceil['copy_TBps']} TB/s, bf16 mm {ceil['bf16_mm_TFLOPs']} TFLOP/s.", "",
             f"Timing: {record.get('method', 'not recorded')}.", "",
             *([f"Partial run: only cases whose name contains {env['case_filter']!r}.", ""]
               if env.get("case_filter") else []),
             *([f"Aborted {env['aborted']}.", ""] if env.get("aborted") else []),
             *([f"Unfinished: {env['unfinished']} (the run stopped or is still going).", ""]
               if env.get("unfinished") else []),
             "| case | bound us | inductor_cute us | triton us | aten us | vs triton | vs aten | roofline | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    vs_triton, vs_aten = speedups(record, "triton"), speedups(record, "aten")
    for case, st, sa in zip(record["cases"], vs_triton, vs_aten):
        t = case["times_us"]
        ours = t.get("inductor_cute")
        roof = case["bound_us"] / ours if ours else None
        lines.append(f"| {case['name']} | {_fmt(case['bound_us'])} | {_fmt(ours)} | {_fmt(t.get('triton'))} | "
                     f"{_fmt(t.get('aten'))} | {_fmt(st, 2)}x | {_fmt(sa, 2)}x | {_fmt(roof and roof * 100, 0)}% | "
                     f"{case.get('notes') or ''} |")
    lines += ["", f"Geomean speedup: {_fmt(geomean(vs_triton), 2)}x vs triton, {_fmt(geomean(vs_aten), 2)}x vs aten."]
    extra = [(case["name"], k, v) for case in record["cases"] for k, v in case["times_us"].items() if k not in BACKENDS]
    if extra:  # a suite's additional runners (e.g. the two stock modes behind "triton")
        lines += ["", "Other runners (us): " + "; ".join(f"{name}: {k} {_fmt(v)}" for name, k, v in extra) + "."]
    if record.get("host_overhead_us"):
        costs = ", ".join(f"{k} {v} us" for k, v in record["host_overhead_us"].items())
        lines += ["", f"Host cost per call on a one-row input (back-to-back calls, wall clock): {costs}."]
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> bool:
    """Speedup over each baseline and roofline fraction per case; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [c["name"] for c in record["cases"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.7 * len(names) + 2), 7), sharex=True)
    width = 0.4
    xs = range(len(names))
    for i, base in enumerate(("triton", "aten")):
        vals = [v or 0 for v in speedups(record, base)]
        ax1.bar([x + (i - 0.5) * width for x in xs], vals, width, label=f"vs {base}")
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_ylabel("speedup (x)")
    ax1.legend()
    ax1.set_title(f"{record['suite']} on {record['env']['gpu']}")
    roof = [c["bound_us"] / c["times_us"]["inductor_cute"] if c["times_us"].get("inductor_cute") else 0
            for c in record["cases"]]
    ax2.bar(list(xs), roof, color="tab:green")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("roofline fraction")
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(record: dict, out_dir: str | os.PathLike, with_plot: bool = True) -> list[Path]:
    """Write <suite>-<gpu>-<yyyymmdd>.json/.md/.png under out_dir; returns the paths written. Says on
    stderr when the PNG is left out, and why (not when `with_plot` is False: a run's progress)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{record['suite']}-{gpu_slug(record['env']['gpu'])}-{record['created'][:10].replace('-', '')}"
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(record, indent=1) + "\n")
    paths[1].write_text(markdown(record))
    if not with_plot:
        return paths
    if plot(record, out / f"{stem}.png"):
        paths.append(out / f"{stem}.png")
    else:
        print(f"skipped the PNG plot: {plot_unavailable() or 'matplotlib could not be used'}", file=sys.stderr)
    return paths
