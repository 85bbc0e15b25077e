"""In-memory snapshots (zero/checkpoint/snapshot.py, snapshot_restore.py): a
run that stops after step 5 (its processes gone, its /dev/shm kept) resumes
in new processes from its snapshot and ends bit for bit where an
uninterrupted run ends (fp32 masters, Adam's moments and steps, the buffers;
dropout draws from the restored RNG states). Damaged snapshots are refused by
checksum: the buddy's copy, the step before, or the disk checkpoint is used.
A world of one rank resumes a two-rank snapshot (resharded). Rank kills under
torchrun: test_restarts.py runs benchmarks/restarts.py --memory."""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest
import torch
from torch import nn

from harness import run_ranks

from zero.checkpoint.snapshot_piece import expired
from zero.checkpoint.snapshot_config import SnapshotOptions, parse
from zero.checkpoint.snapshot_wire import Placement
from zero.estimate.memory_model import snapshot_nbytes as snapshot_nbytes_estimate

WIDTH, STOPPED, STEPS, DISK_STEP = 16, 5, 8, 3


def new_engine(root: str, stage: int = 2, amsgrad: bool = False, interval: int = 1):
    import zero

    if root.endswith("{host}"):  # one simulated host per rank: its own name and its own snapshot folder
        import socket

        import torch.distributed as dist
        host = f"host{dist.get_rank()}"
        socket.gethostname = lambda: host
        root = root.format(host=host)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.3), nn.Linear(WIDTH, WIDTH))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "amsgrad": amsgrad}},
              "zero_optimization": {"stage": stage},
              "checkpoint": {"in_memory": {"enabled": True, "path": root, "interval": interval}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=config)
    return engine


def train(engine, rank: int, world_size: int, until: int, ckpt: str | None = None) -> None:
    while engine.global_steps < until:
        step = engine.global_steps
        x = torch.randn(4 * world_size, WIDTH, generator=torch.Generator().manual_seed(step))[4 * rank:4 * rank + 4]
        engine.backward((engine(x) - x).square().mean())
        engine.step()
        if ckpt is not None and engine.global_steps == DISK_STEP:
            engine.save_checkpoint(ckpt)


def state_of(engine) -> dict:
    """This rank's states, as lists: masters and Adam's moments by shard, buffers, a draw of the RNG."""
    out = {}
    for key, shard in engine.parts.group.state_dict().items():
        for kind, tensor in shard.tensors.items():
            out[f"{key}:{kind}"] = tensor.tolist()
    for name, buf in engine.module.named_buffers():
        out[name] = buf.tolist()
    return out


def copied_in_the_step() -> list[list[str]]:
    """Records, per snapshot, the kinds of tensor take() copied into the slot
    (the rest the fused optimizer step wrote)."""
    from zero.checkpoint.tensorfile import MappedSafetensors

    copied, original = [], MappedSafetensors.copy

    def copy(self, fill, skip=()):
        copied.append(sorted({spec.name.rsplit(":", 1)[1] for spec in self.specs if spec.name not in skip}))
        return original(self, fill, skip)
    MappedSafetensors.copy = copy
    return copied


def run_worker(rank: int, world_size: int, root: str, ckpt: str, until: int, resume: bool,
               amsgrad: bool = False, stage: int = 2) -> dict:
    engine = new_engine(root, stage, amsgrad)
    copied = copied_in_the_step()
    resumed = None
    if resume:
        engine.resume(ckpt)
        resumed = (engine.resumed.source, engine.resumed.step, engine.resumed.lost, engine.resumed.pieces)
    train(engine, rank, world_size, until, ckpt)
    engine.parts.snapshots.wait()
    return {"state": state_of(engine), "rng": torch.rand(3).tolist(), "resumed": resumed, "copied": copied}


