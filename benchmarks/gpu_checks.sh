#!/usr/bin/env bash
# The GPU checks for kernels and integration code that were compiled but not yet run, in the
# order they gate work, each with its own time limit; logs go to $OUT (one file per step).
#   . /opt/cutedsl/env.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash benchmarks/gpu_checks.sh [steps...]
set -u
OUT=${OUT:-/tmp/inductor-cute-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 INDUCTOR_CUTE_CACHE_DIR=${INDUCTOR_CUTE_CACHE_DIR:-/tmp/icache}

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1  # INT: pytest still reports
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - start)) s; $(grep -E '[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -1)"
}

# masks run in steps of their own: a hang there (a new kernel path) must not cost the other results
steps=${*:-"gemv flex flex_mask flex_compile flex_compile_mask fusion gemm inductor"}
for s in $steps; do
    case $s in
        gemv) step gemv 200 python3 -m pytest -m gpu tests/gpu/test_gemv_gpu.py -q -x -p no:cacheprovider ;;
        gemv_group) step gemv_group 200 python3 -m pytest -m gpu tests/gpu/test_gemv_group_gpu.py -q -p no:cacheprovider ;;
        flex) step flex 240 python3 -m pytest -m gpu tests/gpu/test_flex_decode_gpu.py -q -p no:cacheprovider -k "not mask" ;;
        flex_mask) step flex_mask 240 python3 -m pytest -m gpu tests/gpu/test_flex_decode_gpu.py -q -p no:cacheprovider -k mask ;;
        flex_lowering) step flex_lowering 120 python3 -m pytest tests/test_flex_lowering.py -q -p no:cacheprovider ;;
        flex_compile) step flex_compile 300 python3 -m pytest -m gpu tests/gpu/test_flex_compile_gpu.py -q -p no:cacheprovider -k "not block_mask" ;;
        # what transformers and PyTorch's decoding tests hand the lowering (padding masks, symbolic lengths)
        flex_coverage) step flex_coverage 300 python3 -m pytest -m gpu tests/gpu/test_flex_coverage_gpu.py -q -rf -n 8 \
                   -p no:cacheprovider ;;
        flex_compile_mask) step flex_compile_mask 240 python3 -m pytest -m gpu tests/gpu/test_flex_compile_gpu.py -q -p no:cacheprovider -k block_mask ;;
        fusion) step fusion 200 python3 -m pytest -m gpu tests/gpu/test_inductor_gpu.py -q -p no:cacheprovider -k fuse ;;
        gemm) step gemm 300 python3 -m pytest -m gpu tests/gpu/test_gemm_gpu.py -q -p no:cacheprovider ;;
        inductor) step inductor 400 python3 -m pytest -m gpu tests/gpu/test_inductor_gpu.py -q -p no:cacheprovider ;;
        # the backward's tests (dq_reduce's first run among them), then its speeds per schedule
        flex_backward) step flex_backward 300 python3 -m pytest -m gpu tests/gpu/test_flex_backward_gpu.py \
                   tests/gpu/test_flex_backward_lowering_gpu.py -q -rf -n 8 -p no:cacheprovider ;;
        flex_backward_speed) step flex_backward_speed 400 python3 benchmarks/flex_backward_speed.py ;;
        # the grouped GEMM's first cluster and gated runs alone, serially, stopping at the first failure (a hang
        # then names its test in the log: -v), then the rest of its tests, then every config's speed
        grouped_cluster) step grouped_cluster 240 python3 -m pytest -m gpu tests/gpu/test_grouped_gemm_gpu.py -v -x \
                   -p no:cacheprovider -k "cluster or gated" ;;
        grouped) step grouped 300 python3 -m pytest -m gpu tests/gpu/test_grouped_gemm_gpu.py -q -rf -n 8 -p no:cacheprovider ;;
        grouped_compile) step grouped_compile 300 python3 -m pytest -m gpu tests/gpu/test_grouped_gemm_compile_gpu.py -q -rf \
                   -p no:cacheprovider ;;
        sweep_grouped) step sweep_grouped 540 python3 benchmarks/sweep_grouped.py ;;
        sweep_gated) step sweep_gated 400 python3 benchmarks/sweep_grouped.py gated ;;
        # the prefill's new paths (split K/V rings, persistent CTAs after the C7512 fix), then its speeds
        # the whole prefill file: the O epilogue (halves) changed every variant since its last run
        prefill_new) step prefill_new 300 python3 -m pytest -m gpu tests/gpu/test_flex_prefill_gpu.py -q -rf -n 8 \
                   -p no:cacheprovider ;;
        prefill_quick) step prefill_quick 560 python3 -m inductor_cute bench flex_prefill --quick --out "$OUT/flex_prefill" ;;
        # the prefill's opt-in levers (poly_exps, overlap_tiles) against the device default
        prefill_levers) step prefill_levers 450 python3 benchmarks/prefill_levers.py ;;
        # stock flex_attention with a BlockMask traced into the graph (trace_block_masks), against eager
        traced_mask) step traced_mask 400 python3 benchmarks/traced_mask_check.py ;;
        # Nsight Compute on one launch of each attention kernel in benchmarks/ncu_kernels.py (full set: pipe
        # use, warp stalls, sampled stalls per source line); needs a machine whose ncu reads counters
        ncu) ncu --version > "$OUT/ncu-version.log" 2>&1
            for c in prefill_vit prefill_llama prefill_mla backward_plain backward_dq_reduce; do
                step "ncu-$c" 240 ncu --clock-control none --profile-from-start off --set full --print-details all \
                     --print-summary none python3 benchmarks/ncu_kernels.py "$c"
            done ;;
        # the same on the MoE block's grouped GEMMs (the weight gradient in ping-pong, in 2x2 ping-pong and
        # cooperative 128x256; the up forward in 1x2 and 2x2 clusters): speed of light (tensor pipe, L2,
        # DRAM), memory workload and warp stalls, a few replay passes each
        ncu_grouped) ncu --version > "$OUT/ncu-version.log" 2>&1
            for c in wgrad_pingpong wgrad_pingpong_2x2 wgrad_128x256 up_1x2_half up_2x2_half; do
                step "ncu-$c" 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
                     --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
                     --print-summary none python3 benchmarks/ncu_kernels.py "$c"
            done ;;
        rmsnorm) step rmsnorm 200 python3 -m pytest -m gpu tests/gpu/test_rmsnorm_gpu.py -q -p no:cacheprovider ;;
        sweep_gemv) step sweep_gemv 400 python3 benchmarks/sweep_gemv.py quick ;;
        flex_splits) step flex_splits 300 python3 benchmarks/sweep_flex_splits.py ;;
        # transformers families (decode, prefill, training) through our kernels: tiny configs, real head dims
        # where the families' gpt-oss prefill NaNs and Phi-3 decode crash come from (prints only)
        diag_families) step diag_families 300 python3 benchmarks/diag_families.py ;;
        families) step families 400 python3 -m pytest -m gpu tests/gpu/test_transformers_families_gpu.py -q -rf -n 8 \
                   -p no:cacheprovider ;;
        # the twenty-second session's fixes at their first GPU run: V.choices rebuilt in autograd's thread
        # (the backward lowering file in one process: its first tests enable flex_backward, a later one
        # not), the prefill lowering's unsupported head dim, Phi-3 decode through our 96/96 kernel, gpt-oss
        # prefill against stock's drift, prefill masks of finer blocks (walked coarsened), MoE router GEMMs
        # (fixes_backward and fixes are independent: two gpu_checks.sh processes may run them side by side)
        fixes_backward) step fixes_backward 300 python3 -m pytest -m gpu -q -rf -p no:cacheprovider -p no:xdist \
                   tests/gpu/test_flex_backward_lowering_gpu.py ;;
        fixes) step fixes 300 python3 -m pytest -m gpu -q -rf -n 8 -p no:cacheprovider \
                   tests/gpu/test_flex_prefill_lowering_gpu.py tests/gpu/test_transformers_families_gpu.py \
                   tests/gpu/test_flex_prefill_gpu.py::test_finer_block_masks_walked_at_the_kernels_blocks \
                   tests/gpu/test_flex_prefill_gpu.py::test_block_lists_alone_of_finer_blocks \
                   "tests/gpu/test_gemm_gpu.py::test_layouts_dtypes_and_sizes" ;;
        # the whole GPU tier; SIGINT at the limit still prints what failed so far (-rf). On an H100 it
        # ran past 490 s at 93% (twenty-first session): all_kernels, all_grouped and all_compiled split it
        # in three calls
        all) step all 470 python3 -m pytest -m gpu tests/gpu -q -rf -n 14 -p no:cacheprovider ;;
        # (the grouped GEMM's in a call of their own: their large shapes ran out of memory beside 13 other
        # workers, twenty-eighth session, and ping-pong and 2x2 clusters added ~170 tests)
        all_kernels) step all_kernels 540 python3 -m pytest -m gpu -q -rf -n 14 -p no:cacheprovider \
                   tests/gpu/test_flex_{decode,prefill,backward,launch}_gpu.py tests/gpu/test_gemm_gpu.py \
                   tests/gpu/test_gemv{,_group}_gpu.py tests/gpu/test_rmsnorm_gpu.py ;;
        all_grouped) step all_grouped 540 python3 -m pytest -m gpu -q -rf -n 8 -p no:cacheprovider \
                   tests/gpu/test_grouped_{gemm,wgrad,gather,gate_grad}_gpu.py ;;
        all_compiled) step all_compiled 540 python3 -m pytest -m gpu -q -rf -n 14 -p no:cacheprovider \
                   tests/gpu/test_flex_{backward_lowering,compile,coverage,prefill_lowering}_gpu.py \
                   tests/gpu/test_{choice_timing,gemv_shared_a_pass,grouped_gemm_compile,inductor_dynamic_m,inductor}_gpu.py \
                   tests/gpu/test_{moe_block,moe_routing,moe_scatters,transformers_families}_gpu.py ;;
        # one decode model case, 4 layers, CUDA graphs: CASE="llama3-8b decode B32 KV4096 cg" by default
        model) INDUCTOR_CUTE_MODEL_LAYERS=4 step model 540 python3 -m inductor_cute bench models \
                   --match "${CASE:-llama3-8b decode B32 KV4096 cg}" --out "$OUT/models" ;;
        # the same with the 2-D attention mask generate() passes each step (a stock graph breaks on it)
        model_masked) INDUCTOR_CUTE_MODEL_ATTENTION_MASK=1 INDUCTOR_CUTE_MODEL_LAYERS=4 step model_masked 540 \
                   python3 -m inductor_cute bench models --match "${CASE:-llama3-8b decode B8 KV8192 cg}" \
                   --out "$OUT/models-masked" ;;
        # the grouped GEMM's configs on routed offsets (after `grouped`: every config path's tests)
        grouped_routing) step grouped_routing 400 python3 benchmarks/grouped_routing.py ;;
        gather) step gather 300 python3 -m pytest -m gpu tests/gpu/test_grouped_gather_gpu.py -q -rf -n 8 -p no:cacheprovider ;;
        grouped_gather) step grouped_gather 400 python3 benchmarks/grouped_gather.py ;;
        # ours per cluster shape against Triton's template on the MoE block's routing (work rounds)
        grouped_rounds) step grouped_rounds 400 python3 benchmarks/grouped_rounds.py ;;
        # the MoE scatters made gathers (inductor/grouped/scatters.py) and the weight gradient's whole-tile
        # store (GroupedConfig.store_whole_tile), then the training step in default mode (no autotuning:
        # the scatter pass and the non-GEMM kernels side by side, ~100 s)
        moe_scatters) step moe_scatters 200 python3 -m pytest -m gpu tests/gpu/test_moe_scatters_gpu.py -q -rf -n 4 \
                   -p no:cacheprovider ;;
        wgrad_whole) step wgrad_whole 300 python3 -m pytest -m gpu tests/gpu/test_grouped_wgrad_gpu.py -q -rf -n 4 \
                   -p no:cacheprovider -k whole_tile ;;
        # the weight gradient's clusters (GroupedConfig cluster_m/cluster_n; grouped_wgrad_config.CLUSTERS_OFFERED)
        wgrad_clusters) step wgrad_clusters 300 python3 -m pytest -m gpu tests/gpu/test_grouped_wgrad_gpu.py -q -rf -n 4 \
                   -p no:cacheprovider -k cluster ;;
        # the weight gradient's ping-pong (GroupedConfig.pingpong; grouped_wgrad_config.PINGPONG_GPU_CHECKED), then
        # the weight gradients alone in grouped_rounds.py (ping-pong beside the offered candidates and eager)
        wgrad_pingpong) step wgrad_pingpong 200 python3 -m pytest -m gpu tests/gpu/test_grouped_wgrad_gpu.py -q -rf -n 4 \
                   -p no:cacheprovider -k pingpong ;;
        wgrad_rounds) step wgrad_rounds 200 python3 benchmarks/grouped_rounds.py 4096 --wgrad ;;
        # the weight gradients at every ring depth: is a unit's time its bytes over ring bytes / latency?
        wgrad_ring) step wgrad_ring 200 python3 benchmarks/grouped_rounds.py 4096 --ring ;;
        # the forward kernel's 2x2 clusters (grouped_config.CLUSTERS_2X2_OFFERED), and that a wave of
        # 4-CTA clusters fits the GPCs at once (TileScheduler.max_clusters against the driver's count)
        clusters_2x2) step clusters_2x2 300 python3 -m pytest -m gpu tests/gpu/test_grouped_gemm_gpu.py -q -rf -n 4 \
                   -p no:cacheprovider -k "2x2 or wave" ;;
        # the down projection's input gradient with SwiGLU's backward fused (GroupedProblem.gate_grad), then
        # the MoE block's runners (a training step fuses it under max-autotune), then their speed beside unfused
        gate_grad) step gate_grad 300 python3 -m pytest -m gpu tests/gpu/test_grouped_gate_grad_gpu.py -q -rf -n 4 \
                   -p no:cacheprovider
            step gate_grad_block 300 python3 -m pytest -m gpu tests/gpu/test_moe_block_gpu.py -q -rf -p no:cacheprovider
            step gate_grad_rounds 200 python3 benchmarks/grouped_rounds.py 4096 --gate-grad ;;
        # the forward kernel's half tiles (GroupedConfig.half_tiles; grouped_config.HALF_TILES_GPU_CHECKED)
        half_tiles) step half_tiles 300 python3 -m pytest -m gpu tests/gpu/test_grouped_gemm_gpu.py -q -rf -n 4 \
                   -p no:cacheprovider -k half ;;
        # the enabled training step's output code (which graph nodes each non-GEMM kernel computes), max-autotune
        moe_train_code) TORCH_LOGS=output_code step moe_train_code 320 python3 benchmarks/profile_model.py \
                   --model moe-block --phase train --tokens 4096 --mode max-autotune-no-cudagraphs --runners enabled \
                   --steps 3 ;;
        moe_train_default) step moe_train_default 240 python3 benchmarks/profile_model.py --model moe-block \
                   --phase train --tokens 4096 --mode default --steps 10 ;;
        # issue 14's MoE block (Qwen3-30B-A3B shapes): forward at 4096 and 16384 tokens, a training step
        moe_block) step moe_block 560 python3 -m inductor_cute bench models --match moe-block --out "$OUT/moe-block" ;;
        grouped_quick) step grouped_quick 560 python3 -m inductor_cute bench grouped_gemm --quick --out "$OUT/grouped" ;;
        # issue 11's per-call host cost and dynamic-M suites (whole suites, records to $OUT/<suite>)
        host|gemm_dynamic) step "$s" 500 python3 -m inductor_cute bench "$s" --out "$OUT/$s" ;;
        # where the host time of the host suite's GEMV case goes (cProfile of ours and stock)
        host_profile) step host_profile 300 python3 benchmarks/host_profile.py ;;
        # cold and warm compile of one model case, stock and enabled, each in fresh processes
        compile_cost) step compile_cost 560 python3 benchmarks/model_compile_cost.py \
                   --case "${CASE:-llama3-8b decode B8 KV8192 cg}" --json "$OUT/compile_cost.json" ;;
        # PyTorch's test_flex_decoding.py (fetched into .device/pt with expecttest beside it; never committed)
        # (pt_stock and pt_enabled: one run each, e.g. in two calls of a warm machine; /tmp/pt keeps the
        # first's results for the second's summary)
        pt_decoding|pt_stock|pt_enabled)
            modes=stock,enabled; [ "$s" = pt_stock ] && modes=stock; [ "$s" = pt_enabled ] && modes=enabled
            PYTHONPATH=$PWD/.device/pt:$PYTHONPATH step "$s" 560 python3 benchmarks/pytorch_flex_tests.py \
                .device/pt/test_flex_decoding.py --out /tmp/pt --modes "$modes" -n 14
            cp /tmp/pt/*-summary.md /tmp/pt/*.jsonl "$OUT/" 2>/dev/null ;;
        # PyTorch's test_flex_attention.py (fetched into .device/pt beside the decoding file), every test
        # under no_grad with our prefill offered too (issue 13): one mode per call, /tmp/pta keeps both
        pta_stock|pta_enabled)
            # (enabled: only the tests stock passed; under no_grad most fail stock, calling backward)
            modes=stock; [ "$s" = pta_enabled ] && modes=enabled
            PYTHONPATH=$PWD/.device/pt:$PYTHONPATH step "$s" 560 python3 benchmarks/pytorch_flex_tests.py \
                .device/pt/test_flex_attention.py --out /tmp/pta --modes "$modes" --prefill -n 14 --where-stock-passed
            cp /tmp/pta/*-summary.md /tmp/pta/*.jsonl "$OUT/" 2>/dev/null ;;
        # the same file (ptt) and test_flex_decoding.py (ptd) as written (with grad), training graphs
        # through our backward (issue 15 names both); stock first, then enabled on what stock passed
        ptt_stock|ptt_enabled|ptd_stock|ptd_enabled)
            kind=${s%%_*}; modes=${s#*_}
            file=test_flex_attention.py; [ "$kind" = ptd ] && file=test_flex_decoding.py
            PYTHONPATH=$PWD/.device/pt:$PYTHONPATH step "$s" 560 python3 benchmarks/pytorch_flex_tests.py \
                ".device/pt/$file" --out "/tmp/$kind" --modes "$modes" --prefill --backward -n 14 \
                --where-stock-passed
            cp "/tmp/$kind"/*-summary.md "/tmp/$kind"/*.jsonl "$OUT/" 2>/dev/null ;;
        *) echo "unknown step $s" ;;
    esac
done
