"""Kernel workspaces kept between calls (host.common.stream_scratch) and CUDA-graph trees:
torch.compile's trees warm a graph up on their own stream with every allocation routed to the
graphs' pool and then refuse any pool allocation still alive that the graph's outputs do not
account for; a workspace kept from that warm-up broke every enabled model under CUDA graphs."""

from types import SimpleNamespace

import torch
from torch._inductor import cudagraph_trees

from inductor_cute.host import common


def manager_on(stream):
    return SimpleNamespace(stream=SimpleNamespace(cuda_stream=stream))


def test_a_tree_is_recognised_only_on_its_own_stream(monkeypatch):
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists=True: manager_on(77))
    assert common._in_cudagraph_tree(0, 77)
    assert not common._in_cudagraph_tree(0, 78)


def test_no_tree_or_other_internals_mean_no_tree(monkeypatch):
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists=True: None)
    assert not common._in_cudagraph_tree(0, 77)

    def changed(index, create_if_none_exists=True):
        raise AttributeError("no such thing in this torch")

    monkeypatch.setattr(cudagraph_trees, "get_manager", changed)
    assert not common._in_cudagraph_tree(0, 77)


def test_the_tree_lookup_never_creates_a_manager(monkeypatch):
    asked = []
    monkeypatch.setattr(cudagraph_trees, "get_manager",
                        lambda index, create_if_none_exists=True: asked.append(create_if_none_exists))
    common._in_cudagraph_tree(0, 5)
    assert asked == [False]


def cuda_stand_ins(monkeypatch, stream):
    """stream_scratch's CUDA path on the CPU: allocations land on the CPU, the stream is `stream`."""
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream, raising=False)
    for name in ("empty", "zeros"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, device=None, **k: _real(*a, **k))
    monkeypatch.setattr(common, "_SCRATCH", {})
    monkeypatch.setattr(common, "_VIEWS", {})


BUFFERS = (((4, 8), torch.float32, False), ((3,), torch.int32, True))


def test_buffers_are_kept_and_reused_on_an_ordinary_stream(monkeypatch):
    cuda_stand_ins(monkeypatch, stream=11)
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists=True: manager_on(99))
    first = common.stream_scratch(torch.device("cuda", 0), BUFFERS)
    again = common.stream_scratch(torch.device("cuda", 0), BUFFERS)
    assert [t.shape for t in first] == [(4, 8), (3,)] and (first[1] == 0).all()
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in again]
    assert len(common._SCRATCH) == 2


def test_a_tree_warm_up_gets_fresh_buffers_and_keeps_none(monkeypatch):
    cuda_stand_ins(monkeypatch, stream=99)
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists=True: manager_on(99))
    for per_stream in (True, False):
        first = common.stream_scratch(torch.device("cuda", 0), BUFFERS, per_stream=per_stream)
        again = common.stream_scratch(torch.device("cuda", 0), BUFFERS, per_stream=per_stream)
        assert [t.shape for t in first] == [(4, 8), (3,)] and (first[1] == 0).all()
        assert first[0].data_ptr() != again[0].data_ptr()  # both alive: two allocations
    assert common._SCRATCH == {}


def test_views_are_remembered_until_a_buffer_is_replaced(monkeypatch):
    # the second call with the same buffers returns the first call's views (no view is made);
    # a larger request replaces a flat buffer, and no earlier view of the old one is handed out
    cuda_stand_ins(monkeypatch, stream=11)
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists=True: None)
    device = torch.device("cuda", 0)
    first = common.stream_scratch(device, BUFFERS)
    made = []
    monkeypatch.setattr(common, "alias", lambda *a: made.append(a) or torch.empty(0))
    assert common.stream_scratch(device, BUFFERS) is first and made == []
    monkeypatch.undo()
    cuda_stand_ins(monkeypatch, stream=11)
    bigger = (((64, 8), torch.float32, False), ((3,), torch.int32, True))
    common.stream_scratch(device, BUFFERS)  # fresh state: allocates
    grown = common.stream_scratch(device, bigger)
    again = common.stream_scratch(device, BUFFERS)
    assert again is not first and again[0].data_ptr() == grown[0].data_ptr()
    assert again[0].shape == (4, 8) and grown[0].shape == (64, 8)
