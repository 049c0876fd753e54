"""`pflbed data list` (narrow, fast) and `pflbed data new-client` (a run's held-out client as the files a new
client would bring). `data new-client` reads only the run's config.yaml, so most tests give it just that."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pflbed.cli import main
from pflbed.config import load_config
from pflbed.data import DATASETS, describe_datasets, load_digits_source, load_source
from pflbed.federation import build_federation
from pflbed.results.rundir import config_text


def _run_dir(path: Path, *overrides: str) -> Path:
    """A run directory as far as `data new-client` reads it: its config.yaml."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config_text(load_config(None, list(overrides))))
    return path


def _federation(run: Path):
    cfg = load_config(str(run / "config.yaml"))
    source = load_source(cfg.dataset)
    return source, build_federation(source, cfg.federation, cfg.seed)


def test_new_client_writes_a_held_out_client_s_raw_samples(tmp_path, capsys):
    run = _run_dir(tmp_path / "run", "federation.clients=6", "federation.new_clients=2")
    assert main(["data", "new-client", str(run), "--out", str(tmp_path / "nc")]) == 0
    assert "try: pflbed personalize" in capsys.readouterr().out
    source, fed = _federation(run)
    cid = fed.new[0]
    client = fed.clients[cid]
    trained = torch.cat([t for c in fed.participated for t in (fed.clients[c].train, fed.clients[c].val,
                                                                 fed.clients[c].test)])  # fmt: skip
    assert not set(client.train.tolist()) & set(trained.tolist())  # never trained on, never scored a trained client
    for name, idx in (("train", client.train), ("val", client.val), ("test", client.test)):
        with np.load(tmp_path / "nc" / f"{name}.npz") as f:
            x, y = f["x"], f["y"]
        assert x.dtype == np.uint8 and x.shape == (len(idx), 8, 8) and int(x.max()) <= 16  # digits' native format
        assert np.array_equal(y, source.train.y[idx].numpy())
        assert torch.allclose(source.inputs(x), source.train.x[idx], atol=1e-5)  # exactly the run's inputs


def test_new_client_of_a_run_scored_on_the_global_test_set_takes_that_set(tmp_path):
    """`eval.pfl_test: global`: the run scores every client on the global test set, so the new client's test.npz is
    that set (its own test share went unused)."""
    run = _run_dir(tmp_path / "run", "federation.clients=6", "federation.new_clients=2", "eval.pfl_test=global")
    assert main(["data", "new-client", str(run), "--out", str(tmp_path / "nc")]) == 0
    source, fed = _federation(run)
    with np.load(tmp_path / "nc" / "test.npz") as f:
        y = f["y"]
    assert np.array_equal(y, getattr(source, fed.global_split).y[fed.global_test].numpy())
    assert len(y) != len(fed.clients[fed.new[0]].test)


def test_new_client_of_the_pflbed_protocol_takes_its_domain_s_shared_sets(tmp_path):
    run = _run_dir(tmp_path / "run", "dataset.name=digits-rot4", "federation.protocol=pflbed",
                   "federation.pflbed.clients_per_domain=3", "federation.pflbed.new_clients_per_domain=2")  # fmt: skip
    assert main(["data", "new-client", str(run), "--out", str(tmp_path / "nc"), "--client", "-1"]) == 2
    source, fed = _federation(run)
    cid = fed.new[-1]
    assert main(["data", "new-client", str(run), "--out", str(tmp_path / "nc"), "--client", str(cid)]) == 0
    domain = fed.clients[cid].domain
    for name, idx in (("train", fed.clients[cid].train), ("val", fed.domain_val[domain]),
                      ("test", fed.domain_test[domain])):  # fmt: skip
        with np.load(tmp_path / "nc" / f"{name}.npz") as f:
            assert np.array_equal(f["y"], source.train.y[idx].numpy()) and len(f["x"]) == len(idx)


