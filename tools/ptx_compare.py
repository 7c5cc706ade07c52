"""Compare two INDUCTOR_CUTE_PTX_LOG files: did a change leave the generated code alone?

Make each log by running the compile tests with INDUCTOR_CUTE_PTX_LOG=FILE (runtime/compiler.py
appends one line per compiled kernel: builder module, params, PTX fingerprint), once before and
once after the change. Usage: python tools/ptx_compare.py BEFORE AFTER
1) by params: kernels compiled in both with the same params must have the same fingerprint;
2) by code: every fingerprint of BEFORE must appear in AFTER (every kernel the old tests compiled
   is still generated identically, whatever its params are now called)."""
import json, sys
def load(p):
    by_params, fps = {}, {}
    for line in open(p):
        mod, params, fp = json.loads(line)
        by_params.setdefault(json.dumps(params, sort_keys=True), set()).add(fp)
        fps.setdefault(fp, f"{mod} {json.dumps(params, sort_keys=True)[:200]}")
    return by_params, fps
(a, fa), (b, fb) = load(sys.argv[1]), load(sys.argv[2])
diff = sum(1 for k in set(a) & set(b) if a[k] != b[k])
for k in sorted(set(a) & set(b)):
    if a[k] != b[k]:
        print("DIFFERENT params:", k[:300])
missing = [fa[f] for f in fa if f not in fb]
for m in missing:
    print("NOT GENERATED ANY MORE:", m)
print(f"by params: {len(set(a) & set(b)) - diff} identical, {diff} different, {len(set(a) - set(b))} only before, "
      f"{len(set(b) - set(a))} only after; by code: {len(fa) - len(missing)} of {len(fa)} earlier kernels "
      f"generated identically, {len(missing)} not")
sys.exit(1 if diff or missing else 0)
