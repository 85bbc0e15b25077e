"""Arguments and RINGCOMM_* variables that would reach C++ (or a system call)
unchecked are refused in Python with an error that names them, their value and
what is allowed, never with pybind11's overload dump, std::bad_alloc or EINVAL."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ringcomm
from ringcomm import ReduceOp
from ringcomm.core import host
from ringcomm.kernels import cpu as kernels
from ringcomm.observe import recorder


def new_recorder() -> recorder.FlightRecorder | None:
    """What every new group does first: its flight recorder, from the RINGCOMM_TRACE_* variables."""
    return recorder.for_group(0, 1, (0,), "shm", 1.0, None)


@pytest.mark.parametrize("name,why", [("KILL", "SIGKILL cannot be caught"), ("SIGSTOP", "SIGSTOP cannot be caught"),
                                      ("NOPE", "not a signal name"), ("segv", "SIGSEGV is a fault signal")])
def test_trace_signal_that_cannot_trigger_a_dump(monkeypatch, name, why) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_SIGNAL", name)
    with pytest.raises(ValueError, match=f"RINGCOMM_TRACE_SIGNAL='{name}'.*{why}"):
        new_recorder()


@pytest.mark.parametrize("value", ["1000000000000", str(2**63), "-1", "1e12", "64.0", "abc"])
def test_trace_buffer_size_outside_its_range(monkeypatch, value) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_BUFFER_SIZE", value)
    with pytest.raises(ValueError, match=rf"RINGCOMM_TRACE_BUFFER_SIZE='{value}' .*\[0, 1000000\]"):
        new_recorder()


def test_trace_stacks_is_1_or_0(monkeypatch) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_STACKS", "true")
    with pytest.raises(ValueError, match="RINGCOMM_TRACE_STACKS='true' must be 1 .* or 0"):
        new_recorder()


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    ringcomm.destroy_default_group()
    dist.destroy_process_group()


def test_group_timeouts_and_cma_variable(one_rank_world, monkeypatch) -> None:
    for value, why in (("abc", "is not a number of seconds"), ("-1", "must be a finite number of seconds > 0"),
                       ("nan", "must be a finite number")):
        monkeypatch.setenv("RINGCOMM_TIMEOUT", value)
        with pytest.raises(ValueError, match=f"RINGCOMM_TIMEOUT='{value}' {why}"):
            ringcomm.all_reduce(torch.ones(2))  # the default group reads RINGCOMM_TIMEOUT
    monkeypatch.delenv("RINGCOMM_TIMEOUT")
    for timeout in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"timeout={timeout} s must be a finite number > 0"):
            ringcomm.new_group(timeout=timeout)
    monkeypatch.setenv("RINGCOMM_CMA", "false")  # was taken as on: only "0" turned it off
    with pytest.raises(ValueError, match="RINGCOMM_CMA='false' must be 1 .* or 0"):
        ringcomm.new_group(transport="shm")


@pytest.mark.parametrize("options,error,text", [
    (dict(slot_nbytes=1.5), TypeError, "slot_nbytes=1.5 must be an int"),
    (dict(slot_nbytes=2**63), ValueError, r"slot_nbytes=9223372036854775808 is out of range.*\[64, 1099511627776\]"),
    (dict(num_slots=True), TypeError, "num_slots=True must be an int, got bool"),
    (dict(num_slots=2**40), ValueError, r"num_slots=1099511627776 is out of range.*\[2, 1024\]"),
    (dict(spin_us=float("inf")), ValueError, "spin_us=inf is out of range"),
    (dict(spin_us=float("nan")), ValueError, "spin_us=nan is out of range"),
    (dict(cma=1), TypeError, "cma=1 must be a bool"),
    (dict(cma_piece_nbytes=4000), ValueError, r"cma_piece_nbytes=4000 is out of range.*\[4096, "),
    (dict(cma_piece_nbytes=4096 + 32), ValueError, "cma_piece_nbytes=4128 must be a multiple of 64"),
    (dict(cma_piece_nbytes=65536.0), TypeError, "cma_piece_nbytes=65536.0 must be an int"),
])
def test_shm_options(options, error, text) -> None:
    with pytest.raises(error, match=f"ShmOptions: {text}"):
        ringcomm.ShmOptions(**options)


def test_torch_dist_options() -> None:
    with pytest.raises(ValueError, match=r"TorchDistOptions: segment_nbytes=0 is out of range"):
        ringcomm.TorchDistOptions(segment_nbytes=0)
    with pytest.raises(TypeError, match="TorchDistOptions: segment_nbytes=4.0 must be an int"):
        ringcomm.TorchDistOptions(segment_nbytes=4.0)


def test_ints_for_cpp_kernels() -> None:
    for pid, error in ((1.5, TypeError), (True, TypeError), (2**63, ValueError)):
        with pytest.raises(error, match=f"process_state: pid={pid}"):
            host.process_state(pid)
    ones = torch.ones(3)
    with pytest.raises(TypeError, match="reduce_into: divisor=2.5 must be an int"):
        kernels.reduce_into(ones, [ones, ones], ReduceOp.AVG, 2.5)


def test_cma_piece_follows_the_l2_cache() -> None:
    """Half of one core's L2 for the pieces of every peer and the output's share:
    L2 / (2 x world size), in 4 KiB steps between 16 KiB and 1 MiB."""
    options = ringcomm.ShmOptions()
    assert options.cma_piece_nbytes_for(2, 512 << 10) == 128 << 10  # AMD Zen 2
    assert options.cma_piece_nbytes_for(2, 2 << 20) == 512 << 10  # Intel Sapphire Rapids
    assert options.cma_piece_nbytes_for(3, 1280 << 10) == 212 << 10  # Ice Lake: 1.25 MiB / 6, down to 4 KiB
    assert options.cma_piece_nbytes_for(64, 256 << 10) == 16 << 10  # never below 16 KiB
    assert options.cma_piece_nbytes_for(1, 64 << 20) == 1 << 20  # nor above 1 MiB
    assert options.cma_piece_nbytes_for(2, None) == 128 << 10  # unknown L2
    assert ringcomm.ShmOptions(cma_piece_nbytes=8192).cma_piece_nbytes_for(2, 512 << 10) == 8192


def test_cache_sizes_as_sysfs_reports_them(tmp_path, monkeypatch) -> None:
    caches = {"index0": ("1", "Data", "48K"), "index1": ("1", "Instruction", "32K"),
              "index2": ("2", "Unified", "2048K"), "index3": ("3", "Unified", "105M")}
    for cpu in range(os.cpu_count() or 1):
        for index, (level, kind, size) in caches.items():
            folder = tmp_path / f"cpu{cpu}" / "cache" / index
            folder.mkdir(parents=True)
            for name, value in (("level", level), ("type", kind), ("size", size)):
                (folder / name).write_text(value + "\n")
    monkeypatch.setattr(host, "CPU_CACHES", str(tmp_path / "cpu{cpu}" / "cache"))
    assert (host.cache_nbytes(1), host.cache_nbytes(2), host.cache_nbytes(3)) == (48 << 10, 2 << 20, 105 << 20)
    assert host.cache_nbytes(4) is None
    monkeypatch.setattr(host, "CPU_CACHES", str(tmp_path / "absent"))
    assert host.cache_nbytes(2) is None
