"""Deployments with the data on the sites (`sites.local`): parity with the simulation, the server holding no data,
and the trust boundary. In-process, on the faked Flower runtime (`fake_flower.FakeGrid`), whose ClientApps run the
real node code with each site's own node config."""


import json
import math

import numpy as np
import pytest
import torch
import yaml

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.errors import PflbedError
from pflbed.results.checkpoint import load_checkpoint
from pflbed.results.experiment import experiment, run

from ..tiny import TINY, figures

flwr = pytest.importorskip("flwr")

from pflbed.flower import client  # noqa: E402
from pflbed.flower.site_executor import SiteExecutor, discover_sites  # noqa: E402
from pflbed.flower.sites import SiteError, server_algorithm  # noqa: E402

from ..fake_flower import FakeGrid  # noqa: E402
from .site_setup import (  # noqa: E402
    ALGOS,
    _discover,
    _server_task,
    _site_cfg,
    _sites,
    _tampered,
    _tree,
    run_sites,
    server_executor,
)


def _server_test(tmp_path, cfg):
    """The simulation's global test set, written for the server (`sites.test`)."""

    from pflbed.data import load_source
    from pflbed.federation import build_federation

    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    path = tmp_path / "server-test.npz"
    np.savez(path, x=source.test.x[fed.global_test].numpy(), y=source.test.y[fed.global_test].numpy())
    return path


def _no_diag(tree):
    """Without the algorithms' diagnostics, which read every client's state (kept on the sites in a site-local run,
    which records none)."""
    if isinstance(tree, dict):
        return {k: _no_diag(v) for k, v in tree.items() if k != "diag"}
    return [_no_diag(v) for v in tree] if isinstance(tree, list) else tree


PUBLIC = {"feddf", "fedmd", "ktpfl", "pfeddf", "sim_pfl", "topk_pfl"}  # exchange predictions on public data


@pytest.mark.parametrize("name", list(ALGOS))
def test_a_site_local_run_gives_the_simulation_s_figures(name, tmp_path):
    """The five seeds' systems, 4 rounds, +FT and +LP: every figure and the server state bit for bit."""
    _parity(_tree(name), tmp_path)


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - set(ALGOS)))
def test_every_other_algorithm_gives_the_simulation_s_figures_or_is_refused_for_its_public_data(name, tmp_path):
    """Two rounds of every other algorithm: bit for bit, or — those that exchange predictions on public data — one
    line saying why they cannot run site-local."""
    tree = _tree(name, train={**TINY["train"], "rounds": 2}, eval={"every": 2, "finetune": []})
    if name in PUBLIC:
        with pytest.raises(SiteError, match=f"{name} cannot keep the data on the sites .* public data"):
            server_algorithm(_site_cfg(tree), [[10]] * 4)
        return
    _parity(tree, tmp_path)


def _parity(tree, tmp_path):
    sim = run(validate_config(tree), write=False, progress=False)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path, validate_config(tree))
    sites = run_sites(_site_cfg(tree, _server_test(tmp_path, validate_config(tree))), grid)
    a, b = _no_diag(figures(sim.summary)), figures(sites.summary)
    assert b.pop("gfl_source") == "sites.test (on the server)"
    assert a == b
    assert all(torch.equal(sim.server[k], sites.server[k]) for k in sim.server)


def test_the_server_loads_no_data_and_g_fl_from_the_sites_is_their_sample_weighted_mean(tmp_path, monkeypatch):
    """No `sites.test`: G-FL is the generic model's accuracy over the union of the sites' test data, i.e. the
    sample-weighted mean of the sites' own figures. The server's process reads no dataset (every loader fails)."""
    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    dirs, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    client.algorithm.cache_clear()
    # the sites read their .npz files; the server process must not open any dataset
    import pflbed.data as data
    import pflbed.engine.build as build

    def no_data(*a, **kw):
        raise AssertionError("the server loaded a dataset")

    for mod, name in ((data, "load_source"), (build, "load_source"), (data, "load_dataset")):
        monkeypatch.setattr(mod, name, no_data)
    result = run_sites(cfg, grid)
    assert result.summary["gfl_source"] == "the sites' test data, sample-weighted"
    generic = result.executor.algo.generic_model(result.server)
    right = n = 0
    for d in dirs:

        f = np.load(d / "test.npz")
        pred = generic.logits(torch.from_numpy(f["x"]), 64).argmax(1)
        right, n = right + int((pred == torch.from_numpy(f["y"])).sum()), n + len(f["y"])
    assert result.summary["final"]["gfl_acc"] == pytest.approx(right / n, abs=1e-7)
    assert result.summary["final"]["gfl_acc"] != result.summary["final"]["pfl_acc"]  # not the personal figure


