"""The learned scheduler: the fitted-model (shadow-price) plan steered by a small policy trained by evolution
strategies on generated workloads.

Action space: the fitted scheduler's own (every slot each job grows, shrinks or keeps its size, placement
repaired by `jobs.place`), because the policy only rescales the two knobs the shadow-price plan reads per
job: its ranking key (remaining work) and its `beta` (how much the devices it takes cost the jobs behind
it). A tanh MLP maps per-job features to log-scales of both. Its output layer starts at zero, so the
untrained policy makes exactly the fitted scheduler's decisions (the warm start: imitation with zero error).

Features the fitted model does not see: queue composition (waiting share, jobs per device), application
mix (share of active jobs of the job's own application), arrival burstiness (arrivals in the last
30 minutes) and time of day, beside the job's own rank, size, age and share of the active work.

Lengths from observed outcomes, where the fitted loss form is wrong (`ResidualScheduler.remaining_steps`):
- `ClassLengths`: jobs of one class (application and batch size) recur, and the lengths of the finished ones
  are observed online; a job whose class has finished jobs takes their lengths, whatever its loss curve looks
  like;
- `DropWatch`, `drop_anchor`: a learning-rate decay shows as a sudden drop, which the fitted form reads as a
  job far from done; a warm-start step learned from finished jobs replaces its remaining steps once a drop is
  seen, and is silent on curves without one.
Step times (`aware`): the straggler and interference terms of `FittedAware`, estimated from measured step
times and who shares which node.

Training (`train_residual`): antithetic evolution strategies (a policy-gradient estimate without
back-propagating through the simulator) with rank-shaped fitness; every iteration draws a workload from
the training distribution (`generate_workload`: a time window of a training trace, its jobs resampled
and their arrivals jittered) and scores each perturbation by its average JCT over the fitted scheduler's
on that same workload. The training traces are the Pollux sets the bench does not report (0.5x, 1.5x and
2x load); the bench evaluates on `workloads` and `workloads-realistic`. The trained policy is kept only if
it beats the fitted scheduler on `learned.es_validation` further generated workloads with confidence
(`accept`: the paired mean ratio plus `learned.es_confidence` standard errors below 1) and, where its warm
start passes that test too, the warm start as well; otherwise its warm start (class lengths, drop anchor,
step-time terms, the supervised correction) if it passes; otherwise the fitted scheduler's decisions. So a
training run whose gain is within the noise of a few workloads cannot make the scheduler worse on the files
it is evaluated on.

Modules, one concept each: `policy` (the MLP), `scheduler` (`ResidualScheduler`), `lengths` (class lengths),
`drops` (loss-drop detection), `workloads` (generated training workloads and their simulator configs),
`supervised` (the warm start's fits from observed outcomes), `es` (evolution strategies and the acceptance
test), `store` (a policy on disk), `training` (`train_residual`: all of it joined, as `scheduler=learned` runs it).
"""
