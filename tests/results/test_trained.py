"""Using a trained run (`pflbed.load_run`, `pflbed personalize`): raw samples are transformed as the loader did,
the loaded models are the run's final ones, personalization keeps the epoch validation picks, and bad input is one
line, exit code 2."""

import json
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

import pflbed
from pflbed.algorithms.common import Predictor
from pflbed.cli import main
from pflbed.data import load_dataset
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.data.digits import MEAN, STD
from pflbed.data.samples import read_samples
from pflbed.errors import DataError, PflbedError
from pflbed.results import trained
from pflbed.results.trained import load_model

RUN = {"dataset": {"name": "digits"}, "federation": {"clients": 6, "new_clients": 2, "alpha": 0.3},
       "train": {"rounds": 3, "lr": 0.05}, "eval": {"every": 3, "finetune": [], "new_clients": {"epochs": 2}},
       "executor": {"threads": 1}}  # fmt: skip


def _raw_digits(x: torch.Tensor) -> np.ndarray:
    """Digits' raw 8×8 images in 0–16 (integers) back from the loader's normalized tensors."""
    return torch.round((x[:, 0] * STD + MEAN) * 16).numpy()


pytestmark = pytest.mark.xdist_group("trained-runs")  # one worker trains the module's runs, once


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name in ("fedavg", "fedper"):
        torch.set_num_threads(1)
        result = pflbed.run({**RUN, "algorithm": {"name": name}}, base / name)
        out[name] = (base / name, result)
    return out


def _client_samples(cid_labels=(1, 4, 7), n=(30, 30, 200)):
    """A new client's raw digits of three classes: train, val, test (disjoint)."""
    source = load_dataset("digits")
    x, y = _raw_digits(source.test.x), source.test.y.numpy()
    raw_train, y_train = _raw_digits(source.train.x), source.train.y.numpy()
    keep = np.flatnonzero(np.isin(y_train, cid_labels))
    rng = np.random.default_rng(0)
    keep = rng.permutation(keep)
    tr, va = keep[: n[0]], keep[n[0] : n[0] + n[1]]
    te = np.flatnonzero(np.isin(y, cid_labels))
    return (raw_train[tr], y_train[tr]), (raw_train[va], y_train[va]), (x[te], y[te])


def test_raw_samples_are_transformed_as_the_loader_did():
    source = load_dataset("digits")
    assert source.raw_shape == (8, 8)
    x = source.inputs(_raw_digits(source.train.x))
    assert x.shape == source.train.x.shape
    assert torch.allclose(x, source.train.x, atol=1e-6)
    assert torch.equal(source.inputs(source.train.x), source.train.x * 0 + source.inputs(source.train.x))
    with pytest.raises(DataError, match=r"x: samples of shape \[28, 28\], but digits samples are \[8, 8\]"):
        source.inputs(np.zeros((2, 28, 28)))


def test_colour_images_are_read_channels_last():
    x = torch.rand(3, 3, 4, 5)
    source = DataSource("folder:t", ArrayDataset(x, torch.zeros(3, dtype=torch.long)), ArrayDataset(x[:0], torch.zeros(
        0, dtype=torch.long)), 2, "t", pixel_norm=(0.5, 0.5), raw_scale=255.0, raw_channels_last=True)  # fmt: skip
    raw = (x * 0.5 + 0.5) * 255
    assert source.raw_shape == (4, 5, 3)
    assert torch.allclose(source.inputs(raw.permute(0, 2, 3, 1).numpy()), x, atol=1e-5)


def test_loaded_models_are_the_runs_final_ones(runs):
    path, result = runs["fedavg"]
    run = pflbed.load_run(path)
    source = run.source
    expected = result.executor.algo.generic_model(result.server).logits(source.test.x).argmax(1).numpy()
    assert np.array_equal(run.predict(_raw_digits(source.test.x)), expected)
    assert run.round == 3 and run.summary["rounds"] == 3 and [h["round"] for h in run.history] == [3]

    path, result = runs["fedper"]
    run = pflbed.load_run(path)
    cid = run.algo.ctx.federation.participated[0]
    algo = result.executor.algo
    expected = algo.personal_model(result.server, result.executor.states[cid]).logits(source.test.x).argmax(1)
    init = algo.personal_model(result.server, algo.init_client(cid)).logits(source.test.x).argmax(1)
    assert not torch.equal(expected, init)  # the personal head matters: a loader ignoring it would fail below
    assert np.array_equal(run.predict(_raw_digits(source.test.x), cid=cid), expected.numpy())
    with pytest.raises(PflbedError, match="did not participate"):
        run.personal_model(run.algo.ctx.federation.new[0])


def test_personalization_keeps_the_epoch_validation_picks(runs):
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), val, test = _client_samples()
    p = run.personalize(x, y, method="ft", epochs=6, lr=0.05, val=val)
    accs = [e["val_acc"] for e in p.epochs]
    assert len(accs) == 6 and p.selected_epoch == 1 + int(np.argmax(accs))  # earliest of the best
    assert [e["epoch"] for e in p.epochs] == [1, 2, 3, 4, 5, 6] and p.method == "ft" and 0 < p.seconds < 60
    assert {k: p.info[k] for k in ("run", "algorithm", "samples", "val_samples")} == {
        "run": str(runs["fedavg"][0]), "algorithm": "fedavg", "samples": 30, "val_samples": 30}
    assert p.accuracy(*val) == pytest.approx(accs[p.selected_epoch - 1])  # the kept model is that epoch's
    last = run.personalize(x, y, method="ft", epochs=6, lr=0.05)
    assert last.selected_epoch == 6 and last.epochs == [{"epoch": e} for e in range(1, 7)]
    assert "lr_val" not in last.info  # one lr: nothing was chosen
    generic = float((run.predict(test[0]) == test[1]).mean())
    assert last.accuracy(*test) > generic  # three classes only: adapting to them must help


def test_selection_rule_is_best_validation_earliest_on_ties(runs, monkeypatch):
    """Scripted validation accuracies per epoch: the kept model is epoch 2's (0.8, earliest of three ties)."""
    from pflbed.results import trained

    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), val, _ = _client_samples()
    scores = iter([0.5, 0.8, 0.8, 0.3, 0.8, 0.1])
    made = []
    real_module = trained._module
    monkeypatch.setattr(trained, "_accuracy", lambda model, xs, ys: next(scores))
    monkeypatch.setattr(trained, "_module", lambda pred: made.append(real_module(pred)) or made[-1])
    p = run.personalize(x, y, method="ft", epochs=6, lr=0.05, val=val)
    assert p.selected_epoch == 2 and p.model is made[1]
    assert [e["val_acc"] for e in p.epochs] == [0.5, 0.8, 0.8, 0.3, 0.8, 0.1]


