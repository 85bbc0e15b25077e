"""Kill-and-restart soak under torchrun on one host: a zero run (2 ranks on the
"ringcomm" backend, a checkpoint on disk after every optimizer step) loses one
rank to SIGKILL in each of N attempts, at a random step after its resume and on
either side of that step's save; torchrun (--max-restarts N) restarts the
workers and each attempt resumes from the newest checkpoint. Then the same run
without kills: the final checkpoints must be equal, tensor for tensor.

    python benchmarks/restarts.py                   # 20 cycles, static rendezvous
    python benchmarks/restarts.py --cycles 5 --rdzv standalone --stage 3

Prints one row per restart: the victim, the step it died at, the step resumed
from and the steps lost, and the time from the death to the first resumed
step with its parts: detection (death to the first survivor's error naming
it; "-" where torchrun stopped the survivors first), restart (death to the
new workers' start: torchrun noticing, stopping, spawning), start-up (imports),
join (init_process_group), build (zero.initialize), restore (load_checkpoint:
validate, agree, apply) and the first step. Writes bench-results/restarts.json;
exits 1 if an attempt did not join, lost more than one step, or the final
state differs from the uninterrupted run's.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from machine import cpu_line, write_json  # noqa: E402

RDZV = ("static", "standalone", "c10d-own-store")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=20, help="kills, each followed by a restart (default 20)")
    p.add_argument("--rdzv", choices=RDZV, default="static",
                   help="torchrun's rendezvous: --master-addr/--master-port (static), --standalone (c10d, store "
                        "shared with the workers), or c10d with a store per attempt "
                        "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--memory", action="store_true",
                   help="in-memory snapshots every step (config checkpoint.in_memory) and a disk checkpoint every "
                        "--disk-every steps; each attempt resumes with engine.resume() from the newer")
    p.add_argument("--disk-every", type=int, default=4, help="with --memory: steps between disk checkpoints")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("bench-results", "restarts.json"))
    p.add_argument("--worker", nargs=2, metavar=("PLAN", "DIR"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the worker (one torchrun attempt's rank) ----

def process_start() -> float:
    """When this process started (epoch seconds, 10 ms resolution): /proc counts
    its start time, and the uptime, from boot."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def log_event(folder: str, event: dict) -> None:
    with open(os.path.join(folder, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


def worker(args: argparse.Namespace) -> None:
    started = process_start()
    import datetime

    import torch
    import torch.distributed as dist

    import ringcomm  # noqa: F401  (registers the backend)
    import zero
    from models import mlp
    imported = time.time()
    plan_path, folder = args.worker
    with open(plan_path) as f:
        plan = json.load(f)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("ringcomm", timeout=datetime.timedelta(seconds=20))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    joined = time.time()
    config = {"train_batch_size": 4 * world_size, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": plan["stage"]}}
    memory = plan.get("snapshots")
    if memory:
        config["checkpoint"] = {"in_memory": {"enabled": True, "path": memory}}
    engine, *_ = zero.initialize(model=mlp(plan["layers"], plan["width"]), config=config)
    built = time.time()
    ckpt = os.path.join(folder, "ckpt")
    engine.resume(ckpt)  # the newest of the snapshots and the disk checkpoint; nothing on the first attempt
    restored = time.time()
    resumed_from = engine.global_steps
    event = {"attempt": attempt, "rank": rank, "started": started, "imported": imported, "joined": joined,
             "built": built, "restored": restored, "resumed_from": resumed_from, "source": engine.resumed.source,
             "restore_parts": engine.resumed.seconds, "lost": engine.resumed.lost}
    kill = plan["kills"][attempt] if attempt < len(plan["kills"]) else None
    step = resumed_from
    try:
        while step < plan["steps"]:
            data = torch.Generator().manual_seed(step * world_size + rank)  # the same batches in every run
            x = torch.randn(4, plan["width"], generator=data)
            engine.backward((engine(x) - x).square().mean())
            engine.step()
            step += 1
            if step == resumed_from + 1:
                event["first_step"] = time.time()
                log_event(folder, event)
            dies = kill is not None and rank == kill["rank"] and step == resumed_from + kill["after"]
            if dies and kill["when"] in ("before_save", "snapshot_in_flight"):
                die(folder, attempt, rank, step)
            if memory and dies:  # "after_snapshot": this step's snapshot complete on this rank
                engine.parts.snapshots.wait()
            if step % plan["disk_every"] == 0 or step == plan["steps"]:
                engine.save_checkpoint(ckpt, tag=f"step{step}")
                if rank == 0 and step % plan["disk_every"] == 0:  # the newest two stay
                    shutil.rmtree(os.path.join(ckpt, f"step{step - 2 * plan['disk_every']}"), ignore_errors=True)
            if dies:
                die(folder, attempt, rank, step)
    except RuntimeError as err:  # a survivor: its collective names the dead rank
        log_event(folder, {"attempt": attempt, "rank": rank, "detected": time.time(), "error": str(err)[:300]})
        raise
    dist.destroy_process_group()


def die(folder: str, attempt: int, rank: int, step: int) -> None:
    log_event(folder, {"attempt": attempt, "rank": rank, "died": time.time(), "step": step})
    os.kill(os.getpid(), signal.SIGKILL)


# ---- the parent: plans the kills, runs torchrun twice, reports ----

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: argparse.Namespace, plan: dict, folder: str) -> tuple[int, str, list[dict]]:
    """One torchrun with len(plan["kills"]) restarts; its exit code, its stderr
    tail and the events its workers logged."""
    plan_path = os.path.join(folder, "plan.json")
    write_json(plan_path, plan)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, HERE]), "OMP_NUM_THREADS": "1"}
    if args.rdzv == "static":
        launch = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    elif args.rdzv == "standalone":
        launch = ["--standalone"]
    else:
        launch = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
           str(len(plan["kills"])), "--monitor-interval", "0.1", *launch, os.path.abspath(__file__),
           "--worker", plan_path, folder]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120 + 30 * len(plan["kills"]))
        code, tail = proc.returncode, proc.stderr[-3000:]
    except subprocess.TimeoutExpired as err:
        code, tail = -1, f"torchrun timed out after {err.timeout} s"
    events = []
    if os.path.exists(os.path.join(folder, "events.jsonl")):
        with open(os.path.join(folder, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
    return code, tail, events


def final_state(folder: str, steps: int) -> dict:
    """Every tensor of the final checkpoint's files, by file and key path: the
    ranks' shard files (fp32 masters, Adam's moments and steps) and the .pt
    files (model states, engine state)."""
    import torch

    from zero.checkpoint.tensorfile import SafetensorsReader

    tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "ckpt", f"step{steps}", "*.safetensors"))):
        with SafetensorsReader(path) as reader:
            for name, spec in reader.specs.items():
                tensors[f"{os.path.basename(path)}/{name}"] = reader.read(name, torch.empty(spec.shape,
                                                                                             dtype=spec.dtype))

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            tensors[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)
    for path in sorted(glob.glob(os.path.join(folder, "ckpt", f"step{steps}", "*.pt"))):
        walk(os.path.basename(path), torch.load(path, map_location="cpu", weights_only=False))
    return tensors


