"""Pipelines train like one process: every scheduler, 2 and 4 stages (8 interleaved), TP inside
stages (interleaved ones too, with pipeline_virtual_stages), DP across pipelines, and inference through the pipeline."""

import pytest
import torch

from nbscaler import ComputeConfig, parallelize
from tests.models import batch, build
from tests.multiprocess import Case, check_equivalence, pipeline, run_ranks, train_parallel, zero

def halves(graph, cfg):
    """A hand-written pipeline policy: blocks 0-1 and everything before them in stage 0."""
    from nbscaler.policy import replicate
    from nbscaler.policy.staging import set_stage
    later = False
    for node in graph.nodes:
        later = later or node.module_path.startswith("gpt.blocks.2")
        set_stage([node], int(later))
        replicate(node, [node.stage])
    return graph


TWO_RANKS = [Case("gpt", "pp", 2, 2, config=pipeline(s, 2, 4)) for s in ("1f1b", "1f1b_plus", "gpipe")]
TWO_RANKS += [Case("gpt", halves, 2, 2, config=pipeline("1f1b", 2, 2))]
TWO_RANKS += [                                                             # the schedules of today
    Case("gpt", "pp", 2, 2, config=pipeline("zb_h1", 2, 4)),
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b_interleaved", 4, 4)),    # stages 0, 2 | 1, 3
    Case("llama_e2e", "pp", 2, 2, config=pipeline("zb_h1", 2, 4)),
    Case("llama_e2e", "pp", 2, 2, config=pipeline("1f1b_interleaved", 4, 2)),
    Case("gpt", "pp", 2, 2, config=pipeline("zbv", 4, 4)),                 # stages 0, 3 | 1, 2
    # pipeline_virtual_stages=2: one pipeline device of 2-way TP running stages 0 and 1, interleaved
    Case("gpt", "hybrid", 2, 2, config=pipeline("1f1b_interleaved", 2, 2, virtual_stages=2)),
]
FOUR_RANKS = [Case("gpt", "pp", 4, 4, config=pipeline(s, 4, m))
              for s, m in (("1f1b", 8), ("1f1b_plus", 4), ("gpipe", 4), ("chimera_direct", 4))]
FOUR_RANKS += [
    Case("gpt", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4)),       # 2 stages x 2-way TP
    Case("gpt", "pp", 2, 4, config=pipeline("1f1b", 2, 4)),           # two data-parallel pipelines
    Case("gpt", "tp", 2, 4, config=(("use_end2end", True),)),          # train_step without a pipeline
    Case("gpt", "pp", 4, 4, config=pipeline("zb_h1", 4, 4)),
    Case("gpt", "hybrid", 4, 4, config=pipeline("zb_h1", 2, 4)),      # B and W through TP collectives
    Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("zb_h1", 2, 4) + zero(stage=2)),  # hooks fire in W
    Case("gpt", "pp", 4, 4, config=pipeline("1f1b_interleaved", 8, 4)),
    Case("llama_e2e", "pp", 4, 4, config=pipeline("zb_h1", 4, 4)),
    Case("llama_e2e", "pp", 4, 4, config=pipeline("1f1b_interleaved", 8, 8)),
    Case("gpt", "pp", 4, 4, config=pipeline("zbv", 8, 4)),
    Case("llama_e2e", "hybrid", 4, 4, config=pipeline("zbv", 4, 4)),  # a V of 2 devices x 2-way TP
    # Megatron-LM's interleaving with TP: stages 0, 2 on devices 0-1 and 1, 3 on 2-3, each split 2 ways
    Case("gpt", "hybrid", 4, 4, config=pipeline("1f1b_interleaved", 4, 4, virtual_stages=2)),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-stages", "4-ranks"])
def test_pipelines_equal_single_process(nranks, cases, tmp_path):
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.parametrize("config, words", [
    (pipeline("chimera_direct", 4, 3), ["chimera"]),
    (pipeline("1f1b", 3, 4), ["pipeline_nstages", "divide plan_ngpus=4"]),
    (pipeline("1f1b_interleaved", 8, 6), ["pipeline_nmicros=6", "multiple of 4", "pipeline_nmicros=8"]),
    (pipeline("1f1b_interleaved", 6, 4), ["pipeline_nstages=6", "multiple of 4"]),
])
def test_bad_pipelines_fail_before_running(config, words, tmp_path):
    with pytest.raises(ValueError) as err:
        cfg = ComputeConfig(4, 4, **dict(config))
        parallelize(build("gpt"), batch("gpt", 0), "pp", cfg, gen_savedir=tmp_path, load_module=False)
    for word in words:
        assert word in str(err.value)


def test_custom_staging_must_flow_forward(tmp_path):
    def backwards(graph, cfg):
        from nbscaler.policy import replicate
        for i, node in enumerate(graph.nodes):
            node.stage = 1 if i < 3 else 0
            replicate(node, [node.stage])
        return graph

    with pytest.raises(ValueError, match="from the later stage 1; data may only flow to the same or later stages"):
        parallelize(build("gpt"), batch("gpt", 0), backwards, ComputeConfig(2, 2, **dict(pipeline("1f1b", 2, 2))),
                    gen_savedir=tmp_path, load_module=False)


