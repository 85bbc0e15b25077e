"""A damaged or foreign checkpoint changes nothing, on any rank: corrupt headers,
flipped data bytes, truncated, empty and missing files, another model's
checkpoint, a pickle payload; each is the same ValueError on every rank,
within the agreement's timeout, naming the file (and the parameter), and the
engine's parameters and optimizer state hash the same as before the call.
A pickle payload never runs (load_checkpoint, to_fp32, to_deepspeed). A failing write
during save names its path on every rank; the next save cleans up."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import resource
import shutil
import signal
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_zero_reshard import new_engine, train
from zero_reference import TinyTransformer, engine_config, make_model

import zero
from zero.checkpoint import save, to_deepspeed, to_fp32
from zero.checkpoint.parts import CheckpointOptions
from zero.checkpoint.format import ENGINE_STATE, MANIFEST, file_crc32
from zero.checkpoint.tensorfile import SafetensorsReader

TAG = "global_step2"
SHARD0, SHARD1 = "zero_shards_rank0_of2.safetensors", "zero_shards_rank1_of2.safetensors"
TIMEOUT_S = 20.0  # the agreement's deadline here; every error must come well within it


class Payload:
    """Unpickling it makes a directory: the marker that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def flip_master(path: str) -> None:
    """Flips a bit in the data of the last master slice in the file."""
    with SafetensorsReader(path) as reader:
        name = [n for n in reader.specs if n.endswith(":master")][-1]
        offset = reader.data_start + reader.offsets[name] + 1
    flip(path, offset)


def header_length(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def header_digit(path: str) -> None:
    """Changes one digit of the shards index: the header still parses."""
    with open(path, "r+b") as f:
        header = f.read(8 + header_length(path))
        at = header.index(b'"shards":"[[') + 20
        at += next(i for i, c in enumerate(header[at:]) if chr(c).isdigit() and chr(c) != "9")
        f.seek(at)
        f.write(b"9")


def truncate(path: str, numel: int | None = None) -> None:
    os.truncate(path, os.path.getsize(path) // 2 if numel is None else numel)


def plant_payload(directory: str, marker: str) -> None:
    """engine_state.pt with a payload in client_state, and a manifest that vouches for it."""
    rewrite_state(directory, lambda state: state.update(client_state={"epoch": Payload(marker)}))


def plant_hyperparameter(directory: str) -> None:
    """A learning rate that is a string, and a key the optimizer does not have, vouched for."""
    rewrite_state(directory, lambda state: state["param_groups"][0].update(lr="0.1", rogue=1))


def rewrite_state(directory: str, change) -> None:
    path = os.path.join(directory, ENGINE_STATE)
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    manifest = json.load(open(os.path.join(directory, MANIFEST)))
    manifest["files"][ENGINE_STATE] = {"nbytes": os.path.getsize(path), "crc32": f"{file_crc32(path):08x}"}
    json.dump(manifest, open(os.path.join(directory, MANIFEST), "w"))


def deepspeed_layout(directory: str) -> None:
    """The files DeepSpeed writes for a 2-rank stage 2 checkpoint, by name, empty (real ones:
    tests/test_zero_deepspeed_interop.py)."""
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        open(os.path.join(directory, name), "wb").close()


# case -> (damage to the copied checkpoint directory, words the error must hold)
CASES = {
    "header_json": (lambda d: flip(os.path.join(d, SHARD1), 9), [SHARD1, "corrupt header"]),
    "header_digit": (lambda d: header_digit(os.path.join(d, SHARD1)), [SHARD1, "header crc32"]),
    "data_byte": (lambda d: flip_master(os.path.join(d, SHARD1)), [SHARD1, "corrupt", ":master"]),
    "truncated": (lambda d: truncate(os.path.join(d, SHARD1)), [SHARD1, "truncated"]),
    "empty": (lambda d: truncate(os.path.join(d, SHARD0), 0), [SHARD0, "0 bytes"]),
    "engine_state_byte": (lambda d: flip(os.path.join(d, ENGINE_STATE), 100), [ENGINE_STATE, "crc32"]),
    "manifest_missing": (lambda d: os.remove(os.path.join(d, MANIFEST)), [MANIFEST, "missing"]),
    "deepspeed": (deepspeed_layout, ["mp_rank_00_model_states.pt", "unreadable"]),
    "payload": (None, [ENGINE_STATE, "refused", "mkdir"]),  # made in the worker: the marker's path
    "hyperparameter": (plant_hyperparameter, [ENGINE_STATE, "param group 0", "lr is '0.1'", "float"]),
}
FOREIGN = {"other_model": ["engine_state.pt", "missing parameters", "blocks.0.fc1.weight"],
           "other_shapes": ["engine_state.pt", "embed.weight", "(40, 16)"]}


def fingerprint(engine) -> str:
    """A hash of what a load may change: masters, module, optimizer state, counters, scaler."""
    h = hashlib.sha256()
    def data(tensor: torch.Tensor) -> bytes:
        return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    for tensor in engine.full_params_fp32() + list(engine.module.parameters()):
        h.update(data(tensor))
    for state in engine.optimizer.state.values():
        for key in sorted(state):
            h.update(key.encode() + data(torch.as_tensor(state[key])))
    h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]).encode())
    h.update(repr((engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps,
                   engine.parts.scaler.state_dict())).encode())
    return h.hexdigest()


