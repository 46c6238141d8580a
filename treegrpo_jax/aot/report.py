"""Compiles a run's programs for a target and says what fits and how fast it should be.

Per program, from the TPU compiler itself: the HBM one device needs (arguments, outputs,
temporaries, generated code; donated arguments counted once), its FLOPs and bytes as
`cost_analysis` gives them (a loop body counted once), and the compile's own verdict (a
RESOURCE_EXHAUSTED when one program alone overflows the device). Per phase, what is live
together: a rollout's decode beside the Adam moments (the train state is not freed while it
samples); the update and the cold start's step alone (the engine frees its K/V pool between
rollouts, `Engine.release_kv`, and is made after the cold start).

The predicted time of a program is the roofline bound of its hand count
(`programs.Program`): max(FLOPs / peak, HBM bytes / bandwidth) over the devices together — a
floor, reached only with perfect overlap and no collective cost. The predicted RL step adds each
program's bound times how often a step runs it.
"""

from __future__ import annotations

import dataclasses
import re
import time

from treegrpo_jax.aot.programs import Program
from treegrpo_jax.aot.targets import Chip, GiB


@dataclasses.dataclass
class ProgramReport:
    """What one program needs on one device (bytes), what it costs, and the compiler's verdict."""

    name: str
    phase: str
    compiled: bool
    error: str = ""  # the compiler's first line when it refused (RESOURCE_EXHAUSTED, ...)
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs written into donated arguments (counted once)
    temp_bytes: int = 0
    code_bytes: int = 0
    xla_flops: float = 0.0  # cost_analysis: a loop body counted once
    xla_bytes: float = 0.0
    hand_flops: float = 0.0  # all devices, one call
    hand_hbm_bytes: float = 0.0
    predicted_s: float = 0.0
    calls_per_step: float = 0.0
    compile_s: float = 0.0

    @property
    def live_bytes(self) -> int:
        """HBM the program holds at its peak on one device."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


_NEEDED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compile_program(p: Program, chip: Chip, num_devices: int) -> ProgramReport:
    t0 = time.perf_counter()
    predicted = max(
        p.flops / (chip.peak_flops * num_devices), p.hbm_bytes / (chip.hbm_bandwidth * num_devices)
    )
    base = dict(
        name=p.name,
        phase=p.phase,
        hand_flops=p.flops,
        hand_hbm_bytes=p.hbm_bytes,
        predicted_s=predicted,
        calls_per_step=p.calls,
    )
    try:
        compiled = p.lower().compile()
    except Exception as e:  # noqa: BLE001  (the compiler's refusal is the answer, reported)
        first = str(e).strip().splitlines()[0][:400]
        report = ProgramReport(compiled=False, error=first, **base)
        m = _NEEDED.search(first)
        if m:  # the temporaries it asked for: still a number for the table
            report.temp_bytes = int(float(m.group(1)) * _UNITS[m.group(2)])
        report.compile_s = time.perf_counter() - t0
        return report
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    return ProgramReport(
        compiled=True,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes),
        xla_flops=float(cost.get("flops", 0.0)),
        xla_bytes=float(cost.get("bytes accessed", 0.0)),
        compile_s=time.perf_counter() - t0,
        **base,
    )


@dataclasses.dataclass
class PhaseReport:
    """The most HBM one device holds during a phase of the run, and whether the chip has it."""

    phase: str
    program: str  # the program at the phase's peak
    peak_bytes: int
    beside_bytes: int  # what else is live (the Adam moments beside a rollout)
    fits: bool


def phases(reports: list[ProgramReport], chip: Chip, *, opt_bytes: int) -> list[PhaseReport]:
    """Per phase, its peak with what is live beside it (see the module docstring)."""
    beside = {"update": 0, "rollout": opt_bytes, "cold_start": 0}
    out = []
    for phase in ("cold_start", "rollout", "update"):
        mine = [r for r in reports if r.phase == phase]
        if not mine:
            continue
        top = max(mine, key=lambda r: r.live_bytes)
        peak = top.live_bytes + beside[phase]
        fits = all(r.compiled for r in mine) and peak <= chip.hbm_bytes
        out.append(PhaseReport(phase, top.name, peak, beside[phase], fits))
    return out


def predicted_step_s(reports: list[ProgramReport]) -> float:
    """The roofline bound of one RL step: each program's bound × its calls per step."""
    return sum(r.predicted_s * r.calls_per_step for r in reports)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(reports: list[ProgramReport], phase_reports: list[PhaseReport], chip: Chip) -> str:
    """The report as Markdown tables (programs, then phases against the chip's HBM)."""
    lines = [
        "| program | args GiB | out GiB | temp GiB | code MiB | live GiB | hand TFLOP | bound ms "
        "| calls/step | compile s | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in reports:
        verdict = "ok" if r.compiled else r.error.split(":")[0] or "error"
        lines.append(
            f"| {r.name} | {_gib(r.argument_bytes)} | {_gib(r.output_bytes)} | {_gib(r.temp_bytes)} | "
            f"{r.code_bytes / 2**20:.1f} | {_gib(r.live_bytes)} | {r.hand_flops / 1e12:.1f} | "
            f"{1e3 * r.predicted_s:.1f} | {r.calls_per_step:g} | {r.compile_s:.1f} | {verdict} |"
        )
    lines += [
        "",
        f"| phase | peak program | live GiB per device (of {_gib(chip.hbm_bytes)}) | beside it GiB | fits |",
    ]
    lines.append("|---|---|---:|---:|---|")
    for p in phase_reports:
        lines.append(
            f"| {p.phase} | {p.program} | {_gib(p.peak_bytes)} | {_gib(p.beside_bytes)} | "
            f"{'yes' if p.fits else '**no**'} |"
        )
    return "\n".join(lines)
