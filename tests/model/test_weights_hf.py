"""HF checkpoint I/O: exact round trips, sharded files, transformers compatibility, bad input."""

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treegrpo_jax.model.config import ModelConfig, RopeScaling
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.model.weights_hf import (
    MAPPINGS,
    DictSource,
    assemble_decoder,
    expected_tensors,
    hf_shape,
    load_hf,
    read_block,
    save_hf,
    to_hf_layout,
)

QWEN = ModelConfig(
    vocab_size=101, embed_dim=48, mlp_dim=96, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
    qkv_bias=True, tie_embeddings=True, rope_theta=1e6, eos_token_ids=(7, 3), bos_token_id=5,
)  # fmt: skip
LLAMA = ModelConfig(
    vocab_size=64, embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=16),
    rms_norm_eps=1e-5, eos_token_ids=(2,),
)  # fmt: skip


def random_model(cfg: ModelConfig, seed: int = 0):
    """A decoder with random weights, built from NumPy through the loader's own assembly.

    (No JAX random ops: compiling those costs seconds per config on a 2-core CPU.)
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for _, m, names in expected_tensors(cfg):
        for name in names:
            noise = rng.standard_normal(hf_shape(m, cfg)).astype(np.float32)
            tensors[name] = 1 + 0.1 * noise if "norm" in name else 0.1 * noise
    return assemble_decoder(DictSource(tensors), cfg)


def _params(model) -> dict:
    return {path: np.asarray(v) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(graphdef, state, tokens):
    b, t = tokens.shape
    model = nnx.merge(graphdef, state)
    return model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), causal_mask(jnp.ones((b, t), bool)))


def _logits(model, cfg, t=20):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, t)))
    return np.asarray(_forward(*nnx.split(model), tokens))


@pytest.mark.parametrize(
    "cfg", [QWEN, LLAMA, QWEN.replace(param_dtype="bfloat16")], ids=["qwen", "llama", "bf16"]
)
def test_save_load_round_trip_is_exact(tmp_path, cfg):
    model = random_model(cfg, seed=3)
    save_hf(model, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    loaded, cfg2 = load_hf(tmp_path, dtype=cfg.dtype)  # storage dtype comes from the checkpoint
    assert cfg2 == cfg
    before, after = _params(model), _params(loaded)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype, key
        np.testing.assert_array_equal(before[key], after[key], err_msg=str(key))
    np.testing.assert_array_equal(_logits(model, cfg), _logits(loaded, cfg2))
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == cfg.to_hf_dict()["eos_token_id"]


def test_sharded_save_writes_index_and_loads(tmp_path):
    model = random_model(QWEN, seed=4)
    save_hf(model, QWEN, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == QWEN.num_params * 4
    loaded, _ = load_hf(tmp_path)
    np.testing.assert_array_equal(_logits(model, QWEN), _logits(loaded, QWEN))
    save_hf(loaded, QWEN, tmp_path)  # re-saving unsharded removes the old shards and index
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen_tied", "llama_untied_llama3"])
def test_saved_checkpoint_loads_in_transformers(tmp_path, cfg, torch):
    from transformers import AutoModelForCausalLM

    model = random_model(cfg, seed=5)
    save_hf(model, cfg, tmp_path, max_shard_bytes=60_000)
    torch_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ref = torch_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_logits(model, cfg), ref, atol=1e-4, rtol=0)
    assert torch_model.generation_config.eos_token_id == cfg.to_hf_dict()["eos_token_id"]


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_read_block_equals_slice_of_full_conversion(name):
    """Any block read through the HF layout equals the same block of the fully converted tensor."""
    m, cfg = MAPPINGS[name], QWEN
    rng = np.random.default_rng(0)
    hf = rng.standard_normal(hf_shape(m, cfg)).astype(np.float32)
    source = DictSource({"t": hf})
    ours = read_block(source, m, "t", tuple(slice(0, n) for n in _our_shape(m, cfg)), cfg)
    np.testing.assert_array_equal(to_hf_layout(m, ours, cfg), hf)  # the inverse is exact
    for _ in range(5):
        index = []
        for n in ours.shape:
            a, b = sorted(rng.choice(n + 1, 2, replace=False))
            index.append(slice(int(a), int(b)))
        np.testing.assert_array_equal(read_block(source, m, "t", tuple(index), cfg), ours[tuple(index)])


def _our_shape(m, cfg):
    sizes = dict(e=cfg.embed_dim, f=cfg.mlp_dim, h=cfg.num_heads, k=cfg.num_kv_heads, d=cfg.head_dim)
    return tuple(sizes.get(a, cfg.vocab_size) for a in m.ours.split())


# ----------------------------------------------------------------- bad input
def _one_line_error(exc_type, match, fn, *args):
    with pytest.raises(exc_type, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)


def test_missing_directory(tmp_path):
    _one_line_error(FileNotFoundError, "does not exist", load_hf, tmp_path / "nope")


def test_directory_without_config(tmp_path):
    _one_line_error(FileNotFoundError, "no config.json", load_hf, tmp_path)


def test_bin_only_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN.to_hf_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    _one_line_error(FileNotFoundError, r"no \*\.safetensors.*pytorch_model\.bin", load_hf, tmp_path)


def test_unknown_architecture(tmp_path):
    save_hf(random_model(LLAMA), LLAMA, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    _one_line_error(
        ValueError, r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]", load_hf, tmp_path
    )


def test_sliding_window_config_is_refused(tmp_path):
    save_hf(random_model(QWEN), QWEN, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "use_sliding_window": True}))
    _one_line_error(ValueError, "sliding-window", load_hf, tmp_path)


def test_missing_and_unused_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_hf(random_model(LLAMA), LLAMA, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    extra = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)})
    save_file(extra, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _one_line_error(ValueError, "do(es)? not use.*o_proj.bias", load_hf, tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _one_line_error(ValueError, "1 tensors missing.*layers.1.mlp.up_proj", load_hf, tmp_path)


def test_wrong_shape(tmp_path):
    save_hf(random_model(LLAMA), LLAMA, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 48}))
    _one_line_error(ValueError, "gate_proj.weight has shape", load_hf, tmp_path)


# ---------------------------------------------------------- sharded loading
_SHARDED = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from flax import nnx
    from treegrpo_jax.model import weights_hf
    from treegrpo_jax.parallel import DEFAULT_RULES, MeshConfig, make_mesh, named_sharding

    read = []  # elements read by every callback: proves each device reads only its block
    original = weights_hf.SafetensorsSource.read
    def counting_read(self, name, index):
        out = original(self, name, index)
        read.append(out.size)
        return out
    weights_hf.SafetensorsSource.read = counting_read

    path = sys.argv[1]
    single, cfg = weights_hf.load_hf(path)
    ref = {p: np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(single, nnx.Param))}
    out = {}
    head_dim_rules = tuple((k, "tensor" if k == "head_dim" else v) for k, v in DEFAULT_RULES if k != "heads")
    head_dim_rules += (("heads", None),)
    for shape, rules in [((2, 2, 2), DEFAULT_RULES), ((1, 2, 4), DEFAULT_RULES), ((1, 1, 8), head_dim_rules)]:
        mesh = make_mesh(MeshConfig(shape=shape))
        read.clear()
        model, _ = weights_hf.load_hf(path, mesh=mesh, rules=rules)
        shard_elems, ok = 0, True
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            arr = v.get_value()
            want = named_sharding(v.get_metadata()["axes"], arr.shape, mesh, rules)
            ok &= arr.sharding.is_equivalent_to(want, arr.ndim)
            ok &= bool(np.array_equal(np.asarray(arr), ref[p]))
            shard_elems += sum(s.data.size for s in arr.addressable_shards)
        out[str(shape)] = dict(ok=bool(ok), read=sum(read), shard_elems=shard_elems,
                               wq=list(model.wq.get_value().addressable_shards[0].data.shape))
    print(json.dumps(out))
    """
)


def test_load_into_mesh_on_8_fake_devices(tmp_path):
    save_hf(random_model(QWEN, seed=6), QWEN, tmp_path, max_shard_bytes=50_000)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for shape in ("(2, 2, 2)", "(1, 2, 4)", "(1, 1, 8)"):
        assert out[shape]["ok"], (shape, out)
    # Default rules: callbacks read at most what the devices hold (no full copy per device).
    assert out["(2, 2, 2)"]["read"] <= out["(2, 2, 2)"]["shard_elems"], out
    assert out["(1, 2, 4)"]["read"] <= out["(1, 2, 4)"]["shard_elems"], out
    # wq [L, E, H, D] = [3, 48, 6, 8]: E over fsdp=2, H=6 not divisible by tensor=4 → replicated.
    assert out["(1, 2, 4)"]["wq"] == [3, 24, 6, 8]
    # head_dim sharded over tensor=8: D=8 → 1 per device (the over-read path).
    assert out["(1, 1, 8)"]["wq"] == [3, 48, 6, 1]
