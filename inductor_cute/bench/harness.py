"""Running a benchmark suite: correctness check, timing of every backend side by side, the record."""

from __future__ import annotations

import math
import sys
import time

import torch

from ..errors import first_line
from . import record as rec
from .case import Case  # noqa: F401  (suites may take it from here too)
from .timing import bound_us, host_overhead_us, measure_ceilings, time_side_by_side


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _parts(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _own_copy(out):
    """A copy of a runner's output (a tensor or a tuple of them). A CUDA-graph replay's outputs
    live in the graphs' shared memory pool, which the next runner's replay may reuse: kept as
    is, an earlier runner's output would be checked against whatever was written there last."""
    if isinstance(out, (tuple, list)):
        return tuple(_own_copy(o) for o in out)
    return out.clone() if isinstance(out, torch.Tensor) else out


# elements compared at once: fp32 temporaries of a few hundred MB, whatever the output's size (a
# DeepSeek-V3 weight gradient has 3.8e9 elements: whole-tensor fp32 temporaries did not fit 80 GB)
_CHUNK = 1 << 26


def _chunk_pairs(o: torch.Tensor, r: torch.Tensor):
    """(o, r) chunk by chunk, flattened, in fp32."""
    o, r = o.reshape(-1), r.reshape(-1)
    for i in range(0, r.numel(), _CHUNK):
        yield o[i:i + _CHUNK].float(), r[i:i + _CHUNK].float()


def _mismatch(case: Case, backend: str, out, ref, ref_name: str) -> str | None:
    """Why `out` (a tensor or a tuple of them) is not `ref` within the case's tolerance; None if it is."""
    outs, refs = _parts(out), _parts(ref)
    if len(outs) != len(refs):
        return f"{backend} returned {len(outs)} outputs, {ref_name} {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        which = f" #{i}" if len(refs) > 1 else ""
        if o.shape != r.shape:
            return f"{backend} output{which} has shape {tuple(o.shape)}, {ref_name} {tuple(r.shape)}"
        if math.isinf(case.atol) and math.isinf(case.rtol):
            # unchecked (a suite that reports its own agreement): allclose would read rtol * |0| as
            # inf * 0 = NaN and reject every output holding an exact zero; only non-finite values
            # where the reference is finite count
            if any((~oc.isfinite() & rc.isfinite()).any() for oc, rc in _chunk_pairs(o, r)):
                return f"{backend} output{which} has non-finite values where {ref_name} is finite"
            continue
        atol = case.atol
        if case.atol_of_max and r.numel():
            atol *= max(float(rc.abs().max()) for _, rc in _chunk_pairs(o, r))
        if not all(torch.allclose(oc, rc, atol=atol, rtol=case.rtol) for oc, rc in _chunk_pairs(o, r)):
            err = max(float((oc - rc).abs().max()) for oc, rc in _chunk_pairs(o, r))
            return f"{backend} output{which} differs from {ref_name} (max abs err {err:.3g}, atol {atol:.3g})"
    return None


def _check(case: Case, outputs: dict, reference=None) -> list[tuple[str, str]]:
    """Compare every backend's output with the reference output (case.reference's) or, without
    one, with aten's: (backend, message) for each that differs; a mismatch disqualifies it.
    Tuple outputs are compared tensor by tensor."""
    ref = reference if reference is not None else outputs.get("aten")
    if ref is None:
        return []
    ref_name = "the reference" if reference is not None else "aten"
    bad = []
    for backend, out in outputs.items():
        if out is None or (reference is None and backend == "aten"):
            continue
        message = _mismatch(case, backend, out, ref, ref_name)
        if message:
            bad.append((backend, message))
    return bad


def _reference(case: Case):
    if case.reference is None:
        return None
    try:
        out = case.reference()
        torch.cuda.synchronize()
        return out
    except Exception as e:  # the runners still get timed; the note says they went unchecked
        case.notes.append(f"reference failed, outputs unchecked: {first_line(e)[:160]}")
        return None


def run_case(case: Case, ceilings: dict) -> dict:
    times: dict[str, float | None] = {}
    outputs = {}
    # the record's backends, then a suite's additional runners (e.g. flash): all checked
    for backend in [*rec.BACKENDS, *(b for b in case.runners if b not in rec.BACKENDS)]:
        fn = case.runners.get(backend)
        if fn is None:
            times[backend] = None
            continue
        try:
            start = time.perf_counter()
            outputs[backend] = _own_copy(fn())
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - start
            if first_call_s > 1.0:
                case.notes.append(f"{backend} first call (compile) {first_call_s:.1f} s")
        except Exception as e:  # a backend that cannot run this case gets null and a note
            outputs.pop(backend, None)  # a fault seen at the sync leaves no output to check
            times[backend] = None
            case.notes.append(f"{backend} failed: {first_line(e)[:160]}")
            case.runners[backend] = None
    for backend, message in _check(case, outputs, _reference(case)):
        case.notes.append("MISMATCH: " + message)
        case.runners[backend] = None
        times[backend] = None
    del outputs
    runnable = {backend: fn for backend, fn in case.runners.items() if fn is not None}
    if case.wall_times_us is not None:
        times.update({b: round(t, 2) for b, t in case.wall_times_us.items() if b in runnable})
    elif runnable:
        times.update({b: round(t, 2) for b, t in time_side_by_side(runnable).items()})
    return {"name": case.name, "params": case.params, "flops": case.flops, "bytes": case.bytes,
            "bound_us": round(bound_us(case.flops if case.matmul else 0, case.bytes, ceilings), 2),
            "times_us": times, "notes": "; ".join(case.notes)}


def _sticky_cuda_error() -> str | None:
    """The error of a CUDA context lost to a faulting kernel (an illegal address or instruction:
    every later call fails the same way), else None; frees the cached blocks when healthy."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return None
    except Exception as e:  # noqa: BLE001 (torch.AcceleratorError on 2.11; RuntimeError before)
        return first_line(e)[:200]


def run_suite(name: str, quick: bool = False, out_dir: str = "benchmarks/results", match: str = "") -> dict:
    """Run a suite's cases (only those whose name contains `match`, if given) and write the record."""
    from .suites import SUITES

    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA GPU; none is visible")
    suite = SUITES[name]
    _progress("measuring ceilings (copy bandwidth, bf16 matmul) ...")
    ceilings = measure_ceilings()
    _progress(f"  copy {ceilings['copy_TBps']} TB/s, bf16 mm {ceilings['bf16_mm_TFLOPs']} TFLOP/s")
    record = rec.new_record(name, ceilings)
    record["method"] = getattr(suite, "METHOD", record["method"])  # suites timing wall clock say so
    if match:
        record["env"]["case_filter"] = match  # a partial run: the record says so
    cases = suite.cases(quick)
    for i, make_case in enumerate(cases, 1):
        if match and match not in getattr(make_case, "case_name", match):  # named: skipped unbuilt
            continue
        try:
            case = make_case()
        except Exception as e:  # one case that cannot be set up must not lose the rest of the run
            _progress(f"[{i}/{len(cases)}] setup failed: {first_line(e)[:200]}")
            fault = _sticky_cuda_error()
            if fault:
                name = getattr(make_case, "case_name", f"case {i}")
                record["env"]["aborted"] = f"in the setup of {name} ({i} of {len(cases)}): {fault}"
                break
            continue
        if match and match not in case.name:
            del case
            continue
        _progress(f"[{i}/{len(cases)}] {case.name} ...")
        try:
            result = run_case(case, ceilings)
        except Exception:  # a fault first seen while checking or timing: keep what was measured
            fault = _sticky_cuda_error()
            if not fault:
                raise  # the harness's own bug, not the GPU's
            record["env"]["aborted"] = f"during case {i} of {len(cases)} ({case.name}): {fault}"
            _progress(f"    stopping: {fault}")
            break
        record["cases"].append(result)
        t = result["times_us"]
        _progress("    " + ", ".join(f"{b} {t[b] if t[b] is not None else '-'} us" for b in rec.BACKENDS)
                  + f" (bound {result['bound_us']} us)")
        if result["notes"]:  # in the log as each case ends: a run cut short by a time limit keeps them
            _progress("    notes: " + result["notes"])
        # the record so far, marked unfinished: a run killed at a time limit leaves what it measured
        record["env"]["unfinished"] = f"written after case {i} of {len(cases)}"
        rec.write(record, out_dir, with_plot=False)
        del case
        fault = _sticky_cuda_error()
        if fault:  # the process's CUDA context is lost: record what was measured, and say why it ends
            record["env"]["aborted"] = f"after case {i} of {len(cases)} ({result['name']}): {fault}"
            _progress(f"    stopping: {fault}")
            break
    record["env"].pop("unfinished", None)
    if hasattr(suite, "host_overhead") and not record["env"].get("aborted"):
        record["host_overhead_us"] = {k: round(host_overhead_us(fn), 2) for k, fn in suite.host_overhead().items()}
    paths = rec.write(record, out_dir)
    print(rec.markdown(record))
    for p in paths:
        print(f"wrote {p}")
    return record
