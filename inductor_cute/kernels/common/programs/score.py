"""Score programs: what a flex_attention score_mod computes, as data, for the split-KV decode kernel.

A program is a JSON list of SSA steps `[name, op, arg, ...]`; the last step is the result, the
modified score. Args are earlier names, numbers, or the leaves

    "score"  fp32: q . k times the softmax scale (what torch's score_mod receives)
    "b", "h", "q", "kv"  int32: batch, query head, query position (0..Lq-1), key position

Captured tensors are "t0", "t1", ... (contiguous 1-D, dtypes in TENSOR_DTYPES); they appear only as
the first argument of `load`: `[name, "load", "t0", index]` reads t0[index] (float dtypes as fp32).

Every value has a type: "f" (fp32), "i" (int32) or "b" (bool). Arithmetic follows torch's
promotion (an int and a float give a float; an int literal takes the other side's type); all
float math is fp32, as the stock flex kernels compute it. A negative load index counts from the
end, as in torch; the kernel then clamps indices into the tensor (padding rows and columns of a
tile compute scores that are then thrown away); an index out of range for a real element is the
caller's error, as it is in torch.

A **mask program** (flex_attention's mask_mod, `mask=True` below) has the same format without
the "score" leaf and ends in a bool: True keeps the key.

Plain Python here; the CuTe DSL is imported only by `make_score_fn`.
"""

from __future__ import annotations

import json

from .epilogue import parse_steps, split_step

LEAVES = {"score": "f", "b": "i", "h": "i", "q": "i", "kv": "i"}
MASK_LEAVES = {k: t for k, t in LEAVES.items() if k != "score"}
TENSOR_DTYPES = {"float32": "f", "bfloat16": "f", "float16": "f", "int32": "i"}
MAX_TENSORS = 4  # the kernel's fixed number of captured-tensor slots

FLOAT_UNARY = ("exp", "log", "tanh", "sigmoid")  # any number in, fp32 out
SAME_UNARY = ("neg", "abs")  # keeps int or float
ARITH = ("add", "sub", "mul", "maximum", "minimum")  # int if both int, else float
INT_ONLY = ("floordiv", "remainder")  # Python/torch semantics: floor, the divisor's sign
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL = ("and", "or")
ARITY = {**{op: 1 for op in FLOAT_UNARY + SAME_UNARY + ("not", "float", "int")},
         **{op: 2 for op in ARITH + INT_ONLY + COMPARE + LOGICAL + ("truediv", "load")}, "where": 3}


def tensor_name(i: int) -> str:
    return f"t{i}"


def dumps(steps: list[list]) -> str:
    """The canonical text of a program (it is part of the kernel's cache key)."""
    return json.dumps(steps, separators=(",", ":"))


def canonical(text: str, tensor_dtypes=(), mask: bool = False) -> str:
    return dumps(loads(text, tensor_dtypes, mask))


def _literal_type(x) -> str | None:
    if isinstance(x, bool):
        return None
    return "i" if isinstance(x, int) else "f" if isinstance(x, float) else None


def _result_type(op: str, types: list[str], name: str) -> str:
    def need(ok, what):
        if not ok:
            raise ValueError(f"score step {name}: {op} needs {what}, got {'/'.join(types)}")

    numeric = all(t in "fi" for t in types)
    if op in FLOAT_UNARY or op == "truediv":
        need(numeric, "numbers")
        return "f"
    if op in SAME_UNARY or op in ARITH:
        need(numeric, "numbers")
        return "i" if all(t == "i" for t in types) else "f"
    if op in INT_ONLY:
        need(all(t == "i" for t in types), "ints")
        return "i"
    if op in COMPARE:
        need(numeric, "numbers")
        return "b"
    if op in LOGICAL or op == "not":
        need(all(t == "b" for t in types), "bools")
        return "b"
    if op == "where":
        need(types[0] == "b" and all(t in "fi" for t in types[1:]), "a bool and two numbers")
        return "i" if types[1] == types[2] == "i" else "f"
    if op == "float":
        return "f"
    assert op == "int"
    return "i"


