"""A parameter gathered to the host across processes, one tensor at a time (the writer's source)."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from omnijax.interop.sharded import shard_key
from omnijax.interop.stacked import leaf


def gather(x: Any) -> np.ndarray:
    """One parameter as a host numpy array on every process (one tensor at a time).

    Assembled from the addressable shards (`np.asarray` of the whole array would cache a host copy on it
    for as long as the parameter lives). Across processes the tensor is first laid out whole on every
    process, split over that process's own devices, so each host holds it once, not once per device."""
    x = leaf(x)
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if not x.is_fully_addressable:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        local = jax.local_device_count()
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.array(devices).reshape(jax.process_count(), local), ("process", "local"))
        spec = PartitionSpec("local") if x.ndim and x.shape[0] % local == 0 else PartitionSpec()
        x = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, spec))(x)
    out = np.empty(x.shape, x.dtype)
    seen = set()
    for shard in x.addressable_shards:
        key = shard_key(shard.index, x.shape)
        if key not in seen:
            seen.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out
