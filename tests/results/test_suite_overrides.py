"""`pflbed bench --set KEY=VALUE`: each rule of where a key lands in a bench suite's tree, a label holding dots
matched whole, and every key that is none of the suite's refused in one line naming it and what the suite has.
(`pflbed tune --set`, made of the same pieces: `test_tune.py`.)"""

from __future__ import annotations

import copy

import pytest
import yaml

from pflbed.errors import ConfigError
from pflbed.results.bench import apply_overrides, load_suite

TREE = {
    "name": "s",
    "base": {"train": {"rounds": 5}},
    "seeds": [0, 1],
    "tables": {
        "main": {
            "base": {"federation": {"clients": 4}},
            "settings": {"Dir(0.3)": {"federation.alpha": 0.3}, "Dir(0.1)": {"federation.alpha": 0.1}},
            "methods": {"FedAvg": {"set": {"algorithm.name": "fedavg"}}, "FedAvg+FT": {"same_as": "FedAvg"},
                        "Local": None},
            "report": {"P-FL": "final.pfl_acc"},
        },
        "extra": {"methods": {"FedAvg": {}, "FedAvg.v2": {}}},  # a label holding another's and a dot
    },
}  # fmt: skip


@pytest.mark.parametrize(("item", "path", "value"), [
    ("base.train.rounds=2", ("base", "train", "rounds"), 2),  # a run config key, nested as the base is
    ("base.eval.every=1", ("base", "eval", "every"), 1),  # a section the base did not have
    ("seeds=[3]", ("seeds",), [3]),
    ("name=t", ("name",), "t"),
    ("out=elsewhere", ("out",), "elsewhere"),
    ("tables.main.base.train.lr=0.5", ("tables", "main", "base", "train", "lr"), 0.5),
    ("tables.main.seeds=[7]", ("tables", "main", "seeds"), [7]),
    ("tables.main.settings.Dir(0.3).federation.alpha=0.5", ("tables", "main", "settings", "Dir(0.3)",
                                                            "federation.alpha"), 0.5),  # the label's dot, and one key
    ("tables.main.methods.FedAvg.set.train.lr=0.1", ("tables", "main", "methods", "FedAvg", "set", "train.lr"), 0.1),
    ("tables.main.methods.FedAvg+FT.report.P-FL=final.ft.pfl_acc", ("tables", "main", "methods", "FedAvg+FT",
                                                                   "report", "P-FL"), "final.ft.pfl_acc"),
    ("tables.main.methods.Local.set.algorithm.name=local", ("tables", "main", "methods", "Local", "set",
                                                           "algorithm.name"), "local"),  # `Local:` with no body
    ("tables.main.methods.FedAvg+FT.same_as=Local", ("tables", "main", "methods", "FedAvg+FT", "same_as"), "Local"),
    ("tables.main.methods.FedAvg.set={algorithm.name: local}", ("tables", "main", "methods", "FedAvg", "set"),
     {"algorithm.name": "local"}),  # a row's whole set
    ("tables.main.methods.FedAvg.report.sel. P-FL=final.x", ("tables", "main", "methods", "FedAvg", "report",
                                                            "sel. P-FL"), "final.x"),  # a column: one key, dots too
    ("tables.extra.methods.FedAvg.v2.set.train.lr=1", ("tables", "extra", "methods", "FedAvg.v2", "set", "train.lr"),
     1),  # the longest label the key starts with
    ("tables.main.report.sel. G-FL=final.gfl_acc", ("tables", "main", "report", "sel. G-FL"), "final.gfl_acc"),
    ("tables.main.column_scale.sel. P-FL=1", ("tables", "main", "column_scale", "sel. P-FL"), 1),
    ("tables.extra.title=Another", ("tables", "extra", "title"), "Another"),
])  # fmt: skip
def test_a_key_lands_where_its_path_says(item, path, value):
    before = copy.deepcopy(TREE)
    tree, keys = apply_overrides(TREE, [item])
    node = tree
    for p in path:
        node = node[p]
    assert node == value and keys == [item.partition("=")[0]]
    assert before == TREE  # the caller's tree is never changed


def test_labels_are_kept_dropped_or_replaced_in_the_order_given():
    tree, _ = apply_overrides(TREE, ["tables=[extra, main]", "tables.main.methods=[Local, FedAvg]",
                                     "tables.main.settings.Dir(0.1)=null", "tables.extra.methods.FedAvg=null",
                                     "tables.main.methods.Local={set: {algorithm.name: local}}"])  # fmt: skip
    assert list(tree["tables"]) == ["extra", "main"]
    assert tree["tables"]["main"]["methods"] == {"Local": {"set": {"algorithm.name": "local"}},
                                                 "FedAvg": {"set": {"algorithm.name": "fedavg"}}}  # fmt: skip
    assert list(tree["tables"]["main"]["settings"]) == ["Dir(0.3)"]
    assert tree["tables"]["extra"]["methods"] == {"FedAvg.v2": {}}
    assert apply_overrides(TREE, ["tables.main.settings=[Dir(0.1)]"])[0]["tables"]["main"]["settings"] == {
        "Dir(0.1)": {"federation.alpha": 0.1}}


