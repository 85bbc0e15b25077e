"""The shared-memory transport against faulty or hostile peers and a shared /dev/shm:
forged descriptors and flags, foreign segments, expired names, pid namespaces,
ranks killed during set-up.

Forgery cases map one segment twice: `comm` is rank 0 under test and `peer` is
rank 1, driven by the test-only hooks `_debug_post` / `_debug_store` to write
what a faulty or hostile rank could. They run in a child process (run_ranks
with one rank) so that a crash fails the test instead of pytest.
"""
from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import pytest
import torch

import ringcomm
from harness import run_ranks
from ringcomm import _C

SLOT_NBYTES = 1 << 16
NUM_SLOTS = 4
NUMEL = 1024  # float32 elements of each window
FLOAT32, SUM = 0, 0
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = 1, 2, 3
TIMEOUT_S = 2.0


class Pair(NamedTuple):
    comm: _C.ShmComm  # rank 0, under test
    peer: _C.ShmComm  # rank 1, writes what the test tells it to
    windows: list  # window 0 of each rank, registered with comm
    scratch: torch.Tensor  # rank 0's output where it is not a window


def make_pair() -> Pair:
    name = f"/ringcomm-test-{secrets.token_hex(8)}"
    comm = _C.ShmComm(name, 0, 2, SLOT_NBYTES, NUM_SLOTS, 0, 0, True)  # oneshot_max_nbytes=0: windows when possible
    try:
        peer = _C.ShmComm(name, 1, 2, SLOT_NBYTES, NUM_SLOTS, 0, 0, False)
    finally:
        _C.ShmComm.unlink(name)
    windows = []
    for _ in range(2):
        window_name = f"/ringcomm-test-{secrets.token_hex(8)}"
        windows.append(_C.ShmWindow(window_name, NUMEL * 4, True))
        _C.ShmWindow.unlink(window_name)
    comm.register_window(0, [w.address for w in windows], [w.nbytes for w in windows])
    return Pair(comm, peer, windows, torch.empty(NUMEL))


def desc(kind: int, numel: int, /, **fields) -> _C._DebugOpDesc:
    """The descriptor an honest rank 1 posts for `kind` on window 0, with `fields` replaced."""
    d = _C._DebugOpDesc()
    d.kind, d.dtype, d.redop, d.numel = kind, FLOAT32, SUM if kind in (ALL_REDUCE, REDUCE_SCATTER) else -1, numel
    d.access, d.in_window, d.in_offset, d.out_window, d.out_offset = 1, 0, 0, 0, 0
    for key, value in fields.items():
        setattr(d, key, value)
    return d


