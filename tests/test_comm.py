"""Scheduled gradient communication: optimal bucketing, same sums as psum, order visible in HLO; step model."""
from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, PartitionSpec as P

from omnijax.errors import ConfigError
from omnijax.parallel import comm
from omnijax.perfmodel import step_model

LINK = comm.LinkModel(n=8, bandwidth_Bps=1e9, latency_s=1e-4)


def ring_s(nbytes: float) -> float:
    """A ring all-reduce over 8 ranks at 1 GB/s and 100 us per collective, written out here (LINK's figures)."""
    return 1e-4 + 2 * 7 / 8 * nbytes / 1e9


def finish_s(segments: list[list]) -> float:
    """When the last of these collectives ends: each waits for its last chunk's gradient and the one before it."""
    t = 0.0
    for chunks in segments:
        t = max(t, max(c.ready_s for c in chunks)) + ring_s(sum((c.stop - c.start) * 4 for c in chunks))
    return t

tensor_lists = st.lists(st.tuples(st.integers(1, 5000), st.floats(0, 0.01)), min_size=1, max_size=7)


def _tensors(spec, all_ready=False):
    ready = np.cumsum([r for _, r in spec])
    return [comm.TensorInfo(f"t{i}", n, 4, "float32", 0.0 if all_ready else float(ready[i]), len(spec) - 1 - i)
            for i, (n, _) in enumerate(spec)]


@settings(max_examples=60, deadline=None)
@given(tensor_lists, st.sampled_from([0, 4000, 12000]))
def test_dp_bucketing_is_optimal(spec, max_bytes):
    """The DP's finish time equals the best of all contiguous segmentations (brute force)."""
    chunks = comm.issue_order(comm.partition(_tensors(spec), 0))
    segs, finish = comm.dp_buckets(chunks, LINK.allreduce_s, max_bytes)
    assert [a for a, _ in segs][1:] == [b for _, b in segs][:-1] and segs[0][0] == 0 and segs[-1][1] == len(chunks)
    assert finish_s([chunks[a:b] for a, b in segs]) == pytest.approx(finish)
    assert comm.simulate([comm.Bucket(tuple(chunks[a:b])) for a, b in segs], LINK.allreduce_s) == pytest.approx(finish)
    n, best = len(chunks), np.inf
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        segments = [chunks[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        if max_bytes and any(sum((c.stop - c.start) * 4 for c in seg) > max_bytes and len(seg) > 1 for seg in segments):
            continue
        best = min(best, finish_s(segments))
    assert finish == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(tensor_lists, st.integers(0, 9000))
def test_partition_covers_each_tensor(spec, part):
    tensors = _tensors(spec)
    chunks = comm.partition(tensors, part)
    for i, t in enumerate(tensors):
        mine = sorted((c.start, c.stop) for c in chunks if c.leaf == i)
        assert mine[0][0] == 0 and mine[-1][1] == t.size
        assert all(a[1] == b[0] for a, b in zip(mine[:-1], mine[1:]))
        if part:
            assert all((b - a) * 4 <= max(part, 4) for a, b in mine)


def test_plan_fuses_orders_by_priority_and_beats_per_tensor():
    sizes = [(2000, 0.002), (300, 0.0003), (300, 0.0003), (8000, 0.008), (100, 0.0001), (100, 0.0001)]
    sync = comm.plan_comm(_tensors(sizes), LINK, comm.CommConfig(bucket_bytes=0, partition_bytes=16000, in_flight=2))
    naive = comm.per_tensor_plan(_tensors(sizes), LINK)
    assert len(sync.buckets) < len(naive.buckets) and sync.exposed_s < naive.exposed_s
    stale = comm.plan_comm(_tensors(sizes, all_ready=True), LINK, comm.CommConfig(bucket_bytes=12000,
                                                                                   partition_bytes=16000))
    prios = [b.priority for b in stale.buckets]
    assert prios == sorted(prios) and prios[0] == 0      # first-needed (forward index 0) goes first
    with pytest.raises(ConfigError):
        comm.CommConfig(in_flight=-1)
    with pytest.raises(ConfigError):
        comm.partition([comm.TensorInfo("x", 0)], 0)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()), ("dp",))