def test_learning_rate_is_the_runs_choice_else_chosen_on_validation(runs, monkeypatch):
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), val, _ = _client_samples()
    tried = []
    scores = {0.005: 0.4, 0.01: 0.7, 0.05: 0.7, 0.2: 0.1}  # 0.01 and 0.05 tie: the earlier one wins

    def adapt(method, data, lr, epochs, seed, xv, yv):
        tried.append(lr)
        return torch.nn.Identity(), [{"epoch": 1}], 1, scores[lr]

    monkeypatch.setattr(run, "_adapt", adapt)
    chosen = run.summary["new_clients"]["methods"]["ft"]["M"]["lr_best"]
    assert run.personalize(x, y, val=val).lr == chosen and tried == [chosen]  # the run chose one on validation
    monkeypatch.setattr(run, "chosen_lr", lambda: None)
    tried.clear()
    p = run.personalize(x, y, val=val)
    assert tried == [0.005, 0.01, 0.05] and p.lr == 0.01 and p.info["lr_val"] == {"0.005": 0.4, "0.01": 0.7,
                                                                                  "0.05": 0.7}  # fmt: skip
    tried.clear()
    assert run.personalize(x, y).lr == 0.005 and tried == [0.005]  # no validation data: nothing to choose on
    assert run.personalize(x, y, lr=0.2).lr == 0.2


def test_native_personalization_is_the_methods_own(runs, monkeypatch):
    (x, y), val, _ = _client_samples()
    for name in ("fedper", "fedavg"):
        run = pflbed.load_run(runs[name][0])
        called = []
        real = run.algo.personalize

        def spy(server, data, budget, gen, real=real, called=called):
            called.append((budget.method, data.num_train, int(data.val.numel()), data.prior.sum().item()))
            assert data.prior.shape == (10,)  # every class of the run, the client's three included (FedRoD-hyper's a)
            yield from real(server, data, budget, gen)

        monkeypatch.setattr(run.algo, "personalize", spy)
        run.personalize(x, y, method="native", epochs=1, lr=0.05, val=val)
        assert called == [("ft", 30, 30, pytest.approx(1.0))]  # trained on the 30 samples, validation apart
        if name == "fedper":  # no generic model: fine-tuning one is refused, in one line
            with pytest.raises(PflbedError, match="fedper has no generic model to fine-tune: use --method native"):
                run.personalize(x, y, method="lp", epochs=1, lr=0.05)
        else:
            run.personalize(x, y, method="lp", epochs=1, lr=0.05)
            assert len(called) == 1  # ft / lp fine-tune the generic model, not the method's own


def _as_folder(root, x, y):
    """Raw digits (0…16) as a folder of class sub-folders of 8-bit PNGs (0…255)."""
    for i, (img, label) in enumerate(zip(x, y, strict=True)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.uint8(img * 255 / 16)).save(root / str(label) / f"{i}.png")
    return root


