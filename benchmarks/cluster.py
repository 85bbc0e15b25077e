"""A simulated cluster on this machine: each host a set of Linux namespaces (its
own network, hostname and /dev/shm), joined through rate-limited veth links to
a bridge, and torchrun --nnodes across them. Tests and benchmarks share it.

    python benchmarks/cluster.py --hosts 2 --nproc-per-host 2 -- benchmarks/bus_bw.py -e 16M
    python benchmarks/cluster.py --hosts 4 --link-gbit 1 -- -m some.module --flag
    python benchmarks/cluster.py --cleanup          # remove what a killed run left

Needs root and iproute2 (ip, tc), util-linux (unshare, nsenter) and bash.

[Note: simulated hosts] A host is a long-lived holder process made by
`unshare --net --uts --mount` (a `sleep` renamed `rcc-holder-<owner pid>-<i>`):
it sets its hostname, mounts a fresh tmpfs on /dev/shm and binds the cluster's
hosts file on /etc/hosts, then sleeps; everything else runs in its namespaces
through `nsenter -t <holder> --net --uts --mount`. The pid namespace and the
file system are shared, so the venv works unchanged and the launcher can
signal any rank. Its link: a veth pair, `eth0` inside, `rcc<owner pid hex>v<i>`
on the bridge `rcc<owner pid hex>b`, shaped by tbf on both ends (the host's
upload and download), MTU 9000 as cluster networks use (tbf counts every
packet's headers: 0.7% of a 9000-byte frame, 4.4% of a 1500-byte one).
Addresses come from 198.18.0.0/15 (RFC 2544, reserved for benchmarks), in a
/24 that none of this machine's addresses is in; the bridge has no address,
so traffic stays between the cluster's hosts. A host's namespaces end with its
last process: cleanup kills every process in each holder's network namespace,
then the holder, then deletes the links; a run whose owner died (SIGKILL) is
swept the same way by the next run, found by the holders' names.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cluster_procs import (  # noqa: E402
    COMMAND_TIMEOUT_S,
    HOLDER,
    PREFIX,
    Launch,
    RankResult,
    _holders,
    _netns_of,
    _processes_in_netns,
    _run,
    leftovers,
    sweep,
)

__all__ = ["Cluster", "Host", "Launch", "RankResult", "leftovers", "missing", "sweep"]

FIRST_ADDRESS = 10  # host i is <subnet>.(10 + i): torchrun's c10d sorts nodes by address, so host i is node rank i
MAX_HOSTS = 90  # two-digit last octets sort as numbers
MTU = 9000
TOOLS = ("ip", "tc", "unshare", "nsenter", "bash")


def missing() -> str:
    """What this machine lacks to run a cluster ("" when nothing)."""
    tools = [t for t in TOOLS if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]
    return "; ".join(([] if os.geteuid() == 0 else ["root (namespaces, veth links and tc need CAP_SYS_ADMIN)"])
                     + ([f"the commands {tools} (iproute2, util-linux, bash)"] if tools else []))


@dataclasses.dataclass
class Host:
    """One simulated host: its holder process, address and link."""

    index: int
    name: str
    address: str
    holder: int
    veth: str  # the bridge side of its link; its tx is the host's download, its rx the host's upload

    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside this host."""
        return ["nsenter", "-t", str(self.holder), "--net", "--uts", "--mount", f"--wd={os.getcwd()}", "--"]

    def run(self, argv: Sequence[str], what: str) -> str:
        return _run(self.enter() + list(argv), what)

    def shm_entries(self) -> list[str]:
        """The names in this host's /dev/shm (seen through its holder's root)."""
        return sorted(os.listdir(f"/proc/{self.holder}/root/dev/shm"))

    def link_bytes(self) -> tuple[int, int]:
        """Bytes (sent, received) by this host over its link since it was made."""
        stats = f"/sys/class/net/{self.veth}/statistics"
        with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:
            return int(rx.read()), int(tx.read())

    def set_link(self, up: bool) -> None:
        """Takes this host's link down (no packet passes either way) or up again."""
        _run(["ip", "link", "set", self.veth, "up" if up else "down"], f"setting host {self.index}'s link")

    def processes(self) -> list[int]:
        return _processes_in_netns(_netns_of(self.holder) or "?", exclude=self.holder)


