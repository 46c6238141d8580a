"""HF checkpoints (config.json + safetensors) ↔ `Decoder`, loaded straight into shardings.

Legend: L layers, E embed, F mlp, H query heads, K kv heads, D head dim, V vocab.

Every weight format we read is presented as a *tensor source*: something that answers
"slice `index` of the tensor HF calls `name`" in HF's layout ([out, in] matrices, one
tensor per layer). `assemble_decoder` turns any source into a `Decoder` whose parameters
are created directly in their target sharding with `jax.make_array_from_callback`: each
device's callback reads only the block that device holds, so no host ever materialises
a full copy per device. The GGUF reader (`weights_gguf`) is just another source.

The layout conversion is written once, as einops-like patterns (HF "(h d) e" ↔ ours
"e h d"), used both to read a block and to write a full tensor back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import re
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import jax
import numpy as np
import tqdm
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from treegrpo_jax.model.build import abstract_model, param_shardings
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.parallel import DEFAULT_RULES, Rules


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """One decoder parameter ↔ one HF tensor (per layer when `hf_name` has `{i}`)."""

    hf_name: str
    hf_pattern: str  # HF dims, parenthesised groups are flattened: "(h d) e" is [H*D, E]
    ours: str  # our per-layer dims, e.g. "e h d"

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name


_LAYER = "model.layers.{i}."
MAPPINGS: dict[str, TensorMapping] = {
    "embed": TensorMapping("model.embed_tokens.weight", "v e", "v e"),
    "attn_norm": TensorMapping(_LAYER + "input_layernorm.weight", "e", "e"),
    "wq": TensorMapping(_LAYER + "self_attn.q_proj.weight", "(h d) e", "e h d"),
    "wk": TensorMapping(_LAYER + "self_attn.k_proj.weight", "(k d) e", "e k d"),
    "wv": TensorMapping(_LAYER + "self_attn.v_proj.weight", "(k d) e", "e k d"),
    "bq": TensorMapping(_LAYER + "self_attn.q_proj.bias", "(h d)", "h d"),
    "bk": TensorMapping(_LAYER + "self_attn.k_proj.bias", "(k d)", "k d"),
    "bv": TensorMapping(_LAYER + "self_attn.v_proj.bias", "(k d)", "k d"),
    "wo": TensorMapping(_LAYER + "self_attn.o_proj.weight", "e (h d)", "h d e"),
    "mlp_norm": TensorMapping(_LAYER + "post_attention_layernorm.weight", "e", "e"),
    "w_gate": TensorMapping(_LAYER + "mlp.gate_proj.weight", "f e", "e f"),
    "w_up": TensorMapping(_LAYER + "mlp.up_proj.weight", "f e", "e f"),
    "w_down": TensorMapping(_LAYER + "mlp.down_proj.weight", "e f", "f e"),
    "final_norm": TensorMapping("model.norm.weight", "e", "e"),
    "lm_head": TensorMapping("lm_head.weight", "v e", "e v"),
}


def _sizes(cfg: ModelConfig) -> dict[str, int]:
    return dict(
        e=cfg.embed_dim, f=cfg.mlp_dim, h=cfg.num_heads, k=cfg.num_kv_heads, d=cfg.head_dim, v=cfg.vocab_size
    )


def _groups(pattern: str) -> list[tuple[str, ...]]:
    """ "(h d) e" → [("h", "d"), ("e",)]."""
    groups, current = [], None
    for tok in pattern.replace("(", " ( ").replace(")", " ) ").split():
        if tok == "(":
            current = []
        elif tok == ")":
            groups.append(tuple(current))
            current = None
        elif current is not None:
            current.append(tok)
        else:
            groups.append((tok,))
    return groups


def hf_shape(m: TensorMapping, cfg: ModelConfig) -> tuple[int, ...]:
    sizes = _sizes(cfg)
    return tuple(math.prod(sizes[a] for a in g) for g in _groups(m.hf_pattern))


@runtime_checkable  # the tests check signatures at run time (jaxtyping + beartype)
class TensorSource(Protocol):
    """Tensors by HF name in HF layout; `read` returns only the requested block."""

    def names(self) -> list[str]:
        """Every tensor the source holds."""

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape, or None when the source does not have it."""

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...


def read_block(source: TensorSource, m: TensorMapping, name: str, index: tuple[slice, ...], cfg: ModelConfig):
    """Block `index` (over our per-layer dims) of one layer's tensor, read from HF layout.

    A flattened HF dim "(h d)" is read as the contiguous row range covering the requested
    heads; inner dims are then sliced on the host (an over-read only when an inner dim
    such as head_dim is itself sharded, which the default rules never do).
    """
    sizes = _sizes(cfg)
    wanted = dict(zip(m.ours.split(), index, strict=True))
    hf_index, inner, split_shape, split_letters = [], [], [], []
    for group in _groups(m.hf_pattern):
        outer = wanted[group[0]]
        rest = math.prod(sizes[a] for a in group[1:])
        hf_index.append(slice(outer.start * rest, outer.stop * rest))
        split_shape += [outer.stop - outer.start] + [sizes[a] for a in group[1:]]
        inner += [slice(None)] + [wanted[a] for a in group[1:]]
        split_letters += list(group)
    block = np.asarray(source.read(name, tuple(hf_index))).reshape(split_shape)[tuple(inner)]
    return block.transpose([split_letters.index(a) for a in m.ours.split()])


