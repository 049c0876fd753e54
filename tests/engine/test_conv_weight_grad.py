"""A convolution's weight gradient as a product (engine/conv_weight_grad.py): the convolution's own gradients, and
which convolutions a batched step computes that way. Batched training through it: test_batched.py
(`test_convolutions_whose_weight_gradient_is_a_product_are_each_clients_own_sgd`)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import grad, vmap

from pflbed.engine import conv_weight_grad
from pflbed.engine.conv_weight_grad import chosen, eligible, patched, product_conv, product_faster


def _gradients(conv, w, x, y):
    """Each client's value, weight and input gradients, and a second derivative (a Hessian-vector product's kind:
    the gradient of the weight gradient's square norm), for `conv(x, w)` against `y`, vmapped over the clients."""

    def loss(w, x):
        return (conv(x, w).sin() * y).sum()

    first = vmap(grad(loss, argnums=(0, 1)), in_dims=(0, 0))(w, x)
    second = vmap(grad(lambda w, x: grad(loss)(w, x).square().sum()))(w, x)
    return (*first, second)


@settings(max_examples=25, deadline=None)
@given(clients=st.integers(1, 3), n=st.integers(1, 4), c=st.integers(1, 3), o=st.integers(1, 4),
       h=st.integers(1, 7), w=st.integers(1, 7), kh=st.integers(1, 4), kw=st.integers(1, 4), ph=st.integers(0, 2),
       pw=st.integers(0, 2))  # fmt: skip
def test_the_product_s_gradients_are_the_convolution_s(clients, n, c, o, h, w, kh, kw, ph, pw):
    """Rule (`weight_grad`, `product_conv`): for any stride-1 shape (kernels rectangular, wider than the padded
    image excluded), padding different across and down, several samples a client, the product form's weight and
    input gradients and second derivative equal the vmapped convolution's to float64 rounding, and its value
    exactly."""
    if kh > h + 2 * ph or kw > w + 2 * pw:
        return
    torch.manual_seed(clients * 1000 + n * 100 + kh * 10 + kw)
    wt = torch.randn(clients, o, c, kh, kw, dtype=torch.float64)
    x = torch.randn(clients, n, c, h, w, dtype=torch.float64)
    y = torch.randn(clients, n, o, h + 2 * ph - kh + 1, w + 2 * pw - kw + 1, dtype=torch.float64)
    want = _gradients(lambda x, wt: F.conv2d(x, wt, None, 1, (ph, pw)), wt, x, y)
    got = _gradients(lambda x, wt: product_conv(x, wt, (ph, pw)), wt, x, y)
    for a, b in zip(want, got, strict=True):
        assert (a - b).abs().max() <= 1e-10 * (1 + a.abs().max())
    assert torch.equal(vmap(product_conv, in_dims=(0, 0, None))(x, wt.requires_grad_(), (ph, pw)),
                       vmap(F.conv2d, in_dims=(0, 0, None, None, None))(x, wt, None, 1, (ph, pw)))  # the value: exactly


def test_the_product_computes_only_the_gradients_asked_for(monkeypatch):
    """A step's first convolution takes no input gradient (its input is the data), and a frozen weight needs none:
    neither is computed (a frozen layer costs what the plain convolution costs)."""
    asked = []

    def spy(name, f):
        return lambda *a, **k: asked.append(name) or f(*a, **k)

    for name in ("conv2d_input", "conv2d_weight"):
        monkeypatch.setattr(torch.nn.grad, name, spy(name, getattr(torch.nn.grad, name)))
    monkeypatch.setattr(conv_weight_grad, "weight_grad", spy("weight", conv_weight_grad.weight_grad))
    wt, x = torch.randn(2, 3, 2, 3, 3), torch.randn(2, 4, 2, 5, 5)
    for argnums, want in ((0, ["weight"]), (1, ["conv2d_input"]), ((0, 1), ["conv2d_input", "weight"])):
        asked.clear()
        vmap(grad(lambda wt, x: product_conv(x, wt, (1, 1)).square().sum(), argnums=argnums))(wt, x)
        assert asked == want, argnums


