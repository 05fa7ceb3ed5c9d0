"""The fusion buffer pool: buffers are reused between calls, never shared by two in-flight ones."""

from __future__ import annotations

import torch

from ringtrain.comm.fusion import BufferPool, ReduceOp, launch_fused_allreduce


def test_pool_reuses_a_returned_buffer_and_never_hands_one_out_twice():
    pool = BufferPool(per_key=2)
    cpu = torch.device("cpu")
    a = pool.take(100, torch.float32, cpu)
    b = pool.take(100, torch.float32, cpu)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    c = pool.take(60, torch.float32, cpu)  # fits in a's buffer: the same memory
    assert c.data_ptr() == a.data_ptr() and c.numel() == 60
    assert pool.take(60, torch.float32, cpu).data_ptr() not in (a.data_ptr(), b.data_ptr())
    assert pool.take(10, torch.float64, cpu).dtype == torch.float64  # per dtype
    for t in (b, c, pool.take(5, torch.float32, cpu)):
        pool.give(t)
    assert len(pool._free[(torch.float32, cpu)]) == 2  # capped at per_key, largest kept


def test_fused_results_stay_correct_when_buffers_are_reused():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 3, generator=g), torch.randn(56, generator=g), torch.arange(12)]
    pool = BufferPool()  # the caller's (ringtrain.horovod's runtime keeps one per hvd.init())
    for threshold in (64, 1 << 20, 64):
        outs = [torch.empty_like(t) for t in tensors]
        launch_fused_allreduce(
            tensors, outs, op=ReduceOp.Sum, world_size=1, threshold_bytes=threshold, pool=pool
        ).wait()
        assert all(torch.equal(t, o) for t, o in zip(tensors, outs, strict=True))
        assert pool._free  # the buffers went back to the pool, for the next call
