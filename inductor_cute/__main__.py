"""Command line: python -m inductor_cute {demo,bench,doctor,cache,report}."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_cache(args) -> int:
    from .runtime.cache import CompiledKernelCache

    cache = CompiledKernelCache()
    if args.action == "clear":
        n = cache.clear()
        print(f"removed {n} entries from {cache.root}")
        return 0
    entries = cache.entries()
    total = sum(e.size for e in entries)
    print(f"location: {cache.root}")
    n_lib = sum(e.kind == "library" for e in entries)
    print(f"entries:  {len(entries)} ({len(entries) - n_lib} compiled objects, {n_lib} linked libraries)")
    print(f"size:     {total / 1e6:.2f} MB")
    if args.action == "list":
        for e in entries:
            h = e.header or {}
            label = h.get("kernel", "DAMAGED (will be recompiled)")
            if e.kind == "library":
                label += " [linked library]"
            print(f"  {e.key[:16]}  {h.get('arch', '?'):7} {e.size / 1e3:8.1f} kB  {label}")
    return 0


def _cmd_bench(args) -> int:
    from .bench.harness import run_suite

    run_suite(args.suite, quick=args.quick, out_dir=args.out, match=args.match)
    return 0


def _cmd_report(args) -> int:
    from .bench import record as rec

    with open(args.json) as f:
        record = json.load(f)
    for p in rec.write(record, args.out or str(__import__("pathlib").Path(args.json).parent)):
        print(f"wrote {p}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inductor_cute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="show the speedup on this GPU (or compile the kernel library without one)")
    sub.add_parser("doctor", help="check the installation; exits non-zero if something needed is missing")
    p = sub.add_parser("cache", help="show or clear the compiled-kernel cache")
    p.add_argument("action", nargs="?", choices=["show", "list", "clear"], default="show")
    from .bench.suites import SUITES

    p = sub.add_parser("bench", help="run a benchmark suite on the GPU and write its record")
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--quick", action="store_true", help="a few representative cases only")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON/Markdown/PNG record")
    p.add_argument("--match", default="", help="only the cases whose name contains this text")
    p = sub.add_parser("report", help="rewrite the Markdown table and PNG plot of a JSON record")
    p.add_argument("json")
    p.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo()
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor()
    return {"cache": _cmd_cache, "bench": _cmd_bench, "report": _cmd_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
