"""What generation yields: frozen events consumed alike by the CLI, tests, the server and the GUI."""

from __future__ import annotations

from dataclasses import dataclass

# Why generation ended.
FINISH_EOS = "eos"  # the model produced an end-of-generation token
FINISH_STOP = "stop"  # a stop string appeared
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CONTEXT = "context"  # the context window is full
FINISH_CANCELLED = "cancelled"  # cancel() was called


@dataclass(frozen=True)
class GenerationEvent:
    text: str  # new text since the previous event (never half a UTF-8 character); may be ""
    token_id: int | None  # the token this event is about (None on the final event)
    n_prompt: int  # prompt tokens processed (only those not already in the KV cache)
    n_generated: int  # tokens generated so far
    n_ctx_used: int  # positions of the context in use after this token
    n_ctx: int  # context size
    ttft_s: float  # time to first token (prompt processing + first sample), seconds
    prompt_tok_s: float  # prompt processing speed, tokens per second
    decode_tok_s: float  # decode speed over the generated tokens so far (0 until the second token)
    finish_reason: str | None = None  # None while streaming; one of the FINISH_* values at the end
    message: str = ""  # a human-readable note with the finish reason (e.g. why the context is full)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
