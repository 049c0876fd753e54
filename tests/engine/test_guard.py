"""The divergence guard on BatchNorm running variances: training only averages squares into them, so a negative one
comes from a rule that extrapolated the statistics, and it stops the run like a non-finite value."""

import pytest
import torch

import pflbed
from pflbed.algorithms.fedavg import FedAvg
from pflbed.engine.guard import (
    check_client,
    check_clients_later,
    check_server,
    finite,
    first_negative_variance,
    screen_finite,
)
from pflbed.errors import DivergedError

from ..algorithms.test_scaffold import BN_RUN


def test_negative_running_variances_are_found_under_any_prefix_and_nothing_else_is():
    ok = {"blocks.fc.weight": -torch.ones(3), "bn.running_mean": -torch.ones(2), "bn.running_var": torch.zeros(2),
          "bn.num_batches_tracked": torch.tensor(-1), "not_running_var": -torch.ones(1)}  # fmt: skip
    assert first_negative_variance(ok) is None  # zero is a valid variance; other keys may be negative
    bad = {**ok, "buf.b.running_var": torch.tensor([1.0, -1e-6]), "a.running_var": torch.tensor([-2.0, 1.0])}
    assert first_negative_variance(bad) == "a.running_var"  # sorted order, like the non-finite check
    assert first_negative_variance({"running_var": torch.tensor([-1.0])}) == "running_var"
    with pytest.raises(DivergedError, match="round 3: the aggregated server state has negative BatchNorm running "
                                            "variances in 'a.running_var' — lower"):  # fmt: skip
        check_server(3, bad)
    # a reply or a client state may hold changes (FedMTL's Δ_i, SCAFFOLD's control variates): negative is fine there
    check_client(3, 5, bad, bad)
    nan = {**bad, "z.running_var": torch.tensor([float("nan")])}
    with pytest.raises(DivergedError, match="non-finite values in 'z.running_var'"):  # NaN is reported as such
        check_server(3, nan)


def test_a_server_rule_that_makes_a_variance_negative_stops_the_run(monkeypatch):
    """A round whose aggregate holds a negative running variance (what extrapolating the statistics gave, finite
    and silent: G-FL at chance, exit 0) raises DivergedError in that round."""
    aggregator = FedAvg.aggregator

    def extrapolated(self, rnd, server, weights):
        mean = aggregator(self, rnd, server, weights)
        result = mean.result
        mean.result = lambda: {k: 2 * v - 3 * server[k] if k.endswith("running_var") else v
                               for k, v in result().items()}  # fmt: skip
        return mean

    monkeypatch.setattr(FedAvg, "aggregator", extrapolated)
    message = r"diverged in round 1: the aggregated server state has negative BatchNorm running variances in 'blocks"
    with pytest.raises(DivergedError, match=message):
        pflbed.run({**BN_RUN, "algorithm": {"name": "fedavg"}}, write=False)


def test_the_guard_reads_one_value_per_check_where_all_is_well_and_still_names_the_bad_key(monkeypatch):
    """On a GPU every value read is a wait for the device: a client's reply and state are screened with one read,
    the server state's finiteness and its variances with one each (not one per tensor); a NaN, an infinity, a sum
    that overflows without either, and a negative variance are still found, under their keys."""
    reads = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real(t))
    g = torch.Generator().manual_seed(0)
    reply = {f"t{i}.weight": torch.randn(4, 3, generator=g) for i in range(10)}
    state = {f"s{i}.running_var": torch.rand(3, generator=g) for i in range(5)}
    check_client(1, 0, reply, state)
    assert len(reads) == 1
    reads.clear()
    check_server(1, {**reply, **state})
    assert len(reads) == 2
    for bad, key in ((float("nan"), "t3.weight"), (float("inf"), "t3.weight")):
        with pytest.raises(DivergedError, match=f"round 1: client 0's reply has non-finite values in '{key}'"):
            check_client(1, 0, {**reply, key: torch.full((2,), bad)}, state)
    big = torch.full((4,), 3e38)  # finite, its sum is not
    check_client(1, 0, {**reply, "t0.weight": big}, state)
    with pytest.raises(DivergedError, match="client 0's state has non-finite values in 's2.running_var'"):
        check_client(1, 0, reply, {**state, "s2.running_var": torch.tensor([1.0, float("-inf")])})
    with pytest.raises(DivergedError, match="negative BatchNorm running variances in 's4.running_var'"):
        check_server(1, {**reply, **state, "s4.running_var": torch.tensor([0.5, -1e-7])})


