"""The processes of a simulated cluster (see [Note: simulated hosts] in
cluster.py): bounded set-up commands, the sweep of hosts and links whose run
ended, and torchrun in every host with each rank's exit status and output."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from cluster import Cluster

PREFIX = "rcc"
HOLDER = "rcc-holder"
RDZV_PORT = 29400
COMMAND_TIMEOUT_S = 10.0
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LINK = re.compile(rf"{PREFIX}([0-9a-f]+)[bv]\d*")
_WORKDIR = re.compile(rf"{PREFIX}-(\d+)-[^/]+")  # Cluster.workdir, in the temporary folder
_HOLDER_NAME = re.compile(rf"{HOLDER}-(\d+)-(\d+)")
WRAPPER = """\
"$@" >"$RCC_OUT/rank$RANK.log" 2>&1 &
pid=$!
echo "$pid $(hostname)" >"$RCC_OUT/rank$RANK.pid"
trap 'kill -TERM $pid 2>/dev/null' TERM INT
while :; do wait $pid; rc=$?; kill -0 $pid 2>/dev/null || break; done
echo $rc >"$RCC_OUT/rank$RANK.rc"
exit $rc
"""


def _run(argv: Sequence[str], what: str) -> str:
    """Runs a set-up command (bounded); its failure names it and its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"cluster: {what}: {' '.join(argv)} took over {COMMAND_TIMEOUT_S} s") from err
    if done.returncode:
        raise RuntimeError(f"cluster: {what}: {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _netns_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _stat(pid: int) -> list[str]:
    """/proc/pid/stat after the command name: [state, ppid, ...]; [] when gone."""
    return _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()


def _processes_in_netns(netns: str, *, exclude: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != exclude and _netns_of(int(p)) == netns]


def _kill_and_wait(pids: Sequence[int], timeout_s: float = 5.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_stat(p)[:1] not in ([], ["Z"]) for p in pids):
        time.sleep(0.02)


def _holders() -> list[tuple[int, int, int]]:
    """(holder pid, owner pid, host index) of every holder on this machine."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if match := _HOLDER_NAME.fullmatch(_read(f"/proc/{entry}/cmdline").split("\0", 1)[0]):
            found.append((int(entry), int(match.group(1)), int(match.group(2))))
    return found


def _owner_alive(owner: int, holder: int) -> bool:
    """Whether the run that made `holder` still runs (its pid not reused since)."""
    owner_stat, holder_stat = _stat(owner), _stat(holder)
    return len(owner_stat) > 19 and len(holder_stat) > 19 and int(owner_stat[19]) <= int(holder_stat[19])


def _links() -> list[str]:
    names = [line.split(":")[1].strip().split("@")[0]
             for line in _run(["ip", "-o", "link", "show"], "listing links").splitlines()]
    return [n for n in names if _LINK.fullmatch(n)]


def leftovers(owner: int | None = None) -> tuple[list[int], list[str]]:
    """The holders and links of `owner`'s run, or (None) of every run whose owner is gone."""
    holders = [h for h, o, _ in _holders() if o == owner or (owner is None and not _owner_alive(o, h))]
    links = []
    for name in _links():
        link_owner = int(_LINK.fullmatch(name).group(1), 16)
        if link_owner == owner or (owner is None and not os.path.exists(f"/proc/{link_owner}")):
            links.append(name)
    return holders, links


def sweep(owner: int | None = None) -> list[str]:
    """Removes the hosts and links of `owner`'s run, or (None) of every run whose
    owner is gone: first every process in a host, then its holder (its
    namespaces, tmpfs and bind mount end with it), then the links and the
    run's folder (hosts file, ranks' output)."""
    holders, links = leftovers(owner)
    for holder in holders:
        if (netns := _netns_of(holder)) is not None:
            _kill_and_wait(_processes_in_netns(netns, exclude=holder))
        _kill_and_wait([holder])
    for link in links:
        subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    folders = []
    for entry in os.listdir(tempfile.gettempdir()):
        if (match := _WORKDIR.fullmatch(entry)) and (int(match.group(1)) == owner or (
                owner is None and not os.path.exists(f"/proc/{match.group(1)}"))):
            shutil.rmtree(os.path.join(tempfile.gettempdir(), entry), ignore_errors=True)
            folders.append(entry)
    return [f"holder pid {h}" for h in holders] + [f"link {n}" for n in links] + [f"folder {f}" for f in folders]


class RankResult(NamedTuple):
    rank: int
    host: int
    returncode: int | None  # None: it never ran, or was killed without its wrapper knowing
    output: str


class Launch:
    """torchrun running in every host of a cluster; a context manager that kills
    whatever still runs on exit. Rank r's stdout and stderr go to a file, its
    exit status to another (WRAPPER, a shell between torchrun and python)."""

    def __init__(self, cluster: Cluster, argv: list[str], *, nproc_per_host: int, env: dict[str, str],
                 timeout_s: float, nnodes: str | None = None, max_restarts: int = 0, rdzv_conf: str = "") -> None:
        self.cluster, self.nproc_per_host = cluster, nproc_per_host
        self.world_size = cluster.num_hosts * nproc_per_host
        self.deadline = time.monotonic() + timeout_s
        self.out = tempfile.mkdtemp(prefix="launch-", dir=cluster.workdir)
        wrapper = os.path.join(self.out, "wrapper.sh")
        with open(wrapper, "w") as f:
            f.write(WRAPPER)
        base = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])),
                    RCC_OUT=self.out, RCC_LINKS=",".join(h.veth for h in cluster.hosts),
                    RCC_LINK_GBIT=str(cluster.link_gbit), OMP_NUM_THREADS="1", **env)
        endpoint = f"{cluster.hosts[0].address}:{RDZV_PORT}"
        self.agents = []
        for host in cluster.hosts:
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes or str(cluster.num_hosts),
                       "--nproc-per-node", str(nproc_per_host), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       endpoint, "--rdzv-id", f"{cluster.owner}", "--local-addr", host.address, "--max-restarts",
                       str(max_restarts), "--monitor-interval", "0.1", *(["--rdzv-conf", rdzv_conf] if rdzv_conf else []),
                       "--no-python", "--", "sh", wrapper, sys.executable, *argv]
            log = open(os.path.join(self.out, f"agent{host.index}.log"), "w")
            self.agents.append(subprocess.Popen(host.enter() + command, env=base, stdin=subprocess.DEVNULL,
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def _file(self, rank: int, suffix: str) -> str:
        return _read(os.path.join(self.out, f"rank{rank}.{suffix}"))

    def rank_pids(self, host: int, timeout_s: float = 60.0) -> list[int]:
        """The pids of the host's ranks (python), once they all started."""
        ranks = range(host * self.nproc_per_host, (host + 1) * self.nproc_per_host)
        deadline = time.monotonic() + timeout_s
        while not all(self._file(r, "pid") for r in ranks):
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster: host {host}'s ranks did not start within {timeout_s} s")
            time.sleep(0.02)
        return [int(self._file(r, "pid").split()[0]) for r in ranks]

    def done(self, ranks: Sequence[int]) -> bool:
        return all(self._file(r, "rc") for r in ranks) or all(a.poll() is not None for a in self.agents)

    def wait(self, ranks: Sequence[int] | None = None, *, echo: int | None = None) -> list[RankResult]:
        """Waits (until the deadline) for `ranks` (default: all) to end; kills
        what remains. `echo`: a rank whose output goes to stdout as it comes."""
        ranks = range(self.world_size) if ranks is None else ranks
        shown = 0
        while True:
            finished = self.done(ranks) or time.monotonic() > self.deadline
            if echo is not None:
                text = self._file(echo, "log")
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            if finished:
                break
            time.sleep(0.05)
        self.kill()
        results = []
        for rank in range(self.world_size):
            rc = self._file(rank, "rc").strip()
            results.append(RankResult(rank, rank // self.nproc_per_host, int(rc) if rc else None,
                                      self._file(rank, "log")))
        return results

    def agent_logs(self) -> str:
        return "\n".join(f"--- torchrun on host {i}:\n" + _read(os.path.join(self.out, f"agent{i}.log"))
                         for i in range(len(self.agents)))

    def kill(self) -> None:
        """Kills the agents and every process they left in the hosts."""
        for agent in self.agents:
            if agent.poll() is None:
                agent.kill()
            agent.wait(timeout=COMMAND_TIMEOUT_S)
        for host in self.cluster.hosts:
            _kill_and_wait(host.processes())