@pytest.mark.parametrize("scheduler, nstages, words", [
    ("1f1b", 2, "must equal 1 x plan_ngpus=4 for 1f1b (got 2"),
    ("zbv", 4, "must equal 2 x plan_ngpus=8 for zbv (got 4: 2 pipeline devices)"),
    (("1f1b_interleaved", 2), 4, "must equal 2 x plan_ngpus=8 for 1f1b_interleaved (got 4: 2 pipeline devices "
                                 "of pipeline_virtual_stages=2)"),
])
def test_pp_needs_its_own_stages_on_every_device(scheduler, nstages, words, tmp_path):
    scheduler, virtual = scheduler if isinstance(scheduler, tuple) else (scheduler, None)
    cfg = ComputeConfig(4, 4, **dict(pipeline(scheduler, nstages, 4, virtual_stages=virtual)))
    with pytest.raises(ValueError, match="use 'hybrid'") as err:
        parallelize(build("gpt"), batch("gpt", 0), "pp", cfg, gen_savedir=tmp_path, load_module=False)
    assert words in str(err.value)


class CheapThenHeavy(torch.nn.Module):
    """Twenty cheap elementwise ops, then two large linears: balancing by op count would be wrong."""

    def __init__(self):
        super().__init__()
        self.big1 = torch.nn.Linear(128, 128)
        self.big2 = torch.nn.Linear(128, 128)

    def forward(self, x):
        for _ in range(20):
            x = x * 1.01
        return self.big2(self.big1(x)).sum()


def test_stages_are_balanced_by_cost_not_count():
    from nbscaler.policy import get_policy
    from nbscaler.trace import trace_module
    cfg = ComputeConfig(2, 2, **dict(pipeline("1f1b", 2, 4)))
    graph = get_policy("pp")(trace_module(CheapThenHeavy(), {"x": torch.randn(4, 128)}), cfg)
    stage = {n.module_path: n.stage for n in graph.nodes if n.module_path}
    assert stage == {"big1": 0, "big2": 1}
    assert sum(n.stage == 0 for n in graph.nodes) == 21       # the cheap ops go with the first linear


def test_layers_are_not_torn_between_stages():
    from nbscaler.trace.modes import trace_modes
    from nbscaler.policy import get_policy
    cfg = ComputeConfig(4, 4, **dict(pipeline("1f1b", 4, 4)))
    graph = get_policy("pp")(trace_modes(build("gpt"), batch("gpt", 0), cfg)["any"], cfg)
    stages_of_block = {}
    for n in graph.nodes:
        parts = n.module_path.split(".")
        if len(parts) > 2 and parts[1] == "blocks":
            stages_of_block.setdefault(parts[2], set()).add(n.stage)
    assert all(len(s) == 1 for s in stages_of_block.values()), stages_of_block
    assert {min(s) for s in stages_of_block.values()} == {0, 1, 2, 3}


def _timeline_on_rank(gen_dir):
    from nbscaler.schedule import Timeline
    cfg = ComputeConfig(2, 2, **dict(pipeline("1f1b", 2, 4)))
    pm = parallelize(build("gpt"), batch("gpt", 0), "pp", cfg, gen_savedir=gen_dir)
    with pytest.raises(ValueError, match="got 3 samples.*pass exactly 4 samples"):
        pm.train_step([batch("gpt", m)["batch"] for m in range(3)])       # refused before any message
    # dummy micro-batches run every block of the schedule but add no gradient
    pm.train_step([batch("gpt", m)["batch"] for m in range(4)], is_dummy_batch=[True] * 4)
    assert all(float(p.grad.abs().sum()) == 0.0 for p in pm.parameters() if p.grad is not None)
    pm.train_step([batch("gpt", m)["batch"] for m in range(4)])
    assert isinstance(pm.pipeline_timeline(), Timeline)
    own = pm.pipeline_timeline()
    assert own.nranks == 1 and 0.0 <= own.bubble_fraction < 1.0       # this rank's idle share, no phantom peers
    return pm.pipeline_events


@pytest.mark.multiprocess
def test_measured_timeline_uses_the_simulator_rows(tmp_path):
    from nbscaler.schedule import Timeline, build_schedule, simulate
    per_rank = run_ranks(_timeline_on_rank, 2, str(tmp_path))
    schedule = build_schedule("1f1b", 2, 4)
    predicted = simulate(schedule, forward_costs=1.0).to_rows()
    for rank, events in enumerate(per_rank):
        assert [(e["stage"], e["micro"], e["phase"]) for e in events] == \
            [(b.stage, b.micro, b.phase) for b in schedule.blocks_of(rank)]
        assert all(e["t_end"] >= e["t_start"] for e in events)
        assert set(events[0]) == set(predicted[0])
    measured = Timeline.from_rows([e for events in per_rank for e in events])
    assert 0.0 <= measured.bubble_fraction < 1.0
