import pytest
import torch

from nbscaler import ComputeConfig, UserConfig
from nbscaler.config import DEFAULT_BUCKET_BYTES, BroadcastGenFilesStrategy, ReuseType, split_buckets


def test_defaults_and_units():
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=8)
    assert cfg.units == 4
    assert cfg.unit_of(5) == 2 and cfg.device_of(5) == 1
    assert not cfg.use_pipeline and cfg.scheduler == "1f1b"


@pytest.mark.parametrize("kwargs, words", [
    (dict(plan_ngpus=0, runtime_ngpus=1), ["plan_ngpus", "positive"]),
    (dict(plan_ngpus=2, runtime_ngpus=3), ["runtime_ngpus", "multiple of plan_ngpus=2"]),
    (dict(plan_ngpus=1, runtime_ngpus=4, use_zero=True, zero_ngroups=3), ["zero_ngroups", "divide"]),
    (dict(plan_ngpus=1, runtime_ngpus=2, reduce_bucket_bytes=0), ["reduce_bucket_bytes=0", "positive", "25 * 2**20"]),
    (dict(plan_ngpus=1, runtime_ngpus=2, reduce_bucket_bytes=1.5e6), ["reduce_bucket_bytes=1500000.0", "integer"]),
    (dict(plan_ngpus=2, runtime_ngpus=2, use_pipeline=True, pipeline_nmicros=2), ["use_end2end=True"]),
    (dict(plan_ngpus=2, runtime_ngpus=2, pipeline_scheduler="zigzag"), ["pipeline_scheduler", "1f1b"]),
    (dict(plan_ngpus=2, runtime_ngpus=2, pipeline_scheduler="infer_pipe"), ["inference_only=True"]),
    (dict(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, use_pipeline=True), ["pipeline_nmicros"]),
    (dict(plan_ngpus=4, runtime_ngpus=4, use_end2end=True, use_pipeline=True, pipeline_nmicros=4,
          pipeline_nstages=3), ["pipeline_nstages", "divide plan_ngpus=4"]),
    (dict(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, use_pipeline=True, pipeline_nmicros=4,
          pipeline_nstages=2, pipeline_scheduler="chimera_direct"), ["chimera_direct", "4 stages"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, compile="yes"), ["compile='yes'", "True", "False"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, compile=True, compile_backend="nonesuch"),
     ["compile_backend='nonesuch'", "'inductor'", "list_backends"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, compile_backend="aot_eager"), ["compile_backend='aot_eager'", "compile=True"]),
    (dict(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, use_pipeline=True, pipeline_nmicros=4,
          pipeline_scheduler="zb_h1", compile=True), ["compile=True", "zb_h1 splits", "compile=False", "1f1b"]),
])
def test_invalid_configs_name_the_field_and_the_fix(kwargs, words):
    with pytest.raises(ValueError) as err:
        ComputeConfig(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_buckets_are_runs_of_one_dtype_up_to_the_cap():
    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [(40, f32), (80, f32), (120, f32), (8, bf16), (8, bf16)]
    assert split_buckets(sizes, 120) == [[0, 1], [2], [3, 4]]           # a dtype change starts a bucket
    assert split_buckets(sizes, 100) == [[0], [1], [2], [3, 4]]         # 120 bytes: a bucket of its own
    assert split_buckets(sizes, DEFAULT_BUCKET_BYTES) == [[0, 1, 2], [3, 4]]
    assert split_buckets([], 100) == []


def test_pipeline_settings_from_pas_config():
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True,
                        pas_config={"use_pipeline": True, "pipeline_nmicros": 4, "pipeline_nstages": 2})
    assert cfg.use_pipeline and cfg.pipeline_nmicros == 4 and cfg.pipeline_nstages == 2
    same = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, use_pipeline=True, pipeline_nmicros=4,
                         pas_config={"pipeline_nmicros": 4})
    assert same.pipeline_nmicros == 4


def test_conflicting_pipeline_settings_are_an_error():
    with pytest.raises(ValueError, match="conflicts with pas_config"):
        ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, use_pipeline=True, pipeline_nmicros=4,
                      pas_config={"pipeline_nmicros": 8})