def test_the_first_negative_variance_is_named_past_a_zero_one():
    """A zero variance is valid: the key named is the first with a negative value, not the first with a zero."""
    tensors = {"a.running_var": torch.zeros(3), "b.running_var": torch.tensor([1.0, -1e-7])}
    assert first_negative_variance(tensors) == "b.running_var"


def test_a_finite_tensor_is_screened_by_its_sum_alone(monkeypatch):
    """`finite`: the element-wise check (a boolean tensor the size of `v`, ~60× a sum's cost) runs only where the sum
    is not finite; then it decides (an overflowing sum of finite values is finite)."""
    sizes = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: sizes.append(t.numel()) or real(t))
    assert finite(torch.ones(1000))
    assert sizes == [1]
    sizes.clear()
    assert finite(torch.full((4,), 3e38))  # its sum overflows
    assert sizes == [1, 4]
    sizes.clear()
    assert not finite(torch.tensor([1.0, float("nan")]))
    assert sizes == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_screen_finds_a_nan_or_an_infinity_in_any_float_tensor_among_many(dtype):
    """`screen_finite` over tensors of several float types (one norm for them all): False where any one holds a NaN
    or ±inf, whatever its type and place; True where all are finite, integers and nothing at all included."""
    many = [torch.ones(5), torch.zeros(0), torch.ones(3, dtype=torch.float64), torch.arange(4), *[torch.ones(2)] * 30]
    assert screen_finite(many + [torch.ones(3, dtype=dtype)]) and screen_finite([]) and screen_finite([torch.arange(3)])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 17, len(many)):
            tensors = [*many[:at], torch.tensor([1.0, bad], dtype=dtype), *many[at:]]
            assert not screen_finite(tensors)
    # the norm is L1: values whose squares pass float32's range (an L2 norm's inf, then a look at every tensor) are
    # still screened finite
    assert screen_finite([*many, torch.full((4,), 1e20, dtype=dtype if dtype != torch.float16 else torch.float32)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_check_read_later_names_what_check_client_names_on_the_first_bad_client(dtype):
    """`check_clients_later`: computed over every client's reply and state at once, read once when it is called;
    it raises as `check_client` raises on the first client of the list it finds a non-finite value in (a NaN, ±inf;
    reply before state, keys in sorted order), passes finite values at the top of each type's range (their L1 norm
    overflows the type itself), integers and empty tensors, and holds none of the tensors meanwhile."""
    import weakref

    top = torch.finfo(dtype).max
    other = torch.float64 if dtype != torch.float64 else torch.float32  # a second group of tensors

    def client(i):
        return ({"b.weight": torch.ones(3, dtype=dtype), "a.bias": torch.full((5,), top, dtype=dtype),
                 "n": torch.arange(3), "w": torch.ones(2, dtype=other), "e": torch.zeros(0, dtype=dtype)},
                {"s.running_var": torch.ones(2, dtype=dtype), "t": torch.full((4,), -top, dtype=dtype)})  # fmt: skip

    clients = [(c, *client(c)) for c in (7, 2, 9)]
    check_clients_later(1, clients)()
    held = weakref.ref(clients[0][1]["a.bias"])
    check = check_clients_later(1, clients)
    del clients
    assert held() is None  # nothing kept alive until the read
    check()
    for bad in (float("nan"), float("inf"), float("-inf")):
        clients = [(c, *client(c)) for c in (7, 2, 9)]
        clients[1][2]["t"][1] = bad  # client 2's state
        clients[2][1]["b.weight"][0] = bad  # client 9's reply, after
        clients[2][1]["w"][0] = bad  # and one of the other type
        assert _named_later(clients) == _named_one_by_one(clients)
        assert "round 4: client 2's state has non-finite values in 't'" in _named_later(clients)
        clients[1][1]["b.weight"][2] = bad  # client 2's reply now too: named first, the keys in sorted order
        clients[1][1]["a.bias"][0] = bad
        assert _named_later(clients) == _named_one_by_one(clients)
        assert "client 2's reply has non-finite values in 'a.bias'" in _named_later(clients)
    check_clients_later(1, [])()


def _named_later(clients):
    with pytest.raises(DivergedError) as got:
        check_clients_later(4, clients)()
    return str(got.value)


def _named_one_by_one(clients):
    with pytest.raises(DivergedError) as want:
        for c, reply, state in clients:
            check_client(4, c, reply, state)
    return str(want.value)