def differences(ours: dict, reference: dict) -> list[str]:
    import torch

    if ours.keys() != reference.keys():
        return [f"tensors differ: {sorted(ours.keys() ^ reference.keys())[:5]}"]
    return [key for key in ours if not torch.equal(ours[key], reference[key])]


def cycles_table(kills: list[dict], events: list[dict]) -> list[dict]:
    """One row per restart: the kill, the resume and the parts of the time between."""
    rows = []
    for attempt, kill in enumerate(kills):
        died = next((e for e in events if e["attempt"] == attempt and "died" in e), None)
        resumed = [e for e in events if e["attempt"] == attempt + 1 and "first_step" in e]
        detected = [e["detected"] for e in events if e["attempt"] == attempt and "detected" in e]
        row = {"cycle": attempt + 1, "victim": kill["rank"], "when": kill["when"], "joined": len(resumed) == 2}
        if died is None or len(resumed) != 2:
            rows.append(row)
            continue
        first = max(e["first_step"] for e in resumed)
        last = {part: max(e[part] for e in resumed) for part in ("started", "imported", "joined", "built",
                                                                   "restored")}
        row.update(died_at=died["step"], resumed_from=resumed[0]["resumed_from"], source=resumed[0]["source"],
                   reported_lost=resumed[0]["lost"],
                   lost=died["step"] - resumed[0]["resumed_from"],
                   detection=min(detected) - died["died"] if detected else None,
                   restart=min(e["started"] for e in resumed) - died["died"],
                   startup=last["imported"] - min(e["started"] for e in resumed),
                   join=last["joined"] - last["imported"], build=last["built"] - last["joined"],
                   restore=last["restored"] - last["built"], first_step=first - last["restored"],
                   total=first - died["died"])
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    parts = ("detection", "restart", "startup", "join", "build", "restore", "first_step", "total")
    print(f"{'cycle':>5} {'victim':>6} {'kill':<18} {'source':<6} {'died':>4} {'from':>4} {'lost':>4} "
          + " ".join(f"{p:>10}" for p in parts) + "   (ms)")
    for row in rows:
        if "total" not in row:
            print(f"{row['cycle']:>5} {row['victim']:>6} {row['when']:<18} DID NOT RESUME")
            continue
        times = " ".join(f"{'-':>10}" if row[p] is None else f"{row[p] * 1e3:>10.0f}" for p in parts)
        print(f"{row['cycle']:>5} {row['victim']:>6} {row['when']:<18} {row['source']:<6} {row['died_at']:>4} "
              f"{row['resumed_from']:>4} "
              f"{row['lost']:>4} {times}")