INTERLEAVED = dict(plan_ngpus=4, runtime_ngpus=4, use_end2end=True, use_pipeline=True,
                   pipeline_scheduler="1f1b_interleaved", pipeline_nmicros=4)


def test_virtual_stages_set_the_pipeline_devices_of_interleaving():
    """``pipeline_virtual_stages`` (a field, or a ``pas_config`` key like the other pipeline
    settings) puts ``pipeline_nstages // it`` pipeline devices in a unit, each tensor-parallel over
    the rest; unset, every plan device is one (as before)."""
    assert ComputeConfig(**INTERLEAVED, pipeline_nstages=4).grid.pipeline.tp == 1
    cfg = ComputeConfig(**INTERLEAVED, pipeline_nstages=4, pas_config={"pipeline_virtual_stages": 2})
    assert cfg.pipeline_virtual_stages == cfg.virtual_stages == 2 and cfg.grid.pipeline.schedule.ndevices == 2
    assert cfg.grid.pipeline.tp == 2 and cfg.with_changes(pipeline_virtual_stages=4).grid.pipeline.tp == 4
    assert ComputeConfig.from_dict(cfg.to_dict()) == cfg
    assert ComputeConfig(**INTERLEAVED, pipeline_virtual_stages=3).pipeline_nstages == -1      # 12 stages, tp 1
    assert ComputeConfig(**INTERLEAVED, pipeline_virtual_stages=3).grid.pipeline.schedule.nstages == 12
    fixed = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="zbv", pipeline_nstages=4,
                          pipeline_nmicros=4, pipeline_virtual_stages=2)                        # zbv's own 2
    assert fixed.grid.pipeline.tp == 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(pipeline_nstages=4, pipeline_virtual_stages=3),
     ["pipeline_virtual_stages=3", "4 is not a multiple of 3", "give one of 1, 2, 4",
      "for 4, 2, 1 pipeline devices, each tensor-parallel over 1, 2, 4 plan devices"]),
    (dict(pipeline_nstages=6, pipeline_virtual_stages=2),
     ["pipeline_virtual_stages=2", "its 3 pipeline devices do not divide plan_ngpus=4", "give one of 3, 6"]),
    (dict(pipeline_nstages=4, pipeline_virtual_stages=0), ["pipeline_virtual_stages=0", "positive integer"]),
    (dict(pipeline_nstages=4, pipeline_virtual_stages=True), ["pipeline_virtual_stages=True", "positive integer"]),
    (dict(pipeline_nstages=4, pipeline_virtual_stages=1, pipeline_nmicros=2),     # 4 pipeline devices
     ["groups of the 4 pipeline devices", "pipeline_nmicros=4"]),
    (dict(pipeline_nstages=4, pipeline_scheduler="1f1b", pipeline_virtual_stages=2),
     ["pipeline_virtual_stages=2", "1f1b puts 1 stage on each pipeline device", "leave pipeline_virtual_stages unset"]),
    (dict(pipeline_nstages=6), ["pipeline_nstages=6", "multiple of 4", "or set pipeline_virtual_stages"]),
])
def test_virtual_stages_that_make_no_pipeline_are_refused_with_the_fix(kwargs, words):
    with pytest.raises(ValueError) as err:
        ComputeConfig(**{**INTERLEAVED, **kwargs})
    for word in words:
        assert word in str(err.value)


def test_round_trip_through_dict():
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=4, user_config=UserConfig(graph={"a": 1}))
    assert ComputeConfig.from_dict(cfg.to_dict()) == cfg
    compiled = ComputeConfig(1, 1, compile=True, compile_backend="aot_eager")
    assert ComputeConfig.from_dict(compiled.to_dict()) == compiled and not cfg.compile


def test_enums_take_strings():
    assert ReuseType("moo") is ReuseType.MOO
    assert BroadcastGenFilesStrategy("no_weights") is BroadcastGenFilesStrategy.NO_WEIGHTS