def _grads():
    rng = np.random.default_rng(0)
    # distinct sizes so each bucket is recognisable in the HLO
    return {"embed": rng.normal(size=(40, 16)).astype(np.float32), "b1": rng.normal(size=(7,)).astype(np.float32),
            "w1": rng.normal(size=(16, 24)).astype(np.float32), "b2": rng.normal(size=(5,)).astype(np.float32),
            "w2": rng.normal(size=(24, 3)).astype(np.float32)}


@pytest.fixture(scope="module")
def scheduled(mesh):
    grads = _grads()
    # flatten order is b1, b2, embed, w1, w2; the forward uses embed, w1, b1, w2, b2
    tensors = comm.describe_grads(grads, fwd_order=[2, 3, 0, 4, 1], backward_s=1e-4)
    plan = comm.plan_comm(tensors, comm.LinkModel(8, 1e8, 2e-5),
                          comm.CommConfig(bucket_bytes=1200, partition_bytes=1024, in_flight=1))
    per_device = {k: np.stack([v * (i + 1) for i in range(8)]) for k, v in grads.items()}  # [8, ...]

    def run(g, use_plan):
        def body(g):
            g = jax.tree.map(lambda x: x[0], g)
            out = comm.scheduled_psum(g, plan, "dp") if use_plan else jax.tree.map(lambda x: jax.lax.psum(x, "dp"), g)
            return out
        return jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P(), check_vma=False)(g)

    lowered = jax.jit(lambda g: run(g, True)).lower(per_device)
    compiled = lowered.compile(compiler_options=comm.CPU_INSPECT_OPTIONS)
    return plan, per_device, compiled, jax.jit(lambda g: run(g, False))


def test_scheduled_psum_equals_psum(scheduled):
    plan, per_device, compiled, plain = scheduled
    assert len(plan.buckets) >= 3 and any(len(b.chunks) > 1 for b in plan.buckets)            # fused
    assert any(c.start > 0 for b in plan.buckets for c in b.chunks)                           # partitioned
    got, want = compiled(per_device), plain(per_device)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def test_hlo_shows_buckets_in_plan_order(scheduled):
    plan, _, compiled, _ = scheduled
    text = compiled.as_text()
    ars = [i for i in step_model.collectives_in_order(text) if i.opcode.startswith("all-reduce")]
    assert [i.shape.elements for i in ars] == plan.bucket_sizes()
    # credit 1: every all-reduce after the first reads a barrier tied to the previous result
    comps = step_model.parse_hlo(text)
    table = step_model.entry(comps).table()
    names = [i.name for i in ars]
    for prev, cur in zip(names[:-1], names[1:]):
        seen, stack = set(), list(table[cur].operands)
        while stack:
            n = stack.pop()
            if n in seen or n not in table:
                continue
            seen.add(n)
            stack += table[n].operands
        assert prev in seen, f"{cur} does not wait for {prev}"


def test_plan_rejects_mismatched_grads(mesh):
    plan = comm.plan_comm(comm.describe_grads({"a": np.zeros(4)}), LINK)
    with pytest.raises(ConfigError, match="tensors"):
        comm.scheduled_psum({"a": jnp.zeros(4), "b": jnp.zeros(2)}, plan, "dp")


def _overlap_program(mesh, dependent: bool):
    """A per-device matmul chain plus one all-reduce that does (not) depend on it."""
    def body(x, w, g):
        y = x
        for _ in range(4):
            y = jnp.tanh(y @ w)
        red = jax.lax.psum(y[:, :1].sum() * g if dependent else g, "dp")
        return y, red
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=(P("dp"), P()), check_vma=False)
    args = (jnp.ones((8 * 256, 512)), jnp.ones((512, 512)), jnp.ones((4 << 20,)))
    return jax.jit(f).lower(*args).compile()


