"""The prefill forward's consumer warp groups (flex_prefill_sm90.py): a tile's S, softmax and O
through the K/V ring, taking turns at the tensor cores with the other consumer, then the epilogue.

Per consumer and tile: S_0 alone, then per KV block j S_j and P_{j-1} V_{j-1} issued together
(S_j's softmax runs while P_{j-1} V_{j-1} still accumulates into O, whose rescale waits for it),
then the last block's P V and the epilogue. With config.overlap_tiles (persistent CTAs walking a
fixed stride, two Q buffers, no block mask) the next tile's S_0 is issued with this tile's last
P V and its softmax runs under it, so a tile's first block and the epilogue no longer stand alone.

A mixin of FlexPrefillSm90, which owns the MMA objects, the mods, the block walk and the epilogue.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..common import barriers
from .accumulator import fence_operand, wait_after
from .flex_prefill_config import M_BLOCK
from .mask import mask_past_end
from .softmax import (add_row_sums, exponentiate_rest, online_softmax_scores, rescale_rows, softmax_reset,
                      softmax_state)
from .tile_order import LongestFirst


class PrefillConsumer:
    @staticmethod
    def _turn(slot) -> pipeline.NamedBarrier:
        """Consumer `slot`'s turn at the tensor cores: it syncs on it, the other arrives to hand over."""
        return pipeline.NamedBarrier(barrier_id=barriers.attention_turn(slot), num_threads=256)

    @cute.jit
    def _consume_tile(self, tile: Int32, states: list, order: tuple, lengths: tuple, block_tensors: tuple,
                      pipes: tuple, slot: Int32, frags: tuple, regs: tuple, scale_log2: Float32, scale: Float32,
                      score_tensors: tuple, mask_tensors: tuple, out: tuple, ctid: Int32, warp_idx: Int32):
        """One tile's S, softmax and O through the ring, then its epilogue (a consumer warp group).
        Called once per CTA without persistent CTAs: no tile loop around the code measured fastest
        (a loop once made the compiler compute each P twice, 40% slower; see add_row_sums)."""
        m_blocks, heads, batch, width = order
        q_len, seq_len = lengths
        mKvNum, mKvIdx, mFullNum, mFullIdx = block_tensors
        q_pipe, kv_pipe, v_pipe = pipes
        tSrQ, tSrK, tOrV, tScS, tOcO = frags
        acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction = regs
        sO, tma_o, gO_full, mLse = out
        q_state, read, release = states
        m_block, head, b = LongestFirst(m_blocks, heads, batch, width).coord(tile)
        walk = self._kv_walk(mKvNum, mFullNum, seq_len, m_block, head, b)
        n_partial, n_blocks, zm, hm, r = walk
        row0 = m_block * M_BLOCK
        acc_o.fill(0.0)
        softmax_reset(row_max, row_sum)
        q_pipe.consumer_wait(q_state)
        if const_expr(self.config.q_stages > 1):
            tSrQ = tSrQ[(None, None, None, q_state.index)]
        # Turns: n_blocks + 1 per consumer and tile (S_0; S_j with P_{j-1} V_{j-1}; P_last
        # V_last), slot 0 first. Slot 1 opens slot 0's first turn and hands over only turns
        # slot 0 still takes, so no arrive is left pending when the tile ends.
        # With split_kv `read` walks K's ring and `release` V's (kv_pipe and v_pipe): K_j's stage is
        # freed once S_j is done and V_{j-1} is waited for before its P V; with one ring v_pipe is
        # kv_pipe and `read`'s wait covers a block's K and V.
        if n_blocks > 0:
            first = [read]
            self._first_block(first, slot, pipes, (tSrQ, tSrK, tOrV, tScS), regs, scale_log2, scale,
                              (b, head, row0, q_len, seq_len), walk, block_tensors, score_tensors, mask_tensors)
            read = first[0]
            ring = [read, release]
            self._steady_blocks(ring, slot, pipes, (tSrQ, tSrK, tOrV, tScS), regs, scale_log2, scale,
                                (b, head, row0, q_len, seq_len), walk, block_tensors, score_tensors, mask_tensors)
            read, release = ring
            last = [release]
            self._last_pv(last, slot, pipes, regs, tOrV)
            release = last[0]
        self.epilogue.run(acc_o, tOcO, row_max, row_sum, sO, tma_o, gO_full, mLse, ctid, warp_idx, slot, m_block,
                          head, b, q_len)
        # with one Q buffer, after the store warp saw the TMA unit read O (staged in Q's buffer);
        # with two, Q's buffer is free already: the producer may load a next Q into it
        q_pipe.consumer_release(q_state)
        q_state.advance()
        states[:] = [q_state, read, release]

    @cute.jit
    def _consume_overlapped(self, first_tile: Int32, step: Int32, n_tiles: Int32, states: list, order: tuple,
                            lengths: tuple, block_tensors: tuple, pipes: tuple, slot: Int32, frags: tuple,
                            regs: tuple, scale_log2: Float32, scale: Float32, score_tensors: tuple,
                            mask_tensors: tuple, out: tuple, ctid: Int32, warp_idx: Int32):
        """Every tile of a persistent CTA (first_tile, then every `step`-th) with the next tile's S_0
        issued beside this tile's last P V (config.overlap_tiles: two Q buffers, so the next Q is
        in, and no block mask, so every tile walks every KV block and has at least one: the host
        answers an empty key sequence without the kernel).
        Turns per consumer: one per KV block of every tile, plus the last tile's P V alone; slot 1
        opens slot 0's first turn and slot 0 hands over slot 1's last, once per CTA."""
        m_blocks, heads, batch, width = order
        q_len, seq_len = lengths
        mKvNum, mKvIdx, mFullNum, mFullIdx = block_tensors
        q_pipe, kv_pipe, v_pipe = pipes
        tSrQ_stages, tSrK, tOrV, tScS, tOcO = frags
        acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction = regs
        sO, tma_o, gO_full, mLse = out
        q_state, read, release = states  # q_state: the next Q to wait for
        q_done = q_state.clone()  # the Q to hand back after its tile's epilogue
        finished_max, finished_sum = softmax_state()  # the finished tile's, for its epilogue
        split = self.config.split_kv
        # ---- the first tile's S_0 alone
        m_block, head, b = LongestFirst(m_blocks, heads, batch, width).coord(first_tile)
        walk = self._kv_walk(mKvNum, mFullNum, seq_len, m_block, head, b)
        acc_o.fill(0.0)
        softmax_reset(row_max, row_sum)
        q_pipe.consumer_wait(q_state)
        q_stage = q_state.index
        q_state.advance()
        first = [read]
        self._first_block(first, slot, pipes, (tSrQ_stages[(None, None, None, q_stage)], tSrK, tOrV, tScS), regs,
                          scale_log2, scale, (b, head, m_block * M_BLOCK, q_len, seq_len), walk, block_tensors,
                          score_tensors, mask_tensors)
        read = first[0]
        for tile in range(first_tile, n_tiles, step):
            m_block, head, b = LongestFirst(m_blocks, heads, batch, width).coord(tile)  # (no Python object
            # is carried through a run-time loop)
            walk = self._kv_walk(mKvNum, mFullNum, seq_len, m_block, head, b)
            ring = [read, release]
            self._steady_blocks(ring, slot, pipes, (tSrQ_stages[(None, None, None, q_stage)], tSrK, tOrV, tScS),
                                regs, scale_log2, scale, (b, head, m_block * M_BLOCK, q_len, seq_len), walk,
                                block_tensors, score_tensors, mask_tensors)
            read, release = ring
            # this tile's S products are done and O has a buffer of its own: its Q buffer goes back
            # now, so that the producer can load the tile after next while this one finishes
            q_pipe.consumer_release(q_done)
            q_done.advance()
            for h in cutlass.range_constexpr(2):
                finished_max[h] = row_max[h]
                finished_sum[h] = row_sum[h]
            if tile + step < n_tiles:
                # ---- the next tile's S_0 with this tile's last P V, its softmax under that P V
                m_next, head_next, b_next = LongestFirst(m_blocks, heads, batch, width).coord(tile + step)
                walk_next = self._kv_walk(mKvNum, mFullNum, seq_len, m_next, head_next, b_next)
                q_pipe.consumer_wait(q_state)
                q_stage = q_state.index
                q_state.advance()
                self._turn(slot).arrive_and_wait()
                kv_pipe.consumer_wait(read)
                self._qk(acc_s, tSrQ_stages[(None, None, None, q_stage)], tSrK, read.index)
                warpgroup.commit_group()
                if const_expr(split):
                    v_pipe.consumer_wait(release)
                self._pv(acc_o, tOrP, tOrV, release.index)
                warpgroup.commit_group()
                self._turn(1 - slot).arrive()
                warpgroup.wait_group(1)  # the next tile's S_0
                if const_expr(split):
                    kv_pipe.consumer_release(read)
                softmax_reset(row_max, row_sum)
                self._first_softmax(regs, scale_log2, scale, (b_next, head_next, m_next * M_BLOCK, q_len, seq_len),
                                    walk_next, block_tensors, tScS, score_tensors, mask_tensors)
                wait_after(row_sum[0], row_sum[1])  # ptxas would wait for the P V before the exponentials
                warpgroup.wait_group(0)  # this tile's last P V: O is done and P's registers are free
                v_pipe.consumer_release(release)
                release.advance()
                r_p.store(acc_s.load().to(self.dtype))
                self._pin_p(r_p)
                read.advance()
            else:  # the last tile
                last = [release]
                self._last_pv(last, slot, pipes, regs, tOrV)
                release = last[0]
            self.epilogue.run(acc_o, tOcO, finished_max, finished_sum, sO, tma_o, gO_full, mLse, ctid, warp_idx,
                              slot, m_block, head, b, q_len)
            acc_o.fill(0.0)
        states[:] = [q_state, read, release]

    @cute.jit
    def _first_block(self, first: list, slot: Int32, pipes: tuple, frags: tuple, regs: tuple, scale_log2: Float32,
                     scale: Float32, where: tuple, walk: tuple, block_tensors: tuple, score_tensors: tuple,
                     mask_tensors: tuple):
        """A tile's first KV block alone (every tile's, or with overlap_tiles a CTA's first tile's):
        slot 1 opens slot 0's first turn; S_0 in this consumer's turn, waited for, then P_0 made and packed.
        `first` ([read]) comes back advanced."""
        read = first[0]
        q_pipe, kv_pipe, v_pipe = pipes
        tSrQ, tSrK, tOrV, tScS = frags
        acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction = regs
        if slot == 1:
            self._turn(0).arrive()
        self._turn(slot).arrive_and_wait()
        kv_pipe.consumer_wait(read)
        self._qk(acc_s, tSrQ, tSrK, read.index)
        warpgroup.commit_group()
        self._turn(1 - slot).arrive()
        warpgroup.wait_group(0)
        if const_expr(self.config.split_kv):
            kv_pipe.consumer_release(read)  # K_0
        self._first_softmax(regs, scale_log2, scale, where, walk, block_tensors, tScS, score_tensors, mask_tensors)
        r_p.store(acc_s.load().to(self.dtype))
        self._pin_p(r_p)
        read.advance()
        first[:] = [read]

    @cute.jit
    def _first_softmax(self, regs: tuple, scale_log2: Float32, scale: Float32, where: tuple, walk: tuple,
                       block_tensors: tuple, tScS: cute.Tensor, score_tensors: tuple, mask_tensors: tuple):
        """S_0 of a tile (in acc_s) becomes P_0 and the row state starts from it; O is still 0, so
        nothing is rescaled. The caller packs P once the registers it goes to are free."""
        acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction = regs
        b, head, row0, q_len, seq_len = where
        n_partial, n_blocks, zm, hm, r = walk
        mKvNum, mKvIdx, mFullNum, mFullIdx = block_tensors
        blk, partial = self.blocks.block_at(0, n_partial, zm, hm, r, mKvIdx, mFullIdx)
        self._scores(acc_s, tScS, scale_log2, scale, b, head, row0, q_len, blk, partial, seq_len,
                     score_tensors, mask_tensors)
        online_softmax_scores(acc_s, row_max, correction,  # O is still 0: no rescale
                              scale_log2 if const_expr(self.fold_scale) else None, poly=self.config.poly_exps)
        self._pin_p(acc_s)
        add_row_sums(acc_s, row_sum, correction)

    @cute.jit
    def _last_pv(self, last: list, slot: Int32, pipes: tuple, regs: tuple, tOrV: cute.Tensor):
        """The tile's last P V alone, in this consumer's last turn (slot 0 then opens slot 1's);
        `last` ([release]) comes back advanced."""
        release = last[0]
        q_pipe, kv_pipe, v_pipe = pipes
        acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction = regs
        self._turn(slot).arrive_and_wait()
        if const_expr(self.config.split_kv):
            v_pipe.consumer_wait(release)
        self._pv(acc_o, tOrP, tOrV, release.index)
        warpgroup.commit_group()
        if slot == 0:
            self._turn(1).arrive()
        warpgroup.wait_group(0)
        v_pipe.consumer_release(release)
        release.advance()
        last[:] = [release]

    @cute.jit
    def _steady_blocks(self, ring: list, slot: Int32, pipes: tuple, frags: tuple, regs: tuple, scale_log2: Float32,
                       scale: Float32, where: tuple, walk: tuple, block_tensors: tuple, score_tensors: tuple,
                       mask_tensors: tuple):
        """KV blocks 1 .. n_blocks - 1 of a tile: per block j, S_j and P_{j-1} V_{j-1} issued together
        in this consumer's turn; S_j's softmax runs while P_{j-1} V_{j-1} still accumulates into O,
        whose rescale waits for it. `ring` ([read, release]) comes back advanced."""
        read, release = ring
        q_pipe, kv_pipe, v_pipe = pipes
        tSrQ, tSrK, tOrV, tScS = frags
        acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction = regs
        b, head, row0, q_len, seq_len = where
        n_partial, n_blocks, zm, hm, r = walk
        mKvNum, mKvIdx, mFullNum, mFullIdx = block_tensors
        split = self.config.split_kv
        for j in range(1, n_blocks):
            self._turn(slot).arrive_and_wait()
            kv_pipe.consumer_wait(read)
            self._qk(acc_s, tSrQ, tSrK, read.index)
            warpgroup.commit_group()
            if const_expr(split):
                v_pipe.consumer_wait(release)  # V_{j-1}
            self._pv(acc_o, tOrP, tOrV, release.index)
            warpgroup.commit_group()
            self._turn(1 - slot).arrive()
            warpgroup.wait_group(1)  # S_j
            if const_expr(split):
                kv_pipe.consumer_release(read)  # K_j
            blk, partial = self.blocks.block_at(j, n_partial, zm, hm, r, mKvIdx, mFullIdx)
            self._scores(acc_s, tScS, scale_log2, scale, b, head, row0, q_len, blk, partial, seq_len,
                         score_tensors, mask_tensors)
            fold = scale_log2 if const_expr(self.fold_scale) else None
            early, poly = self.config.early_exps, self.config.poly_exps
            if const_expr(early > 0):
                # the first exponentials of each row and their partial sums, then a hold that
                # keeps ptxas's wait for P_{j-1} V_{j-1} behind them (accumulator.wait_after)
                online_softmax_scores(acc_s, row_max, correction, fold, count=early, poly=poly)
                fence_operand(acc_s)
                add_row_sums(acc_s, row_sum, correction, count=early)
                wait_after(row_sum[0], row_sum[1])
            else:
                online_softmax_scores(acc_s, row_max, correction, fold, poly=poly)
                self._pin_p(acc_s)
            warpgroup.wait_group(0)  # P_{j-1} V_{j-1}: O and P's registers are free
            v_pipe.consumer_release(release)
            release.advance()
            rescale_rows(acc_o, correction)
            if const_expr(early > 0):
                exponentiate_rest(acc_s, row_max, early, fold, poly=poly)
                add_row_sums(acc_s, row_sum, first=early)
            else:
                add_row_sums(acc_s, row_sum, correction)
            r_p.store(acc_s.load().to(self.dtype))
            self._pin_p(r_p)
            read.advance()
        ring[:] = [read, release]

    def _pin_p(self, t: cute.Tensor) -> None:
        """Persistent CTAs and split_kv: P's fp32 scores and its bf16 pack are materialised where
        they are made (fence_operand). Otherwise NVVM sinks the pack below the next block's S
        WGMMAs in the tile loop, P stays live in fp32 beside S and O, and ptxas serializes every
        WGMMA (C7512; the persistent causal kernels ran 1.4x slower than one CTA per tile); and it
        sinks the exponentials below the wait for P V, so a warp group's softmax no longer overlaps
        its own P V. One CTA per tile with one ring keeps its measured code."""
        if const_expr(self.config.persistent_ctas > 0 or self.config.split_kv):
            fence_operand(t)

    # _qk and _pv are traced inline (not @cute.jit): the MMA's accumulate flag they set must stay
    # a value of the caller's loop body
    def _qk(self, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor, stage: Int32):
        """Issue S = Q K^T of the K block in ring stage `stage` (not committed)."""
        mma = self._make_mma_qk()
        warpgroup.fence()
        for kb in range(cute.size(tSrQ, mode=[2])):  # unrolled at trace time
            mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(mma, acc_s, tSrQ[(None, None, kb)], tSrK[(None, None, kb, stage)], acc_s)

    def _pv(self, acc_o: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor, stage: Int32):
        """Issue O += P V of the V block in ring stage `stage`, P from registers (not committed)."""
        mma = self._make_mma_pv()
        warpgroup.fence()
        mma.set(warpgroup.Field.ACCUMULATE, True)
        for kb in range(cute.size(tOrP, mode=[2])):
            cute.gemm(mma, acc_o, tOrP[(None, None, kb)], tOrV[(None, None, kb, stage)], acc_o)

    @cute.jit
    def _scores(self, acc_s: cute.Tensor, tScS: cute.Tensor, scale_log2: Float32, scale: Float32, b: Int32,
                head: Int32, row0: Int32, q_len: Int32, blk: Int32, partial, seq_len: Int32, score_tensors: tuple,
                mask_tensors: tuple):
        """S of KV block `blk` in log2 units (raw with fold_scale: the softmax scales it), masked:
        scaled or score_mod, mask_mod on partial blocks, keys past the end at -inf."""
        self.mods.apply(acc_s, tScS, scale_log2, scale, b, head, row0, q_len, blk, partial, score_tensors,
                        mask_tensors, scale_later=self.fold_scale)
        mask_past_end(acc_s, tScS, self.kvb, blk, seq_len)
