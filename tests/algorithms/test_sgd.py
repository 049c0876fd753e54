"""`pflbed.algorithms.sgd.SGD` against `torch.optim.SGD`: the same bits, step after step, and no `torch._dynamo`."""

import subprocess
import sys

import pytest
import torch

from pflbed.algorithms.sgd import SGD


def _params(seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (3,), (2, 2, 2), (1,)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_(True) for s in shapes]


def _groups(params, split):
    if not split:
        return params
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.3, "momentum": 0.5, "weight_decay": 0.0}]


def _train(make, params, steps, seed):
    """`steps` steps of `make(params)` on a fixed quadratic-ish loss; the last parameter gets no gradient at step 1
    (a parameter left out of one step keeps its value and, with momentum, its buffer)."""
    opt = make(params)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        targets = [torch.randn(p.shape, generator=g).to(p.device, p.dtype) for p in params]
        used = params if step != 1 else params[:-1]
        pairs = enumerate(zip(used, targets[: len(used)], strict=True))
        loss = sum(((p - t) ** 2 * (i + 1)).sum() + p.abs().sum() for i, (p, t) in pairs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("momentum,weight_decay,split", [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 5e-4, False),
                                                         (0.0, 1e-2, False), (0.9, 5e-4, True)])  # fmt: skip
def test_the_same_bits_as_torch_optim_sgd_step_after_step(momentum, weight_decay, split):
    kw = dict(lr=0.05, momentum=momentum, weight_decay=weight_decay)
    ours = _train(lambda ps: SGD(_groups(ps, split), **kw), _params(0), steps=6, seed=1)
    torch_s = _train(lambda ps: torch.optim.SGD(_groups(ps, split), **kw), _params(0), steps=6, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(ours, torch_s, strict=True))
    moved = _params(0)
    assert not any(torch.equal(a, b) for a, b in zip(ours, moved, strict=True))  # the run did train


def test_zero_grad_without_set_to_none_zeroes_in_place():
    p = torch.ones(3, requires_grad=True)
    opt = SGD([p], lr=0.1)
    p.sum().backward()
    grad = p.grad
    opt.zero_grad(set_to_none=False)
    assert p.grad is grad and torch.equal(grad, torch.zeros(3))
    opt.zero_grad()
    assert p.grad is None


def test_an_unknown_group_option_is_refused():
    with pytest.raises(ValueError, match="nesterov"):
        SGD([{"params": [torch.ones(1, requires_grad=True)], "nesterov": True}], lr=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_foreach_path_gives_torch_optim_sgds_bits_on_cuda():
    kw = dict(lr=0.05, momentum=0.9, weight_decay=5e-4)
    ours = _train(lambda ps: SGD(_groups(ps, True), **kw), _params(0, "cuda"), steps=6, seed=1)
    torch_s = _train(lambda ps: torch.optim.SGD(_groups(ps, True), **kw), _params(0, "cuda"), steps=6, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(ours, torch_s, strict=True))


def test_local_training_does_not_import_torch_dynamo():
    """A second of CPU in every fresh process that trains (each Flower ClientApp message): see `sgd.py`."""
    code = ("import sys, torch\n"
            "from pflbed import run\n"
            "run({'dataset': {'name': 'synthetic'}, 'model': {'name': 'mlp'}, 'federation': {'clients': 4},\n"
            "     'train': {'rounds': 1}, 'eval': {'finetune': ['ft']}, 'executor': {'name': 'loop', 'threads': 1}},\n"
            "    write=False, progress=False)\n"
            "print('torch._dynamo' in sys.modules)\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
