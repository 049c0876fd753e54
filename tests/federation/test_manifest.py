"""Partition manifests: `pflbed data export OUT` writes a run's federation; `federation.manifest: OUT` runs on it,
identically to the original run; a manifest of other data, a missing or malformed one: one line, exit 2, nothing
written."""

import json
from dataclasses import fields

import pytest
import torch
import yaml

from pflbed.cli import main
from pflbed.config import validate_config
from pflbed.data import load_source
from pflbed.errors import DataError
from pflbed.federation import build_federation
from pflbed.federation.federation import new_client_train
from pflbed.federation.manifest import manifest, read_manifest, write_manifest

from ..tiny import TINY, figures

NEW = {"epochs": 2, "lrs": [0.05], "fractions": [0.3, 1.0]}
STANDARD = {**TINY, "federation": {**TINY["federation"], "new_clients": 2, "public": 40, "val_fraction": 0.2},
            "train": {**TINY["train"], "rounds": 2}, "eval": {"every": 1, "finetune": ["ft"], "new_clients": NEW}}
PFLBED = {**STANDARD, "dataset": {"name": "digits-rot4"},
          "federation": {"protocol": "pflbed", "alpha": 1.0, "min_size": 5, "sample_fraction": 0.5,
                         "pflbed": {"clients_per_domain": 2, "new_clients_per_domain": 1}}}  # fmt: skip
CASES = {"standard": STANDARD, "pflbed": PFLBED}


