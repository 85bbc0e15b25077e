"""Hugging Face training scripts as a user writes them for ringcomm: torch.distributed
is initialized on the backend before TrainingArguments (or Accelerator), then a
tiny GPT-2 (built from a config, no download) trains on random learnable data.

    torchrun --nproc-per-node 2 tests/hf_trainer_script.py --runs gloo:ddp,ringcomm:ddp --out out.json
    accelerate launch --config_file cfg.yaml tests/hf_trainer_script.py --runs ringcomm:accelerate

Each run of `--runs` (backend:engine) trains in this process in turn, on a
process group of its own, and records every rank's losses, the final parameters
and what ran them; rank 0 writes them to `--out` (JSON). Engines: ddp (Trainer),
fsdp2 (Trainer with fsdp=True and FSDP version 2; on CPU, Accelerate runs it as
DDP), accelerate (a plain Accelerator loop; the launch's config decides the rest).
tests/test_hf_trainer.py and benchmarks/trainer_exit_loop.py run it."""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401  (registers the "ringcomm" backend)

VOCAB, BLOCK, EMBD, LAYERS, HEADS = 64, 16, 32, 2, 2
MICRO_BATCH, NUM_SAMPLES, SEED = 4, 64, 1234


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="ringcomm:fsdp2", help="comma-separated backend:engine (engine: ddp, fsdp2 or accelerate)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--out", default="", help="rank 0 writes the losses and parameters here (JSON)")
    p.add_argument("--output-dir", default="", help="Trainer's output_dir (default: a folder under /tmp)")
    return p.parse_args(argv)


class Sequences(torch.utils.data.Dataset):
    """Random token sequences that count up modulo VOCAB: learnable, so the loss falls."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(SEED)
        starts = torch.randint(0, VOCAB, (NUM_SAMPLES, 1), generator=generator)
        self.ids = (starts + torch.arange(BLOCK)) % VOCAB

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def training_arguments(engine: str, steps: int, output_dir: str):
    from transformers import TrainingArguments

    sharding = {}
    if engine == "fsdp2":
        sharding = {"fsdp": True,
                    "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
    elif engine != "ddp":
        raise ValueError(f"engine {engine!r} is not ddp, fsdp2 or accelerate")
    return TrainingArguments(output_dir=output_dir, use_cpu=True, max_steps=steps, per_device_train_batch_size=MICRO_BATCH,
                             learning_rate=1e-2, lr_scheduler_type="constant", seed=SEED, data_seed=SEED,
                             report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, ddp_find_unused_parameters=False, **sharding)


def init_process_group(backend: str, index: int) -> None:
    """The default group on `backend`, before TrainingArguments (Accelerate then
    keeps it). The first run initializes as a user's script does; a later run
    of this process needs keys of its own on torchrun's store, where the earlier
    group's keys stay (gloo hangs too when initialized twice on the same keys)."""
    timeout = timedelta(seconds=120)
    if index == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"hf_trainer_script/run{index}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def train(backend: str, engine: str, steps: int, output_dir: str, index: int) -> dict:
    """One Trainer run on a process group of `backend`, made here and destroyed after."""
    from transformers import Trainer

    init_process_group(backend, index)
    losses: list[float] = []

    class RecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(loss.item())
            return loss

    trainer = RecordingTrainer(model=tiny_gpt2(), args=training_arguments(engine, steps, output_dir),
                               train_dataset=Sequences())
    trainer.train()
    params = full_parameters(trainer.model)
    wrapper, sharded = type(trainer.model_wrapped).__name__, is_sharded(trainer.model)
    launch = {"backend": dist.get_backend(), "distributed_type": trainer.accelerator.distributed_type.value}
    # The teardown order matters: DDP's reducer holds the process group in C++; freed
    # after destroy_process_group, it would destroy the group with the GIL held.
    del trainer
    gc.collect()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)  # a forwarded call right before the teardown, as scripts do
    dist.destroy_process_group()
    return {"losses": everyone, "params": params, "wrapper": wrapper, "sharded": sharded, **launch}


def train_accelerate(backend: str, steps: int, index: int) -> dict:
    """One run of a plain Accelerate loop (Accelerator.prepare, accelerator.backward)
    on a process group of `backend`; the launch (`accelerate launch --config_file`)
    chooses the rest."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    init_process_group(backend, index)
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Sequences(), batch_size=MICRO_BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(SEED))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _, batch in zip(range(steps), loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = full_parameters(accelerator.unwrap_model(model))
    wrapper, sharded = type(model).__name__, is_sharded(model)
    launch = {"backend": dist.get_backend(), "distributed_type": accelerator.distributed_type.value}
    del model, optimizer, loader, accelerator
    gc.collect()
    AcceleratorState._reset_state(reset_partial_state=True)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    dist.destroy_process_group()
    return {"losses": everyone, "params": params, "wrapper": wrapper, "sharded": sharded, **launch}


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the parameters are FSDP2's DTensors."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def full_parameters(model: torch.nn.Module) -> dict[str, list]:
    """Every floating-point entry of the state dict, whole (FSDP2's DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).tolist()
            for name, value in sorted(model.state_dict().items()) if value.is_floating_point()}


def main(argv: list[str] | None = None) -> None:
    faulthandler.enable()  # a crash in teardown names its thread and frames on stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints every thread's stack
    args = parse_args(argv)
    torch.set_num_threads(1)
    output_dir = args.output_dir or f"/tmp/ringcomm-hf-{os.getuid()}-{os.getppid()}"
    results = {}
    for index, run in enumerate(args.runs.split(",")):
        backend, engine = run.split(":")
        if engine == "accelerate":
            results[run] = train_accelerate(backend, args.steps, index)
        else:
            results[run] = train(backend, engine, args.steps, output_dir, index)
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as file:
            json.dump(results, file)
    print(f"rank {os.environ.get('RANK')}: done {sorted(results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
