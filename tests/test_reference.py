"""The one reference run, against the loops the demo, the Explorer and the tests each wrote before it."""

import copy
import doctest

import torch

from nbscaler import demo, reference
from nbscaler.reference import call_with_kwargs, reference_run
from nbscaler.widgets.explorer.model import shipped_gpt, user_model
from nbscaler.widgets.explorer.oracle import single_process_losses


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return (self.b(torch.tanh(self.a(x))) - y).pow(2).mean()


def batches(step, unit):
    g = torch.Generator().manual_seed(100 * step + 10 * unit)
    return [{"x": torch.randn(4, 6, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(3)]


def test_docstring_example_runs():
    result = doctest.testmod(reference, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_equals_the_loop_the_tests_wrote():
    """Losses, unclipped gradients and norms, step by step, bit for bit, resumed at step 2."""
    torch.manual_seed(0)
    model = TwoLayers()
    twin = copy.deepcopy(model)
    run = reference_run(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, steps=range(2, 5), units=2,
                        loss_of=call_with_kwargs, clip=0.05, keep_grads=True)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for i, step in enumerate(range(2, 5)):
        per_unit = [[twin(**a) for a in batches(step, u)] for u in range(2)]
        sum(l for unit in per_unit for l in unit).backward()
        assert run.losses[i] == [[l.item() for l in unit] for unit in per_unit]
        for name, p in twin.named_parameters():
            assert torch.equal(run.grads[i][name], p.grad)
        assert run.norms[i] == torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05).item()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_the_demo_reference_is_the_loop_it_wrote():
    case = demo.DemoCase("pp", 2, 4, demo._pipeline("1f1b", 2))      # two units of four micro-batches
    got = demo.reference_losses(case, steps=2)
    torch.manual_seed(0)
    model = demo.GPT(demo.MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=demo.LR)
    for step in range(2):
        per_unit = [[model(s) for s in demo._samples(step, u, case.nmicros)] for u in range(2)]
        sum(l for unit in per_unit for l in unit).backward()
        opt.step()
        opt.zero_grad()
        assert got[step] == [[l.item() for l in unit] for unit in per_unit]


def explorer_loop(spec, steps, units, nmicros, lr):
    """What the Explorer's oracle computed before it called ``reference_run``."""
    model = copy.deepcopy(spec.module).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data, out = spec.data(nmicros), []
    for step in range(steps):
        per_unit = []
        for unit in range(units):
            batch = data(step, unit)
            if spec.end2end:
                per_unit.append(torch.stack([model(micro) for micro in batch]).sum())
            else:
                output = model(**batch)
                per_unit.append(spec.loss_fn(output, batch) if spec.loss_fn is not None else output)
        torch.stack(per_unit).sum().backward()
        opt.step()
        opt.zero_grad()
        out.append([loss.item() for loss in per_unit])
    return out


def test_the_explorer_reference_matches_the_loop_it_wrote():
    """The sums differ in order only (fp32 rounding), for an end2end GPT and a module with a loss_fn."""
    gpt = shipped_gpt(n_layer=1, d_model=32, seq_len=16)
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1))
    plain = user_model(net, {"input": torch.randn(4, 5)}, loss_fn=lambda out, batch: out.pow(2).mean())
    for spec, nmicros in ((gpt, 2), (plain, 1)):
        got = single_process_losses(spec, 3, 2, nmicros, torch.optim.SGD, 0.05)
        want = explorer_loop(spec, 3, 2, nmicros, 0.05)
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                              rtol=1e-6, atol=0)
