"""A `procs` worker's loop run in the test's own process, on plain queues: what a worker does with its messages,
observable without a second process (its flags, its allocator, its replies)."""

from __future__ import annotations

import pickle
import queue
import threading

import torch

from pflbed.algorithms.base import Algorithm
from pflbed.engine import procs


def run_worker_here(algo: Algorithm, *tasks: object) -> queue.Queue:
    """The algorithm's message as the pool sends it (its data apart from the pickled algorithm), then `tasks`, then
    stop; returns the worker's results queue. The process's thread count is put back after."""
    ctx = algo.ctx
    shared, (ctx.source, ctx.federation) = (ctx.source, ctx.federation), (None, None)
    try:
        private = pickle.dumps(algo)
    finally:
        ctx.source, ctx.federation = shared
    tasks_q, results = queue.Queue(), queue.Queue()
    procs._put(tasks_q, ("algorithm", (private, (shared[0], pickle.dumps(shared[1])))))
    for task in tasks:
        procs._put(tasks_q, task)
    procs._put(tasks_q, None)
    threads = torch.get_num_threads()
    try:
        procs._worker(threads, tasks_q, results, threading.Event())
    finally:
        torch.set_num_threads(threads)
    return results
