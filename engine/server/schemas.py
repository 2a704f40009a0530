"""The OpenAI request bodies the server accepts, as pydantic models (validation gives the 400s).

Fields OpenAI defines that the server does not implement are either ignored where ignoring them
cannot change the answer (``user``, ``store``, ``metadata``, ``parallel_tool_calls``) or refused with
a 400 naming them (``n`` > 1, ``logprobs``, ``echo``, ``suffix``, ``best_of`` > 1): an answer that
silently ignores what a client asked for is worse than a clear error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; llama-server more)
MAX_STOP_LEN = 256  # characters per stop string
MAX_TOOLS = 128


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extensions); known ones are strictly typed.
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning (llama.cpp's and DeepSeek's field)

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention): role, content as a string,
        tool calls with their arguments, a tool result's id and name, a reply's reasoning."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "assistant" and self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content  # the template keeps or drops it
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(_Body):
    include_usage: bool = False


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Body):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int, Field(ge=1, le=1 << 24)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
StopList = (
    Annotated[list[Annotated[str, Field(max_length=MAX_STOP_LEN)]], Field(max_length=MAX_STOP)]
    | Annotated[str, Field(max_length=MAX_STOP_LEN)]
)


class _Sampling(_Body):
    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0, le=1 << 20)] | None = None  # llama-server's extension
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # llama-server's extension
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    max_tokens: MaxTokens | None = None
    stop: StopList | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    logprobs: bool | int | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