def to_hf_layout(m: TensorMapping, ours: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Inverse of `read_block` for a full per-layer array."""
    letters = [a for g in _groups(m.hf_pattern) for a in g]
    order = m.ours.split()
    return np.ascontiguousarray(ours.transpose([order.index(a) for a in letters]).reshape(hf_shape(m, cfg)))


def expected_tensors(cfg: ModelConfig) -> Iterator[tuple[str, TensorMapping, list[str]]]:
    """(our param name, mapping, HF names in layer order) for every parameter `cfg` has."""
    for ours, m in MAPPINGS.items():
        if ours in ("bq", "bk", "bv") and not cfg.qkv_bias or ours == "lm_head" and cfg.tie_embeddings:
            continue
        names = [m.hf_name.format(i=i) for i in range(cfg.num_layers)] if m.stacked else [m.hf_name]
        yield ours, m, names


# Tensors a checkpoint may hold that carry nothing we need (tied heads are checked below).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def check_source(source: TensorSource, cfg: ModelConfig, what: str) -> None:
    """Raises a one-line error if a tensor is missing, has the wrong shape, or is unused.

    An unused tensor (e.g. an o_proj bias) means the checkpoint is a variant the decoder
    does not reproduce, so loading it would silently give different logits.
    """
    missing, expected = [], set()
    for _, m, names in expected_tensors(cfg):
        want = hf_shape(m, cfg)
        expected.update(names)
        for name in names:
            got = source.shape(name)
            if got is None:
                missing.append(name)
            elif tuple(got) != want:
                raise ValueError(
                    f"{what}: tensor {name} has shape {tuple(got)} but the config implies {want}"
                )
    if missing:
        raise ValueError(f"{what}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:3]}")
    if cfg.tie_embeddings:
        expected.add(MAPPINGS["lm_head"].hf_name)  # stored by some tied checkpoints; unused
    unused = sorted(n for n in source.names() if n not in expected and not _IGNORED.match(n))
    if unused:
        raise ValueError(
            f"{what}: {len(unused)} checkpoint tensors the decoder does not use, e.g. {unused[:3]}"
        )


def assemble_decoder(
    source: TensorSource,
    cfg: ModelConfig,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> Decoder:
    """Builds a `Decoder` whose parameters are created in their shardings from `source`.

    Args:
      source: HF-layout tensors (safetensors, GGUF, ...); must pass `check_source`.
      cfg: the model config (its `param_dtype` is the stored dtype).
      mesh: target mesh; None puts every parameter on the first local device.
      rules: logical-axis rules mapping each parameter's `axes` metadata to mesh axes.

    Returns:
      The decoder, ready to use (no random initialisation ever runs).
    """
    graphdef, state = abstract_model(cfg)  # shapes and `axes` only, nothing allocated
    shardings = dict(nnx.to_flat_state(param_shardings(state, mesh, rules)))
    mappings = {ours: (m, names) for ours, m, names in expected_tensors(cfg)}
    dtype = cfg.jnp_param_dtype
    flat = list(nnx.to_flat_state(state))
    # A bar: an 8B checkpoint on a network disk takes minutes, and nothing else prints meanwhile.
    for path, var in tqdm.tqdm(flat, desc="loading weights", unit="tensor", dynamic_ncols=True, leave=False):
        m, names = mappings[path[-1]]
        shape = tuple(var.shape)

        def callback(index, m=m, names=names, shape=shape):
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
            if not m.stacked:
                return read_block(source, m, names[0], index, cfg).astype(dtype)
            layers = range(index[0].start, index[0].stop)
            return np.stack([read_block(source, m, names[i], index[1:], cfg).astype(dtype) for i in layers])

        var.set_value(jax.make_array_from_callback(shape, shardings[path], callback))
    return nnx.merge(graphdef, state)


# ------------------------------------------------------------------ safetensors
class DictSource:
    """HF-named in-memory arrays (e.g. a converted state dict) as a `TensorSource`."""

    def __init__(self, tensors):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return self.tensors[name].shape if name in self.tensors else None

    def read(self, name, index):
        return self.tensors[name][index]


class SafetensorsSource:
    """Reads blocks of tensors from one or many safetensors files (memory-mapped)."""

    def __init__(self, directory: pathlib.Path, files: dict[str, str]):
        self._dir, self._files = directory, files  # tensor name → file name
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}

    @classmethod
    def open(cls, directory: pathlib.Path) -> SafetensorsSource:
        index = directory / "model.safetensors.index.json"
        if index.exists():
            return cls(directory, json.loads(index.read_text())["weight_map"])
        files: dict[str, str] = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="numpy") as f:
                files.update({name: path.name for name in f.keys()})  # noqa: SIM118 (not a dict)
        return cls(directory, files)

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                safe_open(str(self._dir / file), framework="numpy")
            )
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._files:
            return None
        return tuple(self._handle(self._files[name]).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self._handle(self._files[name]).get_slice(name)[index]

    def close(self) -> None:
        self._stack.close()


def read_hf_config(path: str | pathlib.Path) -> tuple[pathlib.Path, dict]:
    """Validates an HF checkpoint directory; returns (dir, config.json dict). One-line errors."""
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory {str(directory)!r} does not exist")
    config = directory / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not an HF checkpoint directory")
    if not any(directory.glob("*.safetensors")):
        others = sorted(
            p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5")
        )
        raise FileNotFoundError(
            f"{directory} has no *.safetensors weights (found {others or 'none'}); "
            "re-save it with transformers' save_pretrained(safe_serialization=True)"
        )
    return directory, json.loads(config.read_text())


def _dtype_names(hf: dict, param_dtype: str | None, dtype: str | None) -> dict[str, str]:
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    param_dtype = param_dtype or (stored if stored in ("float32", "bfloat16", "float16") else "float32")
    return dict(param_dtype=param_dtype, dtype=dtype or param_dtype)


def load_hf(
    path: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    param_dtype: str | None = None,
    dtype: str | None = None,
) -> tuple[Decoder, ModelConfig]:
    """Loads an HF Llama / Qwen2 / SmolLM2 checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors (or shards + index).
      mesh: target mesh; None → single device.
      rules: logical-axis rules.
      param_dtype: storage dtype ("float32", "bfloat16"); default: the checkpoint's.
      dtype: compute dtype; default: `param_dtype`.

    Returns:
      (decoder, config).
    """
    directory, hf = read_hf_config(path)
    try:
        cfg = ModelConfig.from_hf_dict(hf, **_dtype_names(hf, param_dtype, dtype))
    except ValueError as e:
        raise ValueError(f"{directory / 'config.json'}: {e}") from None
    source = SafetensorsSource.open(directory)
    try:
        check_source(source, cfg, str(directory))
        return assemble_decoder(source, cfg, mesh=mesh, rules=rules), cfg
    finally:
        source.close()


# ----------------------------------------------------------------------- saving
def _to_host(x: jax.ArrayLike) -> np.ndarray:
    # On multi-host meshes a parameter is not addressable from one process: gather it.
    return np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))


def _hf_tensors(model: Decoder, cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], object]]:
    """(HF name, shape, thunk giving the HF-layout array) in checkpoint order, one layer at a time."""
    for ours, m, names in expected_tensors(cfg):
        param = getattr(model, ours)[...]
        for i, name in enumerate(names):
            # Sliced inside the thunk so that only one layer's copy exists at a time.
            def thunk(m=m, param=param, i=i):
                return to_hf_layout(m, _to_host(param[i] if m.stacked else param), cfg)

            yield name, hf_shape(m, cfg), thunk


def save_hf(
    model: Decoder, cfg: ModelConfig, out_dir: str | pathlib.Path, *, max_shard_bytes: int | None = None
):
    """Writes an HF checkpoint that `transformers` (and serving engines) load.

    Args:
      model: the decoder to save (parameters in their stored dtype).
      cfg: its config; becomes config.json and generation_config.json.
      out_dir: created if needed.
      max_shard_bytes: split into model-0000i-of-0000n.safetensors + index when the
        weights exceed this; None writes a single model.safetensors.
    """
    out = pathlib.Path(out_dir)
    tensors = list(_hf_tensors(model, cfg))
    itemsize = np.dtype(cfg.jnp_param_dtype).itemsize
    shards: list[list] = [[]]
    size = 0
    for item in tensors:  # plan shards from shapes first so file names know the count
        nbytes = math.prod(item[1]) * itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    if jax.process_index() != 0:  # every process joins the gathers above/below; one writes
        for shard in shards:
            for _, _, thunk in shard:
                thunk()
        return
    out.mkdir(parents=True, exist_ok=True)
    # Weights of an earlier save (another shard count) would be read in place of these.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.to_hf_dict().get("eos_token_id")}
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    n = len(shards)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        # "format": "pt" is what transformers requires of safetensors metadata.
        save_file({name: thunk() for name, _, thunk in shard}, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name, _, _ in shard})
    if n > 1:
        total = sum(math.prod(shape) * itemsize for _, shape, _ in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