def resume_worker(rank: int, world_size: int, roots: dict[str, str], ckpt: str, amsgrad: bool = False,
                  stage: int = 2) -> dict:
    """Resumes each damaged copy of the stopped run's snapshots (a fresh engine each)."""
    out = {}
    for case, root in roots.items():
        engine = new_engine(root, stage, amsgrad)
        engine.resume(ckpt)
        r = engine.resumed
        out[case] = (r.source, r.step, r.lost, r.pieces, [p.tolist() for p in engine.full_params_fp32()])
        engine.destroy()
    return out


def flip_byte(path: str, offset: int = -5) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def piece(root: str, step: int, rank: int, holder: int, name: str = "zero_shards_rank{r}_of2.safetensors") -> str:
    return os.path.join(root, f"step{step}", f"rank{rank}_of2.by{holder}", name.format(r=rank))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("amsgrad,stage", [(False, 2), (True, 2), (False, 3)],
                         ids=["written-by-the-step", "copied-after-it", "stage-3"])
def test_resume_from_memory_matches_an_uninterrupted_run(amsgrad, stage) -> None:
    """With AdamW the fused step writes the masters and moments into both of
    a rank's pieces; with amsgrad (torch's step) take() copies them."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as disk:
        stopped, ckpt = os.path.join(shm, "stopped"), os.path.join(disk, "ckpt")
        first = run_ranks(run_worker, 2, stopped, ckpt, STOPPED, False, amsgrad, stage)
        assert sorted(os.listdir(stopped)) == ["progress", f"step{STOPPED - 1}", f"step{STOPPED}"]  # two kept
        # the own pieces moved on to step 5 (the moments live in them); the buddies' copies keep both steps
        assert sorted(os.listdir(os.path.join(stopped, f"step{STOPPED - 1}"))) == ["rank0_of2.by1", "rank1_of2.by0"]
        assert sorted(os.listdir(os.path.join(stopped, f"step{STOPPED}"))) == [
            "rank0_of2.by0", "rank0_of2.by1", "rank1_of2.by0", "rank1_of2.by1"]
        roots = {}
        for case in ("buddy", "truncated", "disk", "reshard"):
            roots[case] = os.path.join(shm, case)
            shutil.copytree(stopped, roots[case])
        flip_byte(piece(roots["buddy"], STOPPED, 1, 1))  # rank 1's own piece: its data
        os.truncate(piece(roots["truncated"], STOPPED, 1, 1), 100)  # both of rank 1's copies of step 5
        flip_byte(piece(roots["truncated"], STOPPED, 1, 0, "engine_state.pt"), -40)
        for step, holder in ((STOPPED - 1, 1), (STOPPED, 0), (STOPPED, 1)):  # every copy of rank 0's piece
            flip_byte(piece(roots["disk"], step, 0, holder), -1)

        resumed = run_ranks(run_worker, 2, stopped, ckpt, STEPS, True, amsgrad, stage)
        reference = run_ranks(run_worker, 2, os.path.join(shm, "reference"), os.path.join(disk, "ref"), STEPS, False,
                              amsgrad, stage)
        one = run_ranks(resume_worker, 1, {"reshard": roots.pop("reshard"), "fresh": os.path.join(shm, "fresh")},
                        ckpt, amsgrad, stage)
        cases = run_ranks(resume_worker, 2, roots, ckpt, amsgrad, stage)
        assert os.listdir(os.path.join(shm, "buddy")) == ["progress"], "destroy() removes the snapshots"

    moments = ["exp_avg", "exp_avg_sq", "master", "step"] + ["max_exp_avg_sq"] * amsgrad
    for rank in range(2):
        assert first[rank]["copied"][0] == sorted(moments), "the first snapshot: before the moments, all copied"
        assert all(kinds == (sorted(moments) if amsgrad else ["step"]) for kinds in first[rank]["copied"][1:]), \
            f"rank {rank}: copied in the step: {first[rank]['copied']}"
        assert resumed[rank]["resumed"] == ("memory", STOPPED, 0, {0: "own", 1: "own"})
        ours, theirs = resumed[rank]["state"], reference[rank]["state"]
        assert ours.keys() == theirs.keys() and len(ours) > 6
        different = [key for key in ours if ours[key] != theirs[key]]
        assert not different, f"rank {rank}: {different[:4]} differ from the uninterrupted run's"
        assert resumed[rank]["rng"] == reference[rank]["rng"]
        assert cases[rank]["buddy"][:4] == ("memory", STOPPED, 0, {0: "own", 1: "copy by rank 0"})
        assert cases[rank]["truncated"][:3] == ("memory", STOPPED - 1, 1)
        assert cases[rank]["disk"][:3] == ("disk", DISK_STEP, STOPPED - DISK_STEP)
    assert one[0]["reshard"][:4] == ("memory", STOPPED, 0, {0: "own", 1: "own"})  # 2 ranks' pieces, 1 rank
    assert one[0]["reshard"][4] == cases[0]["buddy"][4]  # the same step-5 masters, resharded
    assert one[0]["fresh"][:3] == ("disk", DISK_STEP, None)  # no snapshot there: the disk checkpoint


@pytest.mark.timeout(240)
def test_a_host_replaced_or_lost_resumes_from_its_buddys_copy() -> None:
    """Each rank plays a host (its own hostname and snapshot folder), so the
    buddy copies travel as bytes over the snapshots' gloo group. Host 1's
    folder then goes (its /dev/shm lost with it): two new ranks resume from
    host 0's copy of rank 1's piece, fetched over the wire, and end bit for
    bit where an uninterrupted run ends; one rank alone (the host is gone)
    resumes both pieces, resharded."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as disk:
        hosts = os.path.join(shm, "run", "{host}")
        run_ranks(run_worker, 2, hosts, os.path.join(disk, "ckpt"), STOPPED, False)
        for step in (STOPPED - 1, STOPPED):  # its own piece and host 1's, copied; across hosts both kept twice
            assert sorted(os.listdir(os.path.join(shm, "run", "host0", f"step{step}"))) == [
                "rank0_of2.by0", "rank1_of2.by0"]
        shutil.copytree(os.path.join(shm, "run", "host0"), os.path.join(shm, "alone", "host0"))
        shutil.rmtree(os.path.join(shm, "run", "host1"))
        resumed = run_ranks(run_worker, 2, hosts, os.path.join(disk, "none"), STEPS, True)
        reference = run_ranks(run_worker, 2, os.path.join(shm, "ref", "{host}"), os.path.join(disk, "ref"), STEPS,
                              False)
        alone = run_ranks(resume_worker, 1, {"lost": os.path.join(shm, "alone", "{host}")}, os.path.join(disk, "x"))
    fetched = "fetched from rank 0 (held by rank 0)"
    for rank in range(2):
        assert resumed[rank]["resumed"][:2] == ("memory", STOPPED)
        assert resumed[rank]["resumed"][3][1] == ("copy by rank 0" if rank == 0 else fetched)
        assert resumed[rank]["state"] == reference[rank]["state"]
        assert resumed[rank]["rng"] == reference[rank]["rng"]
    assert alone[0]["lost"][:4] == ("memory", STOPPED, 0, {0: "own", 1: "copy by rank 0"})


def mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process, by the kernel's account (renames followed); None: none."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            if begin <= address < end:
                return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/dev/shm") else None
    return None


def interval_worker(rank: int, world_size: int, root: str, until: int, resume: bool) -> dict:
    """Snapshots every 2 steps; records after each step which of the optimizer's
    moments live in which file, and which pieces are complete."""
    engine = new_engine(root, interval=2)
    if resume:
        engine.resume(None)
    out = {"resumed": (engine.resumed.source, engine.resumed.step, engine.resumed.lost, engine.resumed.pieces)
           if resume else None, "homes": [], "complete": []}
    while engine.global_steps < until:
        train(engine, rank, world_size, engine.global_steps + 1)
        engine.parts.snapshots.wait()
        homes = {mapped_file(t.data_ptr()) for s in engine.optimizer.state.values()
                 for kind, t in s.items() if kind.startswith("exp_avg")}
        out["homes"].append(sorted(os.path.relpath(h, root) if h else "memory" for h in homes))
        out["complete"].append(sorted(os.path.relpath(path, root) for path, _, names in os.walk(root)
                                      if "piece.json" in names))
    report = engine.memory_report()
    torch.distributed.barrier()  # every rank's snapshot complete
    on_disk = sum(os.path.getsize(os.path.join(path, n)) for path, _, names in os.walk(root) if "progress" not in path
                  for n in names)
    out["nbytes"] = (report.snapshot_nbytes, report.optimizer_nbytes, on_disk)
    out["state"] = state_of(engine)
    return out


