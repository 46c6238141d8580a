"""Preemption-exact resume and retriever outages, on the real command line.

`python launch/train.py --config=configs/resilience.py:http` (3 Tree-GRPO steps, a checkpoint
after each, the HTTP retriever behind a chaos proxy): run A is never interrupted; run B is
SIGKILLed while checkpoint 1 is being written; the same command (C) resumes while the
retrieval server is down and stops with a clear message and a saved checkpoint instead of
hanging; once the server is back the same command (D) finishes. D's parameters equal A's,
bit for bit.
"""

import json
import os
import threading

import pytest

from treegrpo_jax.data.synthetic_world import build_world
from treegrpo_jax.env.bm25 import BM25Retriever
from treegrpo_jax.env.retrieval_server import ServerConfig, make_server
from treegrpo_jax.testing import preemption
from treegrpo_jax.testing.chaos_proxy import ChaosProxy
from treegrpo_jax.testing.preemption import TrainCommand
from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.metrics import read_metrics


def _resilience_config():
    import importlib.util

    spec = importlib.util.spec_from_file_location("resilience", preemption.REPO / "configs/resilience.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return from_config_dict(module.get_config())


@pytest.fixture()
def retrieval_proxy():
    """Our server over the run's synthetic corpus, behind a (quiet) chaos proxy."""
    world = build_world(_resilience_config().data.world)
    server = make_server(
        BM25Retriever.from_texts([r["contents"] for r in world.corpus_rows()]), ServerConfig(port=0)
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with ChaosProxy(f"http://127.0.0.1:{server.server_address[1]}/retrieve") as proxy:
        yield proxy
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_sigkill_and_outage_then_resume_equal_an_uninterrupted_run(tmp_path, retrieval_proxy):
    proxy = retrieval_proxy
    cmd = TrainCommand(
        config="configs/resilience.py:http",
        overrides=(f"--config.retriever.url={proxy.url}", "--config.retriever.max_outage_s=1.0"),
        cache_dir=str(tmp_path / "xla"),
    )
    a, b = tmp_path / "a", tmp_path / "b"
    assert cmd.run(a, "a") == 0, preemption.log_tail(a, "a")

    run = cmd.start(b, "b")
    killed = preemption.wait_then_kill(run, b, preemption.checkpoint_being_written(1))
    assert killed, preemption.log_tail(b, "b")

    proxy.down()  # the retrieval server is dead when the same command resumes the run
    run = cmd.start(b, "c")
    assert run.wait(timeout=600) != 0
    log = preemption.log_tail(b, "c", 20000)
    assert "RetrieverUnavailableError" in log and "max_outage_s=1" in log, log[-3000:]
    assert "Saved checkpoint step" in log and "re-run the same command" in log

    proxy.up()
    assert cmd.run(b, "d") == 0, preemption.log_tail(b, "d")

    assert preemption.bitwise_equal(preemption.final_params(a), preemption.final_params(b))
    assert preemption.train_rows(a) == preemption.train_rows(b)
    evals = [json.loads((w / "final_eval.json").read_text()) for w in (a, b)]
    assert {k: v for k, v in evals[0].items() if "wall" not in k} == {
        k: v for k, v in evals[1].items() if "wall" not in k
    }
    # A kill just after the last checkpoint leaves no final_eval.json: the same command rewrites it
    # from the logged evaluation (it used to write {}).
    (b / "final_eval.json").unlink()
    assert cmd.run(b, "e") == 0, preemption.log_tail(b, "e")
    assert json.loads((b / "final_eval.json").read_text()) == evals[1]
    rows = [r for r in read_metrics(b / "metrics.jsonl") if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("rollout/retriever_retries" in r for r in rows)  # the client's fault counters are logged


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_resumes_from_the_previous_step(tmp_path):
    """The issue-29 case on the command line: the latest step's params cut to half their size,
    the same command again → a warning naming step 3, a resume from step 2 and, after step 3
    is re-trained, the parameters of the run that was never damaged, bit for bit."""
    cmd = TrainCommand(config="configs/resilience.py", cache_dir=str(tmp_path / "xla"))
    a = tmp_path / "a"
    assert cmd.run(a, "a") == 0, preemption.log_tail(a, "a")
    reference = preemption.final_params(a)
    params_dir = a / "checkpoints" / "3" / "params"
    files = [p for p in params_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for f in files:
        os.truncate(f, f.stat().st_size // 2)
    (a / "final_eval.json").unlink()
    assert cmd.run(a, "resumed") == 0, preemption.log_tail(a, "resumed")
    log = preemption.log_tail(a, "resumed", 50000)
    assert "checkpoint step 3" in log and "cannot be read" in log, log[-3000:]
    assert "resuming from step 2" in log and "Traceback" not in log, log[-3000:]
    # The header (written before the read) names the newest committed step, not the resumed one.
    assert "(resuming: newest checkpoint step 3)" in log, log[:3000]
    assert (a / "checkpoints_damaged" / "3" / "DAMAGE.txt").is_file()
    assert preemption.bitwise_equal(preemption.final_params(a), reference)
    assert [r[0] for r in preemption.train_rows(a)] == [1, 2, 3]
