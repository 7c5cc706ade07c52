"""Score programs: what a flex_attention score_mod computes, as data, for the split-KV decode kernel.

A program is a JSON list of SSA steps `[name, op, arg, ...]`; the last step is the result, the
modified score. Args are earlier names, numbers, or the leaves

    "score"  fp32: q . k times the softmax scale (what torch's score_mod receives)
    "b", "h", "q", "kv"  int32: batch, query head, query position (0..Lq-1), key position

Captured tensors are "t0", "t1", ... (contiguous 1-D, dtypes in TENSOR_DTYPES); they appear only as
the first argument of `load`: `[name, "load", "t0", index]` reads t0[index] (float dtypes as fp32),
and of `len`: `[name, "len", "t0"]` is t0's element count (an int).

Its ops are the registry's score ops (registry.py). Every value has a type: "f" (fp32), "i"
(int32) or "b" (bool). Arithmetic follows torch's promotion (an int and a float give a float; an
int literal takes the other side's type); all float math is fp32, as the stock flex kernels
compute it. A negative load index counts from the end, as in torch; the kernel then clamps
indices into the tensor (padding rows and columns of a tile compute scores that are then thrown
away); an index out of range for a real element is the caller's error, as it is in torch.

A **mask program** (flex_attention's mask_mod, `mask=True` below) has the same format without
the "score" leaf and ends in a bool: True keeps the key.

Plain Python here; the CuTe DSL is imported only by `make_score_fn`.
"""

from __future__ import annotations

from . import registry
from .registry import SCORE, dumps, evaluate, literal_type, parse_steps

LEAVES = {"score": "f", "b": "i", "h": "i", "q": "i", "kv": "i"}
MASK_LEAVES = {k: t for k, t in LEAVES.items() if k != "score"}
TENSOR_DTYPES = {"float32": "f", "bfloat16": "f", "float16": "f", "int32": "i"}
MAX_TENSORS = 4  # the kernel's fixed number of captured-tensor slots
ARITY = registry.arity(SCORE)


def tensor_name(i: int) -> str:
    return f"t{i}"


def canonical(text: str, tensor_dtypes=(), mask: bool = False) -> str:
    return dumps(loads(text, tensor_dtypes, mask))


def _check_dtypes(tensor_dtypes) -> None:
    for dt in tensor_dtypes:
        if dt not in TENSOR_DTYPES:
            raise ValueError(f"captured tensor dtype {dt} is not supported (supported: {', '.join(TENSOR_DTYPES)})")
    if len(tensor_dtypes) > MAX_TENSORS:
        raise ValueError(f"{len(tensor_dtypes)} captured tensors, at most {MAX_TENSORS} are supported")


def typer(tensor_dtypes=(), mask: bool = False) -> registry.Typer:
    """A Typer for a score (or, with `mask`, mask) program whose captured tensors have these dtypes
    (names of TENSOR_DTYPES); raises ValueError for others."""
    _check_dtypes(tensor_dtypes)
    return registry.Typer(SCORE, MASK_LEAVES if mask else LEAVES,
                          {tensor_name(i): TENSOR_DTYPES[dt] for i, dt in enumerate(tensor_dtypes)})


def types_of(steps: list[list], tensor_dtypes=(), mask: bool = False) -> dict[str, str]:
    """The type of every leaf and step; raises ValueError naming the first problem."""
    types = typer(tensor_dtypes, mask)
    for step in steps:
        types.add(step)
    return types.types


def loads(text: str, tensor_dtypes=(), mask: bool = False) -> list[list]:
    """Parse and validate a program (a mask program with `mask`) against its captured tensors'
    dtypes (names of TENSOR_DTYPES); raises ValueError naming the first problem."""
    steps = parse_steps(text, SCORE)
    types = types_of(steps, tensor_dtypes, mask)
    if types[steps[-1][0]] != ("b" if mask else "f"):
        raise ValueError("mask program must end in a bool" if mask else "score program must end in a float")
    return steps


def reference(text: str, score, b, h, q, kv, tensors=()):
    """The program on torch tensors (broadcasting; score fp32, indices int32), for tests and
    CPU stand-ins: what the kernel computes per element."""
    import torch

    out = _run_torch(text, {"score": score.float(), "b": b, "h": h, "q": q, "kv": kv}, tensors, mask=False)
    return torch.as_tensor(out, dtype=torch.float32).expand(torch.broadcast_shapes(score.shape, out.shape))


def reference_mask(text: str, b, h, q, kv, tensors=()):
    """A mask program on torch index tensors (broadcasting, int32): the bool keep-mask."""
    import torch

    out = _run_torch(text, {"b": b, "h": h, "q": q, "kv": kv}, tensors, mask=True)
    return torch.as_tensor(out).expand(torch.broadcast_shapes(*(torch.as_tensor(x).shape for x in (b, h, q, kv, out))))


def _run_torch(text: str, env: dict, tensors, mask: bool):
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
    steps = loads(text, dtypes, mask)
    env = dict(env)
    env.update({tensor_name(i): t.float() if t.is_floating_point() else t for i, t in enumerate(tensors)})
    return evaluate(steps, env, registry.reference_ops(SCORE))


