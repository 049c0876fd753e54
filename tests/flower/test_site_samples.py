"""A site's `.npz` of 2-D samples ([N, H, W], e.g. sklearn's digits as a user saves them) in a site-local run: the
shape `pflbed flower local --site-data` infers, the server's model and a site's batches must agree. Unit level: the
functions a deployment calls, without Flower."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pflbed.config import validate_config
from pflbed.flower.sites import (
    SiteError,
    check_report,
    describe_sites,
    read_site,
    report,
    server_algorithm,
    site_algorithm,
)

from ..planted import Planted


def _digits_site(tmp_path) -> tuple:
    """A site directory whose train.npz holds x [60, 8, 8] in 0–16 and y 0–9, as `np.savez` of sklearn's digits."""
    gen = np.random.default_rng(0)
    d = tmp_path / "site-0"
    d.mkdir()
    np.savez(d / "train.npz", x=gen.integers(0, 17, (60, 8, 8)).astype(np.float64), y=np.arange(60) % 10)
    return d


def _cfg(shape, classes=10, **over):
    """A site-local run's config; `over`: sections whose keys replace the base's (`dataset={"normalize": …}`), or
    top-level values (`seed=3`)."""
    tree = {
        "dataset": {"name": "digits"}, "model": {"name": "cnn"}, "federation": {"clients": 1},
        "train": {"rounds": 1, "batch_size": 8}, "eval": {"finetune": []},
        "executor": {"name": "flower", "threads": 1},
        "sites": {"local": True, "input_shape": list(shape), "num_classes": classes},
    }  # fmt: skip
    for key, value in over.items():
        tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
    return validate_config(tree)


def test_two_d_samples_are_one_channel_on_the_server_and_on_the_site(tmp_path):
    d = _digits_site(tmp_path)
    shape, classes = describe_sites([d])
    assert (shape, classes) == ((1, 8, 8), 10)  # [N, H, W] read as one channel, not H = 8 channels
    cfg = _cfg(shape, classes)
    files = read_site({"data": str(d)}, cfg)
    info = report(files, 1, cfg, 0)
    check_report(cfg, 0, info)  # what the server checks at start-up
    server = server_algorithm(cfg, [info["num_train"]])
    site = site_algorithm(cfg, files, 1, 0, [info["num_train"]])
    first = next(m for m in server.ctx.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first.in_channels == 1 and site.ctx.model.state_dict().keys() == server.ctx.model.state_dict().keys()
    data = site.ctx.client_data(0)
    batch = data.x[data.train[:4]]
    assert batch.shape == (4, 1, 8, 8)
    assert server.ctx.model(batch).shape == (4, 10)  # the round-1 crash: 8-channel weights, 1-channel input


def test_a_run_that_asks_for_h_channels_is_refused_at_start_up_in_one_line(tmp_path):
    d = _digits_site(tmp_path)
    cfg = _cfg([8, 8])
    info = report(read_site({"data": str(d)}, cfg), 1, cfg, 0)
    with pytest.raises(SiteError, match=r"site 0: its samples have shape \[1, 8, 8\], the run's sites\.input_shape is "
                                        r"\[8, 8\] \(\[N, H, W\] files are read as one channel") as info_:
        check_report(cfg, 0, info)
    assert "\n" not in str(info_.value)


def test_a_site_s_file_is_read_without_unpickling_and_one_that_is_not_samples_is_refused_naming_it(tmp_path):
    """`read_npz`, which reads every site's files and the server's `sites.test`: an object array is refused, never
    unpickled; a file without x and y, of non-numbers or non-integer labels, or of shapes that do not pair a label
    with each sample, is refused in one line naming it. [N, features] and [N, C, H, W] are taken as they are,
    [N, H, W] as one channel."""
    from pflbed.flower.sites import read_npz

    marker = tmp_path / "ran"
    cases = {
        "pickled": ({"x": np.array([Planted(marker)], dtype=object), "y": np.array([0])},
                    "not a readable .npz file (Object arrays cannot be loaded when allow_pickle=False)"),
        "no_y": ({"x": np.zeros((3, 2)), "z": np.zeros(3)},
                 "an .npz with arrays x (samples) and y (labels) is needed; it has x, z"),
        "no_x": ({"y": np.zeros(3, dtype=np.int64)}, "is needed; it has y"),
        "empty": ({}, "is needed; it has none"),
        "strings": ({"x": np.array([["a", "b"]]), "y": np.array([0])},
                    "x must be numbers and y integers (got <U1 and int64)"),
        "float_labels": ({"x": np.zeros((2, 3)), "y": np.zeros(2)}, "(got float64 and float64)"),
        "flat": ({"x": np.zeros(3), "y": np.zeros(3, dtype=np.int64)},
                 "x must be [N, *sample shape] and y [N] (got (3,) and (3,))"),
        "fewer_labels": ({"x": np.zeros((3, 2)), "y": np.zeros(2, dtype=np.int64)}, "(got (3, 2) and (2,))"),
    }  # fmt: skip
    for name, (arrays, message) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(SiteError) as e:
            read_npz(path, "data")
        assert not marker.exists()  # nothing was unpickled: the planted object never ran
        assert str(e.value).startswith(f"data {path}: ") and str(e.value).endswith(message), (name, str(e.value))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(SiteError, match=r"^sites.test .*junk.npz: not a readable .npz file \(not a zip archive; "):
        read_npz(tmp_path / "junk.npz", "sites.test")
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))  # numpy.save of x alone: was a traceback
    with pytest.raises(SiteError, match=r"^data .*x.npy: not a readable .npz file \(one array, a .npy; "):
        read_npz(tmp_path / "x.npy", "data")
    np.savez(tmp_path / "nan.npz", x=np.array([[0.0, 1.0], [np.nan, 0.0], [0.0, -np.inf]]), y=np.arange(3))
    with pytest.raises(SiteError, match=r"^data .*nan.npz: 2 of 3 samples hold NaN or infinite values$"):
        read_npz(tmp_path / "nan.npz", "data")  # a site would train on them and send NaN updates
    for shape, read in (((4, 5), [4, 5]), ((4, 8, 8), [4, 1, 8, 8]), ((4, 3, 8, 8), [4, 3, 8, 8])):
        np.savez(tmp_path / "ok.npz", x=np.ones(shape, dtype=np.uint8), y=np.arange(4))
        data = read_npz(tmp_path / "ok.npz", "data")
        assert list(data.x.shape) == read and data.x.dtype == torch.float32 and data.y.dtype == torch.int64


