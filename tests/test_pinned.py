"""Host buffers pinned at their exact size (``megatron_streaming.comm.pinned``): the layout of
tensors in one buffer, their views and data, and the registration's lifetime, on the CPU with
a recording stand-in for ``torch.cuda.cudart()`` (the GPU itself: tests/test_cuda.py)."""

import contextlib
import gc

import pytest
import torch

from megatron_streaming.comm import pinned

SHAPES = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((), torch.int64),
          ((0, 4), torch.float32), ((2, 2, 3), torch.float16), ((1,), torch.uint8)]


def _nbytes(shape, dtype):
    return torch.empty(shape, dtype=dtype).numel() * torch.empty(0, dtype=dtype).element_size()


def test_layout_places_each_tensor_aligned_after_the_last_and_wastes_under_an_alignment():
    sizes = [_nbytes(*s) for s in SHAPES]
    offsets, total = pinned.layout(sizes)
    assert sizes == [60, 14, 8, 0, 24, 1]
    assert offsets == [0, 64, 128, 192, 192, 256]
    assert total == 320  # the last one's end, aligned
    for offset, size, following in zip(offsets, sizes, offsets[1:] + [total]):
        assert offset % pinned.ALIGN == 0 and offset + size <= following
    assert sum(sizes) <= total < sum(sizes) + pinned.ALIGN * len(sizes)
    assert pinned.layout([]) == ([], 0)


def test_host_tensors_are_zeroed_views_of_one_exact_buffer_and_keep_their_data():
    tensors = pinned.host_tensors(SHAPES)  # no device: plain host memory, as before
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(tuple(s), d) for s, d in SHAPES]
    storage = tensors[0].untyped_storage()
    assert storage.nbytes() == pinned.layout([_nbytes(*s) for s in SHAPES])[1]
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors)
    assert all(not t.is_pinned() and t.is_contiguous() and not t.any() for t in tensors)
    values = [torch.randn(s).to(d) if d.is_floating_point else torch.full(s, 7, dtype=d)
              for s, d in SHAPES]
    for t, v in zip(tensors, values):  # each written, none overwrites another
        t.copy_(v)
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))


class FakeCudart:
    """``torch.cuda.cudart()``'s two calls, recorded; ``fail`` makes registration fail."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.calls.append(("register", pointer, nbytes, flags))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, pointer):
        self.calls.append(("unregister", pointer))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return fake


def test_a_buffer_for_a_gpu_is_registered_at_its_bytes_until_its_last_view_is_freed(cudart):
    gpu = torch.device("cuda", 0)
    tensors = pinned.host_tensors(SHAPES, gpu)
    total = pinned.layout([_nbytes(*s) for s in SHAPES])[1]
    pointer = tensors[0].untyped_storage().data_ptr()
    assert cudart.calls == [("register", pointer, total, pinned.HOST_REGISTER_PORTABLE)]
    assert all(not t.any() for t in tensors)
    last = tensors.pop()
    del tensors
    gc.collect()
    assert len(cudart.calls) == 1  # a view still holds the memory: still registered
    last.fill_(3)
    del last
    gc.collect()
    assert cudart.calls[1:] == [("unregister", pointer)]


def test_a_failed_registration_leaves_a_pageable_buffer_and_says_so(monkeypatch, caplog):
    fake = FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    buffer = pinned.host_buffer(1000, torch.device("cuda", 0))
    assert buffer.numel() == 1000 and not buffer.any()
    assert "cudaHostRegister of 1000 bytes of host memory failed" in caplog.text
    del buffer
    gc.collect()
    assert [c[0] for c in fake.calls] == ["register"]  # nothing to unregister


def test_the_offloaded_outer_state_is_one_host_buffer_and_the_on_device_one_is_not():
    from megatron_streaming.streaming.sync import _outer_state

    local = [torch.randn(10), torch.randn(3)]
    theta_g, momentum = _outer_state(local, offload=True)
    assert all(torch.equal(t, l) for t, l in zip(theta_g, local))
    assert all(not m.any() for m in momentum)
    storages = {t.untyped_storage().data_ptr() for t in theta_g + momentum}
    assert len(storages) == 1  # one buffer: 4 tensors, 26 floats, each at 64 bytes
    assert theta_g[0].untyped_storage().nbytes() == pinned.layout([40, 12, 40, 12])[1]
    theta_g, momentum = _outer_state(local, offload=False)
    assert all(torch.equal(t, l) and t.data_ptr() != l.data_ptr()
               for t, l in zip(theta_g, local))
    assert _outer_state([], offload=True) == ([], [])
