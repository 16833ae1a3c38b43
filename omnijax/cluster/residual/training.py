"""`train_residual`: the learned scheduler as `scheduler=learned` builds it: supervised warm start, ES,
validation on held-out generated workloads and the keep rule (trained policy, else warm start, else fitted)."""
from __future__ import annotations

import sys

import numpy as np

from omnijax.cluster.residual.es import accept, episode_score, evolve
from omnijax.cluster.residual.policy import MLP
from omnijax.cluster.residual.scheduler import ResidualScheduler
from omnijax.cluster.residual.store import load_policy, save_policy
from omnijax.cluster.residual.supervised import drop_anchor, length_correction
from omnijax.cluster.residual.workloads import episode_configs, generate_workload
from omnijax.cluster.schedulers import FittedModel


def train_residual(cfg) -> ResidualScheduler:
    """Train on workloads generated from the `learned.train_sets` traces (under `learned.train_families`);
    returns the scheduler (or `learned.load`'s saved one)."""
    from omnijax.cluster.simulator import run_workload
    from omnijax.cluster.traces import load_workload, workload_files
    lc = cfg.learned
    if lc.load:
        return load_policy(lc.load)
    pool = [load_workload(w) for s in lc.train_sets for w in workload_files(s, 0)]
    eval_names = {"workloads", "workloads-realistic"}
    if any(s in eval_names for s in lc.train_sets):
        raise ValueError(f"learned.train_sets={lc.train_sets} overlaps the evaluation sets {sorted(eval_names)}")
    rng = np.random.default_rng(lc.seed)
    episodes = [generate_workload(pool, rng, window_s=lc.window_s) for _ in range(lc.es_iterations)]
    frng = np.random.default_rng([lc.seed, 1])
    sims = episode_configs(cfg.sim, lc.train_families, lc.es_iterations, frng)
    mlp = MLP(hidden=lc.hidden_es)
    start = mlp.init(lc.seed)
    anchor = np.zeros(0)
    if lc.anchor_workloads:       # the warm start's first supervised step: lengths after a loss drop
        arng = np.random.default_rng([lc.seed, 3])
        aw = [generate_workload(pool, arng, window_s=lc.supervised_window_s or lc.window_s)
              for _ in range(lc.anchor_workloads)]
        anchor, stats = drop_anchor(aw, episode_configs(cfg.sim, lc.train_families, len(aw), arng),
                                    hidden=lc.hidden_es, seed=lc.seed)
        print(f"# learned supervised: drop anchor from {len(aw)} generated workloads: {stats}", file=sys.stderr)
    if lc.supervised_workloads:   # the warm start's supervised step: a length correction from observed outcomes
        srng = np.random.default_rng([lc.seed, 2])
        sup = [generate_workload(pool, srng, window_s=lc.supervised_window_s or lc.window_s)
               for _ in range(lc.supervised_workloads)]
        start, stats = length_correction(sup, episode_configs(cfg.sim, lc.train_families, len(sup), srng),
                                         hidden=lc.hidden_es, seed=lc.seed, columns=lc.supervised_columns)
        print(f"# learned supervised: length correction on {len(sup)} generated workloads: {stats}", file=sys.stderr)
    opts = {"anchor": anchor, "class_lengths": lc.class_lengths, "aware": lc.aware}
    theta, hist = evolve(start, episodes, cfg.sim, hidden=lc.hidden_es, pairs=lc.es_pairs,
                         sigma=lc.es_sigma, lr=lc.es_lr, seed=lc.seed, sims=sims, opts=opts,
                         log=lambda r: print(f"# learned es: {r}", file=sys.stderr))
    # validation on fresh generated workloads (same distribution, none trained on): of the trained policy and its
    # warm start, those that beat the fitted scheduler there with confidence; of both, the trained policy only if
    # it also beats its warm start with confidence; of neither, the fitted scheduler's decisions
    held = [generate_workload(pool, rng, window_s=lc.window_s) for _ in range(lc.es_validation)]
    held_sims = episode_configs(cfg.sim, lc.train_families, lc.es_validation, frng)
    refs = [run_workload(s, FittedModel(), c).avg_jct_s for s, c in zip(held, held_sims)]

    def validate(th: np.ndarray, what: str) -> tuple[list[float], bool]:
        sc = [episode_score(th, s, c, lc.hidden_es, r, opts) for s, c, r in zip(held, held_sims, refs)]
        ok = accept(sc, lc.es_confidence)
        print(f"# learned es: validation of the {what} on {len(held)} generated workloads: "
              f"{float(np.mean(sc)) if sc else 0.0:.4f} x fitted (per workload "
              f"{[(c.families, round(x, 4)) for c, x in zip(held_sims, sc)]}); {'accepted' if ok else 'rejected'}",
              file=sys.stderr)
        return sc, ok

    scores, kept = validate(theta, "trained policy")
    kept_what, trained = "trained policy", theta
    if lc.es_iterations and np.any(theta != start):
        warm, warm_ok = validate(start, "warm start")
        better = not warm_ok
        if kept and warm_ok:     # both beat fitted: RL must also beat its own warm start (paired, same rule)
            better = accept(np.asarray(scores) / np.asarray(warm), lc.es_confidence)
            print(f"# learned es: trained policy / warm start {float(np.mean(np.asarray(scores) / np.asarray(warm))):.4f}"
                  f" ({'better' if better else 'not better with confidence'})", file=sys.stderr)
        if not better:
            scores, kept, theta, kept_what = warm, warm_ok, start, "warm start"
    if not kept:
        theta, opts, kept_what = mlp.init(lc.seed), {}, "fitted"
    score = float(np.mean(scores)) if scores else 0.0
    print(f"# learned: keeping the {kept_what}", file=sys.stderr)
    sched = ResidualScheduler(theta=theta, hidden=lc.hidden_es, **opts)
    sched.history = hist
    sched.validation_vs_fitted = score
    sched.validation_scores = scores
    sched.accepted = kept
    sched.kept = kept_what
    sched.trained_theta = trained
    if lc.save:
        save_policy(lc.save, sched)
    return sched