@pytest.mark.parametrize(("item", "message"), [
    ("train.rounds=2", "--set train.rounds: not a key of a bench suite (name, base, seeds, tables, out); a run config "
                       "key goes under base (--set base.train.rounds=…) or a table's base (--set "
                       "tables.NAME.base.train.rounds=…)"),
    ("tables.mian.seeds=[0]", "--set tables.mian.seeds: no table 'mian' in the suite (main, extra)"),
    ("tables=[main, nope]", "--set tables: no table 'nope' in the suite (main, extra)"),
    ("tables.main.methods.FedAv.set.train.lr=1", "--set tables.main.methods.FedAv.set.train.lr: no method 'FedAv' in "
                                                 "table 'main' (FedAvg, FedAvg+FT, Local)"),
    ("tables.main.methods=[FedProx]", "--set tables.main.methods: no method 'FedProx' in table 'main' (FedAvg, "
                                      "FedAvg+FT, Local)"),
    ("tables.extra.settings.Dir(0.3).federation.alpha=1", "--set tables.extra.settings.Dir(0.3).federation.alpha: no "
                                                          "setting 'Dir(0' in table 'extra' (it has none)"),
    ("tables.extra.methods.FedAv.set.x=1", "--set tables.extra.methods.FedAv.set.x: no method 'FedAv' in table 'extra' "
                                           "(FedAvg, FedAvg.v2)"),
    ("seeds.0=1", "--set seeds.0: seeds is not a section"),
    ("tables.main.report.P-FL.x=1", "--set tables.main.report.P-FL.x: report is not a section"),
    ("tables.main.settings.Dir(0.1).federation.alpha=1", "--set tables.main.settings.Dir(0.1).federation.alpha: "
                                                         "Dir(0.1) is not a section"),
    ("tables.main.methods.FedAvg.set.train.lr=1", "--set tables.main.methods.FedAvg.set.train.lr: set is not a "
                                                  "section"),
    ("tables.main.base.federation.clients.x=1", "--set tables.main.base.federation.clients.x: clients is not a "
                                                "section"),
    ("tables.main.methods.FedAvg+FT.same_as.x=1", "--set tables.main.methods.FedAvg+FT.same_as.x: same_as is not a "
                                                  "section"),
])  # fmt: skip
def test_a_key_the_suite_does_not_have_is_one_line_naming_it(item, message):
    tree = copy.deepcopy(TREE)
    tree["tables"]["main"]["report"] = "final.pfl_acc"  # a column mapping that is no mapping
    tree["tables"]["main"]["settings"]["Dir(0.1)"] = "alpha 0.1"  # a setting that is no mapping
    tree["tables"]["main"]["methods"]["FedAvg"]["set"] = "fedavg"  # a row's set that is no mapping
    with pytest.raises(ConfigError) as e:
        apply_overrides(tree, [item])
    assert str(e.value) == message


def test_a_table_that_is_no_section_is_said_so():
    with pytest.raises(ConfigError, match=r"^--set tables\.main\.seeds: not a section$"):
        apply_overrides({**TREE, "tables": {"main": "x"}}, ["tables.main.seeds=[0]"])


def test_a_wrong_value_names_the_set_it_came_from_and_a_file_s_own_fault_names_the_file(tmp_path):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({**TREE, "tables": {"main": {"methods": {"FedAvg": {}}}}}))
    assert load_suite(path, ["seeds=[2]", "tables.main.seeds=[4]"]).tables["main"].seeds == [4]
    with pytest.raises(ConfigError, match=r"^--set seeds: each seed once"):
        load_suite(path, ["seeds=[1, 1]"])
    with pytest.raises(ConfigError, match=r"^--set tables\.main\.scale: Input should be a valid number"):
        load_suite(path, ["tables.main.scale=much"])
    with pytest.raises(ConfigError, match=r"^--set seeds\.0: Input should be greater than or equal to 0"):
        load_suite(path, ["seeds=[-1]"])  # an item of the list set
    with pytest.raises(ConfigError, match=r"^--set tables\.main: methods\.FedAvg\.same_as: must name a method that "
                                          r"has its own runs$"):  # the table's own check, of the key set
        load_suite(path, ["tables.main.methods.FedAvg.same_as=Nope"])
    path.write_text(yaml.safe_dump({**TREE, "seeds": [1, 1], "tables": {"main": {"methods": {"FedAvg": {}}}}}))
    with pytest.raises(ConfigError, match=rf"^{path}: seeds: each seed once"):
        load_suite(path, ["tables.main.seeds=[4]"])
    (tmp_path / "run").mkdir()  # a results directory: its suite, the overrides applied, its results there
    (tmp_path / "run" / "suite.yaml").write_text(yaml.safe_dump({**TREE, "tables": {"main": {"methods": {"A": {}}}}}))
    suite = load_suite(tmp_path / "run", ["seeds=[5]"])
    assert suite.seeds == [5] and suite.out == str(tmp_path / "run")
