"""Turning a question into the text the policy sees: the model's own chat template."""

from __future__ import annotations

from typing import Protocol

# Asks for the answer in the form the grader looks for first (logra_jax.rl.rewards).
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class ChatTemplate(Protocol):
    """What format_prompt needs from a tokenizer (logra_jax.models.tokenizer.Tokenizer has it)."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool
                            ) -> str: ...


def format_prompt(question: str, tokenizer: ChatTemplate, *, system_prompt: str | None = None,
                  instruction: str | None = DEFAULT_INSTRUCTION) -> str:
    """The chat-formatted prompt for ``question``, ending where the assistant's answer begins.

    The user turn is the question followed, on a new line, by ``instruction`` (None or "" for the
    bare question). ``system_prompt`` adds a system turn; without one the template applies its own
    default (SmolLM2's names itself "SmolLM").
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    content = f"{question.strip()}\n{instruction}" if instruction else question.strip()
    messages = [{"role": "user", "content": content}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise ValueError(f"{type(tokenizer).__name__}.apply_chat_template returned "
                         f"{type(prompt).__name__}, expected the prompt as str")
    return prompt
