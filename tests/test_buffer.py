"""Single-process tests of FlatBuffer (views, rebinding, zeroing, re-ordering)
and of the transient GradBuckets' spares."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ringcomm.buckets.buffer import FlatBuffer, GradBucket, Spares, flat_buffers
from ringcomm.plan.layout import plan_buckets


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def test_grad_and_data_are_views_of_the_buffer() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 5)
    expected_out = model(x)
    (buffer,) = flat_buffers(model.parameters(), world_size=3, bucket_bytes=64, views_for=("grad", "data"))
    assert buffer.layout.numel % 3 == 0 and buffer.grad.numel() == buffer.data.numel() == buffer.layout.numel
    for i, (param, value) in enumerate(zip(model.parameters(), before)):
        slot = buffer.layout.params[i]
        assert param.data.data_ptr() == buffer.data[slot.begin:].data_ptr(), f"param {i}: .data is not a view"
        assert param.grad.data_ptr() == buffer.grad[slot.begin:].data_ptr(), f"param {i}: .grad is not a view"
        torch.testing.assert_close(param.data, value, msg=lambda m: f"param {i}: value changed: {m}")
    torch.testing.assert_close(model(x), expected_out)
    model(x).sum().backward()  # accumulates in place into the views
    assert all(p.grad.data_ptr() == buffer.view(i).data_ptr() for i, p in enumerate(model.parameters()))
    assert buffer.grad.abs().sum() > 0


def test_bind_grad_after_set_to_none_and_zero_grad() -> None:
    model = _model()
    (buffer,) = flat_buffers(model.parameters(), world_size=2, bucket_bytes=1 << 20)
    model(torch.randn(2, 5)).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 5)).sum().backward()  # .grad are fresh tensors now, outside the buffer
    fresh = [p.grad.clone() for p in model.parameters()]
    for i, param in enumerate(model.parameters()):
        assert buffer.bind_grad(param) is False, f"param {i} was bound"
        assert buffer.bind_grad(param) is True, f"param {i} not bound after bind_grad"
        torch.testing.assert_close(buffer.view(i), fresh[i])
    assert not torch.equal(fresh[0], reference[0])
    buffer.zero_grad()
    assert buffer.grad.count_nonzero() == 0 and all(p.grad.count_nonzero() == 0 for p in model.parameters())


def test_reorder_keeps_values_and_grads() -> None:
    model = _model()
    (buffer,) = flat_buffers(model.parameters(), world_size=2, bucket_bytes=16, views_for=("grad", "data"))
    model(torch.randn(2, 5)).sum().backward()
    values, grads = [p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()]
    buffer.reorder([0, 1, 2, 3])
    assert buffer.layout.order == (0, 1, 2, 3) and buffer.layout.params[0].begin == 0
    for i, param in enumerate(model.parameters()):
        torch.testing.assert_close(param.data, values[i])
        torch.testing.assert_close(param.grad, grads[i])
        assert param.grad.data_ptr() == buffer.view(i).data_ptr()


def test_dtypes_get_separate_buffers_and_errors() -> None:
    a, b, c = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4))
    frozen = nn.Parameter(torch.ones(5), requires_grad=False)
    buffers = flat_buffers([a, b, frozen, c], world_size=2, bucket_bytes=8)
    assert [(x.dtype, len(x.params)) for x in buffers] == [(torch.float32, 2), (torch.bfloat16, 1)]
    assert buffers[0].bucket_numel == 2 and buffers[1].bucket_numel == 4
    with pytest.raises(TypeError, match="flat_buffers"):
        FlatBuffer([a, b], world_size=2, bucket_bytes=8)
    with pytest.raises(ValueError, match="views_for"):
        FlatBuffer([a], world_size=2, bucket_bytes=8, views_for=("data",))
    with pytest.raises(ValueError, match="twice"):
        FlatBuffer([a, a], world_size=2, bucket_bytes=8)
    with pytest.raises(ValueError, match="not in this buffer"):
        buffers[0].index_of(b)


def test_allocate_hook_is_used() -> None:
    calls = []

    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        calls.append((numel, dtype))
        return torch.full((numel,), 7.0, dtype=dtype)  # the buffer must zero it

    param = nn.Parameter(torch.ones(5))
    buffer = FlatBuffer([param], world_size=4, bucket_bytes=1024, allocate=allocate)
    assert calls == [(8, torch.float32)] and buffer.grad.count_nonzero() == 0


def test_a_released_transient_bucket_lends_its_storage_to_the_next_with_zero_padding() -> None:
    """A released bucket's storage is taken by the next bucket that fits in it
    (no allocation), the next one's padding is zero although the storage held
    another bucket's values, and only the longest storage is kept."""
    params = [nn.Parameter(torch.zeros(n)) for n in (5, 17, 3)]
    layout = plan_buckets([p.numel() for p in params], world_size=4, bucket_numel=16)
    spares = Spares()
    buckets = [GradBucket(layout, k, [params[i] for i in span.param_indices], 1, sharded=True, spares=spares)
               for k, span in enumerate(layout.buckets)]
    big, small = sorted(buckets, key=lambda b: -b.span.numel)[:2]
    assert big.span.numel > small.span.numel and small.span.numel > small.span.data_numel, layout.buckets
    big.ensure().fill_(7.0)
    storage = big.grad.data_ptr()
    big.release()
    grad = small.ensure()
    assert grad.data_ptr() == storage, "the spare was not taken"
    assert grad.numel() == small.span.numel and small.fresh
    assert torch.count_nonzero(grad[small.span.data_numel:]) == 0, f"padding {grad[small.span.data_numel:]}"
    assert big.ensure().data_ptr() != storage, "the storage in use was handed out twice"


def test_spares_keep_the_longest_storage_of_each_kind() -> None:
    spares, cpu = Spares(), torch.device("cpu")
    short, long = torch.empty(8), torch.empty(32)
    for order in ((short, long), (long, short)):
        for storage in order:
            spares.give(storage)
        assert spares.take(32, torch.float32, cpu).data_ptr() == long.data_ptr(), f"order {[len(t) for t in order]}"
    spares.give(short)
    assert spares.take(9, torch.float32, cpu).data_ptr() != short.data_ptr(), "a spare too short was taken"
    assert spares.take(4, torch.float64, cpu).dtype == torch.float64
