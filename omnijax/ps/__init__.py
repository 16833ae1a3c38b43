"""Parameter-server backend on Ray with load distribution among servers.

blocks.py (flat parameter vector, blocks, chunks, forward-order priority), server.py (actor owning blocks
+ optax state, straggler injection), worker.py (JAX gradient actor, prioritized chunked pushes with a
credit window), distributor.py (placement planning, straggler detection, exploration), trainer.py
(cluster of actors, sync/async driver loops, agreed-step moves, faults, checkpoints), tuning.py
(optuna auto-tuning of chunk size and credit), config.py (`PSConfig`).
"""
