"""Optimizers on a target: the known ones keep their figures, an unknown one is refused by name
until it is declared (``cost.optimizers``); on this machine any optimizer is timed as it runs."""

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.cost.optimizers import STATELESS_TENSORS
from nbscaler.cost.optimizers import OPTIMIZER_TENSORS
from tests.conftest import gpt_plan


class Lion(torch.optim.SGD):
    """A stand-in for an optimizer the time model has never heard of (one tensor of state)."""


@pytest.fixture
def table():
    saved = dict(OPTIMIZER_TENSORS)
    yield OPTIMIZER_TENSORS
    OPTIMIZER_TENSORS.clear()
    OPTIMIZER_TENSORS.update(saved)


@pytest.fixture(scope="module")
def dp():
    return gpt_plan("dp", ComputeConfig(1, 2))


def test_the_known_optimizers_keep_their_figures(table):
    assert table == {"SGD": 3, "SGD+momentum": 5, "Adam": 7, "AdamW": 7}
    assert STATELESS_TENSORS == table["SGD"]
    nbscaler.register_optimizer(torch.optim.Adam, state_tensors=2)          # declaring it again changes nothing
    assert table["Adam"] == 7


def test_an_unknown_optimizer_is_refused_on_a_target_until_declared(dp, table):
    a100 = Hardware.named("A100-SXM-80GB")
    with pytest.raises(ValueError, match=r"Lion is not an optimizer the target's time model knows.*"
                                         r"nbscaler\.register_optimizer\(Lion, state_tensors=k\)"):
        dp.summary(Lion, hardware=a100)
    nbscaler.register_optimizer(Lion, state_tensors=1)
    lion = dp.step_figures(Lion, hardware=a100).devices[0].update_s
    sgd = dp.step_figures(torch.optim.SGD, hardware=a100).devices[0].update_s
    adam = dp.step_figures(torch.optim.Adam, hardware=a100).devices[0].update_s
    assert sgd < lion < adam


def test_on_this_machine_an_unknown_optimizer_is_timed_as_it_runs(dp, table):
    assert dp.summary(Lion).step_time_s.max() > 0


def test_a_declaration_must_say_its_state(table):
    with pytest.raises(ValueError, match="state_tensors=-1"):
        nbscaler.register_optimizer(Lion, state_tensors=-1)
    with pytest.raises(TypeError, match="class"):
        nbscaler.register_optimizer(Lion(torch.nn.Linear(1, 1).parameters(), lr=1), state_tensors=1)
