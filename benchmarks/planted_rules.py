"""Plant a wrong version of each listed rule, one at a time, and check that the method's own tests go red.

mutmut (`benchmarks/mutation_screen.py`) changes operators and constants; it does not write the mistakes a person
makes when implementing a paper — two phases swapped, a weight dropped, the wrong split selected on, a sign
flipped in a chain rule. This script plants such mistakes by hand for the personalized-aggregation,
hypernetwork, memory and prototype baselines (FedAMP, FedFomo, pFedHN, kNN-Per, FedPAC), the newer methods
(FedLC, MOON, FedALA, FedCP, GPFL, FedDBE, FedProto, FedAS, FedCAC, APPLE) and client-level DP
(`privacy`, guarded by tests/engine/test_privacy.py), each as an exact text
replacement in a scratch copy of `src/` and `tests/`, and runs `tests/algorithms/test_<method>.py` against it:

    python benchmarks/planted_rules.py [METHOD ...]     # all plants, or those of the named methods

One line per plant: RED (some test failed: the rule is protected, the first failing test named) or GREEN (no
test noticed: a gap). A plant whose text no longer occurs exactly once is reported as STALE, so an edit of the
algorithm cannot silently retire one. Results: `benchmarks/results/planted_rules.txt`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Plant(NamedTuple):
    method: str  # tests/algorithms/test_<method>.py and src/pflbed/algorithms/<method>.py, unless `source` says
    what: str
    old: str
    new: str
    source: str | None = None  # another file (relative to src/pflbed/), for a rule outside the algorithms


# Rules outside the algorithms, with the test file that guards each (`test_file`)
TESTS = {"privacy": "tests/engine/test_privacy.py"}


# fmt: off
PLANTS = [
    # FedAMP (Huang et al. 2021, Alg. 1): ξ_ij = α_k·A'(‖w_i − w_j‖²), ξ_ii = 1 − Σ, client prox pull λ/α_k to u_i
    Plant("fedamp", "A' without its 1/σ", "alpha_k * math.exp(-d / sigma) / sigma", "alpha_k * math.exp(-d / sigma)"),
    Plant("fedamp", "distance not squared", "math.exp(-d / sigma) / sigma", "math.exp(-math.sqrt(d) / sigma) / sigma"),
    Plant("fedamp", "self weight 1 instead of 1 − Σ_j ξ_ij", "row[i] = 1.0 - others", "row[i] = 1.0"),
    Plant("fedamp", "HeurFedAMP's self weight swapped with the others' share", "row[i] = self_weight",
          "row[i] = 1.0 - self_weight"),
    Plant("fedamp", "proximal strength λ·α_k instead of λ/α_k", "self.opts.lam / self.opts.alpha_k",
          "self.opts.lam * self.opts.alpha_k"),
    Plant("fedamp", "proximal anchor the initial model instead of u_i",
          "self.objective.plan(payload, payload, phase,",
          "self.objective.plan(payload, self.ctx.initial_params, phase,"),
    Plant("fedamp", "replies not stored", 'out.update({f"{LOCAL}{c}/{k}": v for k, v in replies[c].items()})', "pass"),
    Plant("fedamp", "new clients' start weighted, not the uniform mean", "dict.fromkeys(cids, 1.0)",
          "{c: float(c + 1) for c in cids}"),
    # FedFomo (Zhang et al. 2021, Eq. 6–7): w_n ∝ max(L(θ_prev) − L(θ_n), 0)/‖θ_n − θ_prev‖, update on deltas
    Plant("fedfomo", "gain sign flipped", "gain = own_loss - losses", "gain = losses - own_loss"),
    Plant("fedfomo", "gain not divided by the distance", "gain / torch.where(distances > 0, distances, 1.0)", "gain"),
    Plant("fedfomo", "negative gains not clipped", ".clamp(min=0.0)", ""),
    Plant("fedfomo", "weights not normalized", "return raw / total if", "return raw if"),
    Plant("fedfomo", "models combined instead of their deltas", "acc.add_(m[k] - v, alpha=wn)",
          "acc.add_(m[k], alpha=wn)"),
    Plant("fedfomo", "losses on the training split", "idx, prior = validation_data(self.ctx.federation, data)",
          "idx, prior = data.train, None"),
    Plant("fedfomo", "affinity added to the transposed entries",
          "P[i, torch.tensor(cols, dtype=torch.int64, device=P.device)] +=",
          "P[torch.tensor(cols, dtype=torch.int64, device=P.device), i] +="),
    Plant("fedfomo", "local training from the client's own model, not from the federated update",
          "return LocalSGDPlan(start, (phase,), partial(self._finish, w, gains, payload[IDS]))",
          "return LocalSGDPlan(state, (phase,), partial(self._finish, w, gains, payload[IDS]))"),
    Plant("fedfomo", "ε does not decay", "self.opts.epsilon - self.opts.epsilon_decay * (rnd - 1)",
          "self.opts.epsilon"),
    Plant("fedfomo", "greedy downloads the lowest affinities", "key=lambda j: (-affinity[j], tie[j])",
          "key=lambda j: (affinity[j], tie[j])"),
    Plant("fedfomo", "one exploration coin per client instead of one per download slot",
          'coins = torch.rand(max(m, 1), generator=g, dtype=torch.float64, device="cpu").tolist()',
          'coins = torch.rand(1, generator=g, dtype=torch.float64, device="cpu").tolist() * max(m, 1)'),
    Plant("fedfomo", "authors' affinity (deltas) adds the clipped weights",
          "added = (reply[GAINS] if deltas else reply[WEIGHTS]).to(P.dtype)", "added = reply[WEIGHTS].to(P.dtype)"),
    Plant("fedfomo", "authors' gains sent unnormalized", "reply[GAINS] = affinity_deltas(gains)",
          "reply[GAINS] = gains"),
    Plant("fedfomo", "authors' affinity normalized by the signed sum, not its absolute value",
          "norm = gains.sum().abs()", "norm = gains.sum()"),
    Plant("fedfomo", "authors' pool (last_round) is every client that ever uploaded",
          "latest > 0 and seen[self.index[c]] == latest", "seen[self.index[c]] > 0"),
    # pFedHN (Shamsian et al. 2021, Alg. 1): φ, v_i step on (∂θ/∂·)ᵀ(θ − θ̃); new clients learn v with φ frozen
    Plant("pfedhn", "hypernetwork gradient sign flipped", "grad_outputs=[-delta[k] for k in self.param_names]",
          "grad_outputs=[delta[k] for k in self.param_names]"),
    Plant("pfedhn", "φ steps on the sum of the replies, not their mean",
          "step_phi({k: g / len(cids) for k, g in total.items()})", "step_phi(total)"),
    Plant("pfedhn", "v_i's step divided by the number of replies", "                step_v(c, per_v[c])",
          "                step_v(c, per_v[c] / len(cids))"),
    Plant("pfedhn", "reply θ_i − θ̃_i instead of Δθ_i = θ̃_i − θ_i", "reply = {k: trained[k] - payload[k]",
          "reply = {k: payload[k] - trained[k]"),
    Plant("pfedhn", "embeddings ignore embed_lr", "lr_v = o.embed_lr if o.embed_lr is not None else o.hn_lr",
          "lr_v = o.hn_lr"),
    Plant("pfedhn", "a new client also trains φ", "opt = torch.optim.SGD([v], lr=",
          "opt = torch.optim.SGD([v, *(p.requires_grad_() for p in phi.values())], lr="),
    Plant("pfedhn", "+FT / +LP start from the initial embedding, not the learned one",
          "start = {**self.generate(server, v.detach()), **buffers}",
          "start = {**self.generate(server, self.embedding(server, data.cid)), **buffers}"),
    # kNN-Per (Marfoq et al. 2022, Eq. 3–4): λ·p_kNN + (1 − λ)·p_model, kernel exp(−d/T) over the k nearest
    Plant("knnper", "λ on the wrong side of the interpolation",
          "return lam * p_knn + (1.0 - lam) * torch.softmax(logits.float(), dim=1)",
          "return (1.0 - lam) * p_knn + lam * torch.softmax(logits.float(), dim=1)"),
    Plant("knnper", "logits interpolated instead of probabilities",
          "(1.0 - lam) * torch.softmax(logits.float(), dim=1)",
          "(1.0 - lam) * logits.float()"),
    Plant("knnper", "kernel exp(−d·T) instead of exp(−d/T)", "torch.exp(-(d - d[:, :1]) / t)",
          "torch.exp(-(d - d[:, :1]) * t)"),
    Plant("knnper", "default T = 1 instead of the feature dimension",
          "t = float(keys.shape[1]) if temperature is None else temperature",
          "t = 1.0 if temperature is None else temperature"),
    Plant("knnper", "k + 1 neighbours vote", "d, nb = d[:, :kk], nb[:, :kk]", "d, nb = d[:, :kk + 1], nb[:, :kk + 1]"),
    Plant("knnper", "λ chosen on the client's test split", "idx, weights = validation_data(self.ctx.federation, data)",
          "idx, weights = self.ctx.federation.clients[data.cid].test, None"),
    Plant("knnper", "datastore capacity ignored", "size = min(size, o.capacity)", "size = size"),
    Plant("knnper", "datastore labels misaligned with its features", "keys, data.y[store], 0.0",
          "keys, data.y[store].roll(1), 0.0"),
    Plant("knnper", "largest λ on validation ties", "if acc > best_acc:", "if acc >= best_acc:"),
    # client-level DP (McMahan et al. 2018, DP-FedAvg; pflbed.privacy): clip each client's update on the client,
    # sum, one N(0, σ²C²) per round from the (seed, round) stream, over the expected count qN, uniform weights
    Plant("privacy", "no clip", "    if norm <= clip:\n        return reply\n", "    return reply\n", "privacy.py"),
    Plant("privacy", "noise drawn per client", "* scale + z[k] / m_bar for k in reply}",
          "* scale + z[k] / m_bar * (1 + 0.5 * (cid % 2)) for k in reply}", "privacy.py"),
    Plant("privacy", "the actual count as denominator, not qN", "        scale = count / m_bar\n",
          "        scale = 1.0\n", "privacy.py"),
    Plant("privacy", "one noise for every round", "g = rng.generator(seed, rng.PRIVACY, rnd)",
          "g = rng.generator(seed, rng.PRIVACY, 1)", "privacy.py"),
    Plant("privacy", "ε of one round fewer", "accountant.history = [(sigma, rate, rounds)]",
          "accountant.history = [(sigma, rate, max(1, rounds - 1))]", "privacy.py"),
    Plant("privacy", "clients weighted by size under DP", "weights = {c: 1.0 for c in arrived} if arrived else",
          "weights = weights if arrived else", "engine/driver.py"),
    Plant("privacy", "no clip where the client runs (update_client)",
          "    return private(algo, payload, reply), new_state", "    return reply, new_state", "engine/executor.py"),
    Plant("privacy", "noise on the personal state", "    return private(algo, payload, reply), new_state",
          "    return private(algo, payload, reply), ({k: v + 1e-3 for k, v in new_state.items()} "
          "if algo.ctx.cfg.privacy.clip else new_state)", "engine/executor.py"),
    Plant("privacy", "the personal state clipped too", "    return private(algo, payload, reply), new_state",
          "    return private(algo, payload, reply), (private(algo, {k: v * 0 for k, v in new_state.items()}, "
          "new_state) if new_state else new_state)", "engine/executor.py"),
    # FedPAC (Xu et al. 2023, Eq. 8–13): prototypes count-weighted; α_i from the QP with the variance term
    Plant("fedpac", "QP without the variance term", "return diff @ diff.T + torch.diag(v_over_n)",
          "return diff @ diff.T"),
    Plant("fedpac", "uniform head combination instead of the QP's",
          "a = simplex_qp(combination_matrix(i, h, v_over_n), tol, max_iter)",
          "a = torch.full((len(h),), 1.0 / len(h), dtype=torch.float64)"),
    Plant("fedpac", "global prototypes an unweighted mean",
          "glob = (counts.unsqueeze(2) * protos).sum(0) / total.clamp_min(1.0).unsqueeze(1)", "glob = protos.mean(0)"),
    Plant("fedpac", "feature statistics after local training instead of with the received body",
          '"h": stats["h"], "v": stats["v"]', '"h": local["h"], "v": local["v"]'),
    Plant("fedpac", "head phase dropped", "phases = (Phase(tuple(self.head), o.head_epochs, o.head_lr or t.lr),",
          "phases = ("),
    Plant("fedpac", "body phase before the head phase",
          "phases = (Phase(tuple(self.head), o.head_epochs, o.head_lr or t.lr),\n"
          "                  Phase(tuple(self.body), o.body_epochs, o.body_lr or t.lr, objective=self.objective))",
          "phases = (Phase(tuple(self.body), o.body_epochs, o.body_lr or t.lr, objective=self.objective),\n"
          "                  Phase(tuple(self.head), o.head_epochs, o.head_lr or t.lr))"),
    Plant("fedpac", "alignment also on classes without a global prototype", "* mask[y].to(z.dtype)", ""),
    Plant("fedpac", "h_i = class means, not prior-weighted", "h = sums / max(n, 1)", "h = mean"),
    Plant("fedpac", "client i's head from column i of α, not row i", 'combine(alpha[i], heads[k])',
          'combine(alpha[:, i], heads[k])'),
    # FedLC (Zhang et al. 2022): CE of g = f − τ·n_{c,y}^(−1/4), the client's own counts; the printed y' ≠ y form
    Plant("fedlc", "calibration added, not subtracted", 'g = logits - consts["shift"].to(logits)',
          'g = logits + consts["shift"].to(logits)'),
    Plant("fedlc", "exponent −1/2 instead of −1/4", ".pow(-0.25)", ".pow(-0.5)"),
    Plant("fedlc", "a missing class kept in the softmax", "torch.full_like(shift, math.inf)", "shift"),
    Plant("fedlc", "the printed form with the true class in its denominator",
          "others = g.scatter(1, y[:, None], -math.inf).logsumexp(1)", "others = g.logsumexp(1)"),
    Plant("fedlc", "uniform counts instead of the client's own",
          "shift = calibration(class_counts(data), o.tau, o.missing)",
          "shift = calibration(torch.ones_like(class_counts(data)), o.tau, o.missing)"),
    # MOON (Li et al. 2021, Eqs. 2-3): CE + μ·ℓ_con, positive z_glob, negative z_prev, frozen models in eval mode
    Plant("moon", "positive and negative swapped", "con = F.softplus(neg - pos)", "con = F.softplus(pos - neg)"),
    Plant("moon", "no temperature on the positive",
          "pos = F.cosine_similarity(flat, z_glob.flatten(1), dim=1) / self.tau",
          "pos = F.cosine_similarity(flat, z_glob.flatten(1), dim=1)"),
    Plant("moon", "the global model as the negative", "z_prev = run_blocks(model, prev, body, x).detach()",
          "z_prev = run_blocks(model, glob, body, x).detach()"),
    Plant("moon", "the previous model never updated", "lambda params: (params, dict(params))",
          "lambda params: (params, dict(state))"),
    Plant("moon", "frozen models in training mode", "with _frozen(model):", "with contextlib.nullcontext():"),
    # FedCP (Zhang et al. 2023, Fig. 2): W^hd(r ⊙ h) + W_i^hd(s ⊙ h), CE + λ·MMD²(h, h^g), W^hd and W^fe frozen
    Plant("fedcp", "the MMD alignment subtracted", "return loss + self.lam * mmd2(",
          "return loss - self.lam * mmd2("),
    Plant("fedcp", "policy rows swapped: the global head reads the personalized share", "return p[:, 1], p[:, 0]",
          "return p[:, 0], p[:, 1]"),
    Plant("fedcp", "the global head W^hd trained locally, not frozen", "blocks = tuple(self.ctx.model.body_blocks())",
          "blocks = tuple(self.ctx.model.block_names())"),
    Plant("fedcp", "v_i from the received global head, not the personalized one",
          "return reply, {**personal, CONTEXT: self.context(personal)}",
          "return reply, {**personal, CONTEXT: self.context({PERSONAL + k: payload[k] for k in self.head_keys})}"),
    Plant("fedcp", "h^g from the extractor being trained, not the frozen received one",
          "{**unprefixed(REFERENCE, consts), **unprefixed(REFERENCE, params)}, body, x)", "params, body, x)"),
    Plant("fedcp", "the upload mix's weights swapped", "(1.0 - beta) * params[PERSONAL + k] + beta * payload[k]",
          "beta * params[PERSONAL + k] + (1.0 - beta) * payload[k]"),
    # FedDBE (Zhang et al. 2023): CE(h(z + z̄^p)) + κ·mean ½(r − z̄^g)², r ← (1 − m)r + m·mean(z); z̄^g set once by all
    Plant("feddbe", "MR pushes away from the consensus", "(running - consensus)", "(running + consensus)"),
    Plant("feddbe", "running-mean momentum on the wrong side", "(1 - self.m) * history + self.m * batch",
          "self.m * history + (1 - self.m) * batch"),
    Plant("feddbe", "MR summed over the representation, not averaged", "torch.mean(0.5 *", "torch.sum(0.5 *"),
    Plant("feddbe", "initialization period for the round's sample only",
          "return dict.fromkeys(self.ctx.federation.participated, server)", "return dict.fromkeys(cids, server)"),
    Plant("feddbe", "consensus weighted uniformly, not by n_i", "n = float(self.fed.num_train(cid))", "n = 1.0"),
    Plant("feddbe", "P-FL without the client's memory", "z = z + self.prbm", "z = z"),
    # FedALA (Zhang et al. 2023, Eqs. 4-5): Θ_i + (Θ − Θ_i) ⊙ [1; W], W ← clip(W − η∇_W L) on s% of the data
    Plant("fedala", "the update taken as Θ_i − Θ", "update = {k: glob[k] - local[k] for k in self.top}",
          "update = {k: local[k] - glob[k] for k in self.top}"),
    Plant("fedala", "lower blocks kept local instead of overwritten", "out = {**{k: glob[k] for k in self.params},",
          "out = {**{k: local[k] for k in self.params},"),
    Plant("fedala", "weights not clipped to [0, 1]", ".clamp(0.0, 1.0)", ""),
    Plant("fedala", "weights reset to ones every round", "start_phase = weights is None", "start_phase = True"),
    Plant("fedala", "start phase of one pass", "for _ in range(o.max_start_epochs if start_phase else 1):",
          "for _ in range(1):"),
    Plant("fedala", "weights learned on all the data, not s%", "max(1, n * o.rand_percent // 100)", "n"),
    # APPLE (Luo & Wu 2022): own core and p trained on CE(Σ_j p_j·w_{c,j}) + λ(r)·‖p − p_0‖², cores stored, not averaged
    Plant("apple", "the own core's weight p_ii detached", "self_weight = (p * own).sum()",
          "self_weight = (p * own).sum().detach()"),
    Plant("apple", "the own core counted twice (its stale copy not masked out)", "others = p * (1 - own)",
          "others = p"),
    Plant("apple", "p pulled towards 0 instead of p_0", "((p - consts[P0]) ** 2).sum()", "(p ** 2).sum()"),
    Plant("apple", "the personalized model uploaded in place of the core",
          "return core, {**core, **personal, DR: trained[DR]}",
          "return {**core, **personal}, {**core, **personal, DR: trained[DR]}"),
    Plant("apple", "p starting uniform instead of at p_0", "state.get(DR, payload[P0])",
          "state.get(DR, torch.full_like(payload[P0], 1 / len(payload[P0])))"),
    Plant("apple", "λ(r)'s rounds counted from 1", "r, r_d = rnd - 1,", "r, r_d = rnd,"),
    # FedProto (Tan et al. 2022, Eqs. 5, 6, 8): CE + λ·‖f(x) − C̄^(y)‖², C̄ count-weighted per class, nearest C̄ predicts
    Plant("fedproto", "Eq. 6 without the class-count weights",
          'w = counts * held if self.opts.weighting == "samples" else held.double()', "w = held.double()"),
    Plant("fedproto", "regulariser's sign flipped",
          'return ce + self.lam * self.distance(z, y, consts["protos"], consts["proto_mask"], w), z',
          'return ce - self.lam * self.distance(z, y, consts["protos"], consts["proto_mask"], w), z'),
    Plant("fedproto", "samples of classes without a global prototype pulled to zero",
          "return weighted_mean(((flat - protos[y]) ** 2).mean(1) * mask[y], w)",
          "return weighted_mean(((flat - protos[y]) ** 2).mean(1), w)"),
    Plant("fedproto", "a class no replier holds loses its prototype",
          '"protos": torch.where(new.unsqueeze(1), glob.to(server["protos"]), server["protos"]),',
          '"protos": glob.to(server["protos"]),'),
    Plant("fedproto", "the farthest prototype predicts", "return (-d).masked_fill(~allowed, -math.inf)",
          "return d.masked_fill(~allowed, -math.inf)"),
    Plant("fedproto", "last_epoch prototypes averaged over every epoch",
          "rec = Recorder(self.objective, (t.local_epochs - 1) * per_epoch)", "rec = Recorder(self.objective, 0)"),
    Plant("fedproto", "heterogeneous: every client given the first listed architecture",
          "return architecture_of(cid, self.blocks, self.n_total)", "return self.blocks[0]"),
    Plant("fedproto", "heterogeneous: Eq. 5 in the run's model's embedding, not the client's own architecture's",
          "z = embeddings(model, data.x[data.train])", "z = embeddings(self.ctx.model, data.x[data.train])"),
    # GPFL (Zhang et al. 2023, Eqs. 1-5): L^P on CoV(f, p_i), L^alg and L^mlg on CoV(f, g), Ĉ frozen, head kept home
    Plant("gpfl", "angle-level guidance on the personalized features", "cosine_logits(f_g, params[TABLE])",
          "cosine_logits(f_p.flatten(1), params[TABLE])"),
    Plant("gpfl", "personalized route conditioned on g", '(f, consts["p"])', '(f, consts["g"])'),
    Plant("gpfl", "magnitude anchor the trained C, not the frozen copy", 'F.embedding(y, consts["frozen"])',
          "F.embedding(y, params[TABLE])"),
    Plant("gpfl", "valve scales by γ, not γ + 1", "(self.gamma(c) + 1)", "self.gamma(c)"),
    Plant("gpfl", "p_i without the label frequencies", '"p": prior.to(table) @ table', '"p": table.mean(0)'),
    Plant("gpfl", "the personal head uploaded and averaged", "return {k: params[k] for k in shared}, new",
          "return {k: params[k] for k in [*shared, *self.head_keys]}, new"),
    # FedCAC (Wu et al. 2023): masks of top-τ |Δθ⊙θ|, overlap over |m_i|, E_t with (t+1)/β, unweighted C_i mean
    Plant("fedcac", "sensitivity |Δθ| without the value", "c = ((after - before) * after).abs()",
          "c = (after - before).abs()"),
    Plant("fedcac", "overlap divided by the other client's mask", "1 - differ / (2 * size[:, None]).clamp(min=1)",
          "1 - differ / (2 * size[None, :]).clamp(min=1)"),
    Plant("fedcac", "threshold schedule t/β instead of (t + 1)/β", "s = rnd / beta", "s = (rnd - 1) / beta"),
    Plant("fedcac", "customized model weighted by data size", "share = member.to(server[k].dtype)",
          "share = member.to(server[k].dtype) * torch.tensor([weights[c] for c in cids], dtype=server[k].dtype)"),
    Plant("fedcac", "critical entries from the global model, the rest from the customized one",
          'torch.where(m, server[f"{CUSTOM}{cid}/{k}"], glob[k])',
          'torch.where(m, glob[k], server[f"{CUSTOM}{cid}/{k}"])'),
    Plant("fedcac", "BatchNorm statistics from the payload, not the client's own",
          "start = {k: state[k] if k in state else payload[k] for k in self.keys}",
          "start = {k: payload[k] for k in self.keys}"),
    # FedAS (Yang et al. 2024, from the authors' code): PA to the old local body's prototypes, LT, FIM, CS weights
    Plant("fedas", "prototypes of the received global body, not the old local one",
          "class_prototypes(self.ctx.model, subset(state, self.body_keys)",
          "class_prototypes(self.ctx.model, subset(payload, self.body_keys)"),
    Plant("fedas", "alignment error summed over the features (no 1/d)", "err = ((z - protos[y]) ** 2).mean(1)",
          "err = ((z - protos[y]) ** 2).sum(1)"),
    Plant("fedas", "one MSE over the batch, not a sum of per-class means", "return per_class.sum()",
          "return (member * err[:, None]).sum() / weight.sum()"),
    Plant("fedas", "local training before the alignment", "LocalSGDPlan(start, phases,",
          "LocalSGDPlan(start, phases[::-1],"),
    Plant("fedas", "Fisher trace averaged over the batches", "    return total\n",
          "    return total / len(data.train.split(batch_size))\n"),
    Plant("fedas", "server weights uniform, not the Fisher traces", "f = float(reply[FIM])", "f = 1.0"),
]
# fmt: on


def test_file(method: str) -> str:
    """The method's own test file, relative to the repository (an algorithm's tests live in tests/algorithms/)."""
    return TESTS.get(method, f"tests/algorithms/test_{method}.py")


def run(plant: Plant, scratch: Path) -> str:
    source = scratch / "src/pflbed" / (plant.source or f"algorithms/{plant.method}.py")
    text = source.read_text()
    if text.count(plant.old) != 1:
        return f"STALE {plant.method}: {plant.what} (the planted text occurs {text.count(plant.old)}×)"
    source.write_text(text.replace(plant.old, plant.new))
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file(plant.method)],
            cwd=scratch, capture_output=True, text=True, timeout=1200,
            env={**os.environ, "PYTHONPATH": str(scratch / "src"), "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    finally:
        source.write_text(text)
    if r.returncode == 0:
        return f"GREEN {plant.method}: {plant.what}"
    failed = next((ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))), "?")
    return f"RED   {plant.method}: {plant.what} — {failed.split('::', 1)[-1]}"


def main() -> None:
    only = set(sys.argv[1:])
    unknown = only - {p.method for p in PLANTS}
    if unknown:
        sys.exit(f"planted_rules: no plants for {', '.join(sorted(unknown))}")
    missing = sorted(f for f in {test_file(p.method) for p in PLANTS} if not (ROOT / f).is_file())
    if missing:
        sys.exit(f"planted_rules: no test file {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, scratch / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", scratch)
        for plant in PLANTS:
            if not only or plant.method in only:
                print(run(plant, scratch), flush=True)


if __name__ == "__main__":
    main()