def test_a_site_s_images_become_the_run_s_inputs_channels_first_and_only_grey_or_rgb_shapes_are_taken():
    """`_image_source`: image folders need sites.input_shape [1 or 3, H, W]; an RGB image [H, W, 3] (as read from
    a file) becomes [3, H, W], each channel normalized by its own statistics (ImageNet's here)."""
    from pflbed.data.folders import NORMALIZATIONS
    from pflbed.flower.sites import _image_source

    for shape in ([2, 4, 4], [4, 4, 4], [3, 4], [1, 4, 4, 1]):
        with pytest.raises(SiteError, match=rf"^image folders need sites.input_shape \[1 or 3, H, W\], not "
                                            rf"{re.escape(str(shape))}$"):  # fmt: skip
            _image_source(_cfg(shape))
    cfg = _cfg([3, 4, 5], dataset={"normalize": "imagenet"})
    source = _image_source(cfg)
    raw = np.random.default_rng(0).integers(0, 256, (2, 4, 5, 3)).astype(np.uint8)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in NORMALIZATIONS["imagenet"])
    want = (torch.from_numpy(raw).float().permute(0, 3, 1, 2) / 255 - mean) / std
    assert torch.allclose(source.inputs(raw), want, atol=1e-6)  # its raw range: 8-bit, 0–255
    assert source.num_classes == 10 and _image_source(_cfg([1, 4, 5])).inputs(raw[..., 0]).shape == (2, 1, 4, 5)


def _npz(path, n, shape=(8, 8), first_label=0):
    """`n` samples of `shape` whose first pixel is their position (so a test can tell which samples were read)."""
    x = np.zeros((n, *shape))
    x.reshape(n, -1)[:, 0] = np.arange(n)
    np.savez(path, x=x, y=(np.arange(n) + first_label) % 10)
    return path


