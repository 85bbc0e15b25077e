"""Point-to-point on the "ringcomm" backend ([Note: p2p channels] in
csrc/cpu/shm_p2p.cpp). The options' memory bound (no process), then three
spawns, the cases swept inside each:
- channels: one segment mapped once per rank in one process, driven by one
  thread through p2p_test (sizes 0, 1, odd, more than a slot and than a
  channel, staged and by CMA; tags interleaved; both ranks sending first; any
  source; sizes that disagree; a silent peer, an abort, a peer that left);
- dist.* on 3 ranks against gloo on the same random data (batch_isend_irecv
  ring, dtypes, strided tensors, tags, any source, the torch_dist transport's
  forwarding) and a torch.distributed.pipelining schedule's losses;
- a peer killed mid-recv: a clear, timely error, and nothing left in /dev/shm.
"""
from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import assert_no_new_shm, run_ranks, shm_entries

TIMEOUT_S = 5.0
STAGED = dict(p2p_slot_nbytes=256, p2p_num_slots=2)  # a channel holds 512 bytes
BY_CMA = dict(p2p_slot_nbytes=256, p2p_num_slots=2, p2p_cma_min_nbytes=300)  # > 300 B: read from the sender
SIZES = (0, 1, 7, 255, 256, 257, 1001, 4099)  # bytes: empty, one, odd, a slot -1/+1, several slots and channels


# ---- tier 0: options, no processes ----------------------------------------------------------------
def test_p2p_slots_shrink_to_fit_the_memory_bound():
    from ringcomm import ShmOptions
    from ringcomm.transport.shm import P2P_MIN_SLOT_NBYTES

    options = ShmOptions()
    for world_size in range(1, 65):
        nbytes = options.p2p_slot_nbytes_for(world_size)
        total = world_size * (world_size - 1) * options.p2p_num_slots * nbytes
        assert nbytes % 64 == 0 and P2P_MIN_SLOT_NBYTES <= nbytes <= options.p2p_slot_nbytes, (world_size, nbytes)
        assert total <= options.p2p_max_nbytes or nbytes == P2P_MIN_SLOT_NBYTES, (world_size, nbytes, total)
        assert nbytes * 2 > options.p2p_slot_nbytes or total * 2 > options.p2p_max_nbytes, (world_size, nbytes)
    assert options.p2p_slot_nbytes_for(2) == 128 << 10 and options.p2p_slot_nbytes_for(8) == 64 << 10
    assert ShmOptions(p2p_slot_nbytes=256).p2p_slot_nbytes_for(64) == 256  # never grows
    for bad, error in (({"p2p_slot_nbytes": 100}, ValueError), ({"p2p_num_slots": 1}, ValueError),
                       ({"p2p_cma_min_nbytes": -1}, ValueError), ({"p2p_max_nbytes": 1.5}, TypeError)):
        with pytest.raises(error, match=f"ShmOptions: {next(iter(bad))}="):
            ShmOptions(**bad)


