"""bench/profile.py's arithmetic on kernel timelines (what torch.profiler's CUDA events give): the
time kernels cover, with overlapping (PDL) launches counted once, and the gaps at each boundary."""

from inductor_cute.bench.profile import (Launch, boundary_gaps, busy_us, count_syncs, family, host_gaps_us,
                                         idle_and_overlap_us, times_by_kernel)

OURS = "kernel_cutlass_split_kernel_inductor_cute_flex_decode"
CUBLAS = "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT"
TRITON = "triton_red_fused_add_mean_mul_pow_rsqrt_7"


def test_families_from_kernel_names():
    assert [family(n) for n in (OURS, CUBLAS, "void cublasLt::splitKreduce_kernel<32>", "void cutlass::Kernel2<x>",
                                TRITON, "void at::native::vectorized_elementwise_kernel<2>")] == \
        ["cute", "cublas", "cublas", "cublas", "triton", "other"]


def test_serial_kernels_cover_their_durations_and_the_gaps_are_between_them():
    timeline = [Launch(TRITON, 0.0, 3.0), Launch(CUBLAS, 4.5, 16.5), Launch(OURS, 17.0, 30.0)]
    assert busy_us(timeline) == 28.0
    assert boundary_gaps(timeline) == {("triton", "cublas"): [1.5], ("cublas", "cute"): [0.5]}
    assert idle_and_overlap_us(timeline) == (2.0, 0.0)
    assert times_by_kernel(timeline) == {TRITON: [3.0], CUBLAS: [12.0], OURS: [13.0]}


def test_an_early_pdl_start_counts_once_and_shows_as_a_negative_gap():
    # ours launched at 2.0 while the Triton kernel ran to 3.0, then waited: 1 us of overlap
    timeline = [Launch(TRITON, 0.0, 3.0), Launch(OURS, 2.0, 12.0), Launch(TRITON, 12.25, 14.0)]
    assert busy_us(timeline) == 13.75
    assert boundary_gaps(timeline) == {("triton", "cute"): [-1.0], ("cute", "triton"): [0.25]}
    assert idle_and_overlap_us(timeline) == (0.25, 1.0)  # apart: one does not cancel the other


def test_a_kernel_inside_a_longer_one_keeps_the_longer_ones_end_and_long_gaps_are_the_hosts():
    timeline = [Launch(OURS, 0.0, 10.0), Launch(TRITON, 2.0, 4.0), Launch(CUBLAS, 11.0, 12.0),
                Launch(OURS, 200.0, 201.0)]  # the next call, after the host's gap
    assert busy_us(timeline) == 12.0
    assert boundary_gaps(timeline) == {("cute", "triton"): [-8.0], ("cute", "cublas"): [1.0]}


def test_the_hosts_gaps_are_the_long_ones_boundary_gaps_leaves_out():
    timeline = [Launch(OURS, 0.0, 10.0), Launch(TRITON, 2.0, 4.0), Launch(CUBLAS, 11.0, 12.0),
                Launch(OURS, 200.0, 201.0), Launch(TRITON, 201.5, 202.0), Launch(OURS, 300.0, 301.0)]
    assert host_gaps_us(timeline) == (200.0 - 12.0) + (300.0 - 202.0)
    assert host_gaps_us(timeline, max_gap_us=100.0) == 188.0
    assert host_gaps_us(timeline[:3]) == 0.0


def test_syncs_are_counted_by_event_name():
    names = ["aten::mm", "cudaLaunchKernel", "aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize",
             "cudaDeviceSynchronize", "cudaGraphLaunch"]
    assert count_syncs(names) == 3
    assert count_syncs([]) == 0