def foreign_engine(case: str, stage: int, world_size: int):
    if case == "other_model":
        model = make_model("mlp")
    else:
        torch.manual_seed(0)
        model = TinyTransformer(vocab=40)
        model.head.weight = model.embed.weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=engine_config(stage, "fp32", 1, world_size))
    return engine


def expect_refusal(engine, rank: int, directory: str, words: list[str], case: str) -> str:
    before, start = fingerprint(engine), time.monotonic()
    with pytest.raises(ValueError) as caught:
        engine.load_checkpoint(directory)
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert elapsed < TIMEOUT_S / 2, f"rank {rank} {case}: the error took {elapsed:.1f} s"
    assert "nothing was loaded on any rank" in message and all(w in message for w in words), \
        f"rank {rank} {case}: {words} not all in: {message}"
    assert fingerprint(engine) == before, f"rank {rank} {case}: the engine's state changed"
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, f"{case}: the ranks' errors differ: {messages}"
    return message


def load_worker(rank: int, world_size: int, root: str) -> None:
    for stage in (2, 3):
        good = os.path.join(root, f"stage{stage}")
        for case in FOREIGN:  # another model's checkpoint, saved by the same ranks
            foreign = foreign_engine(case, stage, world_size)
            foreign.save_checkpoint(os.path.join(root, f"stage{stage}-{case}"), TAG)
            foreign.destroy()
        engine = new_engine(stage, world_size)
        engine.checkpoint_options = CheckpointOptions(timeout_s=TIMEOUT_S)
        train(engine, rank, world_size, range(2))
        engine.save_checkpoint(good)
        train(engine, rank, world_size, range(2, 3))  # the engine's state now differs from the checkpoint's
        for case, (damage, words) in CASES.items():
            damaged = os.path.join(root, f"stage{stage}-{case}")
            marker = os.path.join(root, f"ran-{stage}-{case}")
            if rank == 0:
                shutil.copytree(good, damaged)
                (damage or (lambda d: plant_payload(d, marker)))(os.path.join(damaged, TAG))
            dist.barrier()
            expect_refusal(engine, rank, damaged, words, f"stage {stage} {case}")
            assert not os.path.exists(marker), f"rank {rank} stage {stage}: the payload ran"
        for case, words in FOREIGN.items():
            expect_refusal(engine, rank, os.path.join(root, f"stage{stage}-{case}"), words, f"stage {stage} {case}")
        engine.load_checkpoint(good)  # after all the refusals, a good checkpoint loads
        assert engine.global_steps == 2 and engine.micro_steps == 2, f"rank {rank} stage {stage}"
        engine.destroy()


def full_disk(write_shards):
    """write_shards with the file-size limit at 64 bytes (the kernel refuses
    the write: EFBIG, as a full disk's ENOSPC, with no path)."""
    def limited(path, shards):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
        try:
            write_shards(path, shards)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
    return limited


