"""DP-OPT's templates, after VITA-Group/DP-OPT ``utils/template.py`` (the paper's Fig. 5 is an
image missing from the text) and its initial instructions (Table 6).

* forward / evaluation: ``Instruction: <prompt>\\n\\nInput: <x>\\n\\nOutput:`` and the label word;
* backward (Algorithm 1's meta-prompt, DLN-style): the current instruction, the student's
  successes (x, y) and errors (x, ŷ, y), "Improved Instruction:" — the LLM continues from there.
"""

from __future__ import annotations

INIT_INSTRUCTIONS = {
    "sst2": "Classify the input text as positive or negative.",
    "trec": "Read the following question, then choose whether it is about a description, entity, expression, "
            "human, location or number.",
}
DEFAULT_INSTRUCTION = "Read the input, then choose the correct label."

META_INSTRUCTION = ("A student is completing a task that requires producing a text output from a text input. "
                    "The student receives an instruction that describes how to produce the output given each "
                    "input. The student has made some errors. Your task is to improve the instruction such that "
                    "the student can fix the errors.")


def initial_instruction(dataset: str) -> str:
    return INIT_INSTRUCTIONS.get(dataset.lower(), DEFAULT_INSTRUCTION)


def eval_prefix(instruction: str | None) -> str:
    """The part of the forward template before the input (empty instruction: zero-shot)."""
    return f"Instruction: {instruction}\n\n" if instruction else ""


def eval_text(instruction: str | None, text: str) -> str:
    """Forward template up to the label: the next token is the label word."""
    return f"{eval_prefix(instruction)}Input: {text}\n\nOutput:"


def backward_head(instruction: str) -> str:
    """The shared head of every backward meta-prompt of a run (encoded once, its KV reused)."""
    return f"{META_INSTRUCTION}\nThis was the instruction.\n\nInstruction: {instruction}\n\n"


def backward_body(demos: list[tuple[str, str, str]]) -> str:
    """The per-meta-prompt part: successes and errors of k demos (x, y, ŷ), then the slot where
    the improved instruction is generated."""
    successes = [f"Input: {x}\nCorrect Output: {y}" for x, y, yhat in demos if yhat == y]
    errors = [f"Input: {x}\nStudent Output: {yhat}\nCorrect Output: {y}" for x, y, yhat in demos if yhat != y]
    return ("# Student successes\n" + ("\n\n".join(successes) or "(none)") + "\n\n# Student errors\n"
            + ("\n\n".join(errors) or "(none)") + "\n\nImprove the instruction to fix the student errors.\n"
            "Improved Instruction:")
