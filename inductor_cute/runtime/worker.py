"""A compile worker: `python -m inductor_cute.runtime.worker --parent PID --arch ARCH`.

Started by runtime.pool as a fresh interpreter on an entry point of our own, so the user's
`__main__` is never imported (spawn-based pools re-run a script without a main guard in every
worker). It sees no GPU, compiles for the given arch, and writes into the shared cache; the
parent only loads.

Jobs arrive on stdin and replies leave on what was stdout, as wire messages; fd 1 itself is
pointed at stderr, so whatever the DSL or ptxas prints cannot corrupt the replies. The worker
imports the DSL only when it first compiles: a worker that only finds kernels in the cache stays
small. It exits at the end of stdin, or when its parent is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time


def _exit_when_orphaned(parent: int) -> None:
    # The pipe's end of stream already stops an idle worker whose parent died; this also covers a
    # pipe kept open by a process the parent forked.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(arch: str, jobs, replies) -> None:
    from ..errors import first_line
    from .cache import CompiledKernelCache
    from .dsl import import_cute
    from .loader import ensure_compiled, stats
    from .wire import encode, read_message

    def reply(message) -> None:
        replies.write(encode(message))
        replies.flush()

    while (job := read_message(jobs)) is not None:
        job_id = job["id"]

        def compile_starts(job_id=job_id):
            import_cute(arch)  # paid inside the compile slot, before the compile's timeout starts
            reply({"id": job_id, "event": "compiling"})

        compiles_before = stats["compiles"]
        start = time.perf_counter()
        try:
            ensure_compiled(job["spec"], arch, CompiledKernelCache(job["cache"]), on_compile_start=compile_starts)
        except Exception as e:  # reported per kernel; one bad config must not sink the others
            reply({"id": job_id, "status": "failed", "seconds": time.perf_counter() - start, "error": first_line(e)})
            continue
        status = "compiled" if stats["compiles"] > compiles_before else "cached"
        reply({"id": job_id, "status": status, "seconds": time.perf_counter() - start, "error": None})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inductor_cute.runtime.worker")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--arch", required=True)
    args = parser.parse_args(argv)
    if os.getppid() != args.parent:
        return 0
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA context in a worker
    os.environ["CUTE_DSL_ARCH"] = args.arch
    threading.Thread(target=_exit_when_orphaned, args=(args.parent,), daemon=True).start()
    try:
        _serve(args.arch, sys.stdin.buffer, replies)
    except BrokenPipeError:  # the parent stopped listening
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