def run_op(pair: Pair, kind: int) -> None:
    """Rank 0's side of `kind` on its window 0 (zero-copy: the input is in a window)."""
    window, scratch = pair.windows[0].address, pair.scratch.data_ptr()
    if kind == ALL_REDUCE:
        pair.comm.all_reduce(window, window, NUMEL, FLOAT32, SUM, TIMEOUT_S)
    elif kind == REDUCE_SCATTER:
        pair.comm.reduce_scatter(scratch, window, NUMEL // 2, FLOAT32, SUM, TIMEOUT_S)
    else:
        pair.comm.all_gather(scratch, window, NUMEL // 2, FLOAT32, TIMEOUT_S)


OP_NAMES = {ALL_REDUCE: "all_reduce", REDUCE_SCATTER: "reduce_scatter", ALL_GATHER: "all_gather"}
# case: (op, numel, forged fields, a word the error must contain)
FORGED_DESCS = {
    "input offset 2**40": (ALL_REDUCE, NUMEL, {"in_offset": 2 ** 40}, "offset"),
    "input offset 2**62": (ALL_REDUCE, NUMEL, {"in_offset": 2 ** 62}, "offset"),
    "negative input offset": (ALL_REDUCE, NUMEL, {"in_offset": -4096}, "offset"),
    "output offset 2**40": (ALL_REDUCE, NUMEL, {"out_offset": 2 ** 40}, "offset"),
    "output 4 bytes past the end": (ALL_REDUCE, NUMEL, {"out_offset": 4}, "offset"),
    "unknown input window": (ALL_REDUCE, NUMEL, {"in_window": 7}, "window 7"),
    "unknown output window": (ALL_REDUCE, NUMEL, {"out_window": 2 ** 40}, "window 1099511627776"),
    "reduce_scatter input past the end": (REDUCE_SCATTER, NUMEL // 2, {"in_offset": 8}, "offset"),
    "all_gather input past the end": (ALL_GATHER, NUMEL // 2, {"in_offset": NUMEL * 4 - 4}, "offset"),
    "kind out of range": (ALL_REDUCE, NUMEL, {"kind": 17}, "kind=17"),
    "dtype out of range": (ALL_REDUCE, NUMEL, {"dtype": 99}, "dtype=99"),
    "reduce op out of range": (ALL_REDUCE, NUMEL, {"redop": -7}, "op=-7"),
    "negative numel": (ALL_REDUCE, NUMEL, {"numel": -1}, "numel=-1"),
    "access not 0, 1 or 2": (ALL_REDUCE, NUMEL, {"access": 5}, "access=5"),
}


def expect_broken(pair: Pair, kind: int, case: str, word: str) -> str:
    """rank 0 reports the forgery at once (no timeout), naming the op, rank 1 and
    the value, and the group refuses further work."""
    with pytest.raises(RuntimeError) as info:
        run_op(pair, kind)
    message = str(info.value)
    assert OP_NAMES[kind] in message and "rank 1" in message and word in message, f"{case}: {message}"
    assert "timed out" not in message.lower(), f"{case}: {message}"
    with pytest.raises(RuntimeError, match="unusable"):
        pair.comm.barrier(TIMEOUT_S)
    return message


def forged_desc(rank, world_size, case):
    kind, numel, fields, word = FORGED_DESCS[case]
    pair = make_pair()
    pair.peer._debug_post(desc(kind, numel, **fields))
    return expect_broken(pair, kind, case, word)


@pytest.mark.parametrize("case", sorted(FORGED_DESCS))
def test_forged_descriptor_is_a_clear_error(case):
    run_ranks(forged_desc, 1, case, timeout=60)


def honest_descs_still_work(rank, world_size):
    for kind, numel in ((ALL_REDUCE, NUMEL), (REDUCE_SCATTER, NUMEL // 2), (ALL_GATHER, NUMEL // 2)):
        pair = make_pair()
        num_rounds = 2 if kind == ALL_REDUCE else 1  # all_reduce on windows: reduce, then gather
        for _ in range(num_rounds):
            pair.peer._debug_post(desc(kind, numel))
        pair.peer._debug_store("consumed", num_rounds)
        run_op(pair, kind)
        assert pair.comm.rounds == num_rounds, f"{OP_NAMES[kind]}: {pair.comm.rounds=}"


def test_honest_descriptors_pass_the_checks():
    run_ranks(honest_descs_still_work, 1, timeout=60)


def forged_flag(rank, world_size, field):
    pair = make_pair()
    kind = ALL_GATHER
    pair.peer._debug_post(desc(kind, NUMEL // 2))
    pair.peer._debug_store(field, 10 ** 6)
    return expect_broken(pair, kind, field, f"{field}=1000000")


@pytest.mark.parametrize("field", ["posted", "consumed"])
def test_impossible_flag_value_is_a_clear_error(field):
    run_ranks(forged_flag, 1, field, timeout=60)


# [Note: shm trust]: after this rank posted round r, a peer's posted may reach r + NUM_SLOTS
# (it reuses a slot only once this rank consumed it) and its consumed at most r.
def gather_both_windows(pair: Pair, case: str) -> None:
    """rank 0's windowed all_gather against the closed form: rank r's window holds r + 1."""
    half = NUMEL // 2
    for rank, window in enumerate(pair.windows):
        torch.frombuffer(window, dtype=torch.float32).fill_(rank + 1.0)
    pair.scratch.fill_(-7.0)
    run_op(pair, ALL_GATHER)
    want = torch.cat([torch.full((half,), 1.0), torch.full((half,), 2.0)])
    assert torch.equal(pair.scratch, want), f"{case}: {pair.scratch}"


def flags_at_the_limit(rank, world_size):
    pair = make_pair()
    for round in (1, 2):  # the limits move with rank 0's round
        pair.peer._debug_post(desc(ALL_GATHER, NUMEL // 2))
        pair.peer._debug_store("posted", round + NUM_SLOTS)
        pair.peer._debug_store("consumed", round)
        gather_both_windows(pair, f"round {round}: posted={round + NUM_SLOTS}, consumed={round}")
        assert pair.comm.rounds == round and pair.comm.broken == "", f"round {round}: {pair.comm.broken!r}"


def test_largest_legal_flags_are_accepted():
    run_ranks(flags_at_the_limit, 1, timeout=60)


def flag_one_past_the_limit(rank, world_size, field, late):
    """The value is there when rank 0 first looks, or (late) stored while it waits."""
    pair = make_pair()
    pair.peer._debug_post(desc(ALL_GATHER, NUMEL // 2))
    limit = 1 + NUM_SLOTS if field == "posted" else 1  # rank 0 waits in round 1
    pair.peer._debug_store("consumed", 1)
    if late:
        pair.peer._debug_store(field, 0)  # rank 0 has to wait for this flag
        forger = threading.Timer(0.2, pair.peer._debug_store, (field, limit + 1))
        forger.start()
    else:
        pair.peer._debug_store(field, limit + 1)
    message = expect_broken(pair, ALL_GATHER, field, f"{field}={limit + 1}")
    assert f"at most {limit})" in message, message
    if late:
        forger.join()


@pytest.mark.parametrize("late", [False, True], ids=["at once", "while waiting"])
@pytest.mark.parametrize("field", ["posted", "consumed"])
def test_flag_one_past_the_limit_is_a_clear_error(field, late):
    run_ranks(flag_one_past_the_limit, 1, field, late, timeout=60)


def make_cma_pair() -> tuple[_C.ShmComm, _C.ShmComm]:
    """Two ranks of one segment with cross-memory attach on for every size."""
    name = f"/ringcomm-test-{secrets.token_hex(8)}"
    comm = _C.ShmComm(name, 0, 2, SLOT_NBYTES, NUM_SLOTS, 0, 0, True, cma_min_nbytes=0, cma_reduce_min_nbytes=0)
    try:
        peer = _C.ShmComm(name, 1, 2, SLOT_NBYTES, NUM_SLOTS, 0, 0, False, cma_min_nbytes=0, cma_reduce_min_nbytes=0)
    finally:
        _C.ShmComm.unlink(name)
    reasons = []
    helper = threading.Thread(target=lambda: reasons.append(peer.setup_cma(TIMEOUT_S)))
    helper.start()
    reasons.append(comm.setup_cma(TIMEOUT_S))
    helper.join()
    assert reasons == ["", ""] and comm.cma_enabled, reasons
    return comm, peer


def forged_cma_address(rank, world_size, op):
    """A peer that publishes an address its process does not map: the read fails
    in the kernel and rank 0 reports it, instead of copying whatever is there."""
    comm, peer = make_cma_pair()
    kind, numel = {"all_gather": (ALL_GATHER, NUMEL // 2), "all_reduce": (ALL_REDUCE, NUMEL)}[op]
    d = desc(kind, numel, access=2, in_addr=64, out_addr=64)
    peer._debug_post(d)
    data, out = torch.ones(NUMEL), torch.empty(NUMEL)
    with pytest.raises(RuntimeError) as info:
        if kind == ALL_GATHER:
            comm.all_gather(out.data_ptr(), data.data_ptr(), NUMEL // 2, FLOAT32, TIMEOUT_S)
        else:
            comm.all_reduce(out.data_ptr(), data.data_ptr(), NUMEL, FLOAT32, SUM, TIMEOUT_S)
    message = str(info.value)
    assert op in message and "rank 1" in message and "process_vm_readv" in message, message
    with pytest.raises(RuntimeError, match="unusable"):
        comm.barrier(TIMEOUT_S)


@pytest.mark.parametrize("op", ["all_gather", "all_reduce"])
def test_forged_cma_address_is_a_clear_error(op):
    run_ranks(forged_cma_address, 1, op, timeout=60)


def make_foreign_segment(mode: int, uid: int | None = None) -> str:
    """A file in /dev/shm named like a ringcomm segment, made with `mode` (and owner `uid`)."""
    name = f"/ringcomm-test-{secrets.token_hex(8)}"
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, -1)
    finally:
        os.close(fd)
    return name


@pytest.mark.parametrize("mode", [0o666, 0o644, 0o400], ids=oct)
def test_attach_refuses_a_segment_with_another_mode(mode):
    name = make_foreign_segment(mode)
    try:
        with pytest.raises(RuntimeError, match=f"refusing.*{name}.*uid {os.geteuid()} with mode 0{mode:o}"):
            _C.ShmWindow(name, 4096, False)
    finally:
        os.unlink("/dev/shm" + name)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
@pytest.mark.parametrize("mode", [0o600, 0o666], ids=oct)
def test_attach_refuses_a_segment_of_another_user(mode):
    name = make_foreign_segment(mode, uid=65534)
    try:
        with pytest.raises(RuntimeError, match=f"refusing.*{name}.*uid 65534 with mode 0{mode:o}"):
            _C.ShmWindow(name, 4096, False)
        with pytest.raises(RuntimeError, match="refusing"):
            _C.ShmComm(name, 1, 2, SLOT_NBYTES, NUM_SLOTS, 0, 0, False)
    finally:
        os.unlink("/dev/shm" + name)


def test_segments_are_created_0600_whatever_the_umask():
    name = f"/ringcomm-test-{secrets.token_hex(8)}"
    old = os.umask(0o277)
    try:
        created = _C.ShmWindow(name, 4096, True)
        assert os.stat("/dev/shm" + name).st_mode & 0o7777 == 0o600
        attached = _C.ShmWindow(name, 4096, False)
        assert attached.nbytes == created.nbytes
    finally:
        os.umask(old)
        _C.ShmWindow.unlink(name)


def make_entry(path: str, kind: str) -> None:
    if kind == "dir":
        os.mkdir(path)
    elif kind == "symlink":
        os.symlink("/dev/null", path)
    else:
        open(path, "wb").close()
        if kind == "other user's file":
            os.chown(path, 65534, -1)


def test_sweep_removes_only_expired_files_of_this_user():
    from ringcomm.transport.shm_names import remove_stale_segments

    now, token = int(time.time()), secrets.token_hex(4)
    dead_pid = 2 ** 22 + 12345  # above any pid_max: no process has it here, but may in another pid namespace
    cases = {  # file name: (entry kind, expected to be removed)
        f"ringcomm-exp{now - 5}-a{token}": ("file", True),
        f"ringcomm-exp{now + 3600}-b{token}": ("file", False),  # live: its set-up may still run, whoever made it
        f"ringcomm-exp{now - 5}-c{token}": ("dir", False),
        f"ringcomm-exp{now - 5}-d{token}": ("symlink", False),
        f"ringcomm-{dead_pid}-e{token}": ("file", False),  # not a name new_name makes: never guessed at
        f"ringcomm-{dead_pid}-f{token}": ("dir", False),
        f"ringcomm-expsoon-{token}": ("file", False),
    }
    if os.geteuid() == 0:
        cases[f"ringcomm-exp{now - 5}-0{token}"] = ("other user's file", False)
        cases[f"ringcomm-{dead_pid}-1{token}"] = ("other user's file", False)
    try:
        for name, (kind, _) in cases.items():
            make_entry(f"/dev/shm/{name}", kind)
        removed = {os.path.basename(path) for path in remove_stale_segments()}
        for name, (kind, expected) in cases.items():
            assert (name in removed) == expected, f"{name} ({kind}): removed={name in removed}"
            assert os.path.lexists(f"/dev/shm/{name}") != expected, f"{name} ({kind})"
    finally:
        for name, (kind, _) in cases.items():
            path = f"/dev/shm/{name}"
            if kind == "dir" and os.path.isdir(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)


def test_new_names_carry_their_expiry():
    from ringcomm.transport.shm_names import EXPIRY_MARGIN_S, expiry_of, new_name

    before = time.time()
    name = new_name(30.0)
    expiry = expiry_of(name.lstrip("/"))
    assert expiry is not None and before + 30.0 + EXPIRY_MARGIN_S <= expiry <= time.time() + 31.0 + EXPIRY_MARGIN_S, name


def unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# Rank 1 in a new pid namespace: attaches, prints its pid there, is late to a barrier.
NAMESPACED_RANK = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
_C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_C)
comm = _C.ShmComm(sys.argv[2], 1, 2, int(sys.argv[3]), int(sys.argv[4]), 0, 0, False)
print(os.getpid(), flush=True)
time.sleep(1.0)
comm.barrier(10.0)
"""


@pytest.mark.skipif(not unshare_works(), reason="needs unshare --pid (root or user namespaces)")
def test_peer_in_another_pid_namespace_is_not_judged_by_its_pid():
    name = f"/ringcomm-test-{secrets.token_hex(8)}"
    comm = _C.ShmComm(name, 0, 2, SLOT_NBYTES, NUM_SLOTS, 0, 0, True)
    # The namespaced rank gets pid 123456 there (set through ns_last_pid), which no process has here.
    script = 'echo 123455 > /proc/sys/kernel/ns_last_pid; "$0" -c "$1" "$2" "$3" "$4" "$5"; exit $?'
    args = [sys.executable, NAMESPACED_RANK, _C.__file__, name, str(SLOT_NBYTES), str(NUM_SLOTS)]
    child = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", script, *args], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        _C.ShmComm.unlink(name)
        try:
            os.kill(pid, 0)
            pytest.skip(f"pid {pid} of the namespaced rank also exists here")
        except ProcessLookupError:
            pass
        comm.barrier(10.0)  # rank 1 is late but alive: no "has exited" for the pid it wrote
        assert child.wait(timeout=30) == 0
    finally:
        _C.ShmComm.unlink(name)
        if child.poll() is None:
            child.kill()
            child.wait()


SETUP_TIMEOUT_S = 10.0


def kill_rank0_when_announcing(rank, world_size, key_prefix, announce_first):
    """Rank 0 dies (SIGKILL) as it announces the name of a segment it created
    under `key_prefix` ("shm/name": the group's; "window/": its window), after
    or before announcing it, once every other rank waits in ringcomm's set-up
    (so past torch.distributed's own group set-up, which a death breaks too)."""
    from ringcomm.transport import rendezvous, shm

    if rank != 0:
        get = rendezvous.get

        def signal_and_get(store, key, timeout_s, what):
            store.set(f"test/waiting/{rank}", "1")
            return get(store, key, timeout_s, what)

        rendezvous.get = signal_and_get
        return
    publish = shm._publish

    def publish_and_die(store, key, value):
        if key.startswith(key_prefix):
            store.wait([f"test/waiting/{r}" for r in range(1, world_size)])
            if announce_first:
                publish(store, key, value)
            os.kill(os.getpid(), signal.SIGKILL)
        publish(store, key, value)

    shm._publish = publish_and_die


def kill_rank0_after_announcing(rank, world_size, key_prefix):
    kill_rank0_when_announcing(rank, world_size, key_prefix, announce_first=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        group = ringcomm.new_group(transport="shm", timeout=SETUP_TIMEOUT_S)
        ringcomm.empty(1000, group=group)
    message = str(info.value)
    assert "rank 0" in message and "exited" in message, f"rank {rank}: {message}"
    assert time.monotonic() - start < SETUP_TIMEOUT_S, f"rank {rank} waited out the timeout: {message}"
    return message


@pytest.mark.parametrize("key_prefix", ["shm/name", "window/"])
def test_rank_killed_during_setup_leaves_nothing_in_dev_shm(key_prefix):
    before = set(glob.glob("/dev/shm/ringcomm-*"))
    run_ranks(kill_rank0_after_announcing, 3, key_prefix, may_die=frozenset({0}), timeout=60)
    left = set(glob.glob("/dev/shm/ringcomm-*")) - before
    assert not left, f"left in /dev/shm: {left}"


def kill_rank0_before_announcing(rank, world_size):
    kill_rank0_when_announcing(rank, world_size, "shm/name", announce_first=False)
    with pytest.raises(RuntimeError, match="rank 0 to create the segment"):
        ringcomm.new_group(transport="shm", timeout=2.0)


def test_segment_of_ranks_that_all_died_expires():
    from ringcomm.transport.shm_names import EXPIRY_MARGIN_S, expiry_of

    before = set(glob.glob("/dev/shm/ringcomm-*"))
    start = time.time()
    run_ranks(kill_rank0_before_announcing, 2, may_die=frozenset({0}), timeout=60)
    left = set(glob.glob("/dev/shm/ringcomm-*")) - before
    try:
        # Only the dead creator knew the name: it stays until its expiry, which the sweep honours.
        assert len(left) == 1, left
        expiry = expiry_of(os.path.basename(next(iter(left))))
        assert expiry is not None and expiry <= time.time() + 2.0 + EXPIRY_MARGIN_S + 1, (left, start)
    finally:
        for path in left:
            os.unlink(path)


def announce_foreign_name(rank, world_size, key_prefix):
    """Rank 0 announces the name of a file that is not a ringcomm segment; rank 1 must neither map nor unlink it."""
    from ringcomm.transport import shm

    if rank == 0:
        publish = shm._publish

        def publish_foreign(store, key, value):  # the window's value is "name nbytes"
            if key.startswith(key_prefix):
                value = " ".join(["/not-ringcomm", *value.split()[1:]])
            publish(store, key, value)

        shm._publish = publish_foreign
    if rank == 1:
        with pytest.raises(RuntimeError, match="rank 0 announced segment name '/not-ringcomm'"):
            group = ringcomm.new_group(transport="shm", timeout=2.0)
            ringcomm.empty(10, group=group)
    else:
        with pytest.raises(RuntimeError):
            group = ringcomm.new_group(transport="shm", timeout=2.0)
            ringcomm.empty(10, group=group)


@pytest.mark.parametrize("key_prefix", ["shm/name", "window/"])
def test_a_name_ringcomm_does_not_make_is_neither_mapped_nor_unlinked(key_prefix):
    decoy = "/dev/shm/not-ringcomm"
    fd = os.open(decoy, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        run_ranks(announce_foreign_name, 2, key_prefix, timeout=60)
        assert os.path.exists(decoy)
    finally:
        os.unlink(decoy)