class _Net(nn.Module):
    """Eligible convolutions (two of one shape) between ineligible ones, with BatchNorm and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.strided = nn.Conv2d(4, 4, 3, stride=2)
        self.dilated = nn.Conv2d(4, 4, 3, dilation=2)
        self.grouped = nn.Conv2d(4, 4, 1, groups=2)
        self.same = nn.Conv2d(4, 4, 3, padding="same")
        self.circular = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.d = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c(self.b(self.drop(self.norm(self.a(x)))))
        x = self.circular(self.same(self.grouped(self.dilated(self.strided(x)))))
        return self.d(x)


def test_only_stride_one_undilated_ungrouped_zero_padded_convolutions_are_eligible():
    net = _Net()
    assert [n for n, m in net.named_modules() if eligible(m)] == ["a", "b", "c", "d"]
    assert not eligible(nn.Conv1d(2, 2, 3)) and not eligible(nn.Linear(2, 2))


def test_chosen_times_each_eligible_shape_once_and_keeps_those_where_the_product_was_faster(monkeypatch):
    """Rule (`chosen`): the eligible convolutions where the timing said the product is faster; each shape (input
    channels and size, output, kernel, padding, clients, batch, whether its input is the model's own) timed once
    per process, the two of one shape sharing it; a new number of clients timed anew. The forward that finds the
    shapes moves no BatchNorm statistic, draws no dropout mask and leaves the model's mode as it was."""
    monkeypatch.setattr(conv_weight_grad, "_CHOICES", {})
    net = _Net().train()
    net.b.eval()  # a module in its own mode stays in it
    before = {k: v.clone() for k, v in net.state_dict().items()}
    asked = []

    def faster(key):
        asked.append(key)
        return key[4] == 4  # four output channels: a, b and c, not d

    sample = torch.randn(1, 2, 13, 13)
    assert chosen(net, sample, 5, 8, faster) == {"a", "b", "c"}
    assert {k[:2] for k in asked} == {("cpu", torch.float32)}  # the device and dtype the step runs in
    assert [(k[2:8], k[-1]) for k in asked] == [((5, 8, 4, 2, 13, 13), True), ((5, 8, 4, 4, 13, 13), False),
                                                ((5, 8, 3, 4, 2, 2), False)]  # fmt: skip
    assert net.training and not net.b.training and all(m.training for n, m in net.named_modules() if n != "b")
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert chosen(net, sample, 5, 8, faster) == {"a", "b", "c"} and len(asked) == 3  # remembered
    assert set(conv_weight_grad._CHOICES.values()) == {True, False}
    chosen(net, sample, 4, 8, faster)
    assert len(asked) == 6
    chosen(net.double(), sample.double(), 4, 8, faster)  # another dtype: timed anew
    assert len(asked) == 9 and {k[1] for k in asked[6:]} == {torch.float64}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16: cuDNN's kernels, not timed
        assert chosen(net, sample.double(), 7, 8, faster) == frozenset() and len(asked) == 9


def test_patched_convolutions_compute_the_same_and_their_own_forward_comes_back():
    """Rule (`patched`): the named convolutions run as `product_conv`, bias added, within the block only; the
    model's output and gradients are its own to float rounding."""
    torch.manual_seed(0)
    net = _Net().double().eval()
    x = torch.randn(3, 2, 13, 13, dtype=torch.float64)
    out = net(x)
    want = torch.autograd.functional.jacobian(lambda w: torch.func.functional_call(net, {"a.weight": w}, (x,)),
                                              net.a.weight)  # fmt: skip
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv_weight_grad, "product_conv", lambda *a: calls.append(a[1].shape) or product_conv(*a))
        with patched(net, frozenset({"a", "b", "d"})):
            got = torch.autograd.functional.jacobian(lambda w: torch.func.functional_call(net, {"a.weight": w}, (x,)),
                                                     net.a.weight)  # fmt: skip
            assert (net(x) - out).abs().max() <= 1e-12  # (with the biases of a and d)
        assert calls and {tuple(s) for s in calls} == {(4, 2, 3, 3), (4, 4, 3, 3), (3, 4, 1, 1)}
        calls.clear()
        net(x)
        assert not calls and "forward" not in vars(net.a)
    assert (got - want).abs().max() <= 1e-12


def test_a_timing_compares_the_two_forms_and_one_out_of_memory_keeps_the_grouped_convolution(monkeypatch):
    """Rule (`product_faster`): both forms run at the key's shape, and the product is chosen only where its time
    is the shorter; a form that runs out of memory keeps cuDNN's."""
    key = ("cpu", torch.float32, 2, 4, 3, 2, 6, 6, (3, 3), (1, 1), False)
    assert product_faster(key, reps=1) in (True, False)  # (on the CPU it can go either way)
    ran = []
    monkeypatch.setattr(conv_weight_grad, "weight_grad", lambda *a: ran.append(1) or torch.zeros(a[2]))
    times = iter([2.0, 1.0, 1.0, 2.0, 1.0, 1.0])  # grouped, then product
    monkeypatch.setattr(conv_weight_grad, "_seconds", lambda step, args, reps: (step(*args), next(times, 1.0))[1])
    assert [product_faster(key) for _ in range(3)] == [True, False, False] and len(ran) == 3

    def oom(*a, **k):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(conv_weight_grad, "weight_grad", oom)
    assert product_faster(key, reps=1) is False


