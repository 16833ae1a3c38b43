"""Performance models: what a step would cost where it cannot run here (an HLO-replaying step-time model for
GPU clusters, the planner at thousands of devices). Imported by benchmarks and recipes only; nothing that trains
depends on a model of itself."""