def test_a_written_site_local_run_draws_no_plots_of_the_sites_client_states(tmp_path):
    """FedBasis's plots are of every client's mixing weights, which stay on the sites: the server's run writes its
    summary without them rather than plotting states it does not hold."""
    from pflbed.results.rundir import RunDir

    tree = _tree("fedbasis", eval={"every": 2, "finetune": []})
    cfg = _site_cfg(tree)
    _, grid = _sites(tmp_path, validate_config(tree))
    result = run_sites(cfg, grid, RunDir.check(tmp_path / "run", cfg))
    assert (tmp_path / "run" / "summary.json").exists() and "artifacts" not in result.summary
    assert not (tmp_path / "run" / "plots").exists()


def test_sites_restarted_mid_run_continue_from_their_own_state_directories(tmp_path):
    """Sites 0 and 2 restart after round 2 (new node ids, nothing in memory): they read their clients' states from
    their state directories, and the run's figures are the uninterrupted run's."""
    tree = _tree("fedper", eval={"every": 2, "finetune": []})
    _, grid = _sites(tmp_path, validate_config(tree))
    straight = run_sites(_site_cfg(tree), grid)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "again", validate_config(tree))
    grid.restart = {3: [0, 2]}
    restarted = run_sites(_site_cfg(tree), grid)
    assert grid.nodes[0] != 1000 and grid.nodes[2] != 1002  # the restarts happened
    assert figures(restarted.summary) == figures(straight.summary)


def test_a_resumed_server_asks_each_site_for_the_state_version_it_checkpointed(tmp_path):
    """The server's checkpoints hold, per client, only the round of the state its site keeps; a server resumed
    from round 2 continues as if never stopped."""
    from pflbed.errors import PflbedError
    from pflbed.results.rundir import RunDir

    tree = _tree("fedper", eval={"every": 2, "finetune": []}, train={**TINY["train"], "checkpoint_every": 1})
    cfg = _site_cfg(tree)
    _, grid = _sites(tmp_path, validate_config(tree))
    straight = run_sites(cfg, grid)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "again", validate_config(tree))
    out = tmp_path / "run"
    real = SiteExecutor.stream

    def stop_in_round_3(self, rnd, payloads):
        if rnd == 3:
            raise PflbedError("stopped")
        return real(self, rnd, payloads)

    SiteExecutor.stream = stop_in_round_3
    try:
        with pytest.raises(PflbedError, match="stopped"):
            run_sites(cfg, grid, RunDir.check(out, cfg))
    finally:
        SiteExecutor.stream = real
    saved = load_checkpoint(out)
    assert {k for s in saved["clients"].values() for k in s} == {"site.version"}  # no state left its site
    resumed = run_sites(cfg, grid, RunDir(out), resume=True)
    assert figures(resumed.summary) == figures(straight.summary)


