"""summary.json rules on hand-built histories (results/summary.py): the round selected on validation, and which
evaluation each reported figure comes from."""

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

import pflbed
from pflbed.config import Config
from pflbed.results.summary import build_summary, print_table, select_round


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
    # three evaluations, so that "the last" cannot be confused with the second (history[1])
    middle = _row(4, 0.5, 0.5, 0.5, 0.5, pfl_acc_std=0.3, pfl_acc_min=0.2, pfl_acc_p10=0.25, diag={"k": 0.5},
                  up_bytes_per_round=10, down_bytes_per_round=20)  # fmt: skip
    ft = {"pfl_acc": 0.91, "pfl_acc_std": 0.02, "pfl_acc_min": 0.8, "pfl_acc_p10": 0.85, "pfl_val": 0.88, "x": 1}
    nc = {"clients": 2, "zero_shot": None, "methods": {}}
    s = _summary([first, middle, last], {"ft": ft}, {5: 0.7, 0: 0.9, 2: 0.8}, nc)
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
    assert s["timing"]["wall_s"] == 1.0 and s["pflbed_version"] == pflbed.__version__


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


# --- the printed results (print_table / print_new_clients): every printed number is a reported number -----------
def _printed(summary) -> tuple[list[list[str]], list[str], str]:
    """(table rows as cell lists, headers included; other non-table lines; all text, whitespace collapsed)."""
    console = Console(file=io.StringIO(), width=200, color_system=None)
    print_table(summary, console)
    lines = console.file.getvalue().splitlines()
    rows = [[c.strip() for c in ln.strip("│┃").replace("┃", "│").split("│")] for ln in lines if ln[:1] in "│┃"]
    return rows, [ln for ln in lines if ln[:1] not in "│┃┏┡└"], " ".join(" ".join(lines).split())


def _printable(algorithm="fedavg", **over):
    final = {"gfl_acc": 0.6125, "pfl_acc": 0.5, "pfl_acc_std": 0.125, "pfl_acc_min": 0.25, "pfl_acc_p10": 0.375,
             "ft": {"pfl_acc": 0.9, "pfl_acc_std": 0.01, "pfl_acc_min": 0.8, "pfl_acc_p10": 0.85},
             "lp": {"pfl_acc": 0.7, "pfl_acc_std": 0.02, "pfl_acc_min": 0.6, "pfl_acc_p10": 0.65}}  # fmt: skip
    nc = {"clients": 2, "epochs": 3, "lrs": [0.1, 0.2], "sizes": {"S": 0.5, "M": 1.0}, "zero_shot": {"acc": 0.7},
          "methods": {"ft": {"S": {"last": 0.5, "best": 0.625, "delta": 0.125},
                             "M": {"last": 0.75, "best": 0.5, "delta": -0.25}},
                      "lp": {"S": {"last": 0.25, "best": 0.375, "delta": 0.125},
                             "M": {"last": 0.125, "best": 0.875, "delta": 0.75}}}}  # fmt: skip
    return {"algorithm": algorithm, "dataset": "digits", "model": "cnn", "seed": 4, "rounds": 9, "final": final,
            "selected": {"round": 6, "criterion": "pfl_val", "gfl_acc": 0.55, "pfl_acc": 0.45},
            "timing": {"wall_s": 12.34, "train_s": 5.06, "eval_s": 2.51, "s_per_round": 1.234},
            "new_clients": nc, **over}  # fmt: skip


