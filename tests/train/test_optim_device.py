"""The optimizer's moments follow the adapter onto its device."""

import torch

from deltaserve.train.optim import OptimizerConfig, OptimizerState, build_adamw


def test_restored_moments_live_on_the_parameters_device():
    """After a resume or a lost job, AdamW starts from the shared (host) state: its moments must
    be on the adapter's device (``meta`` stands in for a GPU), or every later step fails there."""
    state = OptimizerState(6)
    state.exp_avg.fill_(0.5)
    state.exp_avg_sq.fill_(0.25)
    state.step.fill_(3)
    param = torch.zeros(6, device="meta", requires_grad=True)
    opt = build_adamw(param, OptimizerConfig(), state)
    s = opt.state[param]
    assert s["exp_avg"].device == param.device and s["exp_avg_sq"].device == param.device
    assert s["step"].device.type == "cpu" and float(s["step"]) == 3.0


def test_restored_moments_are_private_copies():
    state = OptimizerState(4)
    state.exp_avg.fill_(1.0)
    state.step.fill_(1)
    param = torch.zeros(4, requires_grad=True)
    opt = build_adamw(param, OptimizerConfig(), state)
    opt.state[param]["exp_avg"].zero_()
    assert torch.equal(state.exp_avg, torch.ones(4))