def test_step_model_flops_and_overlap(mesh):
    net = step_model.network(gbps=100)
    free = _overlap_program(mesh, dependent=False)
    tied = _overlap_program(mesh, dependent=True)
    check = step_model.check_flops(free)
    assert check["ratio"] == pytest.approx(1.0, rel=0.05) and check["matmul_flops"] == 4 * 2 * 256 * 512 * 512
    p_free = step_model.predict(free.as_text(), step_model.H100, net)
    p_tied = step_model.predict(tied.as_text(), step_model.H100, net)
    p_serial = step_model.predict(free.as_text(), step_model.H100, net, overlap=False)
    assert p_free.comm_s > 0 and p_free.compute_s > 0
    assert p_free.step_s == pytest.approx(p_free.lower_bound_s, rel=0.02)       # independent: overlapped
    assert p_tied.step_s == pytest.approx(p_tied.compute_s + p_tied.comm_s, rel=0.02)  # dependent: serial
    assert p_serial.step_s == pytest.approx(p_free.compute_s + p_free.comm_s, rel=0.02)
    assert p_free.collectives[0]["ranks"] == 64


def test_stale_step_with_scheduled_reduction(mesh):
    """The stale step's reduction can be the scheduled one: stale1 SGD on a linear model, against the
    rule computed by hand (w_{t+1} = w_t − lr·ḡ_{t−1}, one synchronous warm-up step)."""
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding

    from omnijax.train.state import init_state
    from omnijax.train.staleness import StalenessSpec, init_extra, make_stale_step, stale_state_shardings

    def loss(model, batch):
        err = (model(batch["x"]) - batch["y"]) ** 2
        return jnp.sum(err * batch["loss_mask"][:, None]), jnp.sum(batch["loss_mask"]), {}

    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.normal(size=(16, 6)).astype(np.float32),
                "loss_mask": np.ones(16, np.float32)} for _ in range(3)]
    graphdef, params, rest = nnx.split(nnx.Linear(12, 6, rngs=nnx.Rngs(0)), nnx.Param, ...)
    w0, b0 = np.asarray(params["kernel"][...], np.float64), np.asarray(params["bias"][...], np.float64)
    opt, spec = optax.sgd(0.1), StalenessSpec("stale1", warmup_steps=1)
    state = init_state(params, opt, init_extra(params, spec, 8))
    pspecs = jax.tree.map(lambda _: P(), params)
    ospecs = jax.tree.map(lambda _: P(), state.opt_state)
    plan = comm.plan_comm(comm.describe_grads(params, all_ready=True), LINK,
                          comm.CommConfig(bucket_bytes=64, partition_bytes=128, in_flight=1))
    assert len(plan.buckets) > 2
    step = jax.jit(make_stale_step(graphdef, rest, loss, opt, mesh, pspecs, ospecs, spec,
                                   reduce_fn=comm.make_reduce_fn(plan, "dp")))
    state = jax.device_put(state, stale_state_shardings(state, mesh, pspecs, ospecs))
    for b in batches:
        state, _ = step(state, jax.device_put(b, NamedSharding(mesh, P("dp"))))

    def grad(w, bias, b):
        r = b["x"] @ w + bias - b["y"]
        return 2 * b["x"].T @ r / 16, 2 * r.sum(0) / 16

    w, bias, prev = w0, b0, None
    for t, b in enumerate(batches):
        g = grad(w, bias, b)
        use = g if t == 0 else prev
        w, bias, prev = w - 0.1 * use[0], bias - 0.1 * use[1], g
    np.testing.assert_allclose(np.asarray(state.params["kernel"][...]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.params["bias"][...]), bias, rtol=1e-5, atol=1e-6)

    # In the compiled program the stale branch's all-reduces read only last step's buffer: none of
    # them depends on a matmul of this step (so XLA may overlap them); the warm-up branch's all do.
    text = step.lower(state, jax.device_put(batches[0], NamedSharding(mesh, P("dp")))).compile(
        compiler_options=comm.CPU_INSPECT_OPTIONS).as_text()
    comps = step_model.parse_hlo(text)

    def has_dot(name, seen=()):
        return any(i.opcode == "dot" or any(has_dot(c) for c in i.called() if c in comps and c not in seen)
                   for i in comps[name].instrs)

    verdicts = []
    for comp in comps.values():
        table = comp.table()
        ars = [i for i in comp.instrs if i.opcode.startswith("all-reduce") and i.shape.elements > 1]
        if not ars or not any(i.opcode == "dot" or (i.opcode == "fusion" and any(has_dot(c) for c in i.called()))
                              for i in comp.instrs):
            continue
        deps = []
        for ar in ars:
            seen, stack, hit = set(), list(ar.operands), False
            while stack:
                n = stack.pop()
                if n in seen or n not in table:
                    continue
                seen.add(n)
                ins = table[n]
                hit |= ins.opcode == "dot" or (ins.opcode == "fusion" and any(has_dot(c) for c in ins.called()))
                stack += ins.operands
            deps.append(hit)
        verdicts.append((len(ars), all(deps), not any(deps)))
    assert any(n >= len(plan.buckets) and free for n, _, free in verdicts), verdicts   # stale branch
    assert any(dep for _, dep, _ in verdicts), verdicts                               # warm-up branch