def test_a_node_s_clients_must_be_a_positive_integer_and_default_to_one():
    from pflbed.flower.sites import num_clients

    assert num_clients({}) == 1 and num_clients({"clients": 3}) == 3
    for bad in (0, -1, True, "3", 2.0, None):
        with pytest.raises(SiteError) as e:
            num_clients({"clients": bad})
        assert str(e.value) == f"clients={bad!r} in the node config: a positive integer is needed"


def test_a_site_reads_the_files_its_node_config_names_before_a_directory_s_own_and_names_each_refused_one(tmp_path):
    """`read_site`: a directory's train/val/test; `val=` and `test=` in the node config replace the directory's own;
    a missing or unreadable file is refused in one line that says which of the site's files it is."""
    d = tmp_path / "site"
    d.mkdir()
    _npz(d / "train.npz", 20)
    _npz(d / "val.npz", 5, first_label=1)
    other = _npz(tmp_path / "other-test.npz", 7, first_label=2)
    cfg = _cfg([1, 8, 8])
    files = read_site({"data": str(d)}, cfg)
    assert (len(files.data), len(files.val), files.test) == (20, 5, None)
    assert files.val.y.tolist() == [1, 2, 3, 4, 5] and files.data.x.shape == (20, 1, 8, 8)
    files = read_site({"data": str(d), "val": str(other), "test": str(other)}, cfg)
    assert len(files.val) == len(files.test) == 7 and files.val.y[0] == files.test.y[0] == 2
    files = read_site({"data": str(d / "train.npz"), "test": str(other)}, cfg)  # a file as data: no val of its own
    assert (len(files.data), files.val, len(files.test)) == (20, None, 7)
    with pytest.raises(SiteError) as e:
        read_site({"data": str(tmp_path / "nowhere")}, cfg)
    assert str(e.value) == f"data {tmp_path / 'nowhere'}: no such file or directory"
    with pytest.raises(SiteError) as e:
        read_site({"data": str(d), "test": str(tmp_path / "gone.npz")}, cfg)
    assert str(e.value) == f"test {tmp_path / 'gone.npz'}: no such file or directory"
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(SiteError, match=rf"^val {re.escape(str(tmp_path / 'junk.npz'))}: not a readable \.npz"):
        read_site({"data": str(d), "val": str(tmp_path / "junk.npz")}, cfg)
    (tmp_path / "images" / "cats").mkdir(parents=True)  # an image folder whose sub-folders are not class numbers
    with pytest.raises(SiteError) as e:
        read_site({"data": str(d), "val": str(tmp_path / "images")}, cfg)
    assert str(e.value) == f"val {tmp_path / 'images'}: needs class sub-folders named 0…9; found ['cats']"


def test_a_site_s_named_dataset_is_read_from_its_own_path_never_downloaded(tmp_path, monkeypatch):
    """`dataset=NAME`: the loader gets the node's name and path (`~` expanded), the run's preprocessing options, and
    never a download or a hub id, whatever the server's config says; a loader without a test split gives the site
    none (its clients then split their test samples off their data)."""
    import pflbed.data
    from pflbed.data.arrays import ArrayDataset, DataSource

    asked = []

    def load_source(dataset):
        asked.append(dataset)
        train = ArrayDataset(torch.zeros(4, 1, 8, 8), torch.arange(4))
        n_test = 0 if dataset.name == "cifar10" else 2
        return DataSource(dataset.name, train, ArrayDataset(torch.zeros(n_test, 1, 8, 8), torch.zeros(n_test).long()),
                          10, "x")  # fmt: skip

    monkeypatch.setattr(pflbed.data, "load_source", load_source)
    cfg = _cfg([1, 8, 8], dataset={"download": True, "normalize": "imagenet", "hf": {"id": "someone/data"}})
    files = read_site({"dataset": "cifar10", "data": "~/site-data"}, cfg)
    (ds,) = asked
    assert (ds.name, ds.path, ds.download, ds.hf.id, ds.normalize) == (
        "cifar10", str(Path("~/site-data").expanduser()), False, None, "imagenet")
    assert files.test is None and len(files.data) == 4
    assert len(read_site({"dataset": "digits"}, cfg).test) == 2 and asked[1].path is None