def types_of(steps: list[list], tensor_dtypes=(), mask: bool = False) -> dict[str, str]:
    """The type of every leaf and step; raises ValueError naming the first problem."""
    types = dict(MASK_LEAVES if mask else LEAVES)
    tensors = {tensor_name(i): dt for i, dt in enumerate(tensor_dtypes)}
    for step in steps:
        name, op, args = split_step(step, ARITY, "score")
        if name in types or name in tensors:
            raise ValueError(f"score step name {name!r} is used twice")
        if op == "load":
            if args[0] not in tensors:
                raise ValueError(f"score step {name}: load from unknown tensor {args[0]!r}")
            args = args[1:]
        arg_types = []
        for arg in args:
            t = types.get(arg) if isinstance(arg, str) else _literal_type(arg)
            if t is None:
                raise ValueError(f"score step {name}: unknown argument {arg!r}")
            arg_types.append(t)
        if op == "load":
            if arg_types[0] != "i":
                raise ValueError(f"score step {name}: load index must be an int")
            types[name] = TENSOR_DTYPES[tensors[step[2]]]
        else:
            types[name] = _result_type(op, arg_types, name)
    return types


def loads(text: str, tensor_dtypes=(), mask: bool = False) -> list[list]:
    """Parse and validate a program (a mask program with `mask`) against its captured tensors'
    dtypes (names of TENSOR_DTYPES); raises ValueError naming the first problem."""
    for dt in tensor_dtypes:
        if dt not in TENSOR_DTYPES:
            raise ValueError(f"captured tensor dtype {dt} is not supported (supported: {', '.join(TENSOR_DTYPES)})")
    if len(tensor_dtypes) > MAX_TENSORS:
        raise ValueError(f"{len(tensor_dtypes)} captured tensors, at most {MAX_TENSORS} are supported")
    steps = parse_steps(text, "score")
    types = types_of(steps, tensor_dtypes, mask)
    if types[steps[-1][0]] != ("b" if mask else "f"):
        raise ValueError("mask program must end in a bool" if mask else "score program must end in a float")
    return steps


def evaluate(steps: list[list], env: dict, ops: dict):
    """Run a program with `ops[op](*args)`; `env` maps leaves and tensor names to values."""
    values = dict(env)
    for name, op, *args in steps:
        values[name] = ops[op](*(values[a] if isinstance(a, str) else a for a in args))
    return values[steps[-1][0]]


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
    import torch

    def maximum(a, c):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(c))

    def minimum(a, c):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(c))

    def where(c, a, d):
        return torch.where(c, torch.as_tensor(a), torch.as_tensor(d))

    ops = {
        "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": maximum, "minimum": minimum,
        "truediv": torch.true_divide, "floordiv": lambda a, c: torch.div(a, c, rounding_mode="floor"),
        "remainder": torch.remainder,
        "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
        "and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not,
        "where": where, "float": lambda x: torch.as_tensor(x).to(torch.float32),
        "int": lambda x: torch.as_tensor(x).to(torch.int32),
        "load": lambda t, i: t[torch.as_tensor(i).long()],
    }
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
    steps = loads(text, dtypes, mask)
    env = dict(env)
    env.update({tensor_name(i): t.float() if t.is_floating_point() else t for i, t in enumerate(tensors)})
    return evaluate(steps, env, ops)


def _reciprocal_of_constant_divisor(step: list) -> list:
    """A division by a nonzero constant as a multiply by its reciprocal, within an ulp of IEEE
    division (Triton's `/` is approximate too): div.rn costs a slow-path branch per element that
    kept the compiler from interleaving elements (softcap ran 7x slower than plain decode). The
    step keeps its name, so its type ("f") is unchanged."""
    name, op, *args = step
    if op == "truediv" and not isinstance(args[1], str) and args[1] != 0:
        return [name, "mul", args[0], 1.0 / args[1]]
    return step


