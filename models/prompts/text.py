"""A discrete text prompt: an instruction the template puts before the input (DP-OPT)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextPrompt:
    instruction: str
    kind: str = "text"

    def template(self, base: str) -> str:
        """``base`` (a classifier template with ``{text}``) with the instruction before it, in
        DP-OPT's forward format; an empty instruction is ``base`` itself (zero-shot's prompt, as
        DP-OPT's forward template writes no instruction line for it). Braces in the instruction
        cannot open a template field."""
        if not self.instruction.strip():
            return base
        safe = self.instruction.replace("{", "(").replace("}", ")")
        return f"Instruction: {safe}\n\n{base}"