def test_the_server_refuses_a_report_that_does_not_fit_in_one_line_naming_the_site():
    cfg = _cfg([1, 8, 8])
    fits = {"input_shape": [1, 8, 8], "labels": [0, 9]}
    check_report(cfg, 0, fits)
    with pytest.raises(SiteError) as e:
        check_report(cfg, 3, {**fits, "input_shape": [3, 8, 8]})
    assert str(e.value) == "site 3: its samples have shape [3, 8, 8], the run's sites.input_shape is [1, 8, 8]"
    with pytest.raises(SiteError) as e:
        check_report(cfg, 1, {**fits, "labels": [-1, 0, 10, 11, 12, 13, 14]})
    assert str(e.value) == ("site 1: labels [-1, 10, 11, 12, 13] are outside the run's label space 0…9 "
                            "(sites.num_classes)")


def test_the_server_s_test_set_must_fit_the_run_and_is_named_when_refused(tmp_path):
    """`sites.test`: samples of the run's input shape, labels 0…num_classes − 1; either wrong is refused."""
    from pflbed.errors import DataError

    path = tmp_path / "server-test.npz"
    cfg = _cfg([1, 8, 8], sites={"test": str(path)})
    message = f"sites.test {path}: samples of shape [1, 8, 8] and labels 0…9 are needed"
    for x, y in (((3, 8, 4), [0, 1, 2]), ((3, 8, 8), [0, 1, 10]), ((3, 8, 8), [-1, 0, 1])):
        np.savez(path, x=np.zeros(x), y=np.array(y))
        with pytest.raises(DataError) as e:
            server_algorithm(cfg, [[5]])
        assert str(e.value) == message, (x, y)
    np.savez(path, x=np.zeros((3, 8, 8)), y=np.array([0, 9, 9]))
    fed = server_algorithm(cfg, [[5]]).ctx.federation
    assert fed.global_test.tolist() == [0, 1, 2] and fed.num_classes == 10
    path.write_bytes(b"junk")
    with pytest.raises(SiteError, match=rf"^sites.test {re.escape(str(path))}: not a readable"):
        server_algorithm(cfg, [[5]])


