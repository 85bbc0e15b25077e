"""Pure tests of zero: stage policy and unit plans, config parsing, loss scaler."""
from __future__ import annotations

import json
import os
import warnings

import pytest

import zero_reference  # noqa: F401  (puts the repo root on sys.path)
from zero.runtime import config as cfg
from zero.runtime.no_effect import NO_EFFECT, NoEffectWarning
from zero.sharding.policy import ShardingPolicy
from zero.runtime.precision import DynamicLossScaler, ScalerOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "configs")  # the users' files, next to the checkout
CONFIGS = SHARED if os.path.isdir(SHARED) else os.path.join(ROOT, "tests", "data")  # byte-identical copies
FACTS = cfg.ModelFacts(world_size=4, param_dtype="float32", hidden_size=64)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_policy_is_data(stage: int) -> None:
    policy = ShardingPolicy.for_stage(stage)
    assert policy.stage == stage
    assert (policy.shard_optimizer, policy.shard_grads, policy.shard_params) == (stage >= 1, stage >= 2, stage >= 3)
    with pytest.raises(ValueError, match="stage"):
        ShardingPolicy.for_stage(4)


def test_batch_rule_and_auto() -> None:
    assert cfg.resolve_batch({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4) == (32, 4, 2)
    assert cfg.resolve_batch({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4) == (32, 2, 4)
    assert cfg.resolve_batch({"train_micro_batch_size_per_gpu": 3}, 2) == (6, 3, 1)
    assert cfg.resolve_batch({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto"}, 2,
                             {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}) == (24, 4, 3)
    with pytest.raises(ValueError, match="train_batch_size"):
        cfg.resolve_batch({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                           "gradient_accumulation_steps": 2}, 4)


@pytest.mark.parametrize("bad, key", [
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "offload_optimizer.device"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer.device"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param.device"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "offload_optimizer.nvme_path"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp",
                                                              "ratio": 0.5}}}, "offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}},
     "offload_optimizer.buffer_count"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp",
                                                          "max_in_cpu": -1}}}, "offload_param.max_in_cpu"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}},
     "offload_optimizer.pin_memory"),
    ({"aio": {"block_size": 1000}}, "aio.block_size"),
    ({"aio": {"thread_count": 0}}, "aio.thread_count"),
    ({"aio": {"use_gds": True}}, "aio.use_gds"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
    ({"scheduler": {"type": "CyclicLR"}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "scheduler.params.warmup_num_steps"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
    ({"activation_checkpointing": {"number_checkpoints": 0}}, "activation_checkpointing.number_checkpoints"),
])
def test_invalid_values_name_the_key(bad: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        cfg.parse(bad, FACTS)


def test_comm_backend_config_key() -> None:
    assert cfg.parse({"comm_backend": "torch"}, FACTS).comm_backend == "torch"
    with pytest.raises(ValueError, match="comm_backend"):
        cfg.parse({"comm_backend": "nccl2"}, FACTS)


def test_unknown_keys_warn() -> None:
    with pytest.warns(UserWarning, match="'no_such_key'"):
        cfg.parse({"no_such_key": 1}, FACTS)
    with pytest.warns(UserWarning, match="zero_optimization.'stage4_magic'"):
        cfg.parse({"zero_optimization": {"stage4_magic": 1}}, FACTS)


@pytest.mark.parametrize("name", ["ds_zero2_config.json", "ds_zero3_config.json"])
def test_shared_configs_parse_with_auto_resolved(name: str) -> None:
    facts = cfg.ModelFacts(2, "float16", 64, {"train_micro_batch_size_per_gpu": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown key in the users' configs
        warnings.simplefilter("ignore", NoEffectWarning)  # DeepSpeed keys zero does not act on: see below
        parsed = cfg.parse(os.path.join(CONFIGS, name), facts)
    raw = json.load(open(os.path.join(CONFIGS, name)))
    assert parsed.zero.stage == raw["zero_optimization"]["stage"]
    assert (parsed.train_batch_size, parsed.micro_batch_size, parsed.gradient_accumulation_steps) == (8, 4, 1)
    assert parsed.dtype == "float16" and parsed.gradient_clipping == 1.0 and parsed.scaler.hysteresis == 2
    assert parsed.zero.offload_optimizer_options == cfg.OffloadOptions(device="cpu", pin_memory=True)
    if parsed.zero.stage == 3:
        assert parsed.zero.offload_param_options == cfg.OffloadOptions(device="cpu", pin_memory=True, buffer_count=5)
    if parsed.zero.stage == 3:
        assert parsed.zero.reduce_bucket_size == 64 * 64 and parsed.zero.param_persistence_threshold == 640


def run_scaler(pattern: str, **options) -> list[float]:
    scaler = DynamicLossScaler(ScalerOptions(**options))
    scales = []
    for flag in pattern:
        scaler.update(flag == "x")
        scales.append(scaler.scale)
    return scales


def test_dynamic_loss_scaler_rules() -> None:
    base = dict(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=1.0)
    # x = overflow, . = clean. Hysteresis 2: the first overflow spends the budget,
    # the second halves; a clean step after 3 clean steps since the last overflow
    # doubles and refills (as DeepSpeed 0.19's stable_interval).
    assert run_scaler("xx....x.x", **base) == [16, 8, 8, 8, 8, 16, 16, 16, 8]
    # consecutive_hysteresis: a clean step refills the budget, so x.x never halves
    assert run_scaler("xx....x.x", consecutive_hysteresis=True, **base) == [16, 8, 8, 8, 8, 16, 16, 16, 16]
    assert run_scaler("xxxx", initial_scale_power=1, hysteresis=1, min_loss_scale=1.0) == [1, 1, 1, 1]
    assert run_scaler("......", initial_scale_power=0, loss_scale_window=2, hysteresis=1) == [1, 1, 2, 2, 4, 4]


def test_rebind_keeps_param_groups() -> None:
    import torch
    from zero.optim.optimizers import rebind
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (4, 6, 3))
    opt = torch.optim.AdamW([{"params": [a, c], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}])
    flat = torch.zeros(13)
    masters = [(0, flat[0:2]), (0, flat[2:4]), (1, flat[4:10]), (2, flat[10:13])]  # a cut in two slices
    rebind(opt, [a, b, c], masters)
    assert [[m.data_ptr() for m in g["params"]] for g in opt.param_groups] == \
        [[flat[0:2].data_ptr(), flat[2:4].data_ptr(), flat[10:13].data_ptr()], [flat[4:10].data_ptr()]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    with pytest.raises(ValueError, match="not a trainable parameter"):
        rebind(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), [a], [])


@pytest.mark.skipif(not os.path.isdir(SHARED), reason="no ../shared/configs next to this checkout")
@pytest.mark.parametrize("name", ["ds_zero2_config.json", "ds_zero3_config.json"])
def test_config_copies_match_the_users_files(name: str) -> None:
    with open(os.path.join(SHARED, name), "rb") as a, open(os.path.join(ROOT, "tests", "data", name), "rb") as b:
        assert a.read() == b.read(), f"tests/data/{name} drifted from ../shared/configs/{name}"


def test_offload_and_aio_sections() -> None:
    parsed = cfg.parse({"zero_optimization": {
        "stage": 3, "sub_group_size": 1000,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 3, "fast_init": True,
                              "pipeline": True},
        "offload_param": {"device": "nvme", "nvme_path": "/y", "buffer_size": 4096, "max_in_cpu": 0}},
        "aio": {"block_size": 8192, "queue_depth": 4, "intra_op_parallelism": 2, "single_submit": True}}, FACTS)
    assert parsed.zero.offload_optimizer_options.device == "nvme" and parsed.zero.offload_param_options.device == "nvme"
    assert parsed.zero.offload_optimizer_options == cfg.OffloadOptions(
        device="nvme", nvme_path="/x", buffer_count=3, fast_init=True, pipeline_read=True, pipeline_write=True)
    assert parsed.zero.offload_param_options == cfg.OffloadOptions(
        device="nvme", nvme_path="/y", buffer_count=5, buffer_size=4096, max_in_cpu=0)
    assert parsed.aio == cfg.AioOptions(block_size=8192, thread_count=2)


def test_keys_without_effect_warn_once_when_they_ask_for_something() -> None:
    """Each key of the one table warns (once) when its value asks for what zero does
    not do, and stays quiet when it asks for what zero does anyway."""
    asking = {"zero_optimization": {"reduce_scatter": False, "contiguous_gradients": False, "stage": 2},
              "prescale_gradients": True, "flops_profiler": {"enabled": True}, "dump_state": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        cfg.parse(asking, FACTS)
        cfg.parse(asking, FACTS)  # once per key and process
    said = sorted(str(w.message).split("=")[0].removeprefix("zero config: ") for w in caught
                  if issubclass(w.category, NoEffectWarning))
    assert said == ["dump_state", "flops_profiler", "prescale_gradients", "zero_optimization.contiguous_gradients",
                    "zero_optimization.reduce_scatter"], said
    quiet = {"zero_optimization": {"reduce_scatter": True, "contiguous_gradients": True, "stage": 2},
             "prescale_gradients": False, "flops_profiler": {"enabled": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.parse(quiet, FACTS)
    with pytest.raises(ValueError, match="zero_optimization.reduce_scatter"):
        cfg.parse({"zero_optimization": {"reduce_scatter": "yes"}}, FACTS)  # still validated


def test_every_key_without_effect_is_documented() -> None:
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "zero.md")).read()
    missing = [key for key in NO_EFFECT if f"`{key}`" not in docs]
    assert not missing, f"docs/zero.md does not list {missing}"


def test_progress_round_trips_to_an_accumulation_boundary() -> None:
    """Progress.state_dict() / load_state_dict(): the counters come back, and
    micro_steps restarts at the boundary in the loading engine's accumulation."""
    from zero.runtime.engine import Progress

    saved = Progress(accumulation_steps=2, global_steps=5, global_samples=40, micro_steps=11, skipped_steps=1)
    for accumulation in (2, 4):
        resumed = Progress(accumulation_steps=accumulation)
        resumed.load_state_dict(saved.state_dict())
        assert (resumed.global_steps, resumed.global_samples, resumed.skipped_steps) == (5, 40, 1)
        assert resumed.micro_steps == 5 * accumulation
    assert saved.state_dict() == {"global_steps": 5, "global_samples": 40, "micro_steps": 11, "skipped_steps": 1}


def test_aio_queue_keys_warn_without_effect() -> None:
    """aio.queue_depth, single_submit and overlap_events steer libaio's queue,
    which zero's blocking pread/pwrite threads do not have: set otherwise than
    DeepSpeed's defaults, they warn as every key without effect does."""
    asking = {"aio": {"queue_depth": 32, "single_submit": True, "overlap_events": False, "thread_count": 2}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = cfg.parse(asking, FACTS)
    said = sorted(str(w.message).split("=")[0].removeprefix("zero config: ") for w in caught
                  if issubclass(w.category, NoEffectWarning))
    assert said == ["aio.overlap_events", "aio.queue_depth", "aio.single_submit"], said
    assert parsed.aio.thread_count == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.parse({"aio": {"queue_depth": 8, "single_submit": False, "overlap_events": True}}, FACTS)
    with pytest.raises(ValueError, match="aio.queue_depth"):
        cfg.parse({"aio": {"queue_depth": 0}}, FACTS)  # still validated


def test_offload_device_has_one_home() -> None:
    """zero_optimization.offload_*.device lives in the offload options only."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cfg.ZeroOptions)}
    assert not names & {"offload_optimizer", "offload_param"}, sorted(names)
    parsed = cfg.parse({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, FACTS)
    assert (parsed.zero.offload_optimizer_options.device, parsed.zero.offload_param_options.device) == ("cpu", "none")


def test_activation_checkpointing_section_is_checked_whole_at_parse() -> None:
    """One home: parse() refuses what configuring would refuse, and
    zero.checkpointing.configure refuses it with the same message."""
    from zero.activation import checkpointing

    bad = {"activation_checkpointing": {"contiguous_memory_optimization": True, "number_checkpoints": 2}}
    with pytest.raises(ValueError, match="needs partition_activations") as parsed:
        cfg.parse(bad, FACTS)
    with pytest.raises(ValueError, match="needs partition_activations") as configured:
        checkpointing.configure(deepspeed_config=bad)
    assert str(parsed.value) == str(configured.value)
    checkpointing.reset()