class Cluster:
    """H simulated hosts; a context manager that always removes them."""

    def __init__(self, num_hosts: int, *, link_gbit: float = 1.0, shm_nbytes: int = 2 << 30) -> None:
        if num_hosts < 1 or num_hosts > MAX_HOSTS or link_gbit <= 0:
            raise ValueError(f"cluster: {num_hosts=} must be in 1..{MAX_HOSTS} and {link_gbit=} > 0")
        self.num_hosts, self.link_gbit, self.shm_nbytes = num_hosts, link_gbit, shm_nbytes
        self.owner = os.getpid()
        self.hosts: list[Host] = []
        self.workdir = ""
        self._previous_sigterm = None

    def __enter__(self) -> Cluster:
        if why := missing():
            raise RuntimeError(f"cluster: needs {why}")
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        sweep()
        self.workdir = tempfile.mkdtemp(prefix=f"{PREFIX}-{self.owner}-")
        tag = f"{PREFIX}{self.owner:x}"
        names = [f"{PREFIX}-{self.owner:x}-host{i}" for i in range(self.num_hosts)]
        subnet = _free_subnet()
        addresses = [f"{subnet}.{FIRST_ADDRESS + i}" for i in range(self.num_hosts)]
        hosts_file = os.path.join(self.workdir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(addresses, names)))
        bridge = f"{tag}b"
        _run(["ip", "link", "add", bridge, "type", "bridge"], "making the bridge")
        _disable_ipv6(bridge)
        _run(["ip", "link", "set", bridge, "mtu", str(MTU), "up"], "starting the bridge")
        for i, (name, address) in enumerate(zip(names, addresses)):
            holder = self._spawn_holder(i, name, hosts_file)
            host = Host(i, name, address, holder, f"{tag}v{i}")
            self.hosts.append(host)
            self._wire(host, bridge)

    def _spawn_holder(self, index: int, name: str, hosts_file: str) -> int:
        script = (f"set -e; hostname {name}; mount -t tmpfs -o size={self.shm_nbytes},mode=1777 tmpfs /dev/shm; "
                  f"mount --bind {hosts_file} /etc/hosts; echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                  f"echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; "
                  f"exec -a {HOLDER}-{self.owner}-{index} sleep infinity")
        proc = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "--propagation", "private", "--",
                                 "bash", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while (holder := next((h for h, o, i in _holders() if o == self.owner and i == index), None)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"cluster: host {index}'s namespaces did not start: {proc.stderr.read().decode()}")
            time.sleep(0.01)
        proc.stderr.close()
        return holder

    def _wire(self, host: Host, bridge: str) -> None:
        """veth pair from the host's namespace to the bridge, tbf on both ends."""
        peer = f"{PREFIX}{self.owner:x}p{host.index}"
        _run(["ip", "link", "add", host.veth, "mtu", str(MTU), "type", "veth", "peer", "name", peer, "mtu", str(MTU)],
             f"making host {host.index}'s link")
        _run(["ip", "link", "set", peer, "netns", str(host.holder)], f"moving host {host.index}'s link end")
        _disable_ipv6(host.veth)
        _run(["ip", "link", "set", host.veth, "master", bridge, "up"], f"bridging host {host.index}")
        shape = " ".join(self.tbf())
        host.run(["sh", "-ec", f"ip link set {peer} name eth0; ip addr add {host.address}/24 dev eth0; "
                  f"ip link set eth0 up; ip link set lo up; tc qdisc add dev eth0 root {shape}"], "wiring eth0")
        _run(["tc", "qdisc", "add", "dev", host.veth, "root", *self.tbf()], f"shaping host {host.index}'s download")

    def tbf(self) -> list[str]:
        """tbf at the link rate: a burst of 2 ms (at least 64 KiB), queueing up to 20 ms."""
        burst = max(64 << 10, int(self.link_gbit * 1e9 / 8 * 2e-3))
        return ["tbf", "rate", f"{self.link_gbit * 1000:g}mbit", "burst", str(burst), "latency", "20ms"]

    def close(self) -> None:
        """Removes every process, namespace, link and file of this cluster."""
        try:
            sweep(self.owner)
        finally:
            self.hosts = []
            if self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir = ""
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    def launch(self, argv: Sequence[str], *, nproc_per_host: int = 1, env: dict[str, str] | None = None,
               timeout_s: float = 300.0, **elastic) -> Launch:
        """Starts torchrun in every host: `python argv...` on each of its ranks;
        `elastic`: nnodes ("MIN:MAX"), max_restarts, rdzv_conf (torchrun's)."""
        return Launch(self, list(argv), nproc_per_host=nproc_per_host, env=env or {}, timeout_s=timeout_s, **elastic)

    def lose_host(self, index: int) -> None:
        """Host `index` is lost: every process in it is killed (SIGKILL: its
        torchrun agent, its ranks) and its /dev/shm emptied. Its namespaces and
        link stay, empty, for close() to remove."""
        host = self.hosts[index]
        for pid in host.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shm = f"/proc/{host.holder}/root/dev/shm"
        for name in os.listdir(shm):
            path = os.path.join(shm, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

    def run(self, argv: Sequence[str], **kwargs) -> list[RankResult]:
        """launch(...) and wait: every rank's exit status and output."""
        with self.launch(argv, **kwargs) as launched:
            return launched.wait()


def _free_subnet() -> str:
    """A /24 of 198.18.0.0/15 (reserved for benchmarks) holding none of this machine's addresses."""
    used = _run(["ip", "-o", "-4", "addr", "show"], "listing this machine's addresses")
    return next(f"198.{b}.{c}" for b in (18, 19) for c in range(256) if f" 198.{b}.{c}." not in used)


def _disable_ipv6(link: str) -> None:
    """No IPv6 chatter (router solicitations, MLD) on the counted links."""
    path = f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6"
    if os.path.exists(path):
        with open(path, "w") as f:
            f.write("1")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through Cluster.__exit__


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--nproc-per-host", type=int, default=1)
    p.add_argument("--link-gbit", type=float, default=1.0, help="each host link's rate, both directions")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the whole run may take")
    p.add_argument("--cleanup", action="store_true", help="only remove what killed runs left behind")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py args (or -m module args)")
    args = p.parse_args(argv)
    args.script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not args.cleanup and not args.script:
        p.error("give the script to run: -- script.py args")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if why := missing():
        print(f"cluster: cannot run here: needs {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        print("\n".join(sweep()) or "cluster: nothing to remove")
        return 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the shell that started us ignores it
    with Cluster(args.hosts, link_gbit=args.link_gbit) as cluster:
        with cluster.launch(args.script, nproc_per_host=args.nproc_per_host, timeout_s=args.timeout) as launched:
            results = launched.wait(echo=0)
    for result in results[1:]:
        print(f"===== rank {result.rank} on host {result.host}: exit {result.returncode}\n{result.output}")
    print(f"===== exit status of ranks 0..{len(results) - 1}: {[r.returncode for r in results]}")
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
