"""Command line: python -m inductor_cute {demo,doctor,cache,bench,report}.

Parsing the arguments imports neither torch nor the CuTe DSL (seconds each): `--help` and argument
errors answer at once; each command imports what it needs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PROG = "python -m inductor_cute"


def _prog() -> str:
    """The name this command was started by: `inductor-cute` for the console script, else `python -m`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not name or name in ("__main__.py", "-c") or name.endswith(".py"):
        return DEFAULT_PROG
    return name


def _suite_names() -> list[str]:
    """The benchmark suites: the modules in bench/suites/ that define `cases` (read as text:
    importing them would import torch; a module there without it serves the suites)."""
    folder = Path(__file__).resolve().parent / "bench" / "suites"
    return sorted(p.stem for p in folder.glob("*.py")
                  if not p.stem.startswith("_") and "\ndef cases(" in p.read_text())


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _cmd_cache(args) -> int:
    from .runtime.cache import CompiledKernelCache

    cache = CompiledKernelCache()
    action = args.action or "show"
    if action == "clear":
        n = cache.clear()
        print(f"removed {n} entries from {cache.root}")
        return 0
    if action == "export":
        return _cache_export(cache, args.file)
    if action == "import":
        return _cache_import(cache, args.file)
    entries = cache.entries()
    total = sum(e.size for e in entries)
    print(f"location: {cache.root}")
    n_lib = sum(e.kind == "library" for e in entries)
    print(f"entries:  {len(entries)} ({len(entries) - n_lib} compiled objects, {n_lib} linked libraries)")
    print(f"size:     {total / 1e6:.2f} MB")
    if action == "list":
        for e in entries:
            h = e.header or {}
            label = h.get("kernel", "DAMAGED (will be recompiled)")
            if e.kind == "library":
                label += " [linked library]"
            print(f"  {e.key[:16]}  {h.get('arch', '?'):7} {e.size / 1e3:8.1f} kB  {label}")
    return 0


def _cache_export(cache, file: str) -> int:
    from .runtime.artifacts import export_archive

    try:
        n = export_archive(cache, file)
    except OSError as e:
        return _fail(f"cannot write {file}: {e.strerror or e}")
    print(f"exported {n} compiled kernels from {cache.root} to {file}")
    return 0


def _cache_import(cache, file: str) -> int:
    import tarfile

    from .errors import first_line
    from .runtime.artifacts import import_archive

    try:
        report = import_archive(cache, file)
    except FileNotFoundError:
        return _fail(f"{file}: no such file")
    except tarfile.TarError:
        return _fail(f"{file} is not a kernel cache archive (made by `cache export`: a .tar.gz)")
    except OSError as e:
        return _fail(f"cannot read {file}: {e.strerror or first_line(e)}")
    for line in report.skipped:
        print(f"skipped {line}", file=sys.stderr)
    print(f"imported {report.added} compiled kernels into {cache.root}"
          + (f"; {report.present} were already there" if report.present else "")
          + (f"; {len(report.skipped)} skipped" if report.skipped else ""))
    return 1 if report.skipped else 0


def _cmd_bench(args) -> int:
    from .bench.harness import run_suite

    run_suite(args.suite, quick=args.quick, out_dir=args.out, match=args.match)
    return 0


def _cmd_report(args) -> int:
    from .bench import record as rec

    try:
        record = rec.load(args.json)
        paths = rec.write(record, args.out or str(Path(args.json).parent))
    except rec.RecordError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot write the report: {e.strerror or e}")
    for p in paths:
        print(f"wrote {p}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_prog(), description="CuTe DSL kernels for TorchInductor on NVIDIA "
                                     "Hopper: try them, check the installation, manage the kernel cache, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="show the speedup on this GPU (or compile the kernel library without one)")
    sub.add_parser("doctor", help="check the installation; exits non-zero if something needed is missing")
    p = sub.add_parser("cache", help="show, list, clear, export or import the compiled-kernel cache")
    actions = p.add_subparsers(dest="action", metavar="{show,list,clear,export,import}")
    actions.add_parser("show", help="location, number of entries and size (the default)")
    actions.add_parser("list", help="every entry: key, target, size, kernel")
    actions.add_parser("clear", help="delete every entry")
    a = actions.add_parser("export", help="write every compiled kernel into an archive (.tar.gz)")
    a.add_argument("file")
    a = actions.add_parser("import", help="add the kernels of an archive made by export; damaged ones are skipped")
    a.add_argument("file")
    p = sub.add_parser("bench", help="run a benchmark suite on the GPU and write its record")
    p.add_argument("suite", choices=_suite_names())
    p.add_argument("--quick", action="store_true", help="a few representative cases only")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON/Markdown/PNG record")
    p.add_argument("--match", default="", help="only the cases whose name contains this text")
    p = sub.add_parser("report", help="rewrite the Markdown table and PNG plot of a JSON record")
    p.add_argument("json")
    p.add_argument("--out", default=None)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo()
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor()
    return {"cache": _cmd_cache, "bench": _cmd_bench, "report": _cmd_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