def save_worker(rank: int, world_size: int, root: str) -> None:
    engine = new_engine(2, world_size)
    engine.checkpoint_options = CheckpointOptions(timeout_s=TIMEOUT_S)
    train(engine, rank, world_size, range(1))
    save_dir = os.path.join(root, "save")
    engine.save_checkpoint(save_dir, "kept")
    for case, target, words in (("read-only folder", "/sys/zero-checkpoint-test", ["/sys/zero-checkpoint-test"]),
                                ("full disk", save_dir, [SHARD1, "File too large", "rank 1"])):
        original = save.write_shards
        if case == "full disk" and rank == 1:
            save.write_shards = full_disk(original)
        start = time.monotonic()
        try:
            with pytest.raises(RuntimeError) as caught:
                engine.save_checkpoint(target, "failed")
        finally:
            save.write_shards = original
        message, elapsed = str(caught.value), time.monotonic() - start
        assert elapsed < TIMEOUT_S / 2 and all(w in message for w in words), f"rank {rank} {case}: {elapsed:.1f} s {message}"
    dist.barrier()  # rank 0 removed the failed save's .partial before raising
    assert sorted(os.listdir(save_dir)) == ["kept", "latest"], f"rank {rank}: {os.listdir(save_dir)}"
    marker = os.path.join(root, "ran-at-save")
    with pytest.raises(ValueError, match="must be plain data"):  # refused before anything is written
        engine.save_checkpoint(save_dir, "bad", client_state={"epoch": Payload(marker)})
    assert not os.path.exists(marker) and sorted(os.listdir(save_dir)) == ["kept", "latest"], \
        f"rank {rank}: {os.path.exists(marker)=} {os.listdir(save_dir)}"
    dist.barrier()
    if rank == 0:
        os.makedirs(os.path.join(save_dir, ".global_step9.partial"))  # a killed save's leftovers
    dist.barrier()
    engine.save_checkpoint(save_dir, "next")
    assert sorted(os.listdir(save_dir)) == ["kept", "latest", "next"], f"rank {rank}: {os.listdir(save_dir)}"
    engine.load_checkpoint(save_dir, "kept")


def test_damaged_checkpoints_change_nothing() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-safety-") as root:
        run_ranks(load_worker, 2, root, timeout=240)
        marker, planted = os.path.join(root, "ran-to_fp32"), os.path.join(root, "to_fp32-payload")
        shutil.copytree(os.path.join(root, "stage2"), planted)
        plant_payload(os.path.join(planted, TAG), marker)
        with pytest.raises(ValueError, match="refused"):
            to_fp32.convert(planted, os.path.join(root, "out.safetensors"))
        assert not os.path.exists(marker), "to_fp32 ran the payload"
        if importlib.util.find_spec("deepspeed") is not None:  # to_deepspeed writes DeepSpeed's classes
            with pytest.raises(ValueError, match="refused"):
                to_deepspeed.convert(planted, os.path.join(root, "out-deepspeed"))
            assert not os.path.exists(marker), "to_deepspeed ran the payload"
            assert not os.path.exists(os.path.join(root, "out-deepspeed")), "to_deepspeed wrote before it validated"
        for case in ("data_byte", "truncated"):
            with pytest.raises(ValueError, match=SHARD1):
                to_fp32.convert(os.path.join(root, f"stage3-{case}"), os.path.join(root, "out.pt"))
        assert not [f for f in os.listdir(root) if f.startswith("out")], "to_fp32 left an output behind"


def test_save_errors_name_the_path() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-save-errors-") as root:
        run_ranks(save_worker, 2, root, timeout=120)


def test_checksummed_safetensors(tmp_path) -> None:
    """The crc32s rewritten into the header leave a file the safetensors package
    reads as written; each tensor verifies, and a flipped byte is named."""
    from safetensors.torch import load_file

    from zero.checkpoint.tensorfile import TensorSpec, write_safetensors

    tensors = {"a": torch.arange(7, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16),
               "empty": torch.zeros(0), "c": torch.tensor(3.0)}
    path = str(tmp_path / "x.safetensors")
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    write_safetensors(path, specs, lambda spec: tensors[spec.name], {"format": "test"}, checksums=True)
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with SafetensorsReader(path) as reader:
        for name in tensors:
            reader.verify(name)
        offset = reader.data_start + reader.offsets["b"] + 4
    flip(path, offset)
    with SafetensorsReader(path) as reader, pytest.raises(ValueError, match=r"tensor b .*the data is corrupt"):
        reader.verify("b")
