"""summary.json rules on hand-built histories (results/summary.py): the round selected on validation, and which
evaluation each reported figure comes from."""

from types import SimpleNamespace

import pytest

from pflbed.config import Config
from pflbed.results.summary import build_summary, select_round


def _row(rnd, pfl_val, gfl_val, pfl_acc, gfl_acc, **extra):
    return {"round": rnd, "pfl_val": pfl_val, "gfl_val": gfl_val, "pfl_acc": pfl_acc, "gfl_acc": gfl_acc, **extra}


# Round 4 and 6 tie on pfl_val; round 2 has the best gfl_val, round 8 the best test figures.
HISTORY = [
    _row(2, 0.5, 0.9, 0.6, 0.7),
    _row(4, 0.8, 0.1, 0.5, 0.55),
    _row(6, 0.8, 0.2, 0.65, 0.6),
    _row(8, 0.3, 0.3, 0.9, 0.95),
]


def test_select_round_on_pfl_validation_earliest_on_ties_reporting_its_test():
    """Rule (select_round): the evaluation with the best *validation* P-FL accuracy, the earliest of ties (4, not
    6), reporting that round's test figures — not the best test (round 8), not the last round, not gfl_val's pick."""
    assert select_round(HISTORY) == {"round": 4, "criterion": "pfl_val", "gfl_acc": 0.55, "pfl_acc": 0.5}


def test_select_round_falls_back_to_gfl_val_without_pfl_val():
    """No evaluation has a P-FL val figure (e.g. no client has a val split) → the best gfl_val, earliest on ties;
    an evaluation without the criterion never wins."""
    history = [_row(2, None, 0.4, 0.9, 0.9), _row(4, None, 0.7, 0.2, 0.3), _row(6, None, 0.7, 0.4, 0.5),
               _row(8, None, None, 1.0, 1.0)]  # fmt: skip
    assert select_round(history) == {"round": 4, "criterion": "gfl_val", "gfl_acc": 0.3, "pfl_acc": 0.2}


def test_select_round_skips_evaluations_missing_pfl_val():
    """As soon as some evaluation has pfl_val, that is the criterion; evaluations without it are never picked,
    however good their gfl_val or test figures."""
    history = [_row(2, None, 0.99, 0.9, 0.9), _row(4, 0.1, 0.0, 0.2, 0.3), _row(6, 0.3, 0.0, 0.4, 0.5)]
    assert select_round(history) == {"round": 6, "criterion": "pfl_val", "gfl_acc": 0.5, "pfl_acc": 0.4}
    assert select_round(history[:1] + history[1:2])["round"] == 4  # a val of 0.1 beats a missing one


def test_select_round_keeps_a_missing_test_figure_missing():
    """Methods without a generic model have gfl_acc None: the selected entry says so rather than inventing one."""
    assert select_round([_row(2, 0.5, None, 0.4, None)]) == {"round": 2, "criterion": "pfl_val", "gfl_acc": None,
                                                              "pfl_acc": 0.4}  # fmt: skip


def _summary(history, finetuned=None, per_client=None, new_clients=None):
    cfg = Config(algorithm={"name": "fedavg"}, dataset={"name": "synthetic"}, model={"name": "mlp"}, seed=3,
                 train={"rounds": 8}, eval={"pfl_test": "global"})  # fmt: skip
    fed = SimpleNamespace(participated=[0, 2, 5], new=[1, 3])
    timing = {"wall_s": 1.0, "train_s": 0.5, "eval_s": 0.2, "s_per_round": 0.0625}
    return build_summary(cfg, fed, history, finetuned or {}, per_client or {}, timing, new_clients)


