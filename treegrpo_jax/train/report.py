"""What a researcher opens after a run: pictures of training trees and `WORKDIR/index.html`.

* `render_training_trees`: the M trees of one prompt of an RL step, each leaf labelled with its
  reward and its advantage under the run's estimator, the nodes branches were forked from outlined
  (evaluation trees are chains: they show what was answered, not how the tree search branched).
* `write_index`: one self-contained page — the last metrics, the curves, the latest training and
  evaluation trees, the config — that opens from the file system (relative links, no server, no
  scripts). Written at each evaluation and at the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import json
import os
import re
from collections.abc import Sequence

import numpy as np

from treegrpo_jax.rl import advantages
from treegrpo_jax.rollout.render import render_trees
from treegrpo_jax.rollout.tree import Tree
from treegrpo_jax.train.metrics import read_metrics

INDEX = "index.html"


def leaf_advantages(trees: Sequence[Tree], estimator: str) -> list[dict[int, float]]:
    """Each tree's leaf advantages (node id → A), computed over the leaves of `trees` — a prompt's
    trees hold everything its advantages depend on (intra: the tree; inter: the prompt's trees)."""
    rows = [(i, leaf) for i, tree in enumerate(trees) for leaf in tree.leaves()]
    rewards = np.asarray([leaf.reward for _, leaf in rows], np.float32)
    tree_ids = np.asarray([trees[i].tree_id for i, _ in rows], np.int32)
    prompt_ids = np.asarray([trees[i].prompt_id for i, _ in rows], np.int32)
    adv = advantages.compute(rewards, tree_ids, prompt_ids, np.ones(len(rows), bool), estimator)
    out: list[dict[int, float]] = [{} for _ in trees]
    for (i, leaf), a in zip(rows, adv, strict=True):
        out[i][leaf.node_id] = float(a)
    return out


def render_training_trees(trees: Sequence[Tree], estimator: str, path: str, *, step: int) -> None:
    """Pictures the trees of the step's first prompt (rewards, advantages, forked nodes)."""
    first = [t for t in trees if t.prompt_id == trees[0].prompt_id]
    titles = [f"step {step} · prompt {t.prompt_id} · tree {t.tree_id}" for t in first]
    render_trees(first, path, titles=titles, advantages=leaf_advantages(first, estimator))


def _latest(plots_dir: str, prefix: str) -> str | None:
    names = sorted(n for n in os.listdir(plots_dir) if n.startswith(prefix) and n.endswith(".png"))
    return names[-1] if names else None


def _table(row: dict) -> str:
    cells = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>" if isinstance(v, float) else
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in sorted(row.items())
    )  # fmt: skip
    return f"<table>{cells}</table>"


def write_index(workdir: str, cfg, *, title: str = "Tree-GRPO run") -> str:
    """Writes `WORKDIR/index.html` (atomically) from what the run has written so far."""
    plots = os.path.join(workdir, "plots")
    os.makedirs(plots, exist_ok=True)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    rows = read_metrics(metrics_path) if os.path.isfile(metrics_path) else []
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/em" in r]
    last_train = (
        {k: v for k, v in train[-1].items() if k.startswith(("step", "train/", "time/", "mechanism/"))}
        if train
        else {}
    )
    last_eval = evals[-1] if evals else {}
    names = ("overview.png", "reward.png", "em.png", "tool_calls.png", "response_length.png", "mechanism.png")
    curves = [n for n in names if os.path.isfile(os.path.join(plots, n))]
    trees = [n for n in (_latest(plots, "train_trees_step"), _latest(plots, "eval_trees_step")) if n]
    config = json.dumps(dataclasses.asdict(cfg), indent=2, default=str) if cfg is not None else "{}"
    em = f"{100 * last_eval['eval/em']:.1f}%" if last_eval else "–"
    has_final = os.path.isfile(os.path.join(workdir, "final_eval.json"))
    final = " · <a href='final_eval.json'>final_eval.json</a>" if has_final else ""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(os.path.abspath(workdir))} · step {last_train.get('step', 0)} · "
        f"latest eval EM <b>{em}</b> · written {now}</p>",
        "<h2>Last metrics</h2><div class='row'>",
        f"<div><h3>training (step {last_train.get('step', '–')})</h3>{_table(last_train)}</div>",
        f"<div><h3>evaluation (step {last_eval.get('step', '–')})</h3>{_table(last_eval)}</div></div>",
        "<h2>Curves</h2>",
        *(f"<a href='plots/{n}'><img src='plots/{n}' alt='{n}'></a>" for n in curves[:1]),
        "<p>Each panel alone: "
        + " · ".join(f"<a href='plots/{n}'>{n}</a>" for n in curves[1:])
        + "</p>",
        "<h2>Trees</h2>",
        *(f"<figure><a href='plots/{n}'><img src='plots/{n}' alt='{n}'></a>"
          f"<figcaption>{n}</figcaption></figure>" for n in trees),  # fmt: skip
        "<p>Training trees: leaves coloured by reward, labelled with reward r and advantage A; "
        "a blue border marks a node branches were forked from.</p>",
        "<h2>Config</h2><details><summary>TrainConfig</summary>",
        f"<pre>{html.escape(config)}</pre></details>",
        f"<p>Raw data: <a href='metrics.jsonl'>metrics.jsonl</a>{final}</p>",
    ]  # fmt: skip
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}img{max-width:100%;"
        "border:1px solid #ccc;margin:4px 0}table{border-collapse:collapse;font-size:13px}"
        "td{border:1px solid #ddd;padding:2px 8px}.row{display:flex;gap:2em;flex-wrap:wrap}"
        "pre{font-size:12px;background:#f6f6f6;padding:1em}"
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )
    path = os.path.join(workdir, INDEX)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, path)
    return path


def referenced_files(page: str) -> list[str]:
    """The relative paths an index page links or shows (`src=` / `href=`)."""
    return re.findall(r"(?:src|href)='([^']+)'", page)
