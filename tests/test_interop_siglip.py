"""SigLIP parity: a tiny random HF SiglipVisionModel, saved as safetensors, read by the sharded reader
(`pretrained.load_encoder`) into the packed ViT."""
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from omnijax.data import features  # noqa: E402
from omnijax.errors import UserError  # noqa: E402
from omnijax.interop import pretrained  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, image_size=32, patch_size=8, vision_use_head=True)
    model = transformers.SiglipVisionModel(cfg).eval()
    # random init leaves some tensors at 0/1; perturb everything so each weight matters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("siglip")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _pack(images, cfg):
    """Same-size images [B, H, W, 3] as one packed buffer (patches, segment ids, positions), by the data plane's
    own patching."""
    rows, segs, poss = [], [], []
    for i, img in enumerate(images):
        patches, grid = features.image_patches(img, cfg.patch, cfg.temporal_patch, cfg.merge, cfg.max_side)
        rows.append(patches)
        poss.append(features.patch_positions(grid, cfg.merge))
        segs.append(np.full(len(patches), i + 1, np.int32))
    return np.concatenate(rows), np.concatenate(segs), np.concatenate(poss)


def test_siglip_parity(hf_dir):
    path, hf = hf_dir
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (3, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        out = hf(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))
    ref_hidden = out.last_hidden_state.numpy()
    ref_pool = out.pooler_output.numpy()

    model = pretrained.load_encoder(path)
    x, seg, pos = _pack(images, model.cfg)
    hidden = np.asarray(jax.jit(lambda m, a, b, c: m.hidden(a, b, c))(model, x, seg, pos))
    pooled = np.asarray(jax.jit(lambda m, h, s: m.pool(h, s, 3))(model, hidden, seg))
    hidden_err = np.abs(hidden.reshape(ref_hidden.shape) - ref_hidden).max()
    pool_err = np.abs(pooled - ref_pool).max()
    print(f"siglip parity: max|diff| hidden={hidden_err:.2e} pooled={pool_err:.2e}")
    assert hidden_err <= 1e-4 and pool_err <= 1e-4
    assert np.abs(ref_hidden).max() > 0.1  # the comparison is not between two near-zero tensors


def test_siglip_bad_checkpoint(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        pretrained.load_encoder(tmp_path)
