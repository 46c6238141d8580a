"""Prompt templates: bundled files, placeholder rules, and the fixed feedback texts."""

import pytest

from treegrpo_jax.env.prompt import (
    FORCED_ANSWER,
    INVALID_ACTION,
    PromptConfig,
    load_template,
    prompt_text,
    render_prompt,
)


@pytest.mark.parametrize("name", ["search_agent", "search_agent_terse"])
def test_bundled_templates_teach_the_protocol(name):
    template = load_template(name)
    assert template.count("{question}") == 1
    for tag in (
        "<think>",
        "</think>",
        "<search>",
        "</search>",
        "<information>",
        "</information>",
        "<answer>",
    ):
        assert tag in template, (name, tag)


def test_render_substitutes_only_the_placeholder():
    cfg = PromptConfig()
    prompt = cfg.render("  What is {question} and {0}?  ")
    assert prompt.endswith("Question: What is {question} and {0}?")
    assert render_prompt("{a} {question} }", "q") == "{a} q }"


def test_template_from_file(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("Q: {question}\n\n")
    assert PromptConfig.from_template(str(path)).render("x") == "Q: x"


def test_bad_templates_are_rejected():
    with pytest.raises(ValueError, match="template"):
        PromptConfig(template="no placeholder")
    with pytest.raises(ValueError, match="exactly once"):
        render_prompt("{question}{question}", "q")
    with pytest.raises(FileNotFoundError):
        load_template("../etc/passwd")
    with pytest.raises(ValueError, match="forced_answer"):
        PromptConfig(forced_answer="  ")


def test_feedback_texts():
    # Both are plain text shown between steps (not wrapped in information tags) and name the tags.
    for text in (INVALID_ACTION, FORCED_ANSWER):
        assert text.startswith("\n") and text.endswith("\n")
        assert "<answer>" in text and "<information>" not in text
    assert "<search>" in INVALID_ACTION


def test_demonstrations_and_rollouts_tokenize_alike_for_every_kind_of_tokenizer(tokenizer_kinds):
    """One path (`prompt_ids` + segment `encode`): a cold-start demonstration's ids are exactly
    what a rollout feeds the model for the same text, with BOS once at the start or never."""
    from treegrpo_jax.data import WorldConfig, build_world
    from treegrpo_jax.env.bm25 import BM25Retriever
    from treegrpo_jax.env.scripted_agent import ScriptConfig, make_demonstrations, tokenize_demonstration
    from treegrpo_jax.rollout.agent import AgentEnv
    from treegrpo_jax.rollout.search_state import prompt_tokens

    kind, tok = tokenizer_kinds
    world = build_world(WorldConfig(questions_per_hop=(6, 6, 6, 6)))
    env = AgentEnv(tokenizer=tok, retriever=BM25Retriever.from_texts(world.passages))
    demos = make_demonstrations(world.train[:8], retriever=env.retriever, tokenizer=tok, cfg=ScriptConfig())
    bos = tok.bos_id if kind != "no_bos" else None
    for demo in demos:
        spans = tokenize_demonstration(demo, tok).spans
        assert list(spans[0][0]) == prompt_tokens(env, demo.question)  # the rollout's prompt ids
        rollout_like = [prompt_tokens(env, demo.question)]
        for step in demo.steps:  # a model step is its sampled ids; an observation is `encode_obs`
            rollout_like.append(tok.encode(step.generated))
            if step.observation:
                rollout_like.append(env.encode_obs(step.observation))
        assert [list(ids) for ids, _ in spans] == rollout_like
        ids = [t for span, _ in spans for t in span]
        if bos is None:  # nothing prepended (SmolLM2's BOS id is <|im_start|>, which the template writes)
            assert list(spans[0][0]) == tok.encode(prompt_text(demo.prompt, tok))
        else:
            assert ids[0] == bos and ids[1:2] != [bos]  # once, at the start
            assert all(bos not in span for span, _ in spans[1:])  # never inside a segment
