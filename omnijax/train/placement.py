"""Where state and batches live. The default is plain data parallelism over every device.

`omnijax.parallel` builds richer placements (5D LLM layouts); the trainer only needs this interface.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class DataParallel:
    """Parameters replicated, batch rows split over all devices (axis name `dp`)."""

    bubble_fraction = 0.0

    def __init__(self, devices: list | None = None):
        devices = devices or jax.devices()
        self.mesh = Mesh(np.array(devices), ("dp",))

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.shape["dp"]

    def state_shardings(self, state: Any) -> Any:
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), state)

    def batch_sharding(self, batch: dict) -> dict:
        return {k: NamedSharding(self.mesh, P("dp")) for k in batch}

    def put_state(self, state: Any) -> Any:
        return jax.device_put(state, self.state_shardings(state))

    def host_rows(self, global_rows: int, process: int | None = None) -> np.ndarray:
        """Global rows of every batch this host (or `process`) loads: its devices' shards, increasing."""
        from omnijax.parallel import hosts

        return hosts.sharding_rows(NamedSharding(self.mesh, P("dp")), global_rows, process)

    def put_batch(self, batch: dict, global_rows: int | None = None) -> dict:
        """This host's rows -> global arrays of explicit global shape. The rows are those
        `omnijax.parallel.hosts.sharding_rows` names for this mesh (any device order), increasing."""
        from omnijax.parallel import hosts

        shardings = self.batch_sharding(batch)
        return {k: hosts.put_local(shardings[k], v, global_rows) for k, v in batch.items()}


def multimodal_placement(parallel: Any, mm_cfg: Any, devices: list | None = None) -> Any:
    """The joint-step placement (`Multiplexer`) of a multimodal model for `parallel.llm`/`parallel.encoder`
    layouts (`parallel`: a ParallelConfig) over `devices` (default: all); None: plain DP on one process.

    Several processes always take the joint step (all devices on dp/edp when no layout is named): its
    placement is fed the global batch every host plans identically, where plain DP expects host rows."""
    p = parallel
    if not (p.llm or p.encoder) and jax.process_count() == 1:
        return None
    from omnijax.parallel.engine import LLMParallel
    from omnijax.parallel.multiplex import Multiplexer

    engine = LLMParallel(p.llm, mm_cfg.llm, devices=devices, rules=p.rules, microbatches=p.microbatches,
                         schedule=p.pipeline_schedule, remat=p.remat)
    # the data plane balanced its rows over the ranks already (and laid them out per host): not again
    return Multiplexer(engine, mm_cfg, encoder_layout=p.encoder, encoder_rules=p.encoder_rules,
                       interleave=p.interleave_encoders, balance_rows=False)
