"""f_theta's directory format: save -> load gives the same function; the directory describes itself."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from kakeya.verifier.mlx_backend.ftheta import CONFIG_FILE, DRAFT_FILE, Restorer, load_ftheta


def test_save_load_round_trip_is_identical(tmp_path, tiny_pair, mlx_target, draft_model, aux_layers):
    r = Restorer.init(mlx_target, draft_model, rank=8, draft_dir=tiny_pair.draft, target_dir=tiny_pair.target, seed=3)
    r.save(tmp_path / "f")
    back = load_ftheta(f"ftheta:{tmp_path / 'f'}")
    aux = mx.random.normal((7, len(aux_layers) * mlx_target.args.hidden_size), key=mx.random.key(0))
    z, z2 = r.encode(aux, aux_layers), back.encode(aux, aux_layers)
    assert z.shape == (7, 16) and np.array_equal(np.array(z), np.array(z2))
    for spec in r.config.layers:
        attn = mlx_target.inner.layers[spec.index].self_attn
        for a, b in zip(r.layer_kv(z, spec.index, attn), back.layer_kv(z, spec.index, attn)):
            assert a.shape == (7, spec.kv_heads, spec.head_dim)
            assert np.array_equal(np.array(a), np.array(b))
    # the draft's context K/V really are the input: the copied projections reproduce the draft's own
    h = draft_model.hidden_norm(draft_model.fc(aux))
    k0 = draft_model.layers[0].self_attn.k_norm(draft_model.layers[0].self_attn.k_proj(h).reshape(7, -1, 16))
    fk, _ = back.features(aux)
    assert np.allclose(np.array(fk[:, : k0.size // 7]), np.array(k0.reshape(7, -1)), atol=1e-6)


def test_config_is_self_describing(ftheta_dir, tiny_pair, mlx_target):
    cfg = json.loads((ftheta_dir / CONFIG_FILE).read_text())
    assert cfg["format"] == "kakeya-ftheta/1" and cfg["rank"] == 16
    assert cfg["target_layer_ids"] == [1, 4] and cfg["sliding_window"] == 32
    assert cfg["draft"]["path"] == str(tiny_pair.draft) and len(cfg["draft"]["context_sha256"]) == 64
    layers = {l["index"]: l for l in cfg["layers"]}
    sliding = [i for i, t in enumerate(mlx_target.layer_types) if t == "sliding_attention"]
    assert sorted(i for i, l in layers.items() if l["restored"]) == sliding
    assert all(l["type"] == "full_attention" and l["k_eq_v"] for l in layers.values() if not l["restored"])


def test_a_tampered_or_mismatched_directory_is_refused(tmp_path, ftheta_dir, mlx_target):
    bad = tmp_path / "bad"
    shutil.copytree(ftheta_dir, bad)
    w = dict(mx.load(str(bad / DRAFT_FILE)))
    w["fc.weight"] = w["fc.weight"] * 2
    mx.save_safetensors(str(bad / DRAFT_FILE), w)
    with pytest.raises(ValueError, match="fingerprint"):
        load_ftheta(bad)
    other = tmp_path / "other"
    shutil.copytree(ftheta_dir, other)
    cfg = json.loads((other / CONFIG_FILE).read_text())
    cfg["sliding_window"] = 64
    (other / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding_window"):
        load_ftheta(other).check_target(mlx_target)
    with pytest.raises(FileNotFoundError, match="not an f_theta directory"):
        load_ftheta(tmp_path)
