"""What a kernel's PTX does before `griddepcontrol.wait` (kernels/common/dependent_launch.py): no
access to global memory, generic addresses included, before the previous grid has finished."""

import re

# a memory instruction, after an optional predicate: its mnemonic with every qualifier
MEMORY_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:ld|st|red|atom|cp\.async|cp\.reduce|prefetchu?|multimem|suld|sust)"
                       r"(?:\.[\w:]+)*)", re.M)
# kernel arguments, shared memory, descriptors; an access naming none of these is generic
NON_GLOBAL_SPACE = re.compile(r"\.(param|shared|tensormap|const|local)\b")


def touches_global(op: str) -> bool:
    return ".global" in op or not NON_GLOBAL_SPACE.search(op)


def check_waits_then_releases(body: str) -> None:
    """`body`: one entry's PTX. The wait comes before any global or generic memory access, and the
    release of dependents after the wait."""
    wait, release = body.find("griddepcontrol.wait;"), body.find("griddepcontrol.launch_dependents;")
    assert 0 <= wait < release, "no wait, or the release before it"
    early = [op for op in MEMORY_OP.findall(body[:wait]) if touches_global(op)]
    assert not early, f"memory accesses before griddepcontrol.wait: {early}"
    assert MEMORY_OP.search(body[wait:]), "no memory access after the wait: the check saw nothing"


def entries(ptx: str) -> list[str]:
    """Each `.entry`'s PTX, in order (each runs to the next entry)."""
    return re.split(r"^\.visible \.entry ", ptx, flags=re.M)[1:]