def test_a_site_of_several_clients_without_val_and_test_files_splits_its_data(tmp_path):
    """clients=2 and only train.npz: each client gets a seeded share, split train / val / test as a simulated
    client's; the server counts them among the run's clients, in site order."""
    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    dirs, _ = _sites(tmp_path, validate_config(tree))
    for d in dirs[2:]:
        (d / "val.npz").unlink()
        (d / "test.npz").unlink()
    nodes = {0: {"data": str(dirs[0])}, 1: {"data": str(dirs[1])},
             2: {"data": str(dirs[2] / "train.npz"), "clients": 2}}  # fmt: skip
    grid = FakeGrid(partitions=3, node_configs={k: {**v, "state-dir": str(tmp_path / f"s{k}")}
                                                for k, v in nodes.items()})  # fmt: skip
    cfg = _site_cfg(tree)  # 4 clients: 1 + 1 + 2
    sizes = _discover(grid, cfg)
    n2 = len(np.load(dirs[2] / "train.npz")["y"])
    assert [len(s) for s in sizes] == [1, 1, 2] and sum(sizes[2]) < n2 and sum(sizes[2]) > 0.6 * n2
    result = run_sites(cfg, grid)
    assert len(result.history[-1]) and not math.isnan(result.summary["final"]["pfl_acc"])




@pytest.mark.parametrize("key, value", [("dataset__path", "/etc"), ("executor__state_dir", "/tmp/elsewhere"),
                                        ("model__init_from", "/root/weights.pt"), ("dataset__download", True),
                                        ("federation__manifest", "/srv/manifest.json")])  # fmt: skip
def test_a_site_refuses_a_server_that_names_a_path_or_a_download(key, value, tmp_path):
    """A server that sends a path (or a download) in its config: the node refuses the work with one line naming the
    key, reads nothing and writes nothing; the run stops with that line."""
    from pflbed.flower.executor import FlowerRoundError

    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    _, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    ex = server_executor(grid, cfg)
    ex.config = _tampered(cfg, **{key: value})  # the planted server
    with _server_task(), pytest.raises(FlowerRoundError, match=r"^site \d, round 1: its node failed the round's "
                                       rf"work: .*SiteError.*{key.replace('__', '.')}[^\n]*$"):  # fmt: skip
        experiment(cfg, ex.algo, ex, None, False, False)
    # nothing written on the sites but the token each presented at start-up (`site_claims.site_token`)
    assert {p.name for p in tmp_path.glob("states-*/**/*") if p.is_file()} <= {"site-token"}


def test_a_site_refuses_a_run_that_is_not_site_local_and_a_data_less_node_a_site_local_one():
    from pflbed.flower.site_node import site_config

    tree = _tree("fedavg")
    plain = validate_config({**tree, "executor": {"name": "flower"}})
    with pytest.raises(SiteError, match=r"this site holds its own data .* not site-local"):
        site_config({"data": "/data/site.npz"}, _tampered(plain))
    assert site_config({}, _tampered(plain)) is None  # a simulated client: the run's own data, as before
    with pytest.raises(SiteError, match=r"^the run keeps the data on the sites \(sites.local=true\), but this node's "
                                        r"config names no data=$"):  # fmt: skip
        site_config({}, _tampered(_site_cfg(tree)))


def _labels(d, y):
    f = dict(np.load(d / "train.npz"))
    np.savez(d / "train.npz", x=f["x"], y=y(f["y"]))


def test_a_site_whose_labels_or_samples_do_not_fit_is_refused_with_its_number(tmp_path):
    tree = _tree("fedavg")
    dirs, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    k = cfg.sites.num_classes
    _labels(dirs[2], lambda y: np.where(np.arange(len(y)) == 0, k, y))  # one label outside 0…k−1
    with pytest.raises(SiteError, match=rf"site 2: labels \[{k}\] are outside the run's label space 0…{k - 1}"):
        _discover(grid, cfg)
    _labels(dirs[2], lambda y: np.minimum(y, k - 1))
    f = dict(np.load(dirs[1] / "val.npz"))
    np.savez(dirs[1] / "val.npz", x=f["x"][:, :, :4], y=f["y"])
    with pytest.raises(SiteError, match=r"site 1: val .*val.npz: samples of shape \[1, 4, 8\], but the site's data"):
        _discover(grid, cfg)
    for name in ("train", "test"):
        f = dict(np.load(dirs[1] / f"{name}.npz"))
        np.savez(dirs[1] / f"{name}.npz", x=f["x"][:, :, :4], y=f["y"])
    with pytest.raises(SiteError, match=r"site 1: its samples have shape \[1, 4, 8\], the run's sites.input_shape"):
        _discover(grid, cfg)