@pytest.mark.parametrize(("args", "said"), [
    (["new-client", "{trained}", "--out", "{out}"], "holds no new clients"),
    (["new-client", "{run}", "--out", "{out}", "--client", "{participant}"], "took part in training"),
    (["new-client", "{run}", "--out", "{out}", "--client", "99"],
     "pflbed: error: --client 99: client 99 of {run} does not exist; its held-out clients are {new}"),
    (["new-client", "{out}", "--out", "{out}"], "not a pflbed run directory"),
    (["new-client", "{run}", "--out", "{out}", "--set", "seed=1"],
     "pflbed: error: data new-client takes the run's own config (RUN/config.yaml): leave out -c and --set"),
    (["new-client", "{sited}", "--out", "{out}"],
     "pflbed: error: {sited}: its clients' data stayed on their sites (sites.local); a new site brings its own"),
    (["new-client", "{run}", "--out", "{file}"],
     "pflbed: error: --out {file}: is a file; give the directory to write train.npz, val.npz and test.npz into"),
    (["new-client", "--out", "{out}"], "pflbed: error: data new-client needs RUN, the run directory"),
    (["new-client", "{run}"], "pflbed: error: data new-client needs --out DIR"),
    (["list", "--out", "{out}"], "data list takes no --out"),
    (["list", "{run}"], "data list takes no OUT or RUN"),
    (["list", "--path", "{out}"], "pflbed: error: --path {out}: no such directory (a dataset's files, or a folder "
                                  "dataset's root)"),  # it listed every dataset as not found there
    (["list", "--path", "{file}"], "pflbed: error: --path {file}: no such directory"),
    (["show", "--path", "{run}"], "pflbed: error: data show takes no --path (only data list does)"),
    (["export", "{out}", "--path", "{run}"], "pflbed: error: data export takes no --path (only data list does)"),
    (["list", "--png", "{file}"], "pflbed: error: data list takes no --png (only data show does)"),
    (["show", "--png", "{file}"], "pflbed: error: --png {file}: give the heat-map's file name, ending in .png"),
    (["show", "--png", "{out}.json"], "pflbed: error: --png {out}.json: give the heat-map's file name, ending in "
                                      ".png"),  # a ValueError traceback; {file}: written as file.png, said as file
    (["show", "--png", "{run}/dir.png"], "pflbed: error: --png {run}/dir.png: give the heat-map's file name"),
    (["new-client", "{run}", "--out", "{out}", "--png", "{file}"],
     "pflbed: error: data new-client takes no --png (only data show does)"),
    (["export"], "pflbed: error: data export needs OUT, the manifest file to write"),
    (["export", "/proc/m.json"], "pflbed: error: /proc/m.json: No such file or directory"),  # not the temporary file
    (["export", "{file}/m.json"], "pflbed: error: {file}/m.json: {file} is a file, not a directory"),  # "File exists"
    (["show", "--png", "{file}/h.png"], "pflbed: error: --png {file}/h.png: {file} is a file, not a directory"),
    (["new-client", "{run}", "--out", "{file}/nc"], "pflbed: error: --out {file}/nc: {file} is a file, not a "
                                                    "directory"),  # fmt: skip
    (["new-client", "{run}", "--out", "{run}"], "pflbed: error: --out {run}: is a run's or a pretrained model's "
     "directory; write train.npz, val.npz and test.npz elsewhere"),  # written among the run's files
    (["new-client", "{run}", "--out", "{suite}"], "pflbed: error: --out {suite}: is a bench suite's or a tune "
                                                  "directory"),  # fmt: skip
])  # fmt: skip
def test_data_commands_refuse_in_one_line(tmp_path, capsys, args, said):
    run = _run_dir(tmp_path / "run", "federation.clients=6", "federation.new_clients=2")
    trained = _run_dir(tmp_path / "trained", "federation.clients=6")
    fed = _federation(run)[1]
    sited = _run_dir(tmp_path / "sited", "sites.local=true", "sites.input_shape=[1,8,8]", "sites.num_classes=10",
                     "executor.name=flower", "executor.supernodes=2", "federation.clients=2")  # fmt: skip
    (tmp_path / "file").write_text("")
    (run / "dir.png").mkdir()
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "suite.yaml").write_text("")
    paths = {"run": run, "trained": trained, "out": tmp_path / "nc", "participant": fed.participated[0],
             "new": ", ".join(map(str, fed.new)), "sited": sited, "file": tmp_path / "file",
             "suite": tmp_path / "suite"}  # fmt: skip
    assert main(["data", *(a.format(**paths) for a in args)]) == 2
    err = capsys.readouterr().err.strip()
    assert said.format(**paths) in err and "\n" not in err and "Traceback" not in err, err


def test_new_client_replaces_files_only_with_force(tmp_path, capsys):
    run = _run_dir(tmp_path / "run", "federation.clients=6", "federation.new_clients=2")
    (tmp_path / "nc").mkdir()
    (tmp_path / "nc" / "val.npz").write_bytes(b"mine")
    assert main(["data", "new-client", str(run), "--out", str(tmp_path / "nc")]) == 2
    assert "val.npz exists; --force replaces it" in capsys.readouterr().err
    assert main(["data", "new-client", str(run), "--out", str(tmp_path / "nc"), "--force"]) == 0
    assert (tmp_path / "nc" / "val.npz").read_bytes() != b"mine"


def test_data_list_is_readable_in_120_columns(capsys):
    """Piped (as here), the listing is one paragraph per dataset, no line over 120 columns — not a table hundreds
    of columns wide."""
    assert main(["data", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= 120
    named = {line.split()[0] for line in lines if line[:1].strip()}
    assert named == {r["name"] for r in describe_datasets()} >= set(DATASETS)
    digits = lines.index(next(line for line in lines if line.startswith("digits ")))
    assert lines[digits + 1].strip() == "1497 train, 300 test"


def test_data_list_describes_digits_without_loading_it(monkeypatch):
    """Loading digits imports scikit-learn, seconds of a listing's time: its sizes come without it, and are those
    of the loaded dataset."""
    source = load_digits_source()
    monkeypatch.setitem(DATASETS, "digits", lambda *a, **k: pytest.fail("digits loaded to be listed"))
    row = next(r for r in describe_datasets() if r["name"] == "digits")
    assert (row["location"], row["train"], row["test"]) == (source.origin, len(source.train), len(source.test))


def test_data_list_at_a_path_describes_the_tree_there(tmp_path, capsys):
    from tests import data_formats as fx

    root = fx.make_domain_tree(tmp_path / "mine", ("art",), 2, per_class=3, size=4)
    assert main(["data", "list", "--path", str(root)]) == 0
    folder = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("folder "))
    assert folder.split() == ["folder", str(root.resolve())]