def test_print_table_prints_each_reported_number_in_its_place():
    """Rule (print_table / print_new_clients): the printed results are the summary's figures as percentages with two
    decimals, each in its own column (G-FL, P-FL mean, std, min, p10; +FT / +LP rows without G-FL); the selected
    round with its test figures; new clients per method and size as Last / Best / signed Δ, zero-shot under Last of
    every size; a missing figure prints as "—"; run facts and timing in the title / last line."""
    rows, lines, text = _printed(_printable())
    assert rows == [
        ["method", "G-FL", "P-FL mean", "± std", "min", "p10"],
        ["FedAvg", "61.25", "50.00", "12.50", "25.00", "37.50"],
        ["FedAvg+FT", "", "90.00", "1.00", "80.00", "85.00"],
        ["FedAvg+LP", "", "70.00", "2.00", "60.00", "65.00"],
        ["method", "S Last", "S Best", "S Δ", "M Last", "M Best", "M Δ"],
        ["FedAvg (zero-shot)", "70.00", "—", "—", "70.00", "—", "—"],
        ["FedAvg+FT", "50.00", "62.50", "+12.50", "75.00", "50.00", "-25.00"],
        ["FedAvg+LP", "25.00", "37.50", "+12.50", "12.50", "87.50", "+75.00"],
    ]
    assert "selected on validation (pfl_val): round 6 — G-FL 55.00, P-FL 45.00" in lines
    assert "time: 12.3 s wall in the rounds and final stages (start-up not counted), 5.1 s training (1.23 s/round), " \
           "2.5 s evaluation" in lines
    assert "FedAvg on digits (cnn, seed 4, 9 rounds) — accuracy %, final round" in text
    assert "new clients (2): accuracy %, 3 epochs, lr chosen on validation from [0.1, 0.2]" in text


def test_print_table_marks_missing_figures_and_omits_absent_sections():
    """No generic model (G-FL None) and a selected round without a figure print "—", never a number; without
    +FT / +LP results, zero-shot or new clients, their rows / table are not printed. Algorithms without a display
    label print under their config name (in both tables), "local" as Local."""
    s = _printable("fedper", new_clients=None)
    s["final"] = {**s["final"], "gfl_acc": None}
    del s["final"]["ft"], s["final"]["lp"]
    s["selected"] = {**s["selected"], "gfl_acc": None}
    rows, lines, text = _printed(s)
    assert rows[1:] == [["fedper", "—", "50.00", "12.50", "25.00", "37.50"]]
    assert "selected on validation (pfl_val): round 6 — G-FL —, P-FL 45.00" in lines
    assert "new clients" not in text
    nc = {**_printable()["new_clients"], "zero_shot": None, "sizes": {"S": 0.5}}
    rows, _, _ = _printed(_printable("fedper", new_clients=nc))
    assert [r[0] for r in rows] == ["method", "fedper", "fedper+FT", "fedper+LP", "method", "fedper+FT", "fedper+LP"]
    assert rows[4:] == [["method", "S Last", "S Best", "S Δ"], ["fedper+FT", "50.00", "62.50", "+12.50"],
                        ["fedper+LP", "25.00", "37.50", "+12.50"]]  # fmt: skip
    rows, _, _ = _printed(_printable("local"))
    assert [r[0] for r in rows] == ["method", "Local", "Local+FT", "Local+LP", "method", *["Local (zero-shot)",
                                    "Local+FT", "Local+LP"]]  # fmt: skip


def test_the_starting_weights_score_is_printed_under_the_selected_round_only_where_recorded():
    """`init_from.test_acc`: G-FL and each domain in order, as percentages; a `why` in its place; no line for a run
    from scratch or a summary written before the figure was recorded."""
    acc = {"global": 0.2799, "domains": {"rot0": 0.8413, "rot90": 0.0424}}
    _, lines, _ = _printed(_printable(init_from={"path": "m.pt", "test_acc": acc}))
    at = lines.index("selected on validation (pfl_val): round 6 — G-FL 55.00, P-FL 45.00")
    assert lines[at + 1] == "starting weights alone, before training: G-FL 27.99, rot0 84.13, rot90 4.24"
    _, lines, _ = _printed(_printable(init_from={"test_acc": {"global": 0.5}}))
    assert "starting weights alone, before training: G-FL 50.00" in lines
    _, lines, _ = _printed(_printable(init_from={"test_acc": {"why": "the test data is on the sites"}}))
    assert "starting weights alone: not scored (the test data is on the sites)" in lines
    for summary in (_printable(), _printable(init_from={"path": "m.pt"})):
        assert not any(ln.startswith("starting weights") for ln in _printed(summary)[1])