def test_a_site_and_the_server_build_on_one_thread_unless_the_run_says_otherwise(tmp_path):
    """As the simulation's loop at one thread, whose figures a site-local run reproduces (docs: Flower), even for a
    model large enough for pflbed to take every core elsewhere (`choose_threads`)."""
    from unittest import mock

    d = _digits_site(tmp_path)
    cfg = _cfg([1, 8, 8], executor={"threads": None})
    files = read_site({"data": str(d)}, cfg)
    sizes = [report(files, 1, cfg, 0)["num_train"]]
    before = torch.get_num_threads()
    try:
        with mock.patch("pflbed.engine.build.choose_threads", return_value=2):  # what a large model would get
            for build in (lambda: server_algorithm(cfg, sizes), lambda: site_algorithm(cfg, files, 1, 0, sizes)):
                torch.set_num_threads(2)
                build()
                assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_site_data_directories_tell_the_run_its_input_shape_and_label_space(tmp_path):
    """`describe_sites` (`pflbed flower local --site-data`): the samples' shape and the largest label + 1 (at least
    2 classes), over every file of every site; a `.npz` file may stand for a site; image folders, and sites of
    different shapes, are refused in one line."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    np.savez(a / "train.npz", x=np.zeros((4, 8, 8)), y=np.zeros(4, dtype=np.int64))
    assert describe_sites([a]) == ((1, 8, 8), 2)  # labels 0 only: still two classes
    np.savez(a / "test.npz", x=np.zeros((2, 8, 8)), y=np.array([0, 4]))
    np.savez(b / "one.npz", x=np.zeros((3, 8, 8)), y=np.array([0, 1, 2]))
    assert describe_sites([a, b / "one.npz"]) == ((1, 8, 8), 5)
    np.savez(b / "two.npz", x=np.zeros((3, 4)), y=np.array([0, 1, 2]))
    with pytest.raises(SiteError) as e:
        describe_sites([a, b / "two.npz"])
    assert str(e.value) == "the --site-data directories hold samples of different shapes: [(1, 8, 8), (4,)]"
    with pytest.raises(SiteError) as e:
        describe_sites([b])
    assert str(e.value) == (f"{b}: image folders do not say the run's input shape; --set sites.input_shape and "
                            "sites.num_classes")
    (a / "val" / "0").mkdir(parents=True)  # train.npz beside a val/ image folder: the shape is not known either
    with pytest.raises(SiteError) as e:
        describe_sites([a])
    assert str(e.value) == (f"{a}: image folders do not say the run's input shape; --set sites.input_shape and "
                            "sites.num_classes")
    np.savez(a / "val.npz", x=np.zeros((2, 8, 8)), y=np.array([0, 1]))  # val.npz is read before a val/ folder
    assert describe_sites([a]) == ((1, 8, 8), 5)
    (a / "test.npz").rename(a / "test.keep")
    (a / "test" / "0").mkdir(parents=True)  # and a test/ image folder
    with pytest.raises(SiteError, match="image folders do not say the run's input shape"):
        describe_sites([a])
    (a / "test.keep").rename(a / "test.npz")
    assert describe_sites([a]) == ((1, 8, 8), 5)
    with pytest.raises(SiteError) as e:
        describe_sites([a, tmp_path / "site-*"])  # a shell glob that matched nothing
    assert str(e.value) == f"data {tmp_path / 'site-*'}: no such file or directory"


def test_flower_local_fills_in_from_the_site_files_only_what_the_config_leaves_unsaid(tmp_path, monkeypatch, capsys):
    """`pflbed flower local --site-data` takes the input shape and label space from the files where neither the
    config file nor --set gives them; given, the config's figures stand: its 10 classes stay 10 although these sites
    hold labels 0…4 only (the inferred 5 replaced a config file's 10), and image folders, which say no shape, run
    when both are given (they were refused even then)."""
    import pflbed.flower.local as local
    from pflbed.cli import main
    from pflbed.errors import PflbedError

    seen = []

    def deployment(cfg, out, supernodes, **kw):  # what the deployment would have been started with
        seen.append((cfg.sites.input_shape, cfg.sites.num_classes))
        raise PflbedError("not deployed")

    monkeypatch.setattr(local, "run_local", deployment)
    npz, images = tmp_path / "npz", tmp_path / "images"
    npz.mkdir()
    np.savez(npz / "train.npz", x=np.zeros((6, 8, 8)), y=np.arange(6) % 5)
    from PIL import Image

    for c in (0, 1):
        (images / str(c)).mkdir(parents=True)
        Image.fromarray(np.full((16, 16), 40 * c, np.uint8)).save(images / str(c) / "a.png")  # each site's data is
    config = tmp_path / "ten.yaml"  # read as its node will, before the deployment
    config.write_text("sites:\n  num_classes: 10\n")

    def deploy(*given: str | Path) -> str:
        sites = [str(g) for g in given if isinstance(g, Path)]
        rest = [g for g in given if isinstance(g, str)]
        assert main(["flower", "local", "--site-data", *sites, "--out", str(tmp_path / "run"), *rest]) == 2
        return capsys.readouterr().err.strip()

    assert deploy(npz) == "pflbed: error: not deployed" and seen.pop() == ([1, 8, 8], 5)
    assert deploy(npz, "-c", str(config)) == "pflbed: error: not deployed" and seen.pop() == ([1, 8, 8], 10)
    assert deploy(npz, "--set", "sites.num_classes=10") == "pflbed: error: not deployed"
    assert seen.pop() == ([1, 8, 8], 10)
    both = ["-c", str(config), "--set", "sites.input_shape=[1,16,16]"]
    assert deploy(images, *both) == "pflbed: error: not deployed" and seen.pop() == ([1, 16, 16], 10)
    assert deploy(images, "-c", str(config)) == (f"pflbed: error: {images}: image folders do not say the run's input "
                                                 "shape; --set sites.input_shape and sites.num_classes")
    gone = f"pflbed: error: --site-data {tmp_path / 'site-*'}: no such file or directory"
    assert deploy(tmp_path / "site-*") == gone == deploy(npz, tmp_path / "site-*", *both)  # also when nothing is read
    assert seen == []


def test_replace_device_gives_a_copy_on_the_device_and_the_same_config_where_it_already_is():
    from pflbed.flower.sites import replace_device

    cfg = _cfg([1, 8, 8])
    assert replace_device(cfg, "cpu") is cfg
    moved = replace_device(cfg, "cuda:1")
    assert moved.executor.device == "cuda:1" and cfg.executor.device == "cpu"
    assert moved.model_dump(exclude={"executor"}) == cfg.model_dump(exclude={"executor"})
    assert moved.executor.model_dump(exclude={"device"}) == cfg.executor.model_dump(exclude={"device"})


def test_exported_sites_hold_each_participant_s_own_samples_and_a_forced_export_replaces_the_first(tmp_path):
    """`export_sites`: site-<cid>/{train,val,test}.npz hold exactly the simulated client's samples, in order; run
    again into the same folder with `force` (after a change of the config), it replaces the earlier files."""
    from pflbed.data import load_source
    from pflbed.errors import PflbedError
    from pflbed.federation import build_federation
    from pflbed.flower.sites import export_sites

    from ..tiny import TINY

    for seed in (0, 1):
        cfg = validate_config({**TINY, "seed": seed})
        if seed > 0:  # the API asks for force too
            with pytest.raises(PflbedError, match="holds site directories already"):
                export_sites(cfg, tmp_path / "sites")
        dirs = export_sites(cfg, tmp_path / "sites", force=seed > 0)
        source = load_source(cfg.dataset)
        fed = build_federation(source, cfg.federation, cfg.seed)
        assert [d.name for d in dirs] == [f"site-{c}" for c in fed.participated]
        for cid, d in zip(fed.participated, dirs, strict=True):
            for name, idx in (("train", fed.clients[cid].train), ("test", fed.clients[cid].test)):
                with np.load(d / f"{name}.npz") as f:
                    assert np.array_equal(f["y"], source.train.y[idx].numpy()), (seed, cid, name)
                    assert np.array_equal(f["x"], source.train.x[idx].numpy())


def test_an_export_replaces_an_earlier_one_only_when_forced_and_leaves_none_of_its_sites(tmp_path, capsys):
    """An export into a folder that held a larger earlier one left that export's extra sites beside the new ones,
    and the command's own hint (`--site-data DIR/site-*`) ran them all: another federation's clients, with samples
    of the new ones. Now an earlier export is replaced only with --force, whole; a site-<n> that export did not
    write (a site's real data) is refused even then; other files in the folder stay."""
    from pflbed.cli import main

    sites = tmp_path / "sites"

    def export(clients, *flags):
        return main(["flower", "sites", "--out", str(sites), "--set", f"federation.clients={clients}", *flags])

    def refused(clients, *flags, message):
        assert export(clients, *flags) == 2
        assert capsys.readouterr().err == f"pflbed: error: --out {sites}: {message}\n"

    assert export(5) == 0
    assert capsys.readouterr().out == f"5 site directories in {sites}; try them with: pflbed flower local " \
                                      f"--site-data {sites}/site-*\n"  # fmt: skip
    (sites / "README").write_text("mine")
    written = {p.relative_to(sites): p.read_bytes() for p in sites.rglob("*.npz")}
    assert len(written) == 15
    refused(3, message="holds site directories already (site-0, site-1, site-2, …); --force replaces them")
    assert {p.relative_to(sites): p.read_bytes() for p in sites.rglob("*.npz")} == written
    assert export(3, "--force") == 0
    assert sorted(p.name for p in sites.iterdir()) == ["README", "site-0", "site-1", "site-2"]
    refused(3, message="holds site directories already (site-0, site-1, site-2); --force replaces them")
    assert all(sorted(q.name for q in (sites / f"site-{c}").iterdir()) == ["test.npz", "train.npz", "val.npz"]
               for c in range(3))  # fmt: skip
    (tmp_path / "two.yaml").write_text("federation: {clients: 2}\nseed: 1\n")  # the config file is read
    assert main(["flower", "sites", "-c", str(tmp_path / "two.yaml"), "--out", str(sites), "--force"]) == 0
    assert sorted(p.name for p in sites.iterdir()) == ["README", "site-0", "site-1"]
    for c in (2, 10):  # named in number order: site-10 after site-2 (not after site-1)
        (sites / f"site-{c}").mkdir()
        (sites / f"site-{c}" / "train.npz").write_bytes(b"")
    refused(2, message="holds site directories already (site-0, site-1, site-2, …); --force replaces them")
    (sites / "site-10" / "data.csv").write_text("a site's own")
    refused(2, "--force", message="site-10 is not a site directory pflbed flower sites wrote (it holds data.csv); "
                                  "choose another --out")  # fmt: skip
    (sites / "site-10" / "data.csv").unlink()
    (sites / "site-10" / "train.npz").unlink()
    (sites / "site-10").rmdir()
    (sites / "site-10").write_text("")
    refused(2, "--force", message="site-10 is not a site directory pflbed flower sites wrote (it is a file); "
                                  "choose another --out")  # fmt: skip
    assert (sites / "site-10").is_file() and (sites / "site-2" / "train.npz").exists()
    (sites / "site-10").unlink()
    (sites / "site-x").mkdir()  # not an export's name: none of its business
    assert export(2, "--force") == 0
    assert sorted(p.name for p in sites.iterdir()) == ["README", "site-0", "site-1", "site-x"]
    (tmp_path / "file").write_text("")
    assert main(["flower", "sites", "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == (f"pflbed: error: --out {tmp_path / 'file'}: is a file; give the directory to "
                                       "write the site-<client> directories into\n")  # fmt: skip
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{}")  # the sites were written among a run's files
    for out, said in ((tmp_path / "run", "is a run's or a pretrained model's directory; write the site-<client> "
                                         "directories elsewhere"),
                      (tmp_path / "file" / "under", f"{tmp_path / 'file'} is a file, not a directory")):  # fmt: skip
        assert main(["flower", "sites", "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"pflbed: error: --out {out}: {said}\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["summary.json"]


def _files(n_data, n_val=None, n_test=None):
    from pflbed.data.arrays import ArrayDataset
    from pflbed.flower.sites import SiteFiles

    def data(n, first):  # samples numbered from `first`, so a position in the pool names its file
        return ArrayDataset(torch.arange(first, first + n).float().view(n, 1), torch.arange(n) % 3)

    return SiteFiles(data(n_data, 0), n_val and data(n_val, 100), n_test and data(n_test, 200), "here")


def _fractions(val, test, seed=3):
    cfg = _cfg([1], seed=seed)  # copied, not validated: a test_fraction of 0 is below what a config may ask
    return cfg.model_copy(update={"federation": cfg.federation.model_copy(
        update={"val_fraction": val, "test_fraction": test})})  # fmt: skip


def test_a_site_divides_each_of_its_files_among_its_clients_by_the_file_s_own_seeded_stream(tmp_path):
    """`site_splits`: data, val and test files are each divided among the site's clients by a permutation of its own
    stream (seed, SITE, site, file 0/1/2), so no two files share a division and none another part of the run's
    draws; a client's val and test come from the files where the site has them, else are split off its share of the
    data (stratified, seeded by (seed, SITE, site, client)). The pool is data, then val, then test."""
    from pflbed import rng
    from pflbed.flower.sites import site_splits

    def division(n, stream, offset, seed=3, site=1):
        perm = torch.randperm(n, generator=rng.generator(seed, rng.SITE, site, stream)).numpy()
        return [np.sort(p) + offset for p in np.array_split(perm, 2)]

    files = _files(12, 12, 12)  # three files of one size: a division shared by two of them would show
    pool, splits = site_splits(files, 2, _fractions(0.2, 0.2), 1)
    assert pool.x.view(-1).tolist() == [*range(12), *range(100, 112), *range(200, 212)]
    want = list(zip(division(12, 0, 0), division(12, 1, 12), division(12, 2, 24), strict=True))
    for got, expected in zip(splits, want, strict=True):
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == np.int64 and np.array_equal(g, e)
    assert not np.array_equal(division(12, 0, 0)[0], division(12, 1, 0)[0])  # the streams do differ
    # a val file but no test file: the test samples come off each client's share of the data, val is the file's
    _, splits = site_splits(_files(20, 12), 2, _fractions(0.2, 0.25), 1)
    for (tr, va, te), part, val in zip(splits, division(20, 0, 0), division(12, 1, 20), strict=True):
        assert np.array_equal(np.sort(np.concatenate([tr, te])), part) and len(te) == 2 and np.array_equal(va, val)
    # no val or test file: both split off the data, the same again on a second call, another split at another site
    first = site_splits(_files(40), 2, _fractions(0.2, 0.25), 1)[1]
    again = site_splits(_files(40), 2, _fractions(0.2, 0.25), 1)[1]
    other = site_splits(_files(40), 2, _fractions(0.2, 0.25), 0)[1]
    assert all(np.array_equal(a, b) for s, t in zip(first, again, strict=True) for a, b in zip(s, t, strict=True))
    assert not all(np.array_equal(a, b) for s, t in zip(first, other, strict=True) for a, b in zip(s, t, strict=True))
    for (tr, va, te), part in zip(first, division(40, 0, 0), strict=True):
        assert (len(tr), len(va), len(te)) == (11, 4, 5)
        assert np.array_equal(np.sort(np.concatenate([tr, va, te])), part)
    # no fractions and no files: empty val and test positions, not None
    for tr, va, te in site_splits(_files(8), 2, _fractions(0.0, 0.0), 1)[1]:
        assert len(tr) == 4 and va.dtype == te.dtype == np.int64 and len(va) == len(te) == 0


def test_a_site_with_more_clients_than_training_samples_is_refused_naming_the_first_without_any():
    from pflbed.flower.sites import site_splits

    with pytest.raises(SiteError) as e:
        site_splits(_files(3, 5, 5), 5, _fractions(0.2, 0.2), 1)
    assert str(e.value) == "site 1: client 3 of 5 has no training samples; lower clients="


def test_a_site_s_federation_lists_every_client_of_the_run_with_only_its_own_samples(tmp_path):
    """`site_algorithm`: the clients of the other sites are in the site's federation (client ids are global) with no
    sample in any split and a NaN class prior; the site holds no global test set and no new clients. The server's
    count of the site's clients, and of their training samples, must be the site's own (first five shown)."""
    from pflbed.flower.sites import own_clients

    d = _digits_site(tmp_path)
    cfg = _cfg([1, 8, 8])
    files = read_site({"data": str(d)}, cfg)
    own = report(files, 2, cfg, 1)["num_train"]
    algo = site_algorithm(cfg, files, 2, 1, [[7], own, [3, 4]])
    fed = algo.ctx.federation
    assert own_clients(algo) == [1, 2] and fed.participated == [0, 1, 2, 3, 4] and fed.new == []
    assert fed.num_classes == 10 and fed.global_test.dtype == torch.int64 and len(fed.global_test) == 0
    for cid in (0, 3, 4):
        split = fed.clients[cid]
        assert all(t.dtype == torch.int64 and t.numel() == 0 for t in (split.train, split.val, split.test))
        assert split.prior.shape == (10,) and split.prior.isnan().all()
    assert [fed.num_train(c) for c in (1, 2)] == own
    with pytest.raises(SiteError) as e:
        site_algorithm(cfg, files, 2, 1, [[7], [own[0]]])
    assert str(e.value) == "site 1: the server counts 1 clients here, the node config 2"
    six = report(files, 6, cfg, 0)["num_train"]
    with pytest.raises(SiteError) as e:
        site_algorithm(cfg, files, 6, 0, [[n + 1 for n in six]])
    assert str(e.value) == (f"site 0: the server counts {[n + 1 for n in six[:5]]} training samples for its clients, "
                            f"the site holds {six[:5]}")


def test_an_algorithm_of_public_data_is_refused_a_site_local_run_in_one_line():
    cfg = _cfg([1, 8, 8], algorithm={"name": "fedmd"})
    with pytest.raises(SiteError) as e:
        server_algorithm(cfg, [[5]])
    assert str(e.value) == ("fedmd cannot keep the data on the sites (sites.local): it exchanges predictions on "
                            "public data, which a site-local run does not have")
