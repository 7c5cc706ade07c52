"""The prefill kernel's K and V in rings of their own (FlexPrefillConfig.split_kv), a mixin of
FlexPrefillSm90 (flex_prefill_sm90.py): the producer's V loads and the consumers' KV-block loop.

With one ring a stage holds a block's K and V on one mbarrier and is freed after the second warp
group's P V; at 2 stages (192/128) the next block's K then waits for it and the reload is exposed
every block. Here K_j's stage is freed once S_j is done and V_{j-1}'s once P_{j-1} V_{j-1} is, and
the producer loads K_{j+1} before V_j, the order the consumers use them (FlashAttention-3's
arrangement). The turns, the softmax and the helpers (_qk, _pv, _scores, _pin_p) are the kernel's;
the block loop repeats the one-ring loop's shape so that the measured kernel keeps its code until
this one is measured: then one of the two goes.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .softmax import add_row_sums, online_softmax_scores, rescale_rows


class SplitKvRings:
    def _load_v(self, v_pipe, v_state, tma_v: cute.CopyAtom, tVgV: cute.Tensor, tVsV: cute.Tensor, blk: Int32,
                hkv: Int32, b_kv: Int32):
        """Block `blk`'s V into V's ring (split_kv; producer warp). The caller advances v_state."""
        v_pipe.producer_acquire(v_state)
        cute.copy(tma_v, tVgV[(None, 0, blk, hkv, b_kv)], tVsV[(None, v_state.index)],
                  tma_bar_ptr=v_pipe.producer_get_barrier(v_state))
        v_pipe.producer_commit(v_state)

    @cute.jit
    def _consume_blocks_split(self, n_blocks: Int32, pipes: tuple, states: list, slot: Int32, frags: tuple,
                              regs: tuple, scale_log2: Float32, scale: Float32, b: Int32, head: Int32, row0: Int32,
                              q_len: Int32, seq_len: Int32, walk: tuple, score_tensors: tuple, mask_tensors: tuple):
        """A tile's KV blocks with K and V in rings of their own (split_kv; a consumer warp group):
        the order and turns of the one-ring loop in _consume_tile, but K_j's stage is freed once
        S_j is done and V_{j-1}'s once P_{j-1} V_{j-1} is, so the producer's next loads never wait
        for the other warp group's P V. `states` ([K's, V's] ring state) comes back advanced."""
        k_pipe, v_pipe = pipes
        k_state, v_state = states
        tSrQ, tSrK, tOrV, tScS = frags
        acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction = regs
        n_partial, zm, hm, r, mKvIdx, mFullIdx = walk
        if n_blocks > 0:
            if slot == 1:
                self._turn(0).arrive()
            # ---- block 0: S_0 alone
            self._turn(slot).arrive_and_wait()
            k_pipe.consumer_wait(k_state)
            self._qk(acc_s, tSrQ, tSrK, k_state.index)
            warpgroup.commit_group()
            self._turn(1 - slot).arrive()
            warpgroup.wait_group(0)
            k_pipe.consumer_release(k_state)
            k_state.advance()
            blk, partial = self.blocks.block_at(0, n_partial, zm, hm, r, mKvIdx, mFullIdx)
            self._scores(acc_s, tScS, scale_log2, scale, b, head, row0, q_len, blk, partial, seq_len,
                         score_tensors, mask_tensors)
            online_softmax_scores(acc_s, row_max, correction,  # O is still 0: no rescale
                                  scale_log2 if const_expr(self.fold_scale) else None)
            self._pin_p(acc_s)
            add_row_sums(acc_s, row_sum, correction)
            r_p.store(acc_s.load().to(self.dtype))
            self._pin_p(r_p)
            # ---- block j: S_j and P_{j-1} V_{j-1}
            for j in range(1, n_blocks):
                self._turn(slot).arrive_and_wait()
                k_pipe.consumer_wait(k_state)
                self._qk(acc_s, tSrQ, tSrK, k_state.index)
                warpgroup.commit_group()
                v_pipe.consumer_wait(v_state)
                self._pv(acc_o, tOrP, tOrV, v_state.index)
                warpgroup.commit_group()
                self._turn(1 - slot).arrive()
                warpgroup.wait_group(1)  # S_j: K_j's stage is free
                k_pipe.consumer_release(k_state)
                k_state.advance()
                blk, partial = self.blocks.block_at(j, n_partial, zm, hm, r, mKvIdx, mFullIdx)
                self._scores(acc_s, tScS, scale_log2, scale, b, head, row0, q_len, blk, partial, seq_len,
                             score_tensors, mask_tensors)
                online_softmax_scores(acc_s, row_max, correction,
                                      scale_log2 if const_expr(self.fold_scale) else None)
                self._pin_p(acc_s)
                warpgroup.wait_group(0)  # P_{j-1} V_{j-1}: V_{j-1}'s stage, O and P's registers are free
                v_pipe.consumer_release(v_state)
                v_state.advance()
                rescale_rows(acc_o, correction)
                add_row_sums(acc_s, row_sum, correction)
                r_p.store(acc_s.load().to(self.dtype))
                self._pin_p(r_p)
            # ---- the last block's P V
            self._turn(slot).arrive_and_wait()
            v_pipe.consumer_wait(v_state)
            self._pv(acc_o, tOrP, tOrV, v_state.index)
            warpgroup.commit_group()
            if slot == 0:
                self._turn(1).arrive()
            warpgroup.wait_group(0)
            v_pipe.consumer_release(v_state)
            v_state.advance()
        states[:] = [k_state, v_state]
