"""`pflbed data show`'s table and the heat-map's order, on a stand-in source and federation whose every count is
known: participated clients first, then new ones, each group by domain then id; each client's sizes and non-zero
class counts; the shared per-domain test/val sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pflbed.results.partition_plot import _order, client_counts, plot_partition, print_partition, tick_step
from tests.printed import table_cells


def _client(train: list[int], val: int, test: int, domain: int) -> SimpleNamespace:
    return SimpleNamespace(train=torch.tensor(train, dtype=torch.long), val=[0] * val, test=[0] * test, domain=domain)


def _toy(domain_names: list[str] | None) -> tuple[SimpleNamespace, SimpleNamespace]:
    source = SimpleNamespace(name="toy", num_classes=3, domain_names=domain_names,
                             train=SimpleNamespace(y=torch.tensor([0, 0, 1, 2, 2, 2, 1, 0])))  # fmt: skip
    clients = [_client([0, 1, 2], 1, 2, domain=1), _client([3, 4], 3, 4, domain=0),
               _client([5, 6, 7], 5, 6, domain=0), _client([], 7, 8, domain=1)]  # fmt: skip
    fed = SimpleNamespace(clients=clients, participated=[0, 2], new=[1, 3], domain_test=[[0, 1, 2], [3]],
                          domain_val=[[4], [5, 6]])  # fmt: skip
    return source, fed


def test_clients_are_ordered_participated_then_new_each_by_domain_then_id():
    source, fed = _toy(["a", "b"])
    assert _order(fed) == [2, 0, 1, 3]
    assert client_counts(source, fed).tolist() == [[2, 1, 0], [0, 0, 2], [1, 1, 1], [0, 0, 0]]


def test_data_show_s_table_gives_each_client_s_role_domain_sizes_and_class_counts_then_the_shared_sets(capsys):
    print_partition(*_toy(["a", "b"]))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip() == "toy: 2 participated + 2 new clients"
    assert table_cells(lines) == (["client", "role", "domain", "train", "val", "test", "class counts"], [
        ["2", "participated", "a", "3", "5", "6", "0:1 1:1 2:1"],
        ["0", "participated", "b", "3", "1", "2", "0:2 1:1"],
        ["1", "new", "a", "2", "3", "4", "2:2"],
        ["3", "new", "b", "0", "7", "8", ""],
    ])  # fmt: skip
    assert lines[-1] == "shared test/val sets per domain (class-balanced): a: 3/1, b: 1/2"
    for line in (x for x in lines if x.startswith("│")):  # numbers to the right of their column, words to the left
        for k, raw in enumerate(line.split("│")[1:-1]):
            value, width = raw.strip(), len(raw) - 2
            assert raw == f" {value.rjust(width) if k in (0, 3, 4, 5) else value.ljust(width)} ", (k, raw)


def test_without_domain_names_the_domain_column_is_empty_and_the_shared_sets_go_by_number(capsys):
    print_partition(*_toy(None))
    lines = capsys.readouterr().out.splitlines()
    assert [row[2] for row in table_cells(lines)[1]] == ["", "", "", ""]
    assert lines[-1] == "shared test/val sets per domain (class-balanced): 0: 3/1, 1: 1/2"
    source, fed = _toy(None)
    fed.domain_test = fed.domain_val = []  # no shared sets: no line for them
    print_partition(source, fed)
    assert capsys.readouterr().out.splitlines()[-1].startswith("└")


def test_the_heat_map_is_a_png_at_the_path_its_directories_made_and_a_second_one_replaces_it(tmp_path, monkeypatch):
    import matplotlib

    monkeypatch.setitem(matplotlib.rcParams, "savefig.dpi", 50)  # a user's matplotlibrc: not the report's size
    path = tmp_path / "new" / "dir" / "p.png"
    for _ in range(2):
        assert plot_partition(*_toy(["a", "b"]), path) == path
        png = path.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert int.from_bytes(png[16:20], "big") == 600  # 6 in wide (4 clients) at 100 dpi, shown at its size


def test_shared_test_and_val_sets_must_pair_up_by_domain():
    source, fed = _toy(["a", "b"])
    fed.domain_val = fed.domain_val[:1]
    with pytest.raises(ValueError, match="zip"):
        print_partition(source, fed)


@pytest.mark.parametrize(("n", "axis", "label", "step"), [
    (10, 5.0, 1.0, 2),  # 2 items are exactly a label's width: enough
    (10, 5.0, 0.4, 1),
    (100, 9.0, 0.3, 5),
    (0, 1.0, 0.6, 1),  # no items: the axis counts as one item's width
    (100_000, 1.0, 1.0, 10_000),  # nothing fits: the largest step
])  # fmt: skip
def test_the_tick_step_is_the_smallest_round_one_that_gives_each_label_its_width(n, axis, label, step):
    assert tick_step(n, axis, label) == step
