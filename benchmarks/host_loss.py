"""Ranks and a host lost mid-run, on the simulated cluster (benchmarks/cluster.py):
2 hosts x 2 ranks under torchrun --nnodes 1:2 --max-restarts (c10d
rendezvous on host 0) train a small GPT-2 (transformers' GPT2LMHeadModel,
--layers, --width, no dropout) with zero and in-memory snapshots after every
optimizer step (config checkpoint.in_memory). First --rank-kills single ranks are
SIGKILLed at random steps (seeded), right after a step (its snapshot still
in flight: that step is lost) or once the step's snapshot is complete; each
time torchrun restarts every rank and they resume with engine.resume(). Then,
after step --lose-after, once every rank's snapshot of it is complete, host 1
is lost: its processes (torchrun agent and ranks) are SIGKILLed and its
/dev/shm emptied. Host 0's ranks meet the dead peers in their next collective
and exit; host 0's torchrun restarts them, the rendezvous closes with host 0
alone, and the two ranks resume from their own pieces and host 1's pieces
from the buddy copies host 0 holds, resharded from 4 ranks to 2, and finish.
The result is compared with the same schedule without a failure: 4 ranks to
that step, a disk checkpoint, 2 ranks on a host of their own that load it and
go on, on the same global batches (the batch of step s is seeded by s and
split over the ranks, so its size does not change with the world). Every
fp32 master and Adam moment must be equal, bit for bit: a lost step is
recomputed from the same state and batch, and the snapshots reshard as the
disk checkpoint does. (Against a run that stays on 4 ranks the differences
are those of the world size's reduction order, ~1e-5 relative here, as two
uninterrupted runs on 2 and on 4 ranks differ.)

    python benchmarks/host_loss.py                     # stage 3, 200 steps, 3 rank kills, host 1 lost after 150
    python benchmarks/host_loss.py --stage 2 --rank-kills 0 --steps 24 --lose-after 8

Prints each failure with the resume that followed (world size, source, steps
lost, the pieces each saved rank came from, seconds from the death to the
resume) and whether the states are equal; exits 1 when a resume was not from
memory with at most 1 step lost, or a state differs. Needs root (the
cluster) and transformers (in the test extra: pip install -e ".[test]").
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

GLOBAL_BATCH, SEQ, VOCAB = 8, 32, 512  # a small GPT-2 (transformers), no dropout
# c10d rendezvous: a node whose agent stopped its keep-alives leaves after 2 x 1 s (default 3 x 5 s), and a
# round closes 2 s after its last join once at least --nnodes MIN are in
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
KINDS = ("master", "exp_avg", "exp_avg_sq")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lose-after", type=int, default=150, help="host 1 is lost after this optimizer step")
    p.add_argument("--rank-kills", type=int, default=3, help="single ranks SIGKILLed at random steps before")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=128, help="the GPT-2's hidden size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for each torchrun launch")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--lose", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def log_event(folder: str, event: dict) -> None:
    with open(os.path.join(folder, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


def worker(args: argparse.Namespace) -> None:
    """One rank of one torchrun attempt."""
    import torch
    import torch.distributed as dist

    import ringcomm  # noqa: F401  (registers the backend)
    import zero
    from transformers import GPT2Config, GPT2LMHeadModel

    folder, attempt = args.worker, int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(folder, "plan.json")) as f:
        plan = json.load(f) if args.lose else []
    dist.init_process_group("ringcomm", timeout=datetime.timedelta(seconds=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world_size
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": args.stage}, "checkpoint": {"in_memory": {"enabled": True}}}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                       n_positions=SEQ, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    engine, *_ = zero.initialize(model=model, config=config)
    engine.resume(os.path.join(folder, "ckpt"))  # nothing on the first attempt
    log_event(folder, {"attempt": attempt, "rank": rank, "world_size": world_size, "resumed": time.time(),
                       "resumed_from": engine.global_steps, "source": engine.resumed.source,
                       "lost": engine.resumed.lost, "pieces": {str(k): v for k, v in engine.resumed.pieces.items()}})
    step = engine.global_steps
    while step < args.steps:
        batch = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        ids = batch[rank * micro:(rank + 1) * micro]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        step += 1
        kill = next((k for i, k in enumerate(plan) if not os.path.exists(os.path.join(folder, f"killed{i}"))), None)
        if kill is not None and (kill["rank"], kill["step"]) == (rank, step):
            if kill["when"] == "after_snapshot":
                engine.parts.snapshots.wait()
            log_event(folder, {"attempt": attempt, "rank": rank, "died": time.time(), "step": step})
            open(os.path.join(folder, f"killed{plan.index(kill)}"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # "in_step": this step's snapshot still in flight
        if args.lose and kill is None and step == args.lose_after:
            engine.parts.snapshots.wait()  # this step's snapshot complete here, and its copy sent
            open(os.path.join(folder, f"ready{rank}"), "w").close()
            while not os.path.exists(os.path.join(folder, "lost")):  # host 1 is lost meanwhile
                time.sleep(0.01)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), tag="final")
    engine.parts.snapshots.remove()
    dist.destroy_process_group()


def consolidated(folder: str) -> dict:
    """Every parameter's fp32 master and Adam moments, whole, from the final
    checkpoint (whatever the world size that wrote it), read as a resume reads
    it (zero.checkpoint.format.SavedShards: manifest and checksums checked)."""
    from zero.checkpoint.format import SavedShards, read_engine_state, read_manifest

    directory = os.path.join(folder, "ckpt", "final")
    manifest = read_manifest(directory)
    saved = SavedShards(directory, read_engine_state(directory, manifest)["world_size"], manifest)
    try:
        sizes = {name: max(s.offset + s.numel for _, s in shards) for name, shards in saved.by_name.items()}
        return {(name, kind): saved.state(name, 0, numel, kind) for name, numel in sizes.items() for kind in KINDS}
    finally:
        saved.close()


def run(cluster, args: argparse.Namespace, folder: str, lose: bool) -> list[dict]:
    """One torchrun launch over the cluster; with `lose`, host 1 is lost after
    --lose-after. Returns the events the ranks logged (and the loss's time)."""
    argv = [os.path.abspath(__file__), "--worker", folder, "--stage", str(args.stage), "--steps", str(args.steps),
            "--lose-after", str(args.lose_after), "--width", str(args.width), "--layers", str(args.layers)]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # README, "Reliability": restarts across hosts
    rng = random.Random(args.seed)
    steps = sorted(rng.sample(range(2, args.lose_after - 1, 3), args.rank_kills)) if lose else []
    with open(os.path.join(folder, "plan.json"), "w") as f:
        json.dump([{"step": st, "rank": rng.randrange(4), "when": rng.choice(("after_snapshot", "in_step"))}
                   for st in steps], f)
    events = []
    with cluster.launch(argv + (["--lose"] if lose else []), nproc_per_host=2, env=env, timeout_s=args.timeout,
                        nnodes="1:2", max_restarts=2 * args.rank_kills + 2, rdzv_conf=RDZV_CONF) as launched:
        if not lose:
            failed = [r for r in launched.wait() if r.returncode != 0]
            if failed:
                raise SystemExit(f"host_loss: the uninterrupted run's ranks failed: {failed}")
        else:
            while not all(os.path.exists(os.path.join(folder, f"ready{r}")) for r in range(4)):
                if time.monotonic() > launched.deadline:
                    raise SystemExit(f"host_loss: the ranks never reached step {args.lose_after} ({launched.out})")
                time.sleep(0.01)
            cluster.lose_host(1)
            events.append({"lost_at": time.time()})
            open(os.path.join(folder, "lost"), "w").close()
            agent = launched.agents[0]  # the ranks' own files are rewritten by each attempt: wait for torchrun
            code = agent.wait(timeout=max(launched.deadline - time.monotonic(), 1))
            if code != 0:
                with open(os.path.join(launched.out, "agent0.log")) as f:
                    raise SystemExit(f"host_loss: host 0's torchrun exited with {code}:\n{f.read()[-3000:]}")
    with open(os.path.join(folder, "events.jsonl")) as f:
        return events + [json.loads(line) for line in f]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    from cluster import Cluster

    with tempfile.TemporaryDirectory(prefix="host-loss-") as root:
        lost, reference = os.path.join(root, "lost"), os.path.join(root, "reference")
        os.makedirs(lost)
        os.makedirs(reference)
        with Cluster(2) as cluster:
            events = run(cluster, args, lost, lose=True)
            # the reference takes the same schedule without a failure: 4 ranks to the loss's step, a disk
            # checkpoint, then 2 ranks on a host of their own load it (resharded) and go on
            run(cluster, argparse.Namespace(**{**vars(args), "steps": args.lose_after}), reference, lose=False)
        with Cluster(1) as one:
            run(one, args, reference, lose=False)
        ours, theirs = consolidated(lost), consolidated(reference)
    deaths = sorted([(e["died"], f"rank {e['rank']} SIGKILLed after step {e['step']}") for e in events if "died" in e]
                    + [(e["lost_at"], f"host 1 lost after step {args.lose_after}") for e in events if "lost_at" in e])
    print(f"zero stage {args.stage}, 2 hosts x 2 ranks, {args.steps} steps, a snapshot after every step")
    resumes = [e for e in events if "resumed" in e and e["resumed"] > deaths[0][0]]
    for when, what in deaths:
        after = [e for e in resumes if e["resumed"] > when and all(not when < t < e["resumed"] for t, _ in deaths)]
        print(f"  {what}: " + "; ".join(sorted({f"{len(after)} ranks resumed from step {e['resumed_from']} (world "
                                                f"{e['world_size']}, {e['source']}, {e['lost']} lost)" for e in after}))
              + (f", {max(e['resumed'] for e in after) - when:.1f} s after" if after else ""))
        first = min(after, key=lambda e: e["rank"], default=None)
        if first is not None:  # the saved ranks' pieces, as rank 0 found them
            print("    pieces: " + ", ".join(f"rank {r} {how}" for r, how in sorted(first["pieces"].items())))
    if any(e["source"] != "memory" or e["lost"] > 1 for e in resumes) or resumes[-1]["world_size"] != 2:
        print("a resume did not come from memory with at most 1 step lost, or the run did not end on 2 ranks")
        return 1
    if set(ours) != set(theirs):
        print(f"the runs' tensors differ: {sorted(set(ours) ^ set(theirs))[:5]}")
        return 1
    differ = [f"{name} {kind}" for (name, kind) in sorted(ours) if not torch.equal(ours[name, kind], theirs[name, kind])]
    print(f"{len(ours)} tensors (fp32 masters, Adam's moments) against the same schedule without a failure "
          f"(4 ranks, a disk checkpoint at step {args.lose_after}, 2 ranks): "
          + (f"{len(differ)} differ: {differ[:4]}" if differ else "all equal, bit for bit"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
