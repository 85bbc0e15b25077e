"""Inputs that share memory with outputs: the exact in-place forms and partial
overlaps, through the public API and the torch.distributed backend, against a
closed form on random data (each rank regenerates every rank's input) and
against gloo on the same tensors."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ringcomm
from harness import run_ranks
from ringcomm.comm import aliasing

N = 1000  # elements per chunk: not a multiple of any segment, several segments with the small slots below
BACKEND_N = 300_000  # elements per chunk through the backend: more than one default (1 MiB) slot


def data(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s input: small integers, so sums in any order are exact."""
    return torch.randint(-50, 50, (numel,), generator=torch.Generator().manual_seed(1000 + rank)).float()


def overlap_cases(rank, world_size, transport):
    shm = ringcomm.ShmOptions(slot_nbytes=1024 * world_size, oneshot_max_nbytes=256)
    group = ringcomm.new_group(transport=transport, timeout=30, shm=shm)
    ws, total = world_size, world_size * N
    inputs = [data(r, total) for r in range(ws)]
    summed = torch.stack(inputs).sum(0)
    # all_reduce with the output shifted over the input, either way, and exactly in place
    for shift in (1, N // 2, -3, 0):
        buffer = torch.zeros(total + 2 * N)
        source, target = buffer[N:N + total], buffer[N + shift:N + shift + total]
        source.copy_(inputs[rank])
        ringcomm.all_reduce(source, group=group, output=target)
        assert torch.equal(target, summed), f"rank {rank}: all_reduce output shifted by {shift}"
    # reduce_scatter: output inside the input at every offset, including chunk `rank` (in place)
    for offset in (0, 7, rank * N, total - N):
        buffer = inputs[rank].clone()
        output = buffer[offset:offset + N]
        ringcomm.reduce_scatter(output, buffer, group=group)
        expected = summed[rank * N:(rank + 1) * N]
        assert torch.equal(output, expected), f"rank {rank}: reduce_scatter output at offset {offset}"
    # all_gather: input straddling output chunks, and exactly chunk `rank` (in place)
    for offset in (5, rank * N, N // 2 + (ws - 1) * N // 2):
        output = torch.zeros(total)
        input = output[offset:offset + N]
        input.copy_(inputs[rank][:N])
        ringcomm.all_gather(output, input, group=group)
        expected = torch.cat([inputs[r][:N] for r in range(ws)])
        assert torch.equal(output, expected), f"rank {rank}: all_gather input at offset {offset}"
    if transport == "shm":  # buffers in windows that peers read in place
        window = ringcomm.empty(total + N, group=group)
        window[:total].copy_(inputs[rank])
        ringcomm.all_reduce(window[:total], group=group, output=window[N // 2:N // 2 + total])
        assert torch.equal(window[N // 2:N // 2 + total], summed), f"rank {rank}: all_reduce in a window, shifted"
        window[3:3 + N].copy_(inputs[rank][:N])
        ringcomm.all_gather(window[:total], window[3:3 + N], group=group)
        expected = torch.cat([inputs[r][:N] for r in range(ws)])
        assert torch.equal(window[:total], expected), f"rank {rank}: all_gather in a window, input straddling"
    group.close()


def backend_overlap_cases(rank, world_size):
    ours, gloo = dist.new_group(backend="ringcomm"), dist.new_group(backend="gloo")
    n, total = BACKEND_N, world_size * BACKEND_N
    for name, pg in (("ringcomm", ours), ("gloo", gloo)):
        output = torch.zeros(total)
        input = output[3:3 + n]  # straddles chunks 0 and 1
        input.copy_(data(rank, n))
        dist.all_gather_into_tensor(output, input, group=pg)
        expected = torch.cat([data(r, n) for r in range(world_size)])
        assert torch.equal(output, expected), f"rank {rank} {name}: all_gather_into_tensor, input inside output"
    for offset in (rank * n, 11):  # in place (output is chunk `rank`) and straddling
        buffer = data(rank, total)
        output = buffer[offset:offset + n]
        dist.reduce_scatter_tensor(output, buffer, group=ours)
        expected = torch.stack([data(r, total) for r in range(world_size)]).sum(0)[rank * n:(rank + 1) * n]
        assert torch.equal(output, expected), f"rank {rank}: reduce_scatter_tensor output at offset {offset}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_overlapping_input_and_output(transport, world_size):
    run_ranks(overlap_cases, world_size, transport)


@pytest.mark.parametrize("world_size", [2, 3])
def test_backend_overlapping_input_and_output(world_size):
    run_ranks(backend_overlap_cases, world_size)


def test_overlap_rules():
    buffer = torch.zeros(100)
    assert aliasing.overlaps(buffer[0:10], buffer[9:20]) and not aliasing.overlaps(buffer[0:10], buffer[10:20])
    assert not aliasing.overlaps(buffer[0:0], buffer[0:10])  # empty tensors overlap nothing
    assert aliasing.all_reduce_input(buffer[0:10], buffer[0:10]).data_ptr() == buffer.data_ptr()  # in place
    assert aliasing.all_reduce_input(buffer[0:10], buffer[5:15]).data_ptr() != buffer.data_ptr()  # copied
    own = buffer[20:30]
    assert aliasing.reduce_scatter_input(own, buffer[0:40], rank=2).data_ptr() == buffer.data_ptr()
    assert aliasing.reduce_scatter_input(own, buffer[0:40], rank=1).data_ptr() != buffer.data_ptr()
    assert aliasing.all_gather_input(buffer[0:40], own, rank=2).data_ptr() == own.data_ptr()
    assert aliasing.all_gather_input(buffer[0:40], buffer[15:25], rank=1).data_ptr() != buffer[15:25].data_ptr()


def test_coalesced_inputs_copy_exactly_the_overlapping_ones():
    """Against the pairwise definition, on random pairs carved out of one buffer."""
    buffer = torch.zeros(400)
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        num_pairs = int(torch.randint(1, 6, (1,), generator=gen))
        outputs, inputs = [], []
        for _ in range(num_pairs):
            n = int(torch.randint(0, 20, (1,), generator=gen))
            o = int(torch.randint(0, 400 - 2 * n + 1, (1,), generator=gen))
            i = int(torch.randint(0, 400 - n + 1, (1,), generator=gen))
            outputs.append(buffer[o:o + 2 * n])
            inputs.append(buffer[i:i + n])
        got = aliasing.coalesced_inputs(outputs, inputs, rank=0, gather=True)
        for k, (output, input) in enumerate(zip(outputs, inputs)):
            own = aliasing.all_gather_input(output, input, 0)
            expect_copy = own is not input or any(aliasing.overlaps(input, other)
                                                  for j, other in enumerate(outputs) if j != k)
            copied = got[k] is not input
            assert copied == expect_copy, f"trial {trial} pair {k}: copied={copied}, expected {expect_copy}"
            assert torch.equal(got[k], input), f"trial {trial} pair {k}: the input's values changed"