@contextlib.contextmanager
def snapshot_folder(memory: bool) -> Iterator[str | None]:
    """A fresh folder in /dev/shm for a run's in-memory snapshots (None without --memory), removed after."""
    if not memory:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="zero-restarts-", dir="/dev/shm")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rng = random.Random(args.seed)
    whens = ["snapshot_in_flight", "after_snapshot"] if args.memory else ["before_save", "after_save"]
    kills = [{"rank": rng.randrange(2), "after": rng.randint(1, 3), "when": rng.choice(whens)}
             for _ in range(args.cycles)]
    plan = {"stage": args.stage, "width": args.width, "layers": args.layers, "steps": 3 * args.cycles + 3,
            "disk_every": args.disk_every if args.memory else 1}
    with open("/proc/loadavg") as f:
        print(f"{cpu_line()}; load before: {f.read().split()[0]}")
    print(f"zero stage {args.stage}, 2 ranks, {plan['steps']} steps, {args.cycles} kills, torchrun rdzv {args.rdzv}")
    with tempfile.TemporaryDirectory(prefix="ringcomm-restarts-") as tmp:
        soaked, reference = os.path.join(tmp, "soak"), os.path.join(tmp, "reference")
        os.makedirs(soaked)
        os.makedirs(reference)
        start = time.perf_counter()
        with snapshot_folder(args.memory) as memory:
            code, tail, events = run(args, {**plan, "kills": kills, "snapshots": memory}, soaked)
        seconds = time.perf_counter() - start
        rows = cycles_table(kills, events)
        print_rows(rows)
        with snapshot_folder(args.memory) as memory:
            ref_code, ref_tail, _ = run(args, {**plan, "kills": [], "snapshots": memory}, reference)
        ours, theirs = (final_state(folder, plan["steps"]) for folder in (soaked, reference))
        diff = differences(ours, theirs) if code == 0 and ref_code == 0 and ours else ["a run failed"]
    joined = sum(row["joined"] for row in rows)
    lost = [row.get("lost") for row in rows]
    ok = code == 0 and joined == args.cycles and all(x is not None and x <= 1 for x in lost) and not diff
    print(f"torchrun exited {code} after {seconds:.0f} s; {joined} of {args.cycles} restarts joined and resumed; "
          f"steps lost per failure: {lost}; final state vs the uninterrupted run: "
          f"{f'equal ({len(ours)} tensors)' if not diff else f'DIFFERS in {diff[:5]}'}")
    if code != 0:
        print(tail)
    if ref_code != 0:
        print(f"the uninterrupted run failed:\n{ref_tail}")
    write_json(args.out, {"args": vars(args), "cpu": cpu_line(), "exit_code": code, "seconds": seconds,
                          "rows": rows, "final_state_differs": diff, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
