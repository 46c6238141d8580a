"""Reliability as figures: kill/resume, retriever chaos, hostile model output, bad configs and data.

    .venv/bin/python benchmarks/resilience.py --out=benchmarks/results/resilience.json

Everything runs on `configs/resilience.py` (`configs/multihop.py:tiny` at toy sizes: 3 Tree-GRPO
steps, a checkpoint after each) through the real command line, `launch/train.py`, with the
HTTP retriever: our server (BM25 over the run's synthetic corpus) behind a fault-injecting
proxy, all on 127.0.0.1. Parts (`--parts`, comma-separated; default all):

  kill     one uninterrupted reference run, then trials that interrupt the same command and
           run it again until it finishes: SIGKILL while checkpoint 1 is being written, SIGKILL
           mid-step, SIGKILL just after the last checkpoint, SIGTERM mid-step, and a retrieval
           server that dies (the run must stop with a saved checkpoint; the server comes back and
           the command is run again). A trial is *identical* when its final parameters equal
           the reference's bit for bit and its logged losses are the same.
  random   20 SIGKILLs and 20 SIGTERMs at random moments of a run (`_random_kills.py`), each
           followed by a resume that must end bit for bit like an uninterrupted run.
  multihost  SIGTERM to one process of a two-process job (`_multihost_signal.py`): every process
           exits 0 within 60 s, the checkpoint reads back, the job resumes and finishes.
  chaos    (a) client level: searches through the proxy with every fault type at random;
           a fault is *survived* when the search it hit returned one result per query (retried
           or an error result), without raising; (b) a whole training run through the proxy
           with faults at random (`run_completed`).
  hostile  every case of `treegrpo_jax.testing.hostile` through the real rollout, once with
           in-process BM25 and once with the HTTP retriever behind the chaos proxy.
  streams  property-based: ≥ 10⁴ generated hostile token streams (a Markov-chain agent sampling tag
           soup, random bytes, stop strings split into byte tokens at random places, EOS anywhere)
           through the continuous-batching scheduler, with the HTTP retriever behind the chaos proxy
           faulting requests that are in flight while other rows decode; every rollout checked for
           crashes and broken bounds.
  inputs   every bad config of `treegrpo_jax.testing.bad_inputs` (a clear error names the key
           and what is allowed) and every malformed data file (names FILE:ROW); the retriever
           server's request bounds.

Writes the figures as JSON (`kill_resume_trials`, `kill_resume_identical`,
`retriever_faults_injected`, `retriever_faults_survived`, `run_completed`,
`hostile_outputs_tried`, `rollout_crashes`, `bad_configs_tried`, `bad_configs_clear_error`, and
details) and prints a table. All runs share one persistent XLA compilation cache, so only the
reference run pays for compiling (a cached executable is the same program: the comparison stays
bitwise). ~5 minutes on the shared 2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import importlib.util
import json
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _multihost_signal import multihost_signal  # noqa: E402
from _random_kills import random_kills  # noqa: E402

from treegrpo_jax.data.synthetic_world import build_world  # noqa: E402
from treegrpo_jax.env.actions import STOP_SEQUENCES  # noqa: E402
from treegrpo_jax.env.bm25 import BM25Retriever  # noqa: E402
from treegrpo_jax.env.http_client import HttpRetriever, HttpRetrieverConfig  # noqa: E402
from treegrpo_jax.env.retrieval_server import ServerConfig, make_server  # noqa: E402
from treegrpo_jax.rollout.agent import AgentConfig  # noqa: E402
from treegrpo_jax.testing import bad_inputs, hostile, preemption  # noqa: E402
from treegrpo_jax.testing.chaos_proxy import ChaosConfig, ChaosProxy  # noqa: E402
from treegrpo_jax.testing.preemption import TrainCommand  # noqa: E402
from treegrpo_jax.train.config import from_config_dict  # noqa: E402
from treegrpo_jax.train.metrics import read_metrics  # noqa: E402

PARTS = ("kill", "random", "multihost", "chaos", "hostile", "streams", "inputs")
CONFIG = "configs/resilience.py:http"


def _source_hash() -> str:
    """Of the package and configs: a run whose code changes mid-way cannot be bitwise equal."""
    digest = hashlib.sha256()
    for path in sorted([*(REPO / "treegrpo_jax").rglob("*.py"), *(REPO / "configs").glob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _world():
    spec = importlib.util.spec_from_file_location("resilience", REPO / "configs" / "resilience.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return build_world(from_config_dict(module.get_config()).data.world)


@contextlib.contextmanager
def _server():
    """Our retrieval server over the resilience run's corpus, in a thread."""
    texts = [r["contents"] for r in _world().corpus_rows()]
    server = make_server(BM25Retriever.from_texts(texts), ServerConfig(port=0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve", texts
    finally:
        server.shutdown()
        server.server_close()


def _final_eval(workdir: pathlib.Path) -> dict:
    path = workdir / "final_eval.json"
    return (
        {k: v for k, v in json.loads(path.read_text()).items() if "wall" not in k} if path.is_file() else {}
    )


def _same_run(ref: pathlib.Path, got: pathlib.Path) -> tuple[bool, float]:
    """Same parameters bit for bit, same logged losses, same final evaluation (wall time aside)."""
    a, b = preemption.final_params(ref), preemption.final_params(got)
    same = preemption.bitwise_equal(a, b) and preemption.train_rows(ref) == preemption.train_rows(got)
    return same and _final_eval(ref) == _final_eval(got) != {}, preemption.max_abs_diff(a, b)


# ------------------------------------------------------------------- kill / resume
def kill_resume(tmp: pathlib.Path, server_url: str) -> dict:
    with ChaosProxy(server_url) as proxy:  # quiet: only the outage trial switches it off
        cmd = TrainCommand(
            config=CONFIG,
            overrides=(f"--config.retriever.url={proxy.url}", "--config.retriever.max_outage_s=1.0"),
            cache_dir=str(tmp / "xla"),
        )
        t0 = time.perf_counter()
        ref = tmp / "reference"
        if cmd.run(ref, "reference") != 0:
            raise RuntimeError(f"the reference run failed:\n{preemption.log_tail(ref, 'reference')}")
        print(f"  reference run: {time.perf_counter() - t0:.0f} s (compiles everything once)")

        def sigkill(moment, delay_s=0.0):
            def interrupt(workdir):
                run = cmd.start(workdir, f"{workdir.name}-interrupted")
                killed = preemption.wait_then_kill(run, workdir, moment, delay_s=delay_s)
                return killed, bool(preemption.uncommitted_steps(workdir))

            return interrupt

        def sigterm(workdir):
            run = cmd.start(workdir, f"{workdir.name}-interrupted")
            if not preemption.wait_for(run, workdir, preemption.checkpoint_written(1)):
                return False, False
            run.send_signal(signal.SIGTERM)  # finishes the step, saves, exits 0
            return run.wait(timeout=600) == 0, False

        def outage(workdir):
            run = cmd.start(workdir, f"{workdir.name}-interrupted")
            if not preemption.wait_for(run, workdir, preemption.checkpoint_written(1)):
                return False, False
            proxy.down()
            try:
                stopped = run.wait(timeout=600) != 0
            finally:
                proxy.up()
            log = preemption.log_tail(workdir, f"{workdir.name}-interrupted", 20000)
            return stopped and "Saved checkpoint step" in log and "RetrieverUnavailableError" in log, False

        trials = {
            "sigkill_during_checkpoint_write": sigkill(preemption.checkpoint_being_written(1)),
            "sigkill_mid_step": sigkill(preemption.checkpoint_written(1), delay_s=1.5),
            "sigkill_after_last_checkpoint": sigkill(preemption.checkpoint_written(3)),
            "sigterm_mid_step": sigterm,
            "retriever_outage_then_restart": outage,
        }
        details = []
        for name, interrupt in trials.items():
            t0 = time.perf_counter()
            workdir = tmp / name
            interrupted, mid_write = interrupt(workdir)
            latest = max(
                [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()], default=-1
            )
            rc = cmd.run(workdir, f"{name}-resumed")
            identical, diff = _same_run(ref, workdir) if rc == 0 else (False, float("inf"))
            details.append(
                dict(
                    trial=name,
                    interrupted=interrupted,
                    killed_mid_write=mid_write,
                    resumed_from_step=latest,
                    resumed_rc=rc,
                    identical=identical,
                    max_abs_param_diff=diff,
                    seconds=round(time.perf_counter() - t0, 1),
                )
            )
            print(f"  {name}: interrupted={interrupted} resumed from {latest} identical={identical}")
    return {
        "kill_resume_trials": len(details),
        "kill_resume_identical": sum(d["identical"] for d in details),
        "kill_resume_interrupted": sum(bool(d["interrupted"]) for d in details),
        "retriever_outage_stopped_with_checkpoint": details[-1]["interrupted"],
        "kill_resume_details": details,
    }


# ---------------------------------------------------------------------- chaos
def chaos(tmp: pathlib.Path, server_url: str, corpus: list[str], searches: int) -> dict:
    local = BM25Retriever.from_texts(corpus)
    queries = [t.split("\n")[0] for t in corpus[:4]]
    want = local.search(queries, 2)
    injected = survived = wrong = 0
    rates = ChaosConfig.uniform(0.5, latency_s=0.4, seed=1)
    with ChaosProxy(server_url, rates) as proxy:
        client = HttpRetriever(
            HttpRetrieverConfig(
                url=proxy.url, timeout_s=0.3, max_retries=3, backoff_s=0.01, backoff_max_s=0.05
            )
        )
        for _ in range(searches):
            before = sum(proxy.counts().values())
            try:
                results = client.search(queries, 2)
                ok = len(results) == len(queries)
                wrong += sum(r.ok and r != w for r, w in zip(results, want, strict=True))
            except Exception:  # a fault that escapes as an exception is not survived
                ok = False
            hit = sum(proxy.counts().values()) - before
            injected += hit
            survived += hit if ok else 0
        client_counts = proxy.counts()
        client_stats = client.stats.as_dict()

    train_rates = ChaosConfig.uniform(0.5, latency_s=0.5, seed=2)
    with ChaosProxy(server_url, train_rates) as proxy:
        cmd = TrainCommand(
            config=CONFIG,
            overrides=(f"--config.retriever.url={proxy.url}",),
            cache_dir=str(tmp / "xla"),
        )
        workdir = tmp / "chaos_run"
        rc = cmd.run(workdir, "chaos_run")
        run_counts = proxy.counts()
    rows = read_metrics(workdir / "metrics.jsonl") if (workdir / "metrics.jsonl").is_file() else []
    train = [r for r in rows if "train/reward_mean" in r]
    completed = (
        rc == 0 and [r["step"] for r in train] == [1, 2, 3] and (workdir / "final_eval.json").is_file()
    )
    logged = {
        k.removeprefix("rollout/retriever_"): sum(r.get(k, 0) for r in train)
        for k in (train[0] if train else {})
        if k.startswith("rollout/retriever_")
    }
    run_injected = sum(run_counts.values())
    return {
        "retriever_faults_injected": injected + run_injected,
        "retriever_faults_survived": survived + (run_injected if completed else 0),
        "retriever_wrong_passages_accepted": wrong,
        "run_completed": completed,
        "chaos_client_searches": searches,
        "chaos_client_fault_counts": client_counts,
        "chaos_client_stats": client_stats,
        "chaos_run_fault_counts": run_counts,
        "chaos_run_logged_retriever_counters": logged,
        "chaos_run_rc": rc,
        "chaos_run_log_tail": "" if completed else preemption.log_tail(workdir, "chaos_run"),
    }


# -------------------------------------------------------------------- hostile
def hostile_outputs(server_url: str) -> dict:
    agent = AgentConfig(max_tool_calls=2, max_turns=3, max_step_tokens=1024, top_k=2)  # a thousand tags
    results = []
    with ChaosProxy(server_url, ChaosConfig.uniform(0.3, latency_s=0.4, seed=3)) as proxy:
        http = HttpRetriever(
            HttpRetrieverConfig(
                url=proxy.url, timeout_s=0.3, max_retries=3, backoff_s=0.01, backoff_max_s=0.05
            )
        )
        for label, retriever in (("bm25", None), ("http_chaos", http)):
            rig = hostile.HostileRig(retriever=retriever, agent=agent, context_len=3072)
            for case in hostile.CASES:
                r = rig.check(case)
                results.append(
                    dict(
                        case=case.name,
                        retriever=label,
                        crashed=r.crashed,
                        problems=list(r.problems),
                        steps=r.stats.get("invalid_steps", 0) + r.stats.get("tool_calls", 0),
                    )
                )
        faults = sum(proxy.counts().values())
    return {
        "hostile_outputs_tried": len(results),
        "rollout_crashes": sum(r["crashed"] is not None for r in results),
        "hostile_unbounded_or_unclassified": sum(bool(r["problems"]) for r in results),
        "hostile_retriever_faults_during": faults,
        "hostile_details": results,
    }


# -------------------------------------------------------------------- streams
def hostile_streams(server_url: str, target: int) -> dict:
    """Sampled hostile steps through the scheduler until `target` streams ran; crashes and bounds."""
    import jax

    from treegrpo_jax.data.rows import QARow
    from treegrpo_jax.rollout.engine import Engine
    from treegrpo_jax.rollout.scheduler import SchedulerConfig
    from treegrpo_jax.rollout.stops import make_stop_table, token_bytes
    from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout
    from treegrpo_jax.testing.bigram import set_transitions
    from treegrpo_jax.testing.markov_agent import agent_chain

    agent = AgentConfig(
        max_tool_calls=2, max_turns=4, max_step_tokens=96, top_k=2, temperature=1.0, top_p=1.0
    )
    tree = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    prompts = 48
    streams = rollouts = crashes = problems = 0
    details, faults = [], 0
    with ChaosProxy(server_url, ChaosConfig.uniform(0.3, latency_s=0.4, seed=4)) as proxy:
        http = HttpRetriever(
            HttpRetrieverConfig(
                url=proxy.url, timeout_s=0.3, max_retries=3, backoff_s=0.01, backoff_max_s=0.05
            )
        )
        rig = hostile.HostileRig(retriever=http, agent=agent, tree=tree, context_len=1024)
        tok = rig.tokenizer
        table = make_stop_table(token_bytes(tok), STOP_SEQUENCES, vocab_size=tok.vocab_size)
        engine = Engine(
            rig.model, num_slots=prompts * tree.leaves_per_prompt, max_len=1024, eos_ids=tok.eos_ids,
            stop_table=table, min_rows=8,
        )  # fmt: skip
        rows = [
            QARow(id=f"q{i}", question=f"Which city is the capital of Alnor {i}?", golden_answers=("Dovra",),
                  data_source="hostile")
            for i in range(prompts)
        ]  # fmt: skip
        seed = 0
        while streams < target:
            hostility = (0.05, 0.2, 0.5)[seed % 3]
            set_transitions(rig.model, *agent_chain(tok, hostile=hostility, seed=seed)[:1],
                            default=agent_chain(tok, hostile=hostility, seed=seed)[1])  # fmt: skip
            engine.set_params(rig.model)
            quantum = (4, 16, 32)[seed % 3]
            try:
                trees, stats = rollout(
                    engine, rig.env, rows, tree, agent, key=jax.random.key(seed),
                    scheduler=SchedulerConfig(quantum=quantum),
                )  # fmt: skip
                found = hostile._bounds(trees, agent, rig.env, prompts * tree.leaves_per_prompt)
                n = sum(len(t.nodes) - 1 for t in trees)
                crashed = None
            except Exception as e:  # the point is to count crashes, whatever they are
                found, n, crashed, stats = [], 0, f"{type(e).__name__}: {e}", None
            streams += n
            rollouts += 1
            crashes += crashed is not None
            problems += bool(found)
            details.append(dict(seed=seed, hostile=hostility, quantum=quantum, streams=n, crashed=crashed,
                                problems=found[:5], tool_calls=stats.tool_calls if stats else None,
                                retrieval_errors=stats.retrieval_errors if stats else None))  # fmt: skip
            seed += 1
            if crashed and crashes >= 3:
                break
        faults = sum(proxy.counts().values())
    return {
        "hostile_streams": streams,
        "hostile_stream_rollouts": rollouts,
        "hostile_stream_crashes": crashes,
        "hostile_stream_broken_bounds": problems,
        "hostile_stream_retriever_faults": faults,
        "hostile_stream_details": details,
    }


# --------------------------------------------------------------------- inputs
def _post(url: str, body: bytes, headers: dict | None = None) -> int:
    """The status our server answers (0 when it closed the connection without one)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    try:
        conn.request(
            "POST", parsed.path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
        )
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def inputs(tmp: pathlib.Path, server_url: str) -> dict:
    configs = [(c, bad_inputs.config_error(c)) for c in bad_inputs.BAD_CONFIGS]
    unclear = [dict(config=c.name, error=m) for c, m in configs if not bad_inputs.is_clear(c, m)]
    data_dir = tmp / "bad_data"
    data_dir.mkdir(parents=True, exist_ok=True)
    files = [(c, bad_inputs.data_error(c, data_dir)) for c in bad_inputs.BAD_DATA]
    unclear_data = [
        dict(file=c.name, error=m) for c, m in files if not bad_inputs.data_is_clear(c, m, data_dir)
    ]
    probes = {  # request → the status our server must answer (it never evaluates what it receives)
        "not_json": (b"{'queries': __import__('os')}", 400),
        "too_many_queries": (json.dumps({"queries": ["q"] * 10_000, "topk": 3}).encode(), 400),
        "k_too_large": (json.dumps({"queries": ["q"], "topk": 10_000}).encode(), 400),
        "query_too_long": (json.dumps({"queries": ["q" * 100_000], "topk": 3}).encode(), 400),
    }
    hygiene = {name: _post(server_url, body) == status for name, (body, status) in probes.items()}
    # A body larger than the limit is refused from its Content-Length, before it is read.
    hygiene["body_too_large"] = _post(server_url, b"{}", {"Content-Length": str(64 << 20)}) == 413
    return {
        "bad_configs_tried": len(configs),
        "bad_configs_clear_error": len(configs) - len(unclear),
        "bad_configs_unclear": unclear,
        "bad_data_tried": len(files),
        "bad_data_clear_error": len(files) - len(unclear_data),
        "bad_data_unclear": unclear_data,
        "server_hygiene_checks": len(hygiene),
        "server_hygiene_passed": sum(hygiene.values()),
        "server_hygiene": hygiene,
    }


# ----------------------------------------------------------------------- main
def _table(out: dict) -> str:
    rows = [
        ("kill/resume trials identical", "kill_resume_identical", "kill_resume_trials"),
        ("random SIGKILLs resumed bit-exact", "random_sigkill_identical", "random_sigkill_trials"),
        ("random SIGTERMs: exit ≤ 30 s, step saved", "random_sigterm_exit_ok", "random_sigterm_trials"),
        ("random SIGTERMs resumed bit-exact", "random_sigterm_identical", "random_sigterm_trials"),
        ("SIGTERM to 1 of 2 processes: all exit", "multihost_sigterm_ok", "multihost_sigterm_trials"),
        ("retriever faults survived", "retriever_faults_survived", "retriever_faults_injected"),
        ("training run under chaos completed", "run_completed", None),
        ("hostile outputs without a crash", None, "hostile_outputs_tried"),
        ("hostile streams through the scheduler", "hostile_streams", None),
        ("  rollouts crashed", "hostile_stream_crashes", None),
        ("  rollouts with broken bounds", "hostile_stream_broken_bounds", None),
        ("  retriever faults while decoding", "hostile_stream_retriever_faults", None),
        ("bad configs with a clear error", "bad_configs_clear_error", "bad_configs_tried"),
        ("bad data files with FILE:ROW", "bad_data_clear_error", "bad_data_tried"),
        ("server hygiene probes passed", "server_hygiene_passed", "server_hygiene_checks"),
    ]
    lines = [f"{'check':<40} {'result':>12}", "-" * 53]
    for label, num, den in rows:
        if den is None and num in out:
            lines.append(f"{label:<40} {str(out[num]):>12}")
        elif den in out:
            n = out[den] - out.get("rollout_crashes", 0) if num is None else out[num]
            lines.append(f"{label:<40} {f'{n} / {out[den]}':>12}")
    lines.append(f"{'wall time':<40} {out['seconds_total']:>10.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--searches", type=int, default=60, help="client-level chaos searches")
    parser.add_argument("--streams", type=int, default=10_000, help="hostile streams (agent steps) at least")
    parser.add_argument("--kills", type=int, default=20, help="random-moment SIGKILL trials")
    parser.add_argument("--terms", type=int, default=20, help="random-moment SIGTERM trials")
    parser.add_argument("--seed", type=int, default=0, help="draws the random moments")
    parser.add_argument("--multihost_trials", type=int, default=4, help="two-process SIGTERM trials")
    parser.add_argument("--tmp", default="", help="work directory (default: a fresh temporary one)")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {list(PARTS)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    tmp = pathlib.Path(args.tmp or tempfile.mkdtemp(prefix="resilience-"))
    tmp.mkdir(parents=True, exist_ok=True)
    out: dict = {"parts": parts, "config": CONFIG, "workdir": str(tmp)}
    t_all = time.perf_counter()
    source = _source_hash()
    with _server() as (url, corpus):
        for part in parts:
            print(f"[{part}]", flush=True)
            t0 = time.perf_counter()
            try:
                if part == "kill":
                    out.update(kill_resume(tmp, url))
                elif part == "random":
                    out.update(random_kills(tmp, kills=args.kills, terms=args.terms, seed=args.seed))
                elif part == "multihost":
                    out.update(multihost_signal(tmp, trials=args.multihost_trials))
                elif part == "chaos":
                    out.update(chaos(tmp, url, corpus, args.searches))
                elif part == "hostile":
                    out.update(hostile_outputs(url))
                elif part == "streams":
                    out.update(hostile_streams(url, args.streams))
                else:
                    out.update(inputs(tmp, url))
            except Exception:  # one broken part must not hide the others' figures
                out[f"{part}_error"] = traceback.format_exc()
                print(out[f"{part}_error"])
            out[f"seconds_{part}"] = round(time.perf_counter() - t0, 1)
    out["seconds_total"] = round(time.perf_counter() - t_all, 1)
    # Someone edited the code while this ran (a shared checkout): the comparisons are void.
    out["source_changed_during_run"] = _source_hash() != source
    if out["source_changed_during_run"]:
        print("WARNING: the package's source changed during the run; kill/resume comparisons are void")
    print(_table(out))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
