"""Real loopback deployments whose ServerApp or ClientApp is a test module: a modified server or site, run by Flower
exactly as pflbed's own components are, against honest processes.

Why not `pflbed flower local`: an attack needs what `run_local` rightly does not offer — a ServerApp or ClientApp of
the test's own (`app`), node configs of its own per SuperNode (a site's requirements, the node that attacks), and a
run that need not produce a summary. The deployment itself is `run_local`'s, from its own pieces: the same
SuperLink and SuperNode command lines, TLS certificates and node keys, key registration, process groups stopped on
exit, and no runtime dependency installation.

The app (`write_attack_app`): the project `pflbed flower local` writes (`project.write_app`: the run's config and
run directory as its run config), with its `serverapp` and/or `clientapp` component replaced by a module of this
folder, copied into the project. Flower packs every `.py` file of the project into the FAB (except `test_*.py` and
`*_test.py`, hence these modules' names) and puts the unpacked project first on `sys.path` in the ServerApp and
ClientApp processes, so `module:app` resolves to the copy; a component left alone stays pflbed's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pflbed.config import Config
from pflbed.flower.certificates import write_certificates, write_node_keys
from pflbed.flower.local import (
    CONNECTION,
    SuperNodes,
    _env,
    _processes,
    _register,
    _start,
    _tool,
    _wait_for_port,
    free_port,
)
from pflbed.flower.project import write_app

HERE = Path(__file__).resolve().parent


def write_attack_app(path: Path, cfg: Config, out: Path, serverapp: str | None = None,
                     clientapp: str | None = None, run_config: dict[str, str] | None = None) -> Path:  # fmt: skip
    """pflbed's app project for `cfg` (run directory `out`) in `path`, its ServerApp and/or ClientApp replaced by
    the module of this folder so named (`<module>.py` copied in, its `app` object the component); `run_config`:
    more string entries of the run config, for the modified component."""
    app = write_app(path, cfg, out.resolve())
    text = (app / "pyproject.toml").read_text()
    tables = [line for line in text.splitlines() if line.startswith("[")]
    assert tables[-1] == "[tool.flwr.app.config]", "the run config is no longer the last table"
    text += "".join(f"{k} = {json.dumps(v)}\n" for k, v in (run_config or {}).items())
    for component, module in (("serverapp", serverapp), ("clientapp", clientapp)):
        if module is None:
            continue
        pflbed_own = f'{component} = "pflbed.flower.{"server" if component == "serverapp" else "node_app"}:app"'
        assert pflbed_own in text, f"the project no longer names {pflbed_own}"
        text = text.replace(pflbed_own, f'{component} = "{module}:app"')
        shutil.copy(HERE / f"{module}.py", app / f"{module}.py")
    (app / "pyproject.toml").write_text(text)
    return app


def node_config(values: dict) -> str:
    """A `--node-config` string: `key=value` pairs, strings quoted as the node config parser (TOML) reads them."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


def deploy(work: Path, app: Path, nodes: list[dict], *, late: list[dict] = (),
           join_when: Callable[[], bool] = lambda: True, env: dict[str, str] | None = None,
           timeout: float = 600) -> int:  # fmt: skip
    """Run `app` on a SuperLink with TLS and SuperNode authentication and one SuperNode per entry of `nodes` (its
    node config), all on 127.0.0.1, until the run ends; `flwr run`'s exit code, which is 0 also where the ServerApp
    raised: what the run left, and its log, say how it ended.

    The SuperNodes of `late` (their keys registered with the others') start once `join_when()` holds during the
    run: nodes that join a run under way. Logs in `work`: `superlink.log`, `supernode-<k>.log` (the late ones
    numbered after the others) and `run.log`, the ServerApp's output. `env`: more environment for every process
    (e.g. the sites' HOME). Every process started is gone on return, also after `timeout` (`TimeoutError`)."""
    work = work.resolve()
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ca, cert, key = write_certificates(work / "certificates")
    (home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                      f'address = "127.0.0.1:{port}"\nroot-certificates = "{ca}"\n')  # fmt: skip
    environ = {**_env(home), **(env or {})}
    everyone = [*nodes, *late]
    keys = write_node_keys(work / "keys", len(everyone))
    no_install = "--disable-runtime-dependency-installation"

    def supernode(k: int) -> None:
        supernodes.start(k, [_tool("flower-supernode"), "--root-certificates", str(ca), "--auth-supernode-private-key",
                        str(keys[k][0]), "--superlink", f"127.0.0.1:{port}", "--node-config",
                        node_config(everyone[k])])  # fmt: skip

    with _processes() as procs:
        supernodes = SuperNodes(procs, work, environ)
        link_log = work / "superlink.log"
        link = _start(procs, [_tool("flower-superlink"), "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert),
                              "--ssl-keyfile", str(key), "--port", str(port), "--database", str(work / "superlink.db"),
                              no_install, "--enable-supernode-auth"], link_log, environ)  # fmt: skip
        _wait_for_port(port, link, link_log)
        _register(keys, environ, work / "register.log")
        for k in range(len(nodes)):
            supernode(k)
        run = _start(procs, [_tool("flwr"), "run", str(app), CONNECTION, "--stream"], work / "run.log", environ)
        waiting, deadline = list(range(len(nodes), len(everyone))), time.monotonic() + timeout
        while run.poll() is None:
            supernodes.watch()  # a node whose port was taken starts again; how the others ended, the test reads
            if waiting and join_when():
                for k in waiting:
                    supernode(k)
                waiting = []
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not end within {timeout:.0f} s; see {work / 'run.log'}")
            time.sleep(0.2)
        return run.returncode


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under `root` (relative path → its bytes' hash), and every directory (→ "dir"): what a test
    compares before and after a deployment to show nothing was changed or added."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[str(Path(dirpath, d).relative_to(root))] = "dir"
        for name in filenames:
            p = Path(dirpath, name)
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