def test_the_server_refuses_a_count_of_clients_other_than_the_sites_and_a_site_asked_for_others(tmp_path):
    from pflbed.flower.site_message import check_clients

    tree = _tree("fedavg")
    _, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg({**tree, "federation": {**tree["federation"], "clients": 5}})
    with pytest.raises(SiteError, match=r"^federation.clients is 5, but the sites hold 4 clients \(1, 1, 1, 1\): set "
                                         r"federation.clients=4$"):
        _discover(grid, cfg)
    with _server_task():
        sizes = discover_sites(grid, _site_cfg(tree))[0]
    from pflbed.flower.sites import read_site, site_algorithm

    files = read_site({"data": str(tmp_path / "sites" / "site-1")}, _site_cfg(tree))
    algo = site_algorithm(_site_cfg(tree), files, 1, 1, sizes)
    assert check_clients("TRAIN", algo, [1], [0], 0) == ([1], {1: 0})
    with pytest.raises(SiteError, match=r"clients \[0, 2\], which it does not hold"):
        check_clients("TRAIN", algo, [0, 1, 2], [0] * 3, 0)
    with pytest.raises(SiteError, match=r"^the server asked this site for clients \[0, 2, 3, 4, 5\], which it does"):
        check_clients("TRAIN", algo, [0, 1, 2, 3, 4, 5, 6], [0] * 7, 0)  # the first five named


def test_the_server_context_refuses_client_data():
    cfg = _site_cfg(_tree("fedavg"))
    algo = server_algorithm(cfg, [[30], [40], [50], [60]])
    assert [algo.ctx.federation.num_train(c) for c in range(4)] == [30, 40, 50, 60]
    with pytest.raises(SiteError, match="client 2's data is on its site"):
        algo.ctx.client_data(2)
    assert len(algo.ctx.source.train) == 0
    assert torch.isnan(algo.ctx.federation.clients[0].prior).all()


def test_a_new_site_personalizes_the_trained_run_on_its_own_data_with_no_other_data_present(tmp_path):
    """`load_run` of a site-local run directory (the server's state only; no dataset anywhere): a new site
    personalizes the trained model on its samples with the algorithm's own personalization; a participating
    client's personal model is on its site, so asking the run for it says so."""
    import pflbed
    from pflbed.results.rundir import RunDir

    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    dirs, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    run_sites(cfg, grid, RunDir.check(tmp_path / "run", cfg))
    loaded = pflbed.load_run(tmp_path / "run")
    f = np.load(dirs[1] / "train.npz")
    t = np.load(dirs[1] / "test.npz")
    personal = loaded.personalize(f["x"], f["y"], epochs=2, lr=0.05)
    acc = personal.accuracy(t["x"], t["y"])
    start = personal.zero_shot_accuracy(t["x"], t["y"])
    assert acc > start  # fine-tuning on the site's own (skewed) data helps on its own test data
    with pytest.raises(PflbedError, match=r"^client 1's personal model stayed on its site \(sites\.local\): the run "
                                          r"holds the server's state only; a site personalizes it with its own "
                                          r"data$"):  # fmt: skip
        loaded.personal_model(1)
    # the server's own test set (`sites.test`) is on the server, not where the run is loaded: it is not read
    conf = tmp_path / "run" / "config.yaml"
    tree_run = yaml.safe_load(conf.read_text())
    tree_run["sites"]["test"] = str(tmp_path / "elsewhere" / "test.npz")
    conf.write_text(yaml.safe_dump(tree_run))
    again = pflbed.load_run(tmp_path / "run")
    assert again.config.sites.test is not None and again.algo.ctx.cfg.sites.test is None
    assert np.array_equal(again.predict(t["x"]), loaded.predict(t["x"]))


def _images(root, k, n, seed):
    """`root/<class>/<i>.png`: n random 8×8 grey images of each class 0…k−1; their pixels, in file order."""
    from PIL import Image

    g = np.random.default_rng(seed)
    pixels = []
    for c in range(k):
        (root / str(c)).mkdir(parents=True)
        for i in range(n):
            img = g.integers(0, 256, (8, 8), dtype=np.uint8)
            Image.fromarray(img).save(root / str(c) / f"{i:02d}.png")
            pixels.append(img)
    return np.stack(pixels)