@pytest.mark.timeout(240)
def test_the_moments_live_in_the_own_piece_and_between_snapshots_its_buddys_copy_counts() -> None:
    """With a buddy's copy, the optimizer's moments are views of the own
    piece's file from the second snapshot on (the fused step updates them in
    place). A step that is not snapshotted makes the own piece partial again:
    a resume then takes the buddy's copy of the last snapshot, loses the one
    step and ends where an uninterrupted run ends."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        root = os.path.join(shm, "run")
        first = run_ranks(interval_worker, 2, root, 5, False)
        resumed = run_ranks(interval_worker, 2, root, 8, True)
        reference = run_ranks(interval_worker, 2, os.path.join(shm, "ref"), 8, False)
    own = "step{s}/rank{r}_of2.by{r}/zero_shards_rank{r}_of2.safetensors"
    for rank in range(2):
        homes = first[rank]["homes"]
        partial = f"step{{s}}/.rank{rank}_of2.by{rank}.partial/zero_shards_rank{rank}_of2.safetensors"
        assert homes == [["memory"], [own.format(s=2, r=rank)], [partial.format(s=2)], [own.format(s=4, r=rank)],
                         [partial.format(s=4)]], homes  # moved on with each snapshot, partial after the step between
        pieces = ["rank0_of2.by0", "rank0_of2.by1", "rank1_of2.by0", "rank1_of2.by1"]
        assert first[rank]["complete"][3] == [f"step2/{p}" for p in pieces if p[4] != p[-1]] + [
            f"step4/{p}" for p in pieces]
        assert first[rank]["complete"][4] == [f"step{s}/{p}" for s in (2, 4) for p in pieces if p[4] != p[-1]]
        assert resumed[rank]["resumed"] == ("memory", 4, 1, {0: "copy by rank 1", 1: "copy by rank 0"})
        assert resumed[rank]["state"] == reference[rank]["state"]
        snapshot_nbytes, optimizer_nbytes, _ = reference[rank]["nbytes"]
        numel = sum(len(v) for k, v in reference[rank]["state"].items() if k.endswith(":master"))
        assert optimizer_nbytes == 8 * numel  # the moments, where they live (fp32: the masters are the parameters)
        files = 3 * 12 * numel  # the own piece and two steps of the buddy's copy, headers and small files apart
        assert files - 8 * numel < snapshot_nbytes < files - 8 * numel + 3 * 64 * 1024, (snapshot_nbytes, numel)
        estimate = snapshot_nbytes_estimate(2 * numel, 2, 2)
        assert estimate < snapshot_nbytes < estimate + 3 * 64 * 1024, (snapshot_nbytes, estimate)
    # every byte of the folder is counted: by a rank's snapshots, or as its optimizer's moments
    assert sum(r["nbytes"][0] + r["nbytes"][1] for r in reference) == reference[0]["nbytes"][2]


def torn_step_worker(rank: int, world_size: int, root: str) -> None:
    """Trains to STOPPED, then dies inside the next optimizer step: its slots
    open, the moments (living in the own piece) half overwritten, no snapshot taken."""
    engine = new_engine(root)
    train(engine, rank, world_size, STOPPED)
    engine.parts.snapshots.wait()
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(STOPPED))
    engine.backward((engine(x) - x).square().mean())
    engine.parts.snapshots.before_step(STOPPED + 1, engine.checkpoint_parts)
    for state in engine.optimizer.state.values():
        state["exp_avg"][: state["exp_avg"].numel() // 2] = float("nan")


@pytest.mark.timeout(240)
def test_a_rank_killed_inside_its_step_resumes_from_its_buddys_copy() -> None:
    """A rank dies while its step updates the moments where they live: its own
    piece is partial, torn, and the buddy's copy of the step before is taken;
    the run ends where an uninterrupted run ends."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as disk:
        root = os.path.join(shm, "run")
        run_ranks(torn_step_worker, 2, root)
        assert sorted(os.listdir(os.path.join(root, f"step{STOPPED + 1}"))) == [
            ".rank0_of2.by0.partial", ".rank0_of2.by1.partial", ".rank1_of2.by0.partial", ".rank1_of2.by1.partial"]
        resumed = run_ranks(run_worker, 2, root, os.path.join(disk, "none"), STEPS, True)
        reference = run_ranks(run_worker, 2, os.path.join(shm, "ref"), os.path.join(disk, "ref"), STEPS, False)
    for rank in range(2):
        assert resumed[rank]["resumed"] == ("memory", STOPPED, 0, {0: "copy by rank 1", 1: "copy by rank 0"})
        assert resumed[rank]["state"] == reference[rank]["state"]