def test_build_summary_final_is_the_last_evaluation_and_selected_is_chosen_on_val():
    """Rule (build_summary): `final` = the last evaluation's G-FL / P-FL fields (and its diag, if any); `final.ft` /
    `final.lp` = the P-FL fields of the personalized evaluation; `selected` = select_round; `per_client` = final P-FL
    per client in the given order; communication from the last evaluation; run facts from the config."""
    last = _row(8, 0.3, 0.35, 0.9, 0.95, pfl_acc_std=0.1, pfl_acc_min=0.6, pfl_acc_p10=0.65, diag={"k": 1.5},
                up_bytes_per_round=100, down_bytes_per_round=200)  # fmt: skip
    first = _row(2, 0.9, 0.8, 0.1, 0.2, pfl_acc_std=0.4, pfl_acc_min=0.0, pfl_acc_p10=0.05, diag={"k": 0.0},
                 up_bytes_per_round=1, down_bytes_per_round=2)  # fmt: skip
    ft = {"pfl_acc": 0.91, "pfl_acc_std": 0.02, "pfl_acc_min": 0.8, "pfl_acc_p10": 0.85, "pfl_val": 0.88, "x": 1}
    nc = {"clients": 2, "zero_shot": None, "methods": {}}
    s = _summary([first, last], {"ft": ft}, {5: 0.7, 0: 0.9, 2: 0.8}, nc)
    f = s["final"]
    assert {k: f[k] for k in ("gfl_acc", "gfl_val", "pfl_acc", "pfl_acc_std", "pfl_acc_min", "pfl_acc_p10",
                              "pfl_val")} == {"gfl_acc": 0.95, "gfl_val": 0.35, "pfl_acc": 0.9, "pfl_acc_std": 0.1,
                                              "pfl_acc_min": 0.6, "pfl_acc_p10": 0.65, "pfl_val": 0.3}  # fmt: skip
    assert f["ft"] == {k: ft[k] for k in ("pfl_acc", "pfl_acc_std", "pfl_acc_min", "pfl_acc_p10", "pfl_val")}
    assert "lp" not in f and f["diag"] == {"k": 1.5}
    assert s["selected"] == {"round": 2, "criterion": "pfl_val", "gfl_acc": 0.2, "pfl_acc": 0.1}
    assert s["per_client"] == {"cid": [5, 0, 2], "pfl_acc": [0.7, 0.9, 0.8]}
    assert s["communication"] == {"up_bytes_per_round": 100, "down_bytes_per_round": 200}
    assert s["new_clients"] == nc and s["clients"] == {"participated": 3, "new": 2}
    assert (s["algorithm"], s["dataset"], s["model"], s["seed"], s["rounds"], s["pfl_test"]) == (
        "fedavg", "synthetic", "mlp", 3, 8, "global")
    assert s["timing"]["wall_s"] == 1.0


def test_build_summary_diag_only_from_the_last_evaluation():
    """`final.diag` is the final round's diagnostics: an earlier evaluation's diag is not carried forward."""
    s = _summary([_row(2, 0.5, 0.5, 0.5, 0.5, diag={"k": 1.0}), _row(4, 0.5, 0.5, 0.5, 0.5)])
    assert "diag" not in s["final"]
    assert s["final"]["pfl_acc_std"] is None  # a field the evaluation lacks is reported missing, not invented
    assert s["selected"]["round"] == 2 and s["new_clients"] is None


@pytest.mark.parametrize("criterion", ["pfl_val", "gfl_val"])
def test_selected_round_never_depends_on_test_figures(criterion):
    """Permuting test figures across evaluations leaves the selected round unchanged (only val decides)."""
    other = "gfl_val" if criterion == "pfl_val" else "pfl_val"
    vals = [0.2, 0.6, 0.4]
    for tests in ([0.9, 0.1, 0.5], [0.1, 0.5, 0.9], [0.5, 0.9, 0.1]):
        history = [{"round": r, criterion: v, other: None, "pfl_acc": t, "gfl_acc": t}
                   for r, v, t in zip((1, 2, 3), vals, tests, strict=True)]  # fmt: skip
        sel = select_round(history)
        assert sel["round"] == 2 and sel["criterion"] == criterion and sel["pfl_acc"] == tests[1]