def _write(tmp_path, tree, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


def _export(tmp_path, tree, *extra):
    out = tmp_path / "manifest.json"
    assert main(["data", "export", str(out), "-c", str(_write(tmp_path, tree)), *extra]) == 0
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    return a == b


@pytest.mark.parametrize("case", CASES)
def test_a_manifest_reads_back_as_the_federation_it_was_exported_from(tmp_path, case):
    """Every index set (clients' train / val / test, public, global and per-domain sets), prior, domain and role
    comes back bit-equal; the new clients' S/M subsets are those the run would draw from its seed."""
    cfg = validate_config(CASES[case])
    source = load_source(cfg.dataset)
    fed = build_federation(source, cfg.federation, cfg.seed)
    back = read_manifest(_export(tmp_path, CASES[case]), source)
    for f in fields(fed):
        if f.name not in ("key", "new_subsets", "new_fractions"):
            assert _same(getattr(back, f.name), getattr(fed, f.name)), f.name
    assert back.new_fractions == [0.3, 1.0] and sorted(back.new_subsets) == fed.new and fed.new
    for c in fed.new:
        for i, f in enumerate(back.new_fractions):
            assert torch.equal(back.new_subsets[c][i], new_client_train(fed, c, i, f, cfg.seed))
            assert torch.equal(new_client_train(back, c, i, f, seed=12345), back.new_subsets[c][i])  # fixed: any seed


@pytest.mark.parametrize("case", CASES)
def test_a_run_on_its_exported_manifest_is_the_original_run(tmp_path, case):
    """run → data export → run with federation.manifest: the same summary (but timing) and the same metrics."""
    cfg = _write(tmp_path, CASES[case])
    assert main(["run", "-c", str(cfg), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    out = _export(tmp_path, CASES[case])
    assert main(["run", "-c", str(cfg), "--set", f"federation.manifest={out}", "--out", str(tmp_path / "b"),
                 "--no-progress"]) == 0  # fmt: skip
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("a", "b"))
    assert figures(a) == figures(b) and a["new_clients"] is not None
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == (tmp_path / "b" / "metrics.jsonl").read_text()


def test_the_new_clients_personalize_on_the_manifests_subsets(tmp_path, monkeypatch):
    """A manifest's S/M subsets, not the seed's draws, are what each new client trains on."""
    from pflbed.evaluation import newclients
    from pflbed.results.experiment import run

    m = json.loads(_export(tmp_path, STANDARD).read_text())
    clients = m["new_client_subsets"]["clients"]
    for c, sizes in clients.items():
        train = m["clients"][int(c)]["train"]
        sizes["S"], sizes["M"] = train[-2:], train[:3]
    (tmp_path / "edited.json").write_text(json.dumps(m))
    seen: dict = {}

    def record(algo, server, cid, data, budget, gen, P):
        seen.setdefault(cid, []).append(data.train.tolist())
        return {"last": 0.5, "best": 0.5, "last_val": 0.5, "best_val": 0.5}

    monkeypatch.setattr(newclients, "run_one", record)
    cfg = validate_config({**STANDARD, "federation": {**STANDARD["federation"],
                                                      "manifest": str(tmp_path / "edited.json")}})  # fmt: skip
    run(cfg, write=False, progress=False)
    assert seen.keys() == {int(c) for c in clients}
    for c, got in seen.items():  # methods ft and lp, per size
        want = [clients[str(c)]["S"], clients[str(c)]["M"]]
        assert got == want * 2


def _err(capsys):
    err = capsys.readouterr().err.strip()
    assert err.startswith("pflbed: error:") and "\n" not in err, err
    return err


def test_other_new_client_fractions_than_the_manifests_are_refused(tmp_path, capsys):
    out = _export(tmp_path, STANDARD)
    run = tmp_path / "run"
    assert main(["run", "-c", str(_write(tmp_path, STANDARD)), "--set", f"federation.manifest={out}", "--set",
                 "eval.new_clients.fractions=[0.5]", "--out", str(run), "--no-progress"]) == 2  # fmt: skip
    assert _err(capsys) == "pflbed: error: eval.new_clients.fractions: [0.5], but the new-client subsets of " \
        "federation.manifest are for [0.3, 1.0]; set those, or delete the manifest's new_client_subsets to draw them " \
        "from the seed"  # fmt: skip
    assert not run.exists()


def _edit(change):
    def apply(m, path):
        change(m)
        path.write_text(json.dumps(m))

    return apply


BAD = {
    "missing file": (lambda m, path: None, "no such file"),
    "a directory": (lambda m, path: path.mkdir(), "is a directory"),
    "invalid JSON": (lambda m, path: path.write_text('{"format": "pflbed-federation",\n "clients": [1, 2'),
                     r"not a partition manifest \(invalid JSON at line 2\)"),
    "not UTF-8": (lambda m, path: path.write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    "not a manifest": (lambda m, path: path.write_text("[1, 2, 3]"), r"not a partition manifest \(no \"format\""),
    "other version": (_edit(lambda m: m.update(version=99)), "manifest version 99; this pflbed reads version 1"),
    "other data": (_edit(lambda m: m["dataset"].update(fingerprint="0123456789abcdef")),
                   "made for dataset 'synthetic' with fingerprint 0123456789abcdef, but this config's dataset "
                   r"\('synthetic'\) has fingerprint [0-9a-f]{16}; a manifest runs only on the data it was exported"),
    "no clients": (_edit(lambda m: m.pop("clients")), "malformed manifest: 'clients' missing"),
    "index out of range": (_edit(lambda m: m["clients"][1]["test"].append(10**6)),
                           r"client 1's test holds index 1000000, outside 0…1999"),
    "index twice": (_edit(lambda m: m["clients"][0]["train"].append(m["clients"][0]["train"][0])),
                    "client 0's train holds an index twice"),
    "not integers": (_edit(lambda m: m["clients"][2].update(val=[1.5])), "client 2's val must be a list of integer"),
    "empty train": (_edit(lambda m: m["clients"][3].update(train=[])), "client 3 has no training samples"),
    "wrong prior": (_edit(lambda m: m["clients"][0].update(prior=[0.1] * 10)),
                    "client 0's prior is not the class distribution of its train indices"),
    "a client in both roles": (_edit(lambda m: m["participated"].append(m["new"][0])),
                               "every client must be either participated or new"),
    "a subset outside the client": (_edit(lambda m: m["new_client_subsets"]["clients"][str(m["new"][0])].update(
        S=m["clients"][m["participated"][0]]["train"][:2])), "subsets must be non-empty parts of its train indices"),
    "global test out of range": (_edit(lambda m: m.update(global_test=[0, 500])),
                                 r"global_test holds index 500, outside 0…499"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("command", ["run", "show"])
def test_a_bad_manifest_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, case, command):
    good = json.loads(_export(tmp_path, STANDARD).read_text())
    path = tmp_path / "bad.json"
    change, message = BAD[case]
    change(good, path)
    cfg = str(_write(tmp_path, STANDARD))
    capsys.readouterr()
    out = tmp_path / "run"
    args = ["--set", f"federation.manifest={path}"]
    argv = ["run", "-c", cfg, *args, "--out", str(out), "--no-progress"] if command == "run" else \
        ["data", "show", "-c", cfg, *args, "--png", str(tmp_path / "p.png")]  # fmt: skip
    assert main(argv) == 2
    import re

    err = _err(capsys)
    assert err.startswith(f"pflbed: error: federation.manifest: {path}: ") and re.search(message, err), err
    assert not out.exists() and not (tmp_path / "p.png").exists()


def test_export_needs_out_refuses_to_replace_one_and_writes_nothing_on_a_bad_config(tmp_path, capsys):
    cfg = str(_write(tmp_path, STANDARD))
    assert main(["data", "export", "-c", cfg]) == 2
    assert "data export needs OUT" in _err(capsys)
    out = _export(tmp_path, STANDARD)
    written = json.loads(out.read_text())
    said = " ".join(capsys.readouterr().out.split())
    dataset = written["dataset"]
    assert said == (f"manifest: {out} ({len(written['participated'])} participated and {len(written['new'])} new "
                    f"clients of {dataset['name']}, fingerprint {dataset['fingerprint']}); run it with --set "
                    f"federation.manifest={out}")  # fmt: skip
    assert len(written["new"]) == 2
    assert main(["data", "export", str(tmp_path), "-c", cfg]) == 2
    assert _err(capsys) == f"pflbed: error: {tmp_path}: is a directory; give the manifest file to write"
    before = out.read_text()
    assert main(["data", "export", str(out), "-c", cfg]) == 2
    assert f"{out} exists; --force replaces it" in _err(capsys) and out.read_text() == before
    assert main(["data", "export", str(out), "-c", cfg, "--force", "--set", "seed=1"]) == 0
    assert json.loads(out.read_text())["made_with"]["seed"] == 1
    bad = tmp_path / "other.json"
    assert main(["data", "export", str(bad), "-c", cfg, "--set", "federation.clients=100000"]) == 2
    assert "federation.clients" in _err(capsys) and not bad.exists()
    assert main(["data", "show", str(bad)]) == 2
    assert "data show takes no OUT" in _err(capsys)


def test_the_manifest_schema(tmp_path):
    """The documented top-level keys and client fields; one line per client."""
    out = _export(tmp_path, STANDARD)
    m = json.loads(out.read_text())
    assert list(m) == ["format", "version", "dataset", "made_with", "global_split", "global_test", "public",
                       "domain_val", "domain_test", "participated", "new", "clients", "new_client_subsets"]
    assert set(m["dataset"]) == {"name", "fingerprint", "train", "test", "num_classes"}
    made = m["made_with"]  # what made the split; not how rounds sample clients (sample_fraction, sampling)
    assert made["seed"] == 0 and set(made) == {"seed", "federation"}
    assert set(made["federation"]) == {"protocol", "pflbed", "clients", "partition", "alpha", "classes_per_client",
                                       "min_size", "min_samples", "manifest", "new_clients", "public",
                                       "train_per_client", "val_fraction", "test_fraction", "exclude_test_of"}
    assert {k: made["federation"][k] for k in ("clients", "public", "new_clients", "manifest")} == \
        {"clients": 6, "public": 40, "new_clients": 2, "manifest": None}  # fmt: skip
    assert all(set(c) == {"train", "val", "test", "prior", "domain"} for c in m["clients"])
    assert m["new_client_subsets"]["sizes"] == {"S": 0.3, "M": 1.0}
    assert len(out.read_text().splitlines()) == 13 + len(m["clients"]) + 3
    values = [line.split(": ", 1)[-1] for line in out.read_text().splitlines()[1:-1]]  # a key, then its JSON
    assert not [v for v in values if ", " in v or '": ' in v]  # compact: no spaces within a value
    source = load_source(validate_config(STANDARD).dataset)
    assert manifest(validate_config(STANDARD), source, read_manifest(out, source)) == m  # re-export: the same file


def _set(path, value):
    """An edit that sets the entry at `path` (keys and list positions) to `value`."""

    def apply(m):
        *parents, last = path
        for k in parents:
            m = m[k]
        m[last] = value(m[last]) if callable(value) else value

    return apply


def _new_subsets(m):
    return m["new_client_subsets"]["clients"][str(m["new"][0])]


# Each field of the schema a manifest can get wrong (beyond BAD, which goes through the commands): edit → the whole
# message after "federation.manifest: PATH: ".
M = "malformed manifest: "
SIZES = M + "new_client_subsets.sizes must map S (, M, L) to fractions in (0, 1]"
PRIOR = M + "client 0's prior is not the class distribution of its train indices"
ROLES = M + "new_client_subsets.clients must hold every new client, and only them"
DOMAINS = M + "domain_val and domain_test must hold one set for each client's domain"
MALFORMED = {
    "no dataset": (lambda m: m.pop("dataset"), "made for no dataset, but this config's dataset ('synthetic') has "
                   "fingerprint {fingerprint}; a manifest runs only on the data it was exported from"),
    "clients not a list": (_set(["clients"], {}), M + "'clients' has the wrong type"),
    "no clients": (_set(["clients"], []), M + "no clients"),
    "a client not an object": (_set(["clients", 1], [0, 1]), M + "client 1 is not an object"),
    "a client without val": (lambda m: m["clients"][2].pop("val"), M + "client 2: 'val' missing"),
    "a boolean index": (_set(["clients", 0, "train", 0], True),
                        M + "client 0's train must be a list of integer indices"),
    "a negative index": (_set(["clients", 1, "val"], lambda v: [*v, -3]),
                         M + "client 1's val holds index -3, outside 0…1999"),
    "the first index past the end": (_set(["clients", 1, "test"], lambda v: [*v, 2000]),
                                     M + "client 1's test holds index 2000, outside 0…1999"),
    "a negative domain": (_set(["clients", 2, "domain"], -1), M + "client 2's domain must be a non-negative integer"),
    "a boolean domain": (_set(["clients", 2, "domain"], True), M + "client 2's domain must be a non-negative integer"),
    "a prior one class short": (_set(["clients", 0, "prior"], lambda p: p[:-1]), PRIOR),
    "a prior of text": (_set(["clients", 0, "prior"], lambda p: ["0.1", *p[1:]]), PRIOR),
    "a prior half again": (_set(["clients", 0, "prior"], lambda p: [1.5 * v for v in p]), PRIOR),
    "a prior's largest class off by 1.5e-6": (  # an absolute tolerance: 1e-6, whatever the class's share
        _set(["clients", 0, "prior"], lambda p: [v + 1.5e-6 if v == max(p) else v for v in p]), PRIOR),
    "a client taking part twice": (_set(["participated"], lambda p: [*p, p[0]]),
                                   M + "'participated' must list distinct client ids 0…5"),
    "an unknown new client": (_set(["new"], lambda n: [*n, 6]), M + "'new' must list distinct client ids 0…5"),
    "a boolean client id": (_set(["new"], lambda n: [True if c == 1 else c for c in n]),
                            M + "'new' must list distinct client ids 0…5"),
    "no participated client": (lambda m: m.update(participated=[], new=list(range(6))), M + "no participated client"),
    "a client in no role": (_set(["participated"], lambda p: p[1:]),
                            M + "every client must be either participated or new, not both"),
    "another global split": (_set(["global_split"], "val"), M + "'global_split' must be \"train\" or \"test\""),
    "an empty global test set": (_set(["global_test"], []), M + "global_test is empty"),
    "a domain set without its pair": (_set(["domain_val"], [[0]]), DOMAINS),
    "a client of a domain without sets": (
        lambda m: m.update(domain_val=[[0]], domain_test=[[1]], clients=[{**m["clients"][0], "domain": 1},
                                                                          *m["clients"][1:]]), DOMAINS),
    "a domain val set out of range": (lambda m: m.update(domain_val=[[-1]], domain_test=[[0]]),
                                      M + "domain_val[0] holds index -1, outside 0…1999"),
    "a domain test set out of range": (lambda m: m.update(domain_val=[[0]], domain_test=[[2000]]),
                                       M + "domain_test[0] holds index 2000, outside 0…1999"),
    "public out of range": (_set(["public"], [10**7]), M + "public holds index 10000000, outside 0…1999"),
    "subsets not an object": (_set(["new_client_subsets"], []), M + "'new_client_subsets' is not an object"),
    "subsets without sizes": (lambda m: m["new_client_subsets"].pop("sizes"),
                              M + "new_client_subsets: 'sizes' missing"),
    "subsets without clients": (lambda m: m["new_client_subsets"].pop("clients"),
                                M + "new_client_subsets: 'clients' missing"),
    "sizes not S first": (_set(["new_client_subsets", "sizes"], {"M": 0.3, "L": 1.0}), SIZES),
    "no sizes": (_set(["new_client_subsets", "sizes"], {}), SIZES),
    "a size of none": (_set(["new_client_subsets", "sizes", "S"], 0), SIZES),
    "a size beyond the whole": (_set(["new_client_subsets", "sizes", "M"], 1.5), SIZES),
    "a boolean size": (_set(["new_client_subsets", "sizes", "M"], True), SIZES),
    "a participated client's subsets": (
        lambda m: m["new_client_subsets"]["clients"].update({str(m["participated"][0]): _new_subsets(m)}), ROLES),
    "a new client without subsets": (lambda m: m["new_client_subsets"]["clients"].pop(str(m["new"][0])), ROLES),
    "a size missing": (lambda m: _new_subsets(m).pop("M"),
                       M + "new_client_subsets: client 1 needs one subset per size (S, M)"),
    "sizes in another order": (lambda m: m["new_client_subsets"]["clients"].update(
        {str(m["new"][0]): {"M": _new_subsets(m)["M"], "S": _new_subsets(m)["S"]}}),
        M + "new_client_subsets: client 1 needs one subset per size (S, M)"),
    "a subset out of range": (lambda m: _new_subsets(m).update(S=[2000]),
                              M + "new client 1's S subset holds index 2000, outside 0…1999"),
    "an empty subset": (lambda m: _new_subsets(m).update(S=[]),
                        M + "new client 1's subsets must be non-empty parts of its train indices"),
}  # fmt: skip


def _one_class(m, source):
    """Client 0 holds only class-0 samples of its own, with that prior."""
    zeros = [i for i in m["clients"][0]["train"] if int(source.train.y[i]) == 0]
    m["clients"][0].update(train=zeros, prior=[1.0] + [0.0] * 9)


# What a manifest may say in more than one way: edit (of the manifest and its source) → check of the federation.
VALID = {
    "a client without a domain": (lambda m, s: m["clients"][2].pop("domain"), lambda fed: fed.clients[2].domain == 0),
    "a prior rounded to 7 decimals": (
        lambda m, s: m["clients"][0].update(prior=[round(v, 7) for v in m["clients"][0]["prior"]]),
        lambda fed: True),
    "a client of one class": (_one_class, lambda fed: fed.clients[0].prior.tolist() == [1.0] + [0.0] * 9),
    "a global test set of train indices past the test split": (
        lambda m, s: m.update(global_split="train", global_test=[1999]),
        lambda fed: fed.global_split == "train" and fed.global_test.tolist() == [1999]),
}  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """STANDARD's manifest (6 clients of the synthetic data's 2,000 training and 500 test samples) and its source."""
    path = _export(tmp_path_factory.mktemp("manifest"), STANDARD)
    return json.loads(path.read_text()), load_source(validate_config(STANDARD).dataset)


@pytest.mark.parametrize("case", [*MALFORMED, *VALID])
def test_every_field_of_a_manifest_is_checked_and_named(tmp_path, exported, case):
    m, source = json.loads(json.dumps(exported[0])), exported[1]
    assert (len(m["clients"]), len(source.train), len(source.test), m["global_split"], m["new"]) == \
        (6, 2000, 500, "test", [1, 2])  # fmt: skip
    path = tmp_path / "m.json"
    if case in VALID:
        edit, check = VALID[case]
        edit(m, source)
        path.write_text(json.dumps(m))
        assert check(read_manifest(path, source))
        return
    edit, message = MALFORMED[case]
    edit(m)
    path.write_text(json.dumps(m))
    with pytest.raises(DataError) as e:
        read_manifest(path, source)
    assert str(e.value) == f"federation.manifest: {path}: " + message.format(fingerprint=source.fingerprint())


@pytest.mark.parametrize("where", ["own test", "another's train", "public", "domain val", "global test"])
def test_a_sample_in_two_places_is_refused_naming_both(tmp_path, exported, where):
    """A client's train index also in its own test split, another client's train, the public set, a domain's
    validation set or a global test set drawn from the training pool: a run scored models on what they trained on,
    or counted a sample twice, and said nothing (each was accepted). Test sets may share samples with a global test
    set drawn from the training pool (PFLBED's is the domains' test sets together), and stay accepted."""
    m, source = json.loads(json.dumps(exported[0])), exported[1]
    i = m["clients"][0]["train"][0]
    edit, other = {
        "own test": (lambda: m["clients"][0]["test"].append(i), "client 0's test"),
        "another's train": (lambda: m["clients"][3]["train"].append(i), "client 3's train"),
        "public": (lambda: m.update(public=[*m["public"], i]), "public"),
        "domain val": (lambda: m.update(domain_val=[[i]], domain_test=[[m["clients"][1]["test"][0]]]), "domain_val[0]"),
        "global test": (lambda: m.update(global_split="train", global_test=[i]), "global_test"),
    }[where]
    m["clients"][3].pop("prior", None)
    edit()
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    with pytest.raises(DataError) as e:
        read_manifest(path, source)
    first, second = ("global_test", "client 0's train") if where == "global test" else ("client 0's train", other)
    assert str(e.value) == (f"federation.manifest: {path}: malformed manifest: {first} and {second} share index {i}; "
                            "a sample belongs to one place")  # fmt: skip
    both = json.loads(json.dumps(exported[0]))
    a, b = both["clients"][0]["val"].pop(), both["clients"][0]["test"].pop()  # now in no client's splits
    c = both["clients"][1]["test"][0]  # a client's test sample in the global test set: test data both
    both.update(domain_val=[[a]], domain_test=[[b]], global_split="train", global_test=[b, c])
    path.write_text(json.dumps(both))
    assert read_manifest(path, source).global_test.tolist() == [b, c]


def test_an_index_past_int64_is_out_of_range_not_a_crash(tmp_path, exported):
    m, source = json.loads(json.dumps(exported[0])), exported[1]
    m["clients"][0]["train"].append(2**70)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    with pytest.raises(DataError, match=f"client 0's train holds index {2**70}, outside 0…1999$"):
        read_manifest(path, source)


def test_a_manifest_is_written_into_new_folders_and_read_back_under_a_key_of_its_text(tmp_path, exported):
    """Its federation's key (what run directories and caches compare) is 20 hex digits, as a partitioned
    federation's, and follows the file's text: the same file the same key, any edit another."""
    m, source = exported
    path = write_manifest(tmp_path / "a" / "b" / "m.json", m)
    key = read_manifest(path, source).key
    assert len(key) == 20 and int(key, 16) >= 0 and read_manifest(path, source).key == key
    path.write_text(path.read_text() + "\n")
    assert read_manifest(path, source).key != key


def test_a_manifest_that_cannot_be_read_is_named_with_the_reason(tmp_path, exported):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError) as e:
        read_manifest(tmp_path / "file" / "m.json", exported[1])  # a file where a folder should be
    assert str(e.value) == f"federation.manifest: {tmp_path / 'file' / 'm.json'}: cannot read (Not a directory)"
