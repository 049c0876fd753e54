"""pflbed on Flower (the optional `flower` extra): the same algorithms, driven by the same round driver, with
clients as Flower ClientApps — in Flower's simulation runtime (`executor.name: flower`).

Flower's usage telemetry and update checks are switched off before Flower is imported: a run makes no network
connection other than Flower's own between its server and nodes.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # CPU ClientApps: Ray leaves GPU variables alone