def new_layout_worker(rank: int, world_size: int, root: str) -> list[str]:
    """Opens step 3's slots (the moments move into the own piece), then opens
    them again with another layout, as a take() whose shards changed since
    before_step does, and fills them with zeros. Returns the moments that changed."""
    from zero.checkpoint.save import named_shards, shard_specs
    from zero.checkpoint.tensorfile import TensorSpec

    engine = new_engine(root)
    train(engine, rank, world_size, 2)
    snapshots = engine.parts.snapshots
    snapshots.wait()
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2))
    engine.backward((engine(x) - x).square().mean())
    snapshots.before_step(3, engine.checkpoint_parts)

    def moments() -> dict[str, torch.Tensor]:
        return {f"{i}:{kind}": t for i, p in enumerate(engine.optimizer.param_groups[0]["params"])
                for kind, t in engine.optimizer.state[p].items() if kind.startswith("exp_avg")}
    before = {key: t.clone() for key, t in moments().items()}
    with named_shards(engine.checkpoint_parts()) as shards:
        specs, _, metadata = shard_specs(shards)
    slots = snapshots._open(3, [TensorSpec("another:tensor", (3,), torch.float32)] + specs, metadata)
    slots.files[0].copy(lambda spec: torch.zeros(spec.shape, dtype=spec.dtype))
    after = moments()
    assert before and after.keys() == before.keys()
    return [key for key in before if not torch.equal(after[key], before[key])]


@pytest.mark.timeout(240)
def test_a_new_layout_of_the_own_piece_hands_the_moments_back_first() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        changed = run_ranks(new_layout_worker, 2, os.path.join(shm, "run"))
    assert changed == [[], []], f"moments changed by the own piece's new layout: {changed}"


def unpicklable_state_worker(rank: int, world_size: int, root: str) -> list[str]:
    engine = new_engine(root)
    engine.snapshot_client_state = lambda: {"loader": object()}  # not plain data: a resume could not load it
    train(engine, rank, world_size, until=1)
    with pytest.raises(RuntimeError, match="snapshot of step 1 .* must be plain data") as info:
        engine.parts.snapshots.wait()
    assert isinstance(info.value.__cause__, ValueError)
    engine.snapshot_client_state = lambda: {"loader": 7}
    train(engine, rank, world_size, until=2)
    engine.parts.snapshots.wait()
    root = engine.parts.snapshots.root
    complete = sorted(os.path.relpath(path, root) for path, _, names in os.walk(root) if "piece.json" in names)
    engine.destroy()
    return complete


