"""omnijax.cluster: cluster scheduling.

traces (Pollux workloads and measured profiles) -> jobs (cluster, jobs, placement) -> perf_model (loss
curve and speed fitting) -> schedulers (FIFO, DRF, Tiresias, fitted-model; aware: fitted with straggler and
interference terms) and learned (NNX policy; residual: the ES/supervised policy) -> families (workloads where
the fitted forms break) ->
simulator (trace-driven, time slots) and executor (real jobs on local Ray, resized by checkpoint-restart).
Recipes: `cluster_sim`, `cluster_exec`, `bench cluster`.
"""
