"""A tiny, fast experiment config shared by the end-to-end tests (strict executor on)."""

TINY = {
    "dataset": {"name": "synthetic"},
    "model": {"name": "mlp"},
    "federation": {"clients": 6, "partition": "dirichlet", "alpha": 1.0, "sample_fraction": 0.5},
    "train": {"rounds": 4, "batch_size": 16, "lr": 0.1},
    "eval": {"every": 2, "finetune": []},
    "executor": {"strict": True},
}
