"""omnijax.cluster: cluster scheduling.

traces (Pollux workloads and measured profiles) -> jobs (cluster, jobs, placement) -> perf_model (loss
curve and speed fitting) -> schedulers (FIFO, DRF, Tiresias, fitted-model) and learned (NNX policy) ->
simulator (trace-driven, time slots) and executor (real jobs on local Ray, resized by checkpoint-restart).
Recipes: `cluster_sim`, `cluster_exec`, `bench cluster`.
"""