def test_xla_flag_presets_exist_in_this_jaxlib():
    from omnijax.parallel import xla_flags

    every = {}
    for flags in xla_flags.PRESETS.values():
        every.update(flags)
    every.update({k: v[-1] for k, v in xla_flags.TUNABLE.items()})
    assert len(every) >= 8 and xla_flags.verify(every) == []
    assert xla_flags.verify({"xla_gpu_no_such_flag_anywhere": True}) == ["xla_gpu_no_such_flag_anywhere"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in xla_flags.to_xla_flags(xla_flags.for_recipe("tiny_lm"))
    fsdp = xla_flags.for_recipe("tiny_omni", "dp2xfsdp4")
    assert fsdp[xla_flags.PIPELINE_ALL_GATHER] == xla_flags.PIPELINED[xla_flags.PIPELINE_ALL_GATHER]
    with pytest.raises(ConfigError):
        xla_flags.preset("nope")
    # the renaming in jaxlib 0.11.1, spelled for either side of it
    assert set(xla_flags.pipelined_flags((0, 10, 2))) == {
        "xla_gpu_enable_pipelined_all_gather", "xla_gpu_enable_pipelined_reduce_scatter",
        "xla_gpu_enable_pipelined_all_reduce"}
    assert xla_flags.pipelined_flags((0, 12, 0))["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"
    assert "--xla_gpu_pipeline_all_reduce=on" in xla_flags.to_xla_flags(xla_flags.pipelined_flags((0, 12, 0)))


def test_xla_flag_presets_parse_as_xla_flags_in_a_fresh_process():
    """XLA_FLAGS is parsed by a different parser than compile options (an unknown name or value aborts
    the process at backend start), so every preset's text is tried where a user's launch puts it."""
    import subprocess
    import sys

    from omnijax.parallel import xla_flags

    every = {}
    for flags in xla_flags.PRESETS.values():
        every.update(flags)
    env = {**os.environ, "XLA_FLAGS": xla_flags.to_xla_flags(every), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp; print(float(jnp.ones(2).sum()))"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "2.0", done.stderr[-2000:]


def test_load_tuned_settings(tmp_path):
    path = tmp_path / "comm_tuned.yaml"
    path.write_text("comm: {bucket_bytes: 1024, partition_bytes: 4096, in_flight: 2}\n"
                    "xla_flags: {xla_gpu_enable_latency_hiding_scheduler: true}\n")
    cc, flags = comm.load_tuned(str(path))
    assert cc == comm.CommConfig(bucket_bytes=1024, partition_bytes=4096, in_flight=2)
    assert flags == {"xla_gpu_enable_latency_hiding_scheduler": True}
    path.write_text("comm: {bucket_bytes: 1024, buckets: 3}\n")
    with pytest.raises(ConfigError, match="comm.buckets"):
        comm.load_tuned(str(path))
    with pytest.raises(ConfigError, match="tune_comm"):
        comm.load_tuned(str(tmp_path / "missing.yaml"))