# ---- tier 1: the channels, one process ------------------------------------------------------------
def make_comms(world_size: int, p2p: dict):
    """ShmComms of ranks 0..world_size-1 on one segment (CMA set up when asked)."""
    from ringcomm import _C

    name = f"/ringcomm-test-{secrets.token_hex(8)}"
    comms = [_C.ShmComm(name, 0, world_size, 1 << 12, 2, 0, 0, True, **p2p)]
    try:
        comms += [_C.ShmComm(name, r, world_size, 1 << 12, 2, 0, 0, False, **p2p) for r in range(1, world_size)]
    finally:
        _C.ShmComm.unlink(name)
    if p2p.get("p2p_cma_min_nbytes", -1) >= 0:
        reasons = [None] * world_size
        threads = [threading.Thread(target=lambda r=r: reasons.__setitem__(r, comms[r].setup_cma(TIMEOUT_S)))
                   for r in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert reasons == [""] * world_size, f"CMA unavailable here: {reasons}"
    return comms


def drive(*pending, timeout_s: float = TIMEOUT_S) -> None:
    """Makes progress on (comm, request) pairs from this one thread until all ended."""
    deadline = time.monotonic() + timeout_s
    while not all([comm.p2p_test(request) for comm, request in pending]):  # a list: each one a round
        assert time.monotonic() < deadline, [request.error for _, request in pending]
    for comm, request in pending:
        comm.p2p_wait(request, 0.1)  # raises a failed one's error


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def transfer(comms, src: int, dst: int, nbytes: int, tag: int, *, recv_first: bool, seed: int) -> None:
    data, out = random_bytes(nbytes, seed), torch.zeros(nbytes, dtype=torch.uint8)
    if recv_first:
        recv = comms[dst].p2p_irecv(out.data_ptr(), nbytes, src, tag)
        send = comms[src].p2p_isend(data.data_ptr(), nbytes, dst, tag)
    else:
        send = comms[src].p2p_isend(data.data_ptr(), nbytes, dst, tag)
        comms[src].p2p_test(send)
        recv = comms[dst].p2p_irecv(out.data_ptr(), nbytes, src, tag)
    drive((comms[src], send), (comms[dst], recv))
    assert torch.equal(out, data), f"{nbytes} bytes {src}->{dst}, tag {tag}, recv first {recv_first}"
    assert recv.source == src and send.done


def channel_sizes_and_orders(comms, label: str) -> None:
    for nbytes in SIZES:
        for recv_first in (True, False):
            transfer(comms, 0, 1, nbytes, tag=nbytes, recv_first=recv_first, seed=nbytes)
            transfer(comms, 1, 0, nbytes, tag=-nbytes, recv_first=recv_first, seed=nbytes + 1)


def channel_tags_interleaved(comms, label: str) -> None:
    """40 messages on 4 tags, received tag by tag: each tag's in send order."""
    generator = torch.Generator().manual_seed(1)
    tags = torch.randint(0, 4, (40,), generator=generator).tolist()
    sizes = torch.randint(0, 700, (40,), generator=generator).tolist()
    sent = [random_bytes(n, seed=100 + i) for i, n in enumerate(sizes)]
    sends = [comms[0].p2p_isend(t.data_ptr(), t.numel(), 1, tag) for t, tag in zip(sent, tags)]
    order = sorted(range(40), key=lambda i: (-tags[i], i))  # tag 3's first ... tag 0's last
    outs = {i: torch.zeros(sizes[i], dtype=torch.uint8) for i in order}
    recvs = {i: comms[1].p2p_irecv(outs[i].data_ptr(), sizes[i], 0, tags[i]) for i in order}
    drive(*[(comms[0], s) for s in sends], *[(comms[1], r) for r in recvs.values()])
    for i in order:
        assert torch.equal(outs[i], sent[i]), f"{label}: message {i} (tag {tags[i]}, {sizes[i]} bytes)"


def channel_many_outstanding(comms, label: str) -> None:
    """More sends than a channel has rendezvous tickets (kMaxRendezvous) or
    slots, all drained by the receiver before it posts a receive: the rest wait
    in order, and every one arrives and ends."""
    sent = [random_bytes(400, seed=1000 + i) for i in range(150)]
    sends = [comms[0].p2p_isend(t.data_ptr(), 400, 1, 1) for t in sent]
    other = torch.zeros(1, dtype=torch.uint8)
    unrelated = comms[1].p2p_irecv(other.data_ptr(), 1, 0, 2)
    for _ in range(400):  # the receiver drains what comes as unexpected; the sender runs out of tickets
        comms[0].p2p_test(sends[-1])
        comms[1].p2p_test(unrelated)
    outs = [torch.zeros(400, dtype=torch.uint8) for _ in sent]
    recvs = [comms[1].p2p_irecv(out.data_ptr(), 400, 0, 1) for out in outs]
    last = comms[0].p2p_isend(other.data_ptr(), 1, 1, 2)
    drive(*[(comms[0], s) for s in sends + [last]], *[(comms[1], r) for r in recvs + [unrelated]])
    assert all(torch.equal(o, t) for o, t in zip(outs, sent)), label


def channel_both_send_first(comms, label: str) -> None:
    """Both ranks post a send of several channels' worth, then their receive."""
    data = [random_bytes(3000, seed=7 + r) for r in range(2)]
    outs = [torch.zeros(3000, dtype=torch.uint8) for _ in range(2)]
    sends = [comms[r].p2p_isend(data[r].data_ptr(), 3000, 1 - r, 9) for r in range(2)]
    recvs = [comms[r].p2p_irecv(outs[r].data_ptr(), 3000, 1 - r, 9) for r in range(2)]
    drive(*[(comms[r], q) for r in range(2) for q in (sends[r], recvs[r])])
    assert torch.equal(outs[0], data[1]) and torch.equal(outs[1], data[0]), label


def channel_partly_arrived(comms, label: str) -> None:
    """A receive posted while its message is half in the unexpected store: the
    rest goes straight into it."""
    data, out = random_bytes(2000, seed=3), torch.zeros(2000, dtype=torch.uint8)
    send = comms[0].p2p_isend(data.data_ptr(), 2000, 1, 5)
    other = torch.zeros(4, dtype=torch.uint8)
    waiting = comms[1].p2p_irecv(other.data_ptr(), 4, 0, 6)  # drains message 5 as unexpected
    comms[1].p2p_test(waiting)
    recv = comms[1].p2p_irecv(out.data_ptr(), 2000, 0, 5)
    drive((comms[0], send), (comms[1], recv))
    last = comms[0].p2p_isend(data.data_ptr(), 4, 1, 6)
    drive((comms[0], last), (comms[1], waiting))
    assert torch.equal(out, data) and torch.equal(other, data[:4]), label


def channel_sizes_disagree(comms, label: str) -> None:
    """A receive of another size fails with a ValueError naming both sizes; the
    channel stays usable."""
    for nbytes in (16, 1000):  # one piece; several pieces (or by CMA)
        data, out = random_bytes(nbytes, seed=nbytes), torch.zeros(8, dtype=torch.uint8)
        send = comms[0].p2p_isend(data.data_ptr(), nbytes, 1, 2)
        recv = comms[1].p2p_irecv(out.data_ptr(), 8, 0, 2)
        with pytest.raises(ValueError, match=f"rank 1 got a message of {nbytes} bytes from rank 0 \\(tag 2\\) "
                                             f"for a buffer of 8 bytes"):
            drive((comms[0], send), (comms[1], recv))
        drive((comms[0], send))  # the sender's part ended all the same
    transfer(comms, 0, 1, 600, tag=2, recv_first=False, seed=5)


def channel_any_source(label: str, p2p: dict) -> None:
    comms = make_comms(3, p2p)
    data = [random_bytes(700, seed=r) for r in range(3)]
    sends = [comms[r].p2p_isend(data[r].data_ptr(), 700, 1, 4) for r in (2, 0)]
    outs = [torch.zeros(700, dtype=torch.uint8) for _ in range(2)]
    recvs = [comms[1].p2p_irecv(out.data_ptr(), 700, -1, 4) for out in outs]
    drive((comms[2], sends[0]), (comms[0], sends[1]), *[(comms[1], r) for r in recvs])
    sources = sorted(r.source for r in recvs)
    assert sources == [0, 2], f"{label}: {sources}"
    for recv, out in zip(recvs, outs):
        assert torch.equal(out, data[recv.source]), f"{label}: from rank {recv.source}"
    self_data, self_out = random_bytes(33, seed=9), torch.zeros(33, dtype=torch.uint8)
    comms[1].p2p_isend(self_data.data_ptr(), 33, 1, 8)  # to itself: delivered at once
    drive((comms[1], comms[1].p2p_irecv(self_out.data_ptr(), 33, -1, 8)))
    assert torch.equal(self_out, self_data), label


def channel_failures(p2p: dict) -> dict:
    """A silent peer (timeout), an abort from another thread, a peer that closed."""
    messages = {}
    comms = make_comms(2, p2p)
    out = torch.zeros(64, dtype=torch.uint8)
    recv = comms[1].p2p_irecv(out.data_ptr(), 64, 0, 5)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        comms[1].p2p_wait(recv, 0.2)
    messages["timeout"] = (str(info.value), time.monotonic() - start)
    with pytest.raises(RuntimeError, match="unusable in this group after an earlier failure"):
        comms[1].p2p_irecv(out.data_ptr(), 64, 0, 5)
    comms = make_comms(2, p2p)
    recv = comms[1].p2p_irecv(out.data_ptr(), 64, 0, 5)
    threading.Timer(0.1, comms[1].abort).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        comms[1].p2p_wait(recv, 10.0)
    messages["abort"] = (str(info.value), time.monotonic() - start)
    comms = make_comms(2, p2p)
    big = random_bytes(5000, seed=1)
    send = comms[0].p2p_isend(big.data_ptr(), 5000, 1, 3)  # more than the channel (or by CMA): waits for rank 1
    assert comms[1].close(1.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        comms[0].p2p_wait(send, 10.0)
    messages["closed"] = (str(info.value), time.monotonic() - start)
    with pytest.raises(RuntimeError, match="the group is closed"):
        comms[1].p2p_isend(big.data_ptr(), 8, 0, 3)
    return messages


def channels_worker(rank: int, world_size: int) -> dict:
    results = {}
    for label, p2p in (("staged", STAGED), ("cma", BY_CMA)):
        comms = make_comms(2, p2p)
        for case in (channel_sizes_and_orders, channel_tags_interleaved, channel_many_outstanding, channel_both_send_first,
                     channel_partly_arrived, channel_sizes_disagree):
            case(comms, label)
        channel_any_source(label, p2p)
        results[label] = channel_failures(p2p)
    return results


def test_channels_move_every_size_in_order_and_fail_clearly():
    for label, messages in run_ranks(channels_worker, 1, timeout=60)[0].items():
        text, elapsed = messages["timeout"]
        assert text.startswith("recv: rank 1 at step 0/1 (tag 5, 64 bytes from rank 0), waiting for rank 0 to send: "
                               "Timed out after 0.2 s"), (label, text)
        assert elapsed < 1.0, (label, elapsed)
        text, elapsed = messages["abort"]
        assert "recv: rank 1" in text and "aborted" in text and elapsed < 1.0, (label, text, elapsed)
        text, elapsed = messages["closed"]
        assert text.startswith("send: rank 0 at step ") and "(tag 3, 5000 bytes to rank 1)" in text, (label, text)
        assert text.endswith("rank 1 closed the group") and elapsed < 1.0, (label, text, elapsed)


# ---- tier 2: dist.* on 3 ranks, against gloo ------------------------------------------------------
def seeded(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=dtype)


def ring_exchange(group, rank: int, world_size: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """batch_isend_irecv: to the right, from the left, on random data."""
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    out = torch.full((numel,), -1).to(dtype)
    ops = [dist.P2POp(dist.irecv, out, left, group), dist.P2POp(dist.isend, seeded((numel,), dtype, seed + rank),
                                                                right, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def both_send_first(group, rank: int, numel: int, seed: int) -> torch.Tensor:
    """Ranks 0 and 1 isend to each other, then irecv, then wait."""
    peer = 1 - rank
    out = torch.empty(numel)
    send = dist.isend(seeded((numel,), torch.float32, seed + rank), peer, group=group)
    recv = dist.irecv(out, peer, group=group)
    recv.wait()
    send.wait()
    return out


def tags_interleaved(group, rank: int, seed: int) -> list[torch.Tensor]:
    """Rank 0 sends 12 messages on 3 tags; rank 1 receives them tag by tag, the last tag first."""
    tags = [i % 3 for i in range(12)]
    if rank == 0:
        works = [dist.isend(seeded((5 + i,), torch.float32, seed + i), 1, group=group, tag=tag)
                 for i, tag in enumerate(tags)]
        for work in works:
            work.wait()
        return []
    outs = [torch.empty(5 + i) for i in range(12)]
    for i in sorted(range(12), key=lambda i: (-tags[i], i)):
        dist.recv(outs[i], 0, group=group, tag=tags[i])
    return outs


def checked_cases(group, rank: int, world_size: int, label: str) -> list:
    """Every case's results on this rank (compared across backends by the caller)."""
    results = []
    for numel in (0, 1, 5, 40_001, (1 << 18) + 3):  # up to 1 MiB: several slots, and by CMA where on
        results.append(ring_exchange(group, rank, world_size, numel, torch.float32, seed=numel))
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int64, torch.bfloat16, torch.float16, torch.float64,
                  torch.complex64):
        results.append(ring_exchange(group, rank, world_size, 1001, dtype, seed=7))
    if rank < 2:
        results.append(both_send_first(group, rank, 300_001, seed=11))
        results += tags_interleaved(group, rank, seed=13)
        strided = seeded((64, 48), torch.float32, 17 + rank).t()  # ringcomm: through contiguous copies
        out = torch.zeros(96, 64)[::2]
        if rank == 0:
            dist.send(strided.contiguous() if label == "gloo" else strided, 1, group=group)  # gloo takes no strides
        elif label == "gloo":
            received = torch.empty(48, 64)
            dist.recv(received, 0, group=group)
            out.copy_(received)
        else:
            dist.recv(out, 0, group=group)
        results.append(out)
    if rank == 0:  # from any source: every other rank's message, each sender named
        received = {}
        for _ in range(2 * (world_size - 1)):
            out = torch.empty(3)
            received.setdefault(dist.recv(out, group=group), []).append(out)
        results.append(sorted((src, torch.stack(outs).tolist()) for src, outs in received.items()))
    else:
        for i in range(2):
            dist.send(torch.full((3,), float(10 * rank + i)), 0, group=group)
    return results


def dropped_isend(group, rank: int) -> bool:
    """An isend whose Work and tensor the caller drops at once still delivers
    (the transport keeps the tensor until the receiver read it)."""
    if rank == 0:
        dist.isend(torch.full((1 << 18,), 3.0), 1, group=group)  # 1 MiB: by CMA, read later from this rank
        [torch.empty(1 << 18).fill_(-1.0) for _ in range(4)]  # what a freed buffer's memory would hold next
        dist.barrier(group=group)
        return True
    if rank == 1:
        dist.barrier(group=group)
        out = torch.empty(1 << 18)
        dist.recv(out, 0, group=group)
        return bool((out == 3.0).all())
    dist.barrier(group=group)
    return True


def mismatch_case(group, rank: int) -> str:
    if rank == 0:
        dist.send(torch.ones(4), 1, group=group)
        return ""
    if rank == 1:
        with pytest.raises(ValueError) as info:
            dist.recv(torch.empty(3), 0, group=group)
        return str(info.value)
    return ""


def pipeline_losses(group, rank: int, schedule_name: str) -> list[float]:
    """Two stages of a small MLP on ranks 0 and 1, SGD, 3 steps of 4 microbatches; stage 1's losses."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh()), torch.nn.Linear(64, 4)]
    stage = PipelineStage(layers[rank], rank, 2, torch.device("cpu"), group=group)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_class(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD(layers[rank].parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses: list[float] = []
    for _ in range(3):
        x, y = torch.randn(16, 16, generator=generator), torch.randn(16, 4, generator=generator)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=step_losses)
            losses += [loss.item() for loss in step_losses]
        optimizer.step()
    return losses


def dist_worker(rank: int, world_size: int) -> dict:
    import ringcomm  # noqa: F401  (registers the backend)
    from ringcomm.backend.p2p import ForwardedPointToPoint
    from ringcomm.transport.shm_p2p import ShmPointToPoint

    timeout = timedelta(seconds=20)  # a bug that hangs fails within it, not at the harness's deadline
    groups = {"gloo": dist.new_group(backend="gloo", timeout=timeout),
              "ringcomm": dist.new_group(backend="ringcomm", timeout=timeout)}
    for name, env in (("ringcomm staged", {"RINGCOMM_CMA": "0"}), ("ringcomm torch_dist", {"RINGCOMM_TRANSPORT": "torch_dist"})):
        os.environ.update(env)
        try:
            groups[name] = dist.new_group(backend="ringcomm", timeout=timeout)
        finally:
            for key in env:
                del os.environ[key]
    assert isinstance(groups["ringcomm"]._p2p, ShmPointToPoint), f"rank {rank}: {groups['ringcomm']._p2p!r}"
    assert isinstance(groups["ringcomm torch_dist"]._p2p, ForwardedPointToPoint), f"rank {rank}"
    results = {name: checked_cases(group, rank, world_size, name) for name, group in groups.items()}
    mismatch = mismatch_case(groups["ringcomm"], rank)
    assert dropped_isend(groups["ringcomm"], rank), f"rank {rank}: a dropped isend's data changed"
    pairs = {name: dist.new_group([0, 1], backend=name, timeout=timeout) for name in ("gloo", "ringcomm")}
    losses = {}
    if rank < 2:
        for schedule_name in ("gpipe", "1f1b"):
            for name, group in pairs.items():
                losses[(schedule_name, name)] = pipeline_losses(group, rank, schedule_name)
    dist.barrier()
    # Compared here: tensors sent back through the harness's pipe could outlive their sender.
    return {"differ": differences(results, rank), "closed_forms": closed_forms(results["gloo"], rank, world_size),
            "mismatch": mismatch, "losses": losses}


def differences(results: dict, rank: int) -> list[str]:
    """Where each ringcomm group's results differ from gloo's."""
    reference, differ = results["gloo"], []
    for name, got in results.items():
        if len(got) != len(reference):
            differ.append(f"rank {rank}, {name}: {len(got)} results, gloo {len(reference)}")
        for case, (mine, theirs) in enumerate(zip(got, reference)):
            same = (mine.dtype == theirs.dtype and torch.equal(mine, theirs)) if isinstance(theirs, torch.Tensor) \
                else mine == theirs
            if not same:
                differ.append(f"rank {rank}, {name}, case {case}: {mine} != gloo's {theirs}")
    return differ


def closed_forms(reference: list, rank: int, world_size: int) -> list[str]:
    """gloo's results themselves: the ring brought the left rank's seeded data; rank 0 heard every sender."""
    wrong = []
    left = (rank - 1) % world_size
    if not torch.equal(reference[3], seeded((40_001,), torch.float32, 40_001 + left)):
        wrong.append(f"rank {rank}: the ring's 40001 floats are not rank {left}'s")
    if rank == 0:
        expected = [(src, [[10.0 * src] * 3, [10.0 * src + 1] * 3]) for src in range(1, world_size)]
        if reference[-1] != expected:
            wrong.append(f"rank 0 from any source: {reference[-1]} != {expected}")
    return wrong


def test_dist_point_to_point_matches_gloo_and_pipelining_trains_alike():
    for rank, result in enumerate(run_ranks(dist_worker, 3, timeout=120)):
        assert not result["differ"] and not result["closed_forms"], result["differ"] + result["closed_forms"]
        if rank == 1:
            assert result["mismatch"].startswith("recv: rank 1 got a message of 16 bytes from rank 0 (tag 0) for a "
                                                 "buffer of 12 bytes"), result["mismatch"]
            for schedule_name in ("gpipe", "1f1b"):
                ours, gloo = result["losses"][(schedule_name, "ringcomm")], result["losses"][(schedule_name, "gloo")]
                assert len(ours) == 12 and ours == gloo, f"{schedule_name}: ringcomm {ours} != gloo {gloo}"


# ---- tier 3: a peer killed mid-recv ---------------------------------------------------------------
def killed_mid_recv(rank: int, world_size: int) -> tuple[str, float]:
    import ringcomm  # noqa: F401

    os.environ["RINGCOMM_CMA"] = "0"  # staged: rank 1's message is half in the channel when it dies
    group = dist.new_group(backend="ringcomm", timeout=timedelta(seconds=3))
    numel = 1 << 20  # 4 MiB: many slots
    dist.barrier(group=group)
    if rank == 1:
        dist.isend(torch.ones(numel), 0, group=group)  # the first slots only; nobody makes progress on the rest
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    out = torch.zeros(numel)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        dist.recv(out, 1, group=group)
    elapsed = time.monotonic() - start
    with pytest.raises(RuntimeError, match="unusable"):
        dist.recv(out, 1, group=group)
    return str(info.value), elapsed


def test_peer_killed_mid_recv_is_named_at_once_and_leaves_no_shm():
    before = shm_entries()
    message, elapsed = run_ranks(killed_mid_recv, 2, may_die=frozenset({1}), timeout=60)[0]
    assert message.startswith("recv: rank 0 at step "), message
    step = message.split(" at step ")[1].split(" ")[0]
    assert 0 < int(step.split("/")[0]) < int(step.split("/")[1]), f"not mid-message: {message}"
    assert "(tag 0, 4194304 bytes from rank 1), waiting for rank 1 to send: rank 1 (pid " in message, message
    assert message.endswith(") has exited"), message
    assert elapsed < 1.5, f"{elapsed:.2f} s to notice: {message}"
    assert_no_new_shm(before)