def test_a_snapshot_whose_client_state_is_not_plain_data_fails_and_is_not_kept() -> None:
    """The engine state is checked on the snapshot's thread: its error reaches
    the step after, and no piece of that step is complete."""
    with tempfile.TemporaryDirectory(prefix="zero-snap-", dir="/dev/shm") as root:
        complete, = run_ranks(unpicklable_state_worker, 1, root)
    assert complete and all(path.startswith("step2") for path in complete), complete


def test_options_and_buddies() -> None:
    assert parse({}) == SnapshotOptions()
    options = parse({"checkpoint": {"in_memory": {"enabled": True, "interval": 5, "replicas": 0, "async": False}}})
    assert (options.enabled, options.interval, options.replicas, options.asynchronous) == (True, 5, 0, False)
    for bad in ({"interval": 0}, {"replicas": 2}, {"enabled": "yes"}, {"path": 3}):
        with pytest.raises(ValueError, match="checkpoint.in_memory"):
            parse({"checkpoint": {"in_memory": bad}})
    two_hosts = Placement.of(["a", "a", "b", "b"])
    assert [two_hosts.buddy(r) for r in range(4)] == [2, 3, 0, 1]  # the next host's rank of the same local index
    assert two_hosts.sources(2) == [0] and not two_hosts.same_host(0, 2)
    uneven = Placement.of(["a", "b", "b", "c"])
    assert [uneven.buddy(r) for r in range(4)] == [1, 3, 3, 0]
    assert sorted(uneven.sources(3)) == [1, 2]
    one_host = Placement.of(["a"] * 3)
    assert [one_host.buddy(r) for r in range(3)] == [1, 2, 0]
    assert Placement.of(["a"]).buddy(0) is None
    assert expired([3, 4, 5], 6) == [3, 4] and expired([10, 15], 20) == [10]  # the newest before stays
    assert expired([5, 6, 7], 6) == [] and expired([], 1) == []  # (7: a step after a resume, replaced later)
    owned = 600  # 1200 parameters on 2 ranks: a piece is 12 bytes per owned one
    assert snapshot_nbytes_estimate(1200, 2, 2) == 12 * owned * 3 - 8 * owned  # own piece, 2 copies, less the moments
    assert snapshot_nbytes_estimate(1200, 2, 3, hosts=2) == 12 * owned * 4  # across hosts: 2 own, 2 copies
    assert snapshot_nbytes_estimate(1200, 2, 1, replicas=0) == 12 * owned * 2
    assert snapshot_nbytes_estimate(1200, 1, 2) == 12 * 1200 * 2  # one rank: no buddy, 2 own pieces


def test_a_snapshot_file_starts_its_whole_line_tensors_on_cache_lines() -> None:
    """The fused step streams whole cache lines into a snapshot's tensors: the
    shard file lays out those of whole lines first, after a header padded to a
    line, and stays a safetensors file (read back by the safetensors library)."""
    from safetensors import safe_open

    from zero.checkpoint.tensorfile import MappedSafetensors, SafetensorsReader, TensorSpec

    tensors = {"a:step": torch.tensor(3.0), "a:master": torch.randn(37), "b:master": torch.randn(64),
               "b:step": torch.tensor(4.0), "c:master": torch.randn(5, 48), "d:ids": torch.arange(3)}
    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    with tempfile.TemporaryDirectory(prefix="zero-snap-", dir="/dev/shm") as root:
        path = os.path.join(root, "shard.safetensors")
        file = MappedSafetensors(path, specs, {"format": "test"})
        for name in ("b:master", "c:master"):
            assert file.address(name) % 64 == 0, f"{name} starts at {file.address(name) % 64} bytes into a line"
        file.copy(lambda spec: tensors[spec.name])
        file.finish(file.final_header(file.sums({})))
        with SafetensorsReader(path) as reader:
            for name in tensors:
                reader.verify(name)
        with safe_open(path, framework="pt") as opened:
            assert sorted(opened.keys()) == sorted(tensors)
            for name, tensor in tensors.items():
                assert torch.equal(opened.get_tensor(name), tensor), name