def test_a_site_of_image_folders_is_read_as_pflbed_s_folder_datasets_and_trains_beside_npz_sites(tmp_path):
    """data=DIR with train/ and test/ folders of class sub-folders 0/, 1/, …: images resized to the run's input shape,
    pixels to [0, 1] and normalized as the folder datasets (symmetric: to [-1, 1]), labels from the folder names."""
    from pflbed.flower.sites import read_site

    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    dirs, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    k = cfg.sites.num_classes
    site = tmp_path / "images"
    raw = _images(site / "train", k, 12, 0)
    _images(site / "test", k, 3, 1)
    files = read_site({"data": str(site)}, cfg)
    assert files.val is None and len(files.test) == 3 * k
    assert torch.equal(files.data.x, ((torch.from_numpy(raw).float() / 255 - 0.5) / 0.5).unsqueeze(1))
    assert files.data.y.tolist() == [c for c in range(k) for _ in range(12)]
    grid.node_configs[3] = {**grid.node_configs[3], "data": str(site)}  # the last site: images
    result = run_sites(cfg, grid)
    assert _discover(grid, cfg)[3] == [len(files.data) - round(0.1 * len(files.data))]  # val: 10 % of its data
    assert not math.isnan(result.summary["final"]["pfl_acc"])


def test_a_site_may_hold_a_dataset_pflbed_loads_with_the_run_s_preprocessing(tmp_path):
    """dataset=NAME in the node config: the loader's train split is the site's data, its test split the site's
    test data (here the embedded digits, which need no files)."""
    from pflbed.data import load_source
    from pflbed.flower.sites import read_site

    cfg = validate_config({"executor": {"name": "flower"},
                           "sites": {"local": True, "input_shape": [1, 8, 8], "num_classes": 10}})  # fmt: skip
    files = read_site({"dataset": "digits"}, cfg)
    digits = load_source(validate_config({}).dataset)
    assert torch.equal(files.data.x, digits.train.x) and torch.equal(files.test.y, digits.test.y)
    with pytest.raises(SiteError, match=r"dataset=cifar10: "):  # no CIFAR-10 files here: one line naming it
        read_site({"dataset": "cifar10", "data": str(tmp_path)}, cfg)


def test_the_app_project_of_a_site_local_run_gives_each_site_a_node_config_flower_reads(tmp_path, capsys):
    """`pflbed flower app` with sites.local: beside pyproject.toml, a site.toml that Flower's own node-config parser
    reads, naming only node-side keys (the run's config in pyproject.toml names no path)."""
    import tomllib

    from flwr.common.config import parse_config_args

    from pflbed.cli import main

    main(["flower", "app", "--set", "sites.local=true", "--set", "sites.input_shape=[1,28,28]", "--set",
          "sites.num_classes=10", "--set", "federation.clients=3", "--out", str(tmp_path / "app")])  # fmt: skip
    node = parse_config_args([str(tmp_path / "app" / "site.toml")])
    assert "# train.npz (+ val.npz, test.npz): x [1, 28, 28], y in 0…9; or image folders" in (
        tmp_path / "app" / "site.toml").read_text()  # what the site's files must hold
    assert node == {"partition-id": 0, "num-partitions": 3, "data": "/path/to/this/site/data",
                    "state-dir": "/path/to/this/site/states"}  # fmt: skip
    run_config = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = validate_config(json.loads(run_config["config"]))
    assert cfg.sites.local and cfg.dataset.path is None and cfg.executor.state_dir is None


