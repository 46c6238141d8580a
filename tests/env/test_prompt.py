"""Prompt templates: bundled files, placeholder rules, and the fixed feedback texts."""

import pytest

from treegrpo_jax.env.prompt import (
    FORCED_ANSWER,
    INVALID_ACTION,
    PromptConfig,
    load_template,
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