def test_personalize_cli_with_npz_and_image_folders(runs, tmp_path, capsys):
    (x, y), val, test = _client_samples()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=test[0], y=test[1])
    folder = _as_folder(tmp_path / "val", *val)
    out = tmp_path / "p"
    args = ["personalize", str(runs["fedavg"][0]), "--data", str(tmp_path / "train.npz"), "--test",
            str(tmp_path / "test.npz"), "--method", "ft", "--epochs", "3", "--lr", "0.05"]  # fmt: skip
    args += ["--out", str(out)]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    model = load_model(out)
    run = pflbed.load_run(runs["fedavg"][0])
    acc = float((model(run.inputs(test[0])).argmax(1).numpy() == test[1]).mean())
    assert summary["test_acc"] == pytest.approx(acc) and summary["selected_epoch"] == 3
    assert summary["samples"] == 30 and summary["test_samples"] == len(test[1])
    # an image folder for --val needs an image folder for --data too (their raw ranges differ)
    assert main([*args[:-2], "--val", str(folder), "--out", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err == ("pflbed: error: --data and --val must be of one format (both .npz or both "
                                       "image folders)\n")  # fmt: skip
    # image folders for both: read as the run's samples at the images' range, as the Python API reads them
    train_folder, test_folder = _as_folder(tmp_path / "train", x, y), _as_folder(tmp_path / "test", *test)
    assert main(["personalize", str(runs["fedavg"][0]), "--data", str(train_folder), "--val", str(folder), "--test",
                 str(test_folder), "--method", "ft", "--epochs", "8", "--lr", "0.05", "--out", str(tmp_path / "f")
                 ]) == 0  # fmt: skip
    xf, yf, scale = read_samples(train_folder, run.source)
    xv, yv, _ = read_samples(folder, run.source)
    direct = run.personalize(xf, yf, method="ft", epochs=8, lr=0.05, val=(xv, yv), scale=scale, seed=0)
    written = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert scale == 255.0 and [e["val_acc"] for e in written["epochs"]] == [e["val_acc"] for e in direct.epochs]
    xt, yt, _ = read_samples(test_folder, run.source)
    assert written["test_acc"] == pytest.approx(direct.accuracy(xt, yt, scale))
    assert written["zero_shot_test_acc"] == pytest.approx(direct.zero_shot_accuracy(xt, yt, scale))
    assert direct.accuracy(xt, yt, scale) != direct.accuracy(xt, yt, None)  # the range matters on these samples
    # no test set: the line scores the kept epoch and the unadapted model on the validation folder, at its range
    assert main(["personalize", str(runs["fedavg"][0]), "--data", str(train_folder), "--val", str(folder), "--method",
                 "ft", "--epochs", "8", "--lr", "0.05", "--out", str(tmp_path / "g")]) == 0  # fmt: skip
    zero_shot = direct.zero_shot_accuracy(xv, yv, scale)
    assert zero_shot != direct.zero_shot_accuracy(xv, yv, None)  # the range matters on these samples too
    assert f"(zero-shot {100 * zero_shot:.2f} %)" in capsys.readouterr().out


def test_personalize_cli_prints_the_zero_shot_accuracy_beside_the_personalized_one(runs, tmp_path, capsys):
    """The unadapted model personalization started from is scored on the same samples: the generic model for ft,
    nothing for a method without a zero-shot model (FedPer: a new client has no personal layers yet)."""
    (x, y), val, test = _client_samples()
    for name, split in (("train", (x, y)), ("val", val), ("test", test)):
        np.savez(tmp_path / f"{name}.npz", x=split[0], y=split[1])
    base = ["--data", str(tmp_path / "train.npz"), "--epochs", "2", "--lr", "0.05"]
    assert main(["personalize", str(runs["fedavg"][0]), *base, "--method", "ft", "--test", str(tmp_path / "test.npz"),
                 "--out", str(tmp_path / "a")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    run = pflbed.load_run(runs["fedavg"][0])
    generic = float((run.generic_model()(run.inputs(test[0])).argmax(1).numpy() == test[1]).mean())
    assert summary["zero_shot_test_acc"] == pytest.approx(generic)
    assert summary["test_samples"] == len(test[1]) and summary["method"] == "ft"
    a = tmp_path / "a"
    assert re.fullmatch(  # the whole of both lines: no validation set, so the last epoch is kept
        re.escape(f"personalized fedavg (ft), {len(y)} samples, lr 0.05: epoch 2 of 2 kept, test accuracy "
                  f"{100 * summary['test_acc']:.2f} % (zero-shot {100 * generic:.2f} %); ") + r"\d+\.\d s\n"
        + re.escape(f"model: {a / 'model.pt'}, summary: {a / 'summary.json'}\n"), printed)
    assert main(["personalize", str(runs["fedavg"][0]), *base, "--val", str(tmp_path / "val.npz"), "--epochs", "6",
                 "--out", str(tmp_path / "b")]) == 0  # fmt: skip
    printed = " ".join(capsys.readouterr().out.split())
    generic_val = float((run.generic_model()(run.inputs(val[0])).argmax(1).numpy() == val[1]).mean())
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    kept = b["epochs"][b["selected_epoch"] - 1]["val_acc"]  # the kept epoch's, which selection made the best
    assert kept == max(e["val_acc"] for e in b["epochs"]) and len({e["val_acc"] for e in b["epochs"]}) > 1
    assert f"validation accuracy {100 * kept:.2f} % (zero-shot {100 * generic_val:.2f} %)" in printed
    assert main(["personalize", str(runs["fedper"][0]), *base, "--test", str(tmp_path / "test.npz"),
                 "--out", str(tmp_path / "c")]) == 0  # fmt: skip
    assert "(the method has no zero-shot model)" in " ".join(capsys.readouterr().out.split())
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["zero_shot_test_acc"] is None
    # neither a test nor a validation set: no accuracy to print
    assert main(["personalize", str(runs["fedavg"][0]), *base, "--out", str(tmp_path / "d")]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(rf"personalized fedavg \(native\), {len(y)} samples, lr 0\.05: epoch 2 of 2 kept; \d+\.\d s",
                        line)  # fmt: skip


def test_personalize_replaces_a_personalized_model_only_when_forced_and_never_a_run_s_files(runs, tmp_path, capsys,
                                                                                             monkeypatch):
    """`--out` a run's directory replaced its summary.json with the personalization's, silently: the run no longer
    read as one. A second personalization into the same --out replaced the first without being asked. Both are
    refused in one line before any personalization; --force replaces a personalized model, never a run's or a
    pretrained model's files; a folder of other files (the new client's samples) keeps them."""
    (x, y), _, _ = _client_samples()
    data = tmp_path / "client"
    data.mkdir()
    np.savez(data / "train.npz", x=x, y=y)
    base = ["personalize", str(runs["fedavg"][0]), "--data", str(data / "train.npz"), "--epochs", "1", "--lr", "0.05"]

    def refused(out, *flags, message):
        assert main([*base, "--out", str(out), *flags]) == 2
        assert capsys.readouterr().err == f"pflbed: error: --out {out}: {message}\n"

    assert main([*base, "--out", str(data)]) == 0  # beside the samples, which stay
    assert sorted(p.name for p in data.iterdir()) == ["model.pt", "summary.json", "train.npz"]
    first = (data / "summary.json").read_text()
    personalized = []
    monkeypatch.setattr(trained.TrainedRun, "personalize", lambda *a, **k: personalized.append(a))
    refused(data, message="holds a personalized model already (model.pt, summary.json); --force replaces it")
    (data / "model.pt").unlink()
    refused(data, message="holds a personalized model already (summary.json); --force replaces it")
    run = runs["fedavg"][0]
    kept = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for flags in ((), ("--force",)):
        refused(run, *flags, message="is a run's or a pretrained model's directory (it has config.yaml), whose "
                                     "summary.json a personalization's would replace; choose another --out")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == kept
    (tmp_path / "file").write_text("mine")
    refused(tmp_path / "file", "--force", message="is a file; give the directory to write model.pt and "
                                                  "summary.json into")  # fmt: skip
    refused(tmp_path / "file" / "under", message=f"{tmp_path / 'file'} is a file, not a directory")  # after the
    assert (tmp_path / "file").read_text() == "mine" and not personalized  # personalization, "Not a directory"
    monkeypatch.undo()
    assert main([*base, "--epochs", "2", "--out", str(data), "--force"]) == 0
    assert (data / "summary.json").read_text() != first and (data / "model.pt").exists()
    assert len(json.loads((data / "summary.json").read_text())["epochs"]) == 2
    p = pflbed.load_run(run).personalize(x, y, method="ft", epochs=1, lr=0.05)  # the Python API: the same rule
    with pytest.raises(PflbedError, match=r"holds a personalized model already \(model\.pt, summary\.json\)"):
        p.save(data)
    assert p.save(data, force=True) == data and json.loads((data / "summary.json").read_text())["method"] == "ft"


@pytest.mark.parametrize(("arrays", "message"), [
    ({"x": np.zeros((4, 28, 28)), "y": np.zeros(4)}, r"bad\.npz: samples of shape \[28, 28\], but digits samples are"),
    ({"x": np.zeros((4, 8, 8)), "y": np.array([0, 1, 2, 10])}, r"bad\.npz: y: labels must be in 0…9"),
    ({"x": np.zeros((4, 8, 8)), "y": np.zeros(3)}, r"4 samples in x but 3 labels in y"),
    ({"x": np.array(5.0), "y": np.zeros(4)}, r"bad\.npz: x is a single number, not an array of samples$"),  # len()
    ({"x": np.zeros((4, 8, 8)), "y": np.array(3)}, r"bad\.npz: y is a single number, not an array of samples$"),
    ({"x": np.zeros((4, 8, 8))}, r"an \.npz with arrays x \(samples\) and y \(labels\) is needed; it has x$"),
    ({"x": np.full((4, 8, 8), "a"), "y": np.zeros(4)}, r"bad\.npz: samples must be real numbers \(got <U1\)$"),
    ({"x": np.array([[[np.nan] * 8] * 8] + [np.zeros((8, 8))] * 3), "y": np.zeros(4)},
     r"bad\.npz: 1 of 4 samples hold NaN or infinite values$"),  # a NaN sample trained a NaN model, exit 0
    ({"x": np.zeros((0, 8, 8)), "y": np.zeros(0)}, r"x: no samples to personalize from$"),  # the model, untouched
])  # fmt: skip
def test_bad_samples_are_one_line_exit_2(runs, tmp_path, capsys, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    args = ["personalize", str(runs["fedavg"][0]), "--data", str(tmp_path / "bad.npz")]
    rc = main([*args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and re.search(message, err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("content", "message"), [
    (b"\x93NUMPY\x01\x00", r"not a readable \.npz file \(one array, a \.npy; save x and y with numpy\.savez\)$"),
    (b"x,y\n1,2\n", r"not a readable \.npz file \(not a zip archive; save x and y with numpy\.savez\)$"),
    (b"PK\x03\x04truncated", r"not a readable \.npz file \("),
])  # fmt: skip
def test_a_file_that_is_no_npz_is_one_line_exit_2(runs, tmp_path, capsys, content, message):
    """A .npy (numpy.save of x alone) crashed with a traceback; any other file was said to hold pickled data."""
    (tmp_path / "bad.npz").write_bytes(content)
    rc = main(["personalize", str(runs["fedavg"][0]), "--data", str(tmp_path / "bad.npz"), "--out",
               str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and re.search(rf"bad\.npz: {message}", err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--epochs", "0"], r"--epochs must be in 1…100,000 \(got 0\)$"),
    (["--epochs", "100001"], r"--epochs must be in 1…100,000 \(got 100001\)$"),
    (["--lr", "-1"], r"--lr must be a finite number > 0 \(got -1\)$"),
    (["--lr", "nan"], r"--lr must be a finite number > 0 \(got nan\)$"),
    (["--lr", "0"], r"--lr must be a finite number > 0 \(got 0\)$"),
    (["--val", "{label}"], r"\S*label\.npz: y: labels must be in 0…9 \(digits has 10 classes\), got 0…10$"),
    (["--test", "{label}"], r"\S*label\.npz: y: labels must be in 0…9 \(digits has 10 classes\), got 0…10$"),
    (["--seed", "-1"], r"--seed must be in 0…9223372036854775807 \(got -1\)$"),
    (["--seed", str(2**64)], rf"--seed must be in 0…9223372036854775807 \(got {2**64}\)$"),  # was a traceback
    (["--val", "{empty}"], r"val x: no samples to choose an epoch on"),  # was a KeyError
    (["--val", "{nan}"], r"\S*nan\.npz: 1 of 3 samples hold NaN or infinite values$"),
    (["--test", "{empty}"], r"\S*empty\.npz: no samples to score$"),  # was a NaN accuracy in summary.json
    (["--test", "{nan}"], r"\S*nan\.npz: 1 of 3 samples hold NaN or infinite values$"),
])  # fmt: skip
def test_bad_options_and_evaluation_samples_are_one_line_exit_2(runs, tmp_path, capsys, flags, message):
    (x, y), _, _ = _client_samples()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "empty.npz", x=x[:0], y=y[:0])
    np.savez(tmp_path / "nan.npz", x=np.concatenate([x[:2], np.full_like(x[:1], np.inf)]), y=y[:3])
    np.savez(tmp_path / "label.npz", x=x[:3], y=np.array([0, 1, 10]))
    flags = [f.format(empty=tmp_path / "empty.npz", nan=tmp_path / "nan.npz", label=tmp_path / "label.npz")
             for f in flags]  # fmt: skip
    rc = main(["personalize", str(runs["fedavg"][0]), "--data", str(tmp_path / "train.npz"), "--epochs", "1", *flags,
               "--out", str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and re.match(rf"pflbed: error: {message}", err), err
    assert not (tmp_path / "o").exists()


def test_a_diverging_personalization_stops_and_says_so_and_a_diverging_lr_is_not_chosen(runs, tmp_path, capsys):
    """A learning rate that makes a parameter non-finite: alone, exit 3 in one line and no output (it saved a model
    of NaN, exit 0); among the lrs chosen on validation, it is no candidate (a NaN model still predicts a class)."""
    (x, y), val, _ = _client_samples()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    rc = main(["personalize", str(runs["fedavg"][0]), "--data", str(tmp_path / "train.npz"), "--lr", "1e30",
               "--method", "ft", "--epochs", "3", "--out", str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "\n" not in err and re.fullmatch(
        r"pflbed: error: personalizing diverged \(lr 1e\+30 in epoch \d\): a parameter is not finite — lower --lr", err)
    assert not (tmp_path / "o").exists()
    run = pflbed.load_run(runs["fedavg"][0])
    nc = run.config.eval.new_clients.model_copy(update={"lrs": [1e30, 0.05]})
    run.config = run.config.model_copy(update={"eval": run.config.eval.model_copy(update={"new_clients": nc})})
    run.chosen_lr = lambda: None
    p = run.personalize(x, y, method="ft", epochs=3, val=val)
    assert p.lr == 0.05 and p.info["lr_val"]["1e+30"] is None and p.info["lr_val"]["0.05"] >= 0
    assert set(p.info["diverged"]) == {"1e+30"}
    assert all(bool(torch.isfinite(t).all()) for t in p.model.state_dict().values() if t.is_floating_point())
    nc = nc.model_copy(update={"lrs": [1e30, 1e31]})
    run.config = run.config.model_copy(update={"eval": run.config.eval.model_copy(update={"new_clients": nc})})
    with pytest.raises(PflbedError, match=r"^personalizing diverged \(lr 1e\+30 in epoch \d, lr 1e\+31 in epoch \d\)"):
        run.personalize(x, y, method="ft", epochs=3, val=val)


def test_image_files_are_scaled_as_images_for_training_validation_and_scoring(runs, monkeypatch):
    """Samples read from image files span 0–255, not the dataset's own range (digits: 0–16): `scale` reaches the
    training and validation inputs and both accuracies; with the dataset's range they would be other inputs."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), (xv, yv), (xt, yt) = (tuple(np.uint8(a * 255 / 16) if a.ndim == 3 else a for a in split)
                                  for split in _client_samples())  # fmt: skip
    seen = []
    real = run.algo.personalize

    def spy(server, data, budget, gen):
        seen.append(data)
        yield from real(server, data, budget, gen)

    monkeypatch.setattr(run.algo, "personalize", spy)
    p = run.personalize(x, y, method="native", epochs=1, lr=0.05, val=(xv, yv), scale=255.0)
    assert torch.equal(seen[0].x[seen[0].train], run.inputs(x, 255.0))
    assert torch.equal(seen[0].x[seen[0].val], run.inputs(xv, 255.0))
    scales, real_inputs = [], run.inputs
    monkeypatch.setattr(run, "inputs", lambda raw, scale=None, what="x": scales.append((scale, what)) or
                        real_inputs(raw, scale, what))  # fmt: skip
    for model, score in ((p.model, p.accuracy), (p.zero_shot, p.zero_shot_accuracy)):
        assert score(xt, yt, 255.0) == pytest.approx(float((model(real_inputs(xt, 255.0)).argmax(1).numpy() ==
                                                           yt).mean()))  # fmt: skip
    assert scales == [(255.0, "test x")] * 2


def test_the_api_s_choices_are_the_command_s_and_their_bounds_are_taken(runs, monkeypatch):
    """`personalize` without a seed is the command's default (0); the largest seed and --epochs 100,000 are taken
    (the epochs checked, not run: `_adapt` replaced); an unknown method and a run directory without a config or a
    checkpoint are one line each."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), _, _ = _client_samples()
    a, b = (run.personalize(x, y, method="ft", epochs=1, lr=0.05, **k).model.state_dict() for k in ({}, {"seed": 0}))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = run.personalize(x, y, method="ft", epochs=1, lr=0.05, seed=1).model.state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the seed orders the batches: 0 is a choice
    run.personalize(x, y, method="ft", epochs=1, lr=0.05, seed=2**63 - 1)
    monkeypatch.setattr(run, "_adapt", lambda *a: (torch.nn.Identity(), [{"epoch": 1}], 1, 0.0))
    assert run.personalize(x, y, epochs=100_000, lr=0.05).selected_epoch == 1
    with pytest.raises(PflbedError, match=r"^--method: unknown 'all'; choose native, ft or lp$"):
        run.personalize(x, y, method="all")
    p = run.personalize(x, y, method="native", epochs=1, lr=0.05)  # the zero-shot model's own checks
    with pytest.raises(PflbedError, match=r"^test y: labels must be in 0…9"):
        p.zero_shot_accuracy(x[:2], np.array([0, 10]))
    with pytest.raises(PflbedError, match=r"^test x: no samples to score$"):
        p.zero_shot_accuracy(x[:0], y[:0])
    moved = pflbed.load_run(runs["fedavg"][0], device="auto").config.executor
    assert moved.device == "auto" and moved.threads == 1  # the device replaced (the run's: cpu), the rest kept


def test_the_zero_shot_start_is_the_method_s_for_native_and_the_generic_model_for_ft_and_lp(runs, monkeypatch):
    """`zero_shot`: where each personalization started — the method's zero-shot model of the new client's data
    (replaced here by zeros, FedAvg's being its generic model) for native, the generic model for ft and lp. lp
    trains the head alone (its body stays the generic one), with the run's augmentation for every method."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), _, _ = _client_samples()
    generic = run.algo.generic_model(run.server)
    zeros = Predictor(generic.model, {k: torch.zeros_like(v) for k, v in generic.params.items()})
    asked, augments = [], []
    monkeypatch.setattr(run.algo, "zero_shot", lambda server, data: asked.append(data.num_train) or zeros)
    monkeypatch.setattr(run.algo.ctx, "augment", sentinel := object())
    real_finetune = trained.finetune_epochs

    def finetune(model, start, data, budget, gen):
        augments.append(data.augment)
        yield from real_finetune(model, start, replace(data, augment=None), budget, gen)

    monkeypatch.setattr(trained, "finetune_epochs", finetune)
    monkeypatch.setattr(run.algo, "personalize", lambda server, data, budget, gen: finetune(
        run.algo.ctx.model, generic.params, data, budget, gen))  # fmt: skip
    native = run.personalize(x, y, method="native", epochs=1, lr=0.05)
    assert asked == [30] and all(not t.any() for t in native.zero_shot.state_dict().values())
    for method in ("ft", "lp"):
        p = run.personalize(x, y, method=method, epochs=1, lr=0.05)
        start = p.zero_shot.state_dict()
        assert all(torch.equal(start[k], generic.params[k]) for k in generic.params) and asked == [30]
        moved = {k for k, v in p.model.state_dict().items() if not torch.equal(v, generic.params[k])}
        assert moved and (moved <= {k for k in moved if k.startswith("blocks.classifier.")}) == (method == "lp")
    assert augments == [sentinel] * 3


def test_a_run_directory_is_loaded_unfinished_and_refused_without_config_or_checkpoint(runs, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(runs["fedavg"][0], path)
    (path / "summary.json").unlink()
    (path / "metrics.jsonl").unlink()
    run = pflbed.load_run(path)  # interrupted after a checkpoint: its last state, no results yet
    assert run.summary is None and run.history == [] and run.round == 3
    for checkpoint in (path / "checkpoints").iterdir():
        checkpoint.unlink()
    with pytest.raises(PflbedError, match=rf"^{re.escape(str(path))}: has no checkpoint \(the run stopped before its "
                                          r"first checkpointed round\): nothing to load$"):  # fmt: skip
        pflbed.load_run(path)
    (path / "checkpoints" / "last.pt").mkdir()  # was "has no checkpoint" too
    with pytest.raises(PflbedError, match=r"last\.pt: is a directory, not a checkpoint$"):
        pflbed.load_run(path)
    (path / "checkpoints" / "last.pt").rmdir()
    shutil.copy(runs["fedavg"][0] / "checkpoints" / "last.pt", path / "checkpoints" / "last.pt")
    with pytest.raises(PflbedError, match=rf"^{re.escape(str(tmp_path))}: not a pflbed run directory \(no config"):
        pflbed.load_run(tmp_path)
    (path / "config.yaml").write_text((path / "config.yaml").read_text().replace("name: fedavg", "name: nope", 1))
    with pytest.raises(PflbedError, match=rf"^{re.escape(str(path / 'config.yaml'))}: algorithm\.name: unknown "):
        pflbed.load_run(path)  # an edited config's mistake, named with its file (before its checkpoint is read)


def test_version_and_data_show_writes_no_picture_unasked(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pflbed {pflbed.__version__}"
    monkeypatch.chdir(tmp_path)
    assert main(["data", "show", "--set", "federation.clients=4"]) == 0
    assert list(tmp_path.iterdir()) == []


def test_a_new_client_of_a_heterogeneous_run_takes_the_architecture_of_the_run_s_held_out_client(tmp_path):
    """Local with two architectures: a new client is the run's first held-out client, so its personal model is of
    that client's architecture (heterogeneous methods pick it from the client id)."""
    path = tmp_path / "het"
    pflbed.run({**RUN, "algorithm": {"name": "local", "architectures": ["mlp", "lenet5"]},
                "federation": {"clients": 4, "new_clients": 1}, "train": {"rounds": 1}}, path)  # fmt: skip
    run = pflbed.load_run(path)
    (x, y), _, _ = _client_samples()
    new = run.algo.ctx.federation.new[0]
    p = run.personalize(x, y, epochs=1, lr=0.05)
    assert p.model.zoo_name == run.algo.arch_of(new) == "lenet5"


def test_a_personalization_of_a_dropout_model_is_fixed_by_its_seed_whatever_ran_before(tmp_path):
    """`TrainedRun.personalize` on AlexNet (dropout): its masks are drawn from the personalization's seed
    (`rng.global_from`), not from whatever this process last left in torch's global RNG — the same `seed`, the
    same model, after two different draws before; and the global RNG is left where it was."""
    torch.set_num_threads(1)
    pflbed.run({**RUN, "model": {"name": "alexnet_small_x025"}, "train": {"rounds": 1, "lr": 0.05},
                "algorithm": {"name": "fedavg"}}, tmp_path / "run")  # fmt: skip
    run = pflbed.load_run(tmp_path / "run")
    (x, y), _, _ = _client_samples()
    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        models.append(run.personalize(x, y, method="ft", epochs=2, lr=0.05, seed=7).model.state_dict())
        assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_the_learning_rate_the_run_chose_is_read_where_the_summary_has_it(runs, monkeypatch):
    """`chosen_lr`: the run's new-client fine-tuning lr chosen on validation (full-size data), None wherever the
    summary lacks a level of it (an unfinished run, no new clients, no ft, no full size)."""
    run = pflbed.load_run(runs["fedavg"][0])
    for summary in (None, {}, {"new_clients": None}, {"new_clients": {}}, {"new_clients": {"methods": {}}},
                    {"new_clients": {"methods": {"lp": {"M": {"lr_best": 0.1}}}}},
                    {"new_clients": {"methods": {"ft": {"S": {"lr_best": 0.1}}}}},
                    {"new_clients": {"methods": {"ft": {"M": {}}}}}):  # fmt: skip
        monkeypatch.setattr(run, "summary", summary)
        assert run.chosen_lr() is None, summary
    monkeypatch.setattr(run, "summary", {"new_clients": {"methods": {"ft": {"M": {"lr_best": 1}}}}})
    assert run.chosen_lr() == 1.0 and isinstance(run.chosen_lr(), float)


@pytest.mark.parametrize(("y", "message"), [
    (np.zeros((3, 1)), r"^y: expected 3 labels \(one per sample\), got shape \[3, 1\]$"),
    (np.zeros(2), r"^y: expected 3 labels \(one per sample\), got shape \[2\]$"),
    (np.array([0.0, 0.5, 1.0]), r"^y: labels must be integers$"),
    (np.array([-1, 0, 1]), r"^y: labels must be in 0…9 \(digits has 10 classes\), got -1…1$"),
    (np.array(["0", "1", "2"]), r"^y: labels must be integers \(got <U1 values\)$"),  # was torch's dtype error
    ([0, None, 1], r"^y: labels must be integers \(got object values\)$"),
])  # fmt: skip
def test_the_api_checks_labels_as_the_command_does(runs, y, message):
    """`TrainedRun.labels` (what `personalize` and the scores take): one label per sample, integers (floats holding
    integers too), each a class of the run; label 0 and the last class are classes."""
    run = pflbed.load_run(runs["fedavg"][0])
    with pytest.raises(PflbedError, match=message):
        run.labels(y, "y", 3)
    got = run.labels(np.array([0.0, 9.0, 3.0]), "y", 3)
    assert got.dtype == torch.long and got.tolist() == [0, 9, 3]
    assert run.labels(np.zeros(0), "y", 0).tolist() == []


def test_predictions_take_the_raw_range_given_and_a_method_without_a_generic_model_needs_a_client(runs, monkeypatch):
    """`scale` reaches the inputs of `TrainedRun.predict` and `Personalized.predict` (raw samples of another range,
    the same predictions); a personalized model's `predict` is its own model's; loaded without its run it cannot
    transform raw samples, said in one line; a method without a generic model predicts for a client only."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), _, (xt, _) = _client_samples()
    assert torch.allclose(run.inputs(xt * 255 / 16, 255.0), run.inputs(xt), atol=1e-5)
    assert not torch.allclose(run.inputs(xt * 255 / 16), run.inputs(xt), atol=1e-2)
    assert np.array_equal(run.predict(xt * 255 / 16, scale=255.0), run.predict(xt))
    with pytest.raises(DataError, match=r"^x: samples of shape \[28, 28\], but digits samples are \[8, 8\]$"):
        run.inputs(np.zeros((2, 28, 28)))  # named x unless named otherwise
    p = run.personalize(x, y, method="ft", epochs=2, lr=0.05)
    own = p.model(run.inputs(xt)).argmax(1).numpy()
    assert not np.array_equal(own, run.predict(xt))  # the personalized model, not the generic one
    assert np.array_equal(p.predict(xt), own)
    scales, real_inputs = [], run.inputs
    monkeypatch.setattr(run, "inputs", lambda raw, scale=None, what="x": scales.append(scale) or
                        real_inputs(raw, scale, what))  # fmt: skip
    assert np.array_equal(p.predict(xt * 255 / 16, scale=255.0), own) and scales == [255.0]
    with pytest.raises(PflbedError, match=r"^this personalized model was loaded without its run; pass transformed "
                                          r"inputs to \.model$"):  # fmt: skip
        replace(p, run=None).predict(xt)
    monkeypatch.setattr(run.algo, "generic_model", lambda server: None)
    assert run.generic_model() is None
    with pytest.raises(PflbedError, match=r"^fedavg has no generic model: pass a client id$"):
        run.predict(xt)


def test_a_new_client_takes_the_first_held_out_id_else_the_last_client_s(runs, monkeypatch):
    run = pflbed.load_run(runs["fedavg"][0])
    fed = run.algo.ctx.federation
    assert fed.new and fed.new[0] != len(fed.clients) - 1 and run._new_cid() == fed.new[0]
    monkeypatch.setattr(run.algo.ctx, "federation", replace(fed, new=[fed.new[1]]))
    assert run._new_cid() == fed.new[1]
    monkeypatch.setattr(run.algo.ctx, "federation", replace(fed, new=[]))
    assert run._new_cid() == len(fed.clients) - 1


def test_a_participant_without_a_kept_state_gets_its_initial_one(runs):
    """A client that took part but whose state the checkpoint does not hold (stateless methods keep none; a client
    never sampled): its personal model is the one of its initial state, for its own id."""
    run = pflbed.load_run(runs["fedper"][0])
    cid = run.algo.ctx.federation.participated[-1]
    kept = run.personal_model(cid).state_dict()
    run.states.pop(cid)
    asked, real_init = [], run.algo.init_client
    run.algo.init_client = lambda c: asked.append(c) or real_init(c)  # FedPer's is the same for every id; KT-pFL's not
    initial = run.personal_model(cid).state_dict()
    assert asked == [cid]
    expected = trained._module(run.algo.personal_model(run.server, real_init(cid))).state_dict()
    assert all(torch.equal(initial[k], expected[k]) for k in expected)
    assert not all(torch.equal(initial[k], kept[k]) for k in kept)


def _ran(*args):
    raise AssertionError("unpickled: the file ran code")


class _Payload:
    def __reduce__(self):
        return (_ran, ("x",))


def test_a_saved_model_and_its_summary_and_no_unpickling_of_what_a_file_names(runs, tmp_path):
    """`Personalized.save` writes the model and a summary of how it was obtained (`seconds` to the millisecond);
    `load_model` gives back the same predictions and reads tensors only: a model.pt naming code to run is refused."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), val, (xt, _) = _client_samples()
    p = run.personalize(x, y, method="ft", epochs=2, lr=0.05, val=val)
    assert p.save(str(tmp_path / "p")) == tmp_path / "p"  # a path as text too, as the guide's `.save(dir)` reads
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert summary == {"method": "ft", "lr": 0.05, "selected_epoch": p.selected_epoch, "epochs": p.epochs,
                       "seconds": round(p.seconds, 3), **p.info}  # fmt: skip
    assert np.array_equal(load_model(tmp_path / "p")(run.inputs(xt)).argmax(1).numpy(), p.predict(xt))
    (tmp_path / "bad").mkdir()
    torch.save({"architecture": _Payload()}, tmp_path / "bad" / "model.pt")
    with pytest.raises(PflbedError, match=r"model\.pt: not a readable model file \(UnpicklingError\)$"):
        load_model(tmp_path / "bad")  # refused unread: `_ran` would have raised an AssertionError


def test_a_directory_without_a_saved_model_or_with_another_file_is_one_line(runs, tmp_path):
    """`load_model` on what `Personalized.save` did not write: a missing, truncated or empty file, a checkpoint, a
    bare state dict, a tensor, entries of the wrong types or an architecture no zoo has were FileNotFound, torch,
    EOF, Key, Index and Type errors from inside it; the file's own path is refused too."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), _, _ = _client_samples()
    good = run.personalize(x, y, method="ft", epochs=1, lr=0.05).save(tmp_path / "good")
    blob = torch.load(good / "model.pt", weights_only=True)
    saved = (good / "model.pt").read_bytes()
    not_saved = "not a model pflbed saved (a mapping of its state_dict, architecture, input_shape and num_classes)"
    cases = {
        "empty": (None, "{d}: no model.pt in it; give the directory `pflbed personalize --out` (or "
                        "`Personalized.save`) wrote"),
        "truncated": (saved[:100], "{d}/model.pt: not a readable model file (RuntimeError)"),
        "nothing": (b"", "{d}/model.pt: not a readable model file (EOFError)"),
        "checkpoint": ((runs["fedavg"][0] / "checkpoints" / "last.pt").read_bytes(), f"{{d}}/model.pt: {not_saved}"),
        "tensor": (torch.zeros(3), f"{{d}}/model.pt: {not_saved}"),
        "state dict": (blob["state_dict"], f"{{d}}/model.pt: {not_saved}"),
        "classes": ({**blob, "num_classes": -3}, f"{{d}}/model.pt: {not_saved}"),
        "one class": ({**blob, "num_classes": 1}, f"{{d}}/model.pt: {not_saved}"),
        "shape": ({**blob, "input_shape": "abc"}, f"{{d}}/model.pt: {not_saved}"),
        "zero size": ({**blob, "input_shape": [1, 0, 8]}, f"{{d}}/model.pt: {not_saved}"),
        "architecture": ({**blob, "architecture": 5}, f"{{d}}/model.pt: {not_saved}"),
        "no tensors": ({k: v for k, v in blob.items() if k != "state_dict"}, f"{{d}}/model.pt: {not_saved}"),
        "no zoo's": ({**blob, "architecture": "nope"}, "{d}/model.pt: cannot rebuild its 'nope' model (no model of "
                                                       "the zoo)"),
    }  # fmt: skip
    for name, (content, message) in cases.items():
        d = tmp_path / name
        d.mkdir()
        if isinstance(content, bytes):
            (d / "model.pt").write_bytes(content)
        elif content is not None:
            torch.save(content, d / "model.pt")
        with pytest.raises(PflbedError) as e:
            load_model(d)
        assert str(e.value) == message.format(d=d), name
    with pytest.raises(PflbedError, match=r"model\.pt: is a file; give the directory holding model\.pt$"):
        load_model(good / "model.pt")


def test_a_method_s_own_personal_model_is_saved_and_loaded_with_its_run(tmp_path, runs):
    """FedRoD's personal model (its body with the generic and the personal head) and GPFL's are not one of the
    zoo's architectures: saved as tensors, rebuilt from the run's algorithm (`load_model(…, run=…)`), the same
    predictions; without the run, or with another method's, one line. GPFL's generic model takes conditional
    inputs beside the network's: fine-tuning it as one network is refused in one line (it was a KeyError)."""
    (x, y), _, (xt, _) = _client_samples()
    for name in ("fedrod", "gpfl"):
        path = tmp_path / name
        pflbed.run({**RUN, "algorithm": {"name": name}, "train": {"rounds": 1, "lr": 0.05}}, path)
        run = pflbed.load_run(path)
        p = run.personalize(x, y, method="native", epochs=1, lr=0.05)
        assert not hasattr(p.model, "zoo_name")
        p.save(tmp_path / f"{name}-p")
        with pytest.raises(PflbedError, match=rf"^{re.escape(str(tmp_path / f'{name}-p'))}: the model is a method's "
                                              r"own personal model, not one of the zoo's architectures: load it with "
                                              r"its run \(load_model\(path, run=RUN_DIR\)\)$"):  # fmt: skip
            load_model(tmp_path / f"{name}-p")
        for given in (path, run):
            loaded = load_model(tmp_path / f"{name}-p", run=given)
            assert not loaded.training and np.array_equal(loaded(run.inputs(xt)).argmax(1).numpy(), p.predict(xt))
        with pytest.raises(PflbedError, match=r"-p: its tensors do not fit the model rebuilt \("):
            load_model(tmp_path / f"{name}-p", run=runs["fedavg"][0])
    with pytest.raises(PflbedError, match=r"^gpfl's generic model is not one network of body and head to fine-tune "
                                          r"or probe: use --method native$"):  # fmt: skip
        run.personalize(x, y, method="ft", epochs=1, lr=0.05)


def test_the_api_refuses_what_is_no_client_id_and_no_validation_pair(runs):
    """A client id given as text ("3") was reported as "client 3 did not participate", and one given as 3.0 or True
    was taken as a client; a `val` that is not an (x, y) pair was an IndexError from inside `personalize`."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), _, (xt, _) = _client_samples()
    cid = run.algo.ctx.federation.participated[0]
    for bad in (str(cid), float(cid), True):
        with pytest.raises(TypeError, match=rf"^cid: a client id \(int\), got {type(bad).__name__} {bad!r}$"):
            run.predict(xt, cid=bad)
    assert np.array_equal(run.predict(xt, cid=np.int64(cid)), run.predict(xt, cid=cid))  # numpy's integers are ids
    for val, got in (((xt,), "tuple of 1"), (xt, "ndarray"), ([xt, y, y], "list of 3")):
        with pytest.raises(PflbedError, match=rf"^val: expected \(x, y\), the validation samples and their labels; "
                                              rf"got {got}$"):  # fmt: skip
            run.personalize(x, y, epochs=1, lr=0.05, val=val)


def test_the_api_s_options_of_another_type_are_named_and_a_scale_must_be_a_range(runs):
    """`epochs="3"`, `lr="0.1"`, `seed=1.5` failed deep in a comparison or in torch (a bool was taken as 1); a
    `scale` of 0 was taken for unset and a negative one flipped every pixel: each is refused, naming the option.
    numpy's numbers are numbers."""
    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), _, _ = _client_samples()
    for option, bad, kind in (("epochs", "3", "whole number"), ("epochs", True, "whole number"),
                              ("epochs", 1.0, "whole number"), ("lr", "0.1", "number"), ("lr", False, "number"),
                              ("seed", 1.5, "whole number"), ("seed", None, "whole number")):  # fmt: skip
        with pytest.raises(TypeError, match=rf"^{option}: a {kind}, got {type(bad).__name__} {re.escape(repr(bad))}$"):
            run.personalize(x, y, method="ft", **{"epochs": 1, "lr": 0.05, option: bad})
    for bad in (0, -16.0, float("nan"), float("inf"), True, "16"):
        with pytest.raises(DataError, match=rf"^x: scale must be a finite number > 0, the largest value the samples' "
                                            rf"format holds \(255 for 8-bit images\); got {re.escape(repr(bad))}$"):
            run.personalize(x, y, method="ft", epochs=1, lr=0.05, scale=bad)
    kept = run.personalize(x, y, method="ft", epochs=np.int64(1), lr=np.float64(0.05), seed=np.int64(0), scale=16.0)
    same = run.personalize(x, y, method="ft", epochs=1, lr=0.05).model.state_dict()
    assert all(torch.equal(v, same[k]) for k, v in kept.model.state_dict().items())


def test_samples_far_beyond_their_range_and_infinite_labels_are_refused_not_blamed_on_the_lr(runs):
    """Pixels of 1e30 are finite: they trained, diverged in the first epoch, and the message said to lower the lr.
    Values up to 10,000 times the range are taken (8-bit images given to digits are 16 times it), one step above
    is refused, and the range is the `scale` given. An infinite label equalled its rounding and became int64's
    minimum."""
    from pflbed.data.arrays import RAW_RANGE_MAX

    run = pflbed.load_run(runs["fedavg"][0])
    (x, y), _, _ = _client_samples()
    edge = np.float32(RAW_RANGE_MAX * 16.0)
    at, above = x.astype(np.float32), x.astype(np.float32)
    at[0, 0, 0], above[0, 0, 0] = -edge, np.nextafter(edge, np.float32(np.inf))
    run.inputs(at)
    with pytest.raises(DataError, match=r"^x: values up to 1\.6e\+05, over 10,000 times the range 0…16 the samples "
                                        r"are scaled by; give raw samples in it, or pass their own range as scale$"):
        run.inputs(above)
    run.inputs(above, scale=255.0)  # the range given is the range checked
    with pytest.raises(DataError, match=r"over 10,000 times the range 0…255 "):
        run.inputs(above * 16, scale=255.0)
    with pytest.raises(DataError, match=r"^x: values up to 1\.6e\+31, "):
        run.personalize(x * np.float32(1e30), y, method="ft", epochs=1, lr=0.05)
    for bad in (np.inf, -np.inf):
        with pytest.raises(PflbedError, match=r"^y: labels must be integers$"):
            run.labels(np.array([0.0, bad, 1.0]), "y", 3)


def test_a_device_asked_for_that_this_machine_lacks_is_refused_not_replaced_by_the_cpu(runs):
    """Without a device, a GPU run loads on the CPU of a machine without one (its config's device is replaced);
    a device asked for is the one used, or an error naming it, not a silent CPU."""
    for bad in ("cuda:99", "tpu", "cuda:x"):
        with pytest.raises(PflbedError, match=rf"^device '{bad}': "):
            pflbed.load_run(runs["fedavg"][0], device=bad)
    assert pflbed.load_run(runs["fedavg"][0], device=torch.device("cpu")).config.executor.device == "cpu"


@pytest.mark.parametrize(("option", "arrays", "message"), [
    ("--data", {"x": np.zeros((3, 4, 8)), "y": np.zeros(3)}, r"bad\.npz: samples of shape \[4, 8\], but digits"),
    ("--val", {"x": np.zeros((3, 8, 8)), "y": np.array([0, np.inf, 1])}, r"bad\.npz: y: labels must be integers$"),
    ("--test", {"x": np.zeros((3, 4, 8)), "y": np.zeros(3)}, r"bad\.npz: samples of shape \[4, 8\], but digits"),
    ("--test", {"x": np.full((3, 8, 8), 1e30), "y": np.zeros(3)}, r"bad\.npz: values up to 1e\+30, over 10,000 "),
    ("--test", {"x": np.zeros((0, 8, 8)), "y": np.zeros(0)}, r"bad\.npz: no samples to score$"),
])  # fmt: skip
def test_each_samples_file_is_checked_before_the_personalization_and_named(runs, tmp_path, capsys, monkeypatch,
                                                                          option, arrays, message):  # fmt: skip
    """A bad --test file was found once the personalization it then wasted was done; every file's samples are
    checked first, and named by their file rather than "x" or "test x"."""
    (x, y), _, _ = _client_samples()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "bad.npz", **arrays)
    data = tmp_path / ("bad.npz" if option == "--data" else "train.npz")
    called = []
    monkeypatch.setattr(trained.TrainedRun, "personalize", lambda *a, **k: called.append(1))
    extra = [] if option == "--data" else [option, str(tmp_path / "bad.npz")]
    rc = main(["personalize", str(runs["fedavg"][0]), "--data", str(data), *extra, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and re.match(rf"pflbed: error: {re.escape(str(tmp_path))}/{message}", err), err
    assert not called and not (tmp_path / "o").exists()