def test_the_report_of_a_site_local_run_draws_no_partition_of_the_config_s_dataset(tmp_path):
    """The clients' data is the sites' own: a partition heat-map rebuilt from the config's dataset would show data
    the run never used, so the report has none."""
    from pflbed.results.report import partition_png, read_run
    from pflbed.results.rundir import RunDir

    tree = _tree("fedavg", eval={"every": 2, "finetune": []})
    _, grid = _sites(tmp_path, validate_config(tree))
    cfg = _site_cfg(tree)
    run_sites(cfg, grid, RunDir.check(tmp_path / "run", cfg))
    assert partition_png(read_run(tmp_path / "run")) is None
    sim = tmp_path / "sim"
    run(validate_config(tree), sim, progress=False)
    assert partition_png(read_run(sim)) is not None  # the same config simulated: its partition is the run's


def test_an_evaluation_waits_for_a_site_that_is_down_and_the_run_continues_when_it_is_back(tmp_path):
    """Site 1's node is unreachable when the round-2 evaluation is sent, and back (under a new node id, nothing in
    memory) a moment later: the evaluation asks it again and the run's figures are the uninterrupted run's."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    tree = _tree("fedper", eval={"every": 2, "finetune": []})
    _, grid = _sites(tmp_path, validate_config(tree))
    straight = run_sites(_site_cfg(tree), grid)
    client.algorithm.cache_clear()
    _, grid = _sites(tmp_path / "again", validate_config(tree))
    real, down = grid.send_and_receive, []

    def flaky(msgs, timeout=None):
        replies = real(msgs, timeout)
        for i, m in enumerate(msgs):
            if m.metadata.message_type == "evaluate" and m.metadata.dst_node_id == grid.nodes[1] and not down:
                down.append(m.metadata.dst_node_id)
                grid.nodes[1] = max(grid.nodes) + 1  # it restarts under a new node id
                client.algorithm.cache_clear()
                replies[i] = Message(Error(ErrorCode.NODE_UNAVAILABLE, "node gone"), reply_to=m)
        return replies

    grid.send_and_receive = flaky
    again = run_sites(_site_cfg(tree), grid)
    assert down and figures(again.summary) == figures(straight.summary)


def test_the_server_combines_the_sites_numbers_as_a_simulated_run_computes_them():
    """`site_eval.combine`: clients in id order whatever the sites' order; G-FL pooled over the sites' samples in
    float32 (a simulated run's mean of 0/1), the server's own test figure instead where it has one, None where no
    site has samples of a split or the method has no generic model; and one site alone."""
    from pflbed.evaluation.evaluate import summarize
    from pflbed.flower.site_eval import combine

    a = {"test": {"0": 0.5}, "val": {"0": 1.0}, "gfl_test": [3, 4], "gfl_val": [0, 0]}
    b = {"test": {"2": 1.0, "1": 0.0}, "val": {"2": 0.5, "1": 0.5}, "gfl_test": [0, 3], "gfl_val": [0, 0]}
    out, test = combine([b, a], None, True)
    assert test == {0: 0.5, 1: 0.0, 2: 1.0} and list(test) == [0, 1, 2]
    assert out == {"gfl_acc": float(torch.tensor(3.0) / 7), "gfl_val": None,
                   **summarize(test, {0: 1.0, 1: 0.5, 2: 0.5})}  # fmt: skip
    assert out["gfl_acc"] != 3 / 7  # float32, as simulated
    assert combine([a], 0.9, True)[0]["gfl_acc"] == 0.9
    alone, _ = combine([a], None, False)
    assert alone["gfl_acc"] is alone["gfl_val"] is None and alone.keys() == out.keys()


@pytest.mark.parametrize("name", ["fedavg", "local"])
def test_a_site_asked_for_no_client_or_without_a_generic_model_counts_nothing_correct(name):
    from pflbed.engine.build import prepare
    from pflbed.evaluation.evaluate import Predictions
    from pflbed.flower.site_eval import _counts

    algo = prepare(validate_config({**TINY, "algorithm": {"name": name}}))
    P = Predictions(algo.ctx.source, 64)
    assert _counts(algo, algo.init_server(), [], P, "test") == [0, 0]
    n = len(algo.ctx.federation.clients[0].test)
    correct, samples = _counts(algo, algo.init_server(), [0], P, "test")
    assert samples == n and (correct == 0 if name == "local" else 0 < correct <= n)
