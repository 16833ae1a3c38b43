"""dryrun's analytic memory estimate (`omnijax.train.dryrun.step_memory_terms`): the terms XLA's compiled steps
showed (docs/real-size.md, "The analytic estimate"). Shapes only; nothing is compiled."""
import pytest

from omnijax.config import LLMConfig, MoEConfig
from omnijax.parallel.mesh import parse_layout
from omnijax.train.dryrun import layer_weight_bytes, recomputed_layer_bytes, step_memory_terms

D, H, K, Dh, F, E, FE = 256, 4, 2, 64, 512, 8, 128
MOE = LLMConfig(embed_dim=D, num_heads=H, num_kv_heads=K, head_dim=Dh, mlp_dim=F, num_layers=4, vocab_size=1000,
                moe=MoEConfig(num_experts=E, top_k=2, mlp_dim=FE, capacity_factor=1.25, every=2))
B, T = 8, 2048


def test_one_layers_recomputed_values():
    """Per device: 3D + (2H + 2K)·Dh per token; a dense MLP 3F per token, an MoE layer 3 expert hidden buffers
    [rows, E, C, F] and 2 slot buffers [rows, E, C, D] (C = ceil(1.25 x T x 2 / E) = 640)."""
    lay = parse_layout("fsdp2xep2", 4)
    rows, C = B // 4, 640
    shared = rows * T * (3 * D + (2 * H + 2 * K) * Dh)
    assert recomputed_layer_bytes(MOE, lay, B, T, 0, 2) == 2 * (shared + rows * E * C * (3 * FE + 2 * D))
    assert recomputed_layer_bytes(MOE, lay, B, T, 1, 2) == 2 * (shared + rows * T * 3 * F)
    # tp splits heads and MLP columns, not the residual stream or the slot buffers' D
    tp = parse_layout("fsdp2xtp2", 4)
    rows = B // 2
    assert recomputed_layer_bytes(MOE, tp, B, T, 1, 2) == 2 * rows * T * (3 * D + (2 * H + 2 * K) * Dh / 2 + 3 * F / 2)


def test_layer_weights_as_the_forward_uses_them():
    """Gathered over fsdp, split by tp; experts split by ep too; the router and norms whole."""
    lay = parse_layout("fsdp2xep2", 4)
    attn = D * (2 * H + 2 * K) * Dh + 2 * D
    assert layer_weight_bytes(MOE, lay, 0, 2) == 2 * (attn + D * E + 3 * E * D * FE / 2)
    assert layer_weight_bytes(MOE, lay, 1, 2) == 2 * (attn + 3 * D * F)


def test_remat_full_holds_every_layers_recomputed_values():
    """remat full with the layers in one program: every layer's recomputed values beyond the loss's phase, and one
    layer's gathered weights instead of every layer's; without remat or under pp nothing changes."""
    lay = parse_layout("fsdp2xep2", 4)
    per_device = 1e6
    full = step_memory_terms(MOE, lay, B, T, "full", 2, per_device)
    none = step_memory_terms(MOE, lay, B, T, "none", 2, per_device)
    held = sum(recomputed_layer_bytes(MOE, lay, B, T, i, 2) for i in range(4))
    assert full["recomputed_layers"] == pytest.approx(held - full["activations"] - full["loss"])
    assert full["activations"] + full["loss"] + full["recomputed_layers"] == pytest.approx(held)
    weights = [layer_weight_bytes(MOE, lay, i, 2) for i in range(4)]
    assert none["compute_copy"] == per_device * 2 * 2
    assert full["compute_copy"] == pytest.approx(none["compute_copy"] - sum(weights) + max(weights))
    assert none["recomputed_layers"] == 0.0
    # a stage's layers run in the pipeline's loop: no layer's recomputation is hoisted out of it
    pp = step_memory_terms(MOE, parse_layout("pp2xfsdp2", 4), B, T, "full", 2, per_device)
    assert pp["recomputed_layers"] == 0.0 and pp["compute_copy"] == per_device * 2 * 2
    # when the loss's phase holds more than the recomputed layers, the term adds nothing
    short = step_memory_terms(LLMConfig(embed_dim=D, num_layers=1, vocab_size=200_000), lay, B, T, "full", 2, 1e6)
    assert short["recomputed_layers"] == 0.0