def test_a_product_whose_patches_would_crowd_the_gpu_s_memory_is_not_timed(monkeypatch):
    """Rule (`product_faster`, `_fits`): the product's patches (clients · in·k² · the tall image's rows of patches ·
    their width) must take at most an eighth of the GPU's free memory, else the grouped convolution is kept
    without a timing — before anything is allocated on the device."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[0], 10**12))
    key = ("cuda", torch.float32, 100, 32, 64, 32, 16, 16, (5, 5), (2, 2), False)
    need = 100 * 32 * 25 * (32 * 20 - 4) * 16 * 4  # 3.3 GB: FedAvg's CNN, conv2, 100 clients × 32 samples
    free = [8 * need - 1]
    assert product_faster(key) is False  # (on a machine without CUDA, any allocation would fail the test)
    cuda = torch.device("cuda")
    assert not conv_weight_grad._fits(need, cuda)
    free[0] = 8 * need
    assert conv_weight_grad._fits(need, cuda) and conv_weight_grad._fits(10**15, torch.device("cpu"))


def test_the_memory_bound_is_the_size_of_the_patches_the_product_takes(monkeypatch):
    """Rule (`product_faster`): the bytes checked against the free memory are those of the patches `weight_grad`
    unfolds, for every client — for a key rectangular in kernel, padding and image."""
    unfolded, checked = [], []
    unfold = F.unfold
    monkeypatch.setattr(conv_weight_grad.F, "unfold",
                        lambda *a, **k: unfolded.append(unfold(*a, **k)) or unfolded[-1])  # fmt: skip
    monkeypatch.setattr(conv_weight_grad, "_fits", lambda nbytes, device: checked.append(nbytes) and False)
    clients, batch, c, h, w, k, padding = 3, 4, 2, 6, 7, (3, 2), (2, 1)
    product_faster(("cpu", torch.float64, clients, batch, 5, c, h, w, k, padding, False))
    conv_weight_grad.weight_grad(torch.randn(batch, c, h, w), torch.randn(batch, 5, h + 2, w + 1), (5, c, *k),
                                 padding)  # fmt: skip
    assert checked == [clients * unfolded[0].numel() * 8]


@pytest.mark.parametrize("first", [False, True])
def test_the_two_timed_forms_are_the_step_s_gradient_at_the_key_s_shape(monkeypatch, first):
    """Rule (`product_faster`): what is timed is the step's own work at the key's shape, device and dtype: the
    weight gradient, and the input's unless the convolution's input is the model's (`first`), of the convolution
    with the key's padding (a key rectangular in kernel, padding and image), the same in both forms."""
    ran = []
    monkeypatch.setattr(conv_weight_grad, "_seconds",
                        lambda step, args, reps: (ran.append((step(*args), args)), 1.0)[1])  # fmt: skip
    key = ("meta", torch.float64, 3, 4, 5, 2, 6, 7, (3, 2), (1, 0), first)
    product_faster(key)
    shapes = [(3, 5, 2, 3, 2)] if first else [(3, 5, 2, 3, 2), (3, 4, 2, 6, 7)]
    for out, args in ran:
        assert [tuple(a.shape) for a in args] == [(3, 5, 2, 3, 2), (3, 4, 2, 6, 7)]
        out = [out] if first else list(out)
        assert [tuple(o.shape) for o in out] == shapes
        assert all(o.device.type == "meta" and o.dtype == torch.float64 for o in [*out, *args])
    ran.clear()
    torch.manual_seed(0)
    product_faster(("cpu", torch.float64, 3, 4, 5, 2, 6, 7, (3, 2), (1, 0), first))
    (grouped, _), (product, _) = ran
    for a, b in zip([grouped] if first else grouped, [product] if first else product, strict=True):
        assert (a - b).abs().max() <= 1e-10 * a.abs().max()


def test_a_timing_is_the_best_of_its_timed_calls_after_two_untimed_ones(monkeypatch):
    """Rule (`_seconds`): `reps` timed calls after two warm-ups, each from the device's wait before it to the
    wait after it; the shortest."""
    clock = iter([0, 10, 10, 19, 19, 22, 22, 27, 27, 31])  # five calls: 10 and 9 (untimed), 3, 5 and 4
    monkeypatch.setattr(conv_weight_grad.time, "perf_counter", lambda: next(clock))
    calls = []
    assert conv_weight_grad._seconds(lambda t: calls.append(t), (torch.zeros(1),), reps=3) == 3
    assert len(calls) == 5


def test_timing_waits_for_the_gpu_it_runs_on(monkeypatch):
    """Rule (`_sync`, `_fits`): a GPU's timing waits for that GPU, and its memory is that GPU's; a CPU waits for
    nothing."""
    asked = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: asked.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(("free", device)) or (800, 10**12))
    gpu = torch.device("cuda", 1)
    conv_weight_grad._sync(gpu)
    conv_weight_grad._sync(torch.device("cpu"))
    assert conv_weight_grad._fits(100, gpu) and not conv_weight_grad._fits(101, gpu)
    assert asked == [("sync", gpu), ("free", gpu), ("free", gpu)]