def make_score_fn(text: str, tensor_dtypes=(), mask: bool = False):
    """The kernel's per-element hook: fn(score, b, h, q, kv, tensors) on DSL scalars (score
    Float32, indices Int32, tensors the captured 1-D cute.Tensors) -> Float32. Numbers become
    constants of their step's type; float math is IEEE-accurate (no approximate tanh or exp), but
    for division by a constant, which multiplies by the reciprocal.
    With `mask`, a mask program's hook: fn(b, h, q, kv, tensors) -> Boolean (True keeps)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Boolean, Float32, Int32

    steps = loads(text, tensor_dtypes, mask)
    types = types_of(steps, tensor_dtypes, mask)
    steps = [_reciprocal_of_constant_divisor(step) for step in steps]
    dsl = {"f": Float32, "i": Int32, "b": Boolean}

    def sel(c, a, d, t):
        return dsl[t](cutlass.select_(c, a, d))

    def maximum(a, d):  # torch.maximum: NaN from either side wins
        m = sel(a > d, a, d, "f" if isinstance(a, Float32) else "i")
        return sel(d != d, d, sel(a != a, a, m, "f"), "f") if isinstance(a, Float32) else m

    def minimum(a, d):
        m = sel(a < d, a, d, "f" if isinstance(a, Float32) else "i")
        return sel(d != d, d, sel(a != a, a, m, "f"), "f") if isinstance(a, Float32) else m

    def load(t, i):
        n = Int32(t.shape[0])
        i = sel(i < 0, i + n, i, "i")  # a negative index counts from the end, as torch indexing does
        i = cutlass.max(cutlass.min(i, n - 1), Int32(0))
        v = t[i]
        return v if t.element_type is Int32 else Float32(v)

    def floor_div_mod(a, d):
        # torch floors the quotient and gives the remainder the divisor's sign. The DSL's Int32 `//`
        # (arith.floordivsi) came out as a truncating division in the PTX, wrong on the H200 for a
        # negative dividend. So divide magnitudes (every rounding agrees there), take the truncated
        # quotient and step it down where the operands' signs differ and the division is inexact
        one, zero = Int32(1), Int32(0)
        magnitude = sel(a < 0, -a, a, "i") // sel(d < 0, -d, d, "i")
        signs_differ = sel(a < 0, one, zero, "i") != sel(d < 0, one, zero, "i")
        q = sel(signs_differ, -magnitude, magnitude, "i")
        r = a - q * d
        fix = (r != 0) & signs_differ
        return sel(fix, q - 1, q, "i"), sel(fix, r + d, r, "i")

    ops = {
        "neg": lambda x: -x, "abs": lambda x: sel(x < 0, -x, x, "f" if isinstance(x, Float32) else "i"),
        "exp": lambda x: cute.math.exp(x, fastmath=False), "log": lambda x: cute.math.log(x, fastmath=False),
        "tanh": lambda x: cute.math.tanh(x, fastmath=False),
        "sigmoid": lambda x: 1.0 / (1.0 + cute.math.exp(-x, fastmath=False)),
        "add": lambda a, d: a + d, "sub": lambda a, d: a - d, "mul": lambda a, d: a * d,
        "maximum": maximum, "minimum": minimum, "truediv": lambda a, d: a / d,
        "floordiv": lambda a, d: floor_div_mod(a, d)[0], "remainder": lambda a, d: floor_div_mod(a, d)[1],
        "lt": lambda a, d: a < d, "le": lambda a, d: a <= d, "gt": lambda a, d: a > d,
        "ge": lambda a, d: a >= d, "eq": lambda a, d: a == d, "ne": lambda a, d: a != d,
        "and": lambda a, d: a & d, "or": lambda a, d: a | d, "not": lambda a: ~a,
        "where": lambda c, a, d: sel(c, a, d, "f" if isinstance(a, Float32) else "i"),
        "float": Float32, "int": Int32,  # float -> int truncates toward zero, as torch's .to(int32)
        "load": load,
    }

    def operand_type(op: str, name: str, arg_types: list[str]) -> str | None:
        """The type every numeric argument of a step is brought to (None: leave as is)."""
        if op in ("float", "int", "load", "not", "and", "or"):
            return None
        if op in COMPARE or op == "where":
            numeric = [t for t in arg_types if t in "fi"]
            return "i" if all(t == "i" for t in numeric) else "f"
        if op in FLOAT_UNARY or op == "truediv":
            return "f"
        return types[name]

    def program_fn(values: dict, tensors):
        values.update({tensor_name(i): t for i, t in enumerate(tensors)})
        for name, op, *args in steps:
            arg_types = [types[a] if isinstance(a, str) and a in types else _literal_type(a) for a in args]
            to = operand_type(op, name, arg_types)
            vals = []
            for a, t in zip(args, arg_types):
                v = values[a] if isinstance(a, str) else a
                if to is not None and t in ("f", "i"):
                    v = dsl[to](v)  # numbers become typed constants, ints are promoted to float
                elif not isinstance(a, str):
                    v = dsl[t](v)
                vals.append(v)
            values[name] = ops[op](*vals)
        return values[steps[-1][0]]

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