def _reciprocal_of_constant_divisor(step: list) -> list:
    """A division by a nonzero constant as a multiply by its reciprocal, within an ulp of IEEE
    division (Triton's `/` is approximate too): div.rn costs a slow-path branch per element that
    kept the compiler from interleaving elements (softcap ran 7x slower than plain decode). The
    step keeps its name, so its type ("f") is unchanged."""
    name, op, *args = step
    if op == "truediv" and not isinstance(args[1], str) and args[1] != 0:
        return [name, "mul", args[0], 1.0 / args[1]]
    return step


def make_score_fn(text: str, tensor_dtypes=(), mask: bool = False, outputs: tuple[str, ...] = ()):
    """The kernel's per-element hook: fn(score, b, h, q, kv, tensors) on DSL scalars (score
    Float32, indices Int32, tensors the captured 1-D cute.Tensors) -> Float32. Numbers become
    constants of their step's type; float math is IEEE-accurate (no approximate tanh or exp), but
    for division by a constant, which multiplies by the reciprocal.
    With `mask`, a mask program's hook: fn(b, h, q, kv, tensors) -> Boolean (True keeps).
    With `outputs` (step names), fn returns their values as a tuple instead of the last step's
    (score_grad.tangent's result and derivative)."""
    steps = loads(text, tensor_dtypes, mask)
    types = types_of(steps, tensor_dtypes, mask)
    steps = [_reciprocal_of_constant_divisor(step) for step in steps]
    d = registry.ScalarDsl()
    ops = registry.dsl_ops(SCORE, d)

    def conversions(name, op, *args):
        """Per argument: the DSL type it is brought to (numbers become typed constants, ints are
        promoted to float), or None."""
        arg_types = [types.get(a) if isinstance(a, str) else literal_type(a) for a in args]
        to = registry.operand_type(op, arg_types, types[name])
        out = []
        for a, t in zip(args, arg_types):
            if to is not None and t in ("f", "i"):
                out.append(d.typed[to])
            else:
                out.append(None if isinstance(a, str) else d.typed[t])
        return tuple(out)

    convert = [conversions(*step) for step in steps]

    def program_fn(values: dict, tensors):
        values.update({tensor_name(i): t for i, t in enumerate(tensors)})
        if outputs:
            evaluate(steps, values, ops, convert, keep=values)
            return tuple(values[name] for name in outputs)
        return evaluate(steps, values, ops, convert)

    if mask:
        return lambda b, h, q, kv, tensors: program_fn({"b": b, "h": h, "q": q, "kv": kv}, tensors)
    return lambda score, b, h, q, kv, tensors: program_fn({"score": score, "b": b, "h": h, "q": q, "kv": kv}, tensors)


def reference_keep(shape, mask_text: str = "", mask_tensors=(), block_mask=None, kv_block_size: int = 128,
                   q_block_size: int = 128, device=None):
    """(B, Hq, Lq, Lkv) bool, the keys the decode kernel attends before kv_len, as flex_attention
    defines them: with a block mask (kv_num_blocks, kv_indices, full_kv_num_blocks or None,
    full_kv_indices or None; batch b reads row b % Z, head h row h % H, query q block
    q // q_block_size) the keys of its full blocks and the mask program's keys of its partial
    blocks; without one, the mask program's keys ("" keeps all). For tests and CPU stand-ins."""
    import torch

    batch, heads, q_len, kv_len = shape
    idx = [torch.arange(n, dtype=torch.int32, device=device).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate(shape)]
    keep = reference_mask(mask_text, *idx, mask_tensors) if mask_text else torch.ones((), dtype=torch.bool,
                                                                                    device=device)
    keep = keep.expand(shape)
    if block_mask is None or block_mask[0] is None:
        return keep
    num, ind, full_num, full_ind = block_mask
    rows = (torch.arange(batch, device=device) % num.shape[0])[:, None, None]
    hs = (torch.arange(heads, device=device) % num.shape[1])[None, :, None]
    qb = (torch.arange(q_len, device=device) // q_block_size)[None, None, :]
    key_block = torch.arange(kv_len, device=device) // kv_block_size

    def listed(n, i):  # key's block among the first n entries of the row's list
        n, i = n[rows, hs, qb], i[rows, hs, qb]  # (B, H, Lq), (B, H, Lq, C)
        valid = torch.arange(i.shape[-1], device=device) < n[..., None]
        return ((i[..., None, :] == key_block[:, None]) & valid[..., None, :]).any(-1)

    full = listed(full_num, full_ind) if full_num is not None else torch.zeros_like(keep)
    return full | (listed(num, ind) & keep)


def programs_error(score_program: str, score_dtypes, mask_program: str, mask_dtypes) -> str | None:
    """Why a kernel's score and mask programs cannot be compiled (not canonical, or invalid); None
    if they can. Kernel problems (decode, prefill) check their programs here."""
    for kind, text, dtypes in (("score", score_program, score_dtypes), ("mask", mask_program, mask_dtypes)):
        if not (text or dtypes):
            continue
        try:
            if canonical(text, dtypes, mask=kind == "mask") != text:
                return f"{kind}_program must be in canonical form (score_program.canonical)"
        except ValueError as e:
            return str(e)
    return None
