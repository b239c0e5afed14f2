"""The optimizer's moments follow the adapter onto its device; the fused AdamW it builds steps
as torch's reference AdamW does."""

import pytest
import torch

from deltaserve.train.optim import OptimizerConfig, OptimizerState, build_adamw, export_state


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
    assert s["step"].device == param.device and s["step"].shape == ()


def test_restored_moments_are_private_copies():
    state = OptimizerState(4)
    state.exp_avg.fill_(1.0)
    state.step.fill_(1)
    param = torch.zeros(4, requires_grad=True)
    opt = build_adamw(param, OptimizerConfig(), state)
    opt.state[param]["exp_avg"].zero_()
    assert torch.equal(state.exp_avg, torch.ones(4))


@pytest.mark.parametrize("resumed", [False, True])
def test_fused_adamw_steps_as_the_reference_implementation(resumed):
    """Five steps of :func:`build_adamw` (fused) against torch's single-tensor AdamW with the
    same knobs, from fresh or resumed moments: the parameters agree to fp32 rounding, and the
    exported state resumes where it left off."""
    cfg = OptimizerConfig(lr=3e-3, weight_decay=0.1, beta1=0.8, beta2=0.99, eps=1e-6)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(257, generator=gen) for _ in range(5)]
    start = torch.randn(257, generator=gen)
    state = OptimizerState(257)
    if resumed:
        state.exp_avg.copy_(torch.randn(257, generator=gen) * 0.1)
        state.exp_avg_sq.copy_(torch.rand(257, generator=gen) * 0.01)
        state.step.fill_(4)
    ours = start.clone().requires_grad_(True)
    opt = build_adamw(ours, cfg, state)
    ref = start.clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False)
    if resumed:
        ref_opt.state[ref] = {"step": torch.tensor(4.0), "exp_avg": state.exp_avg.clone(),
                              "exp_avg_sq": state.exp_avg_sq.clone()}
    for g in grads:
        for p, o in ((ours, opt), (ref, ref_opt)):
            p.grad = g.clone()
            o.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(ours.detach(), start)
    export_state(opt, ours, state)
    assert state.num_steps == 5 + 4 * resumed
    torch.testing.assert_close(state.exp_avg, ref_opt.state[ref]["exp_avg"], rtol=0, atol=1e-7)
