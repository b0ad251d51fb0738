"""Request bodies of the OpenAI API (completions, chat completions) plus vLLM's extras, as pydantic models.

Types are strict (``"5"`` is not a number, ``true`` is not an integer); unknown fields are accepted and
ignored, as OpenAI clients add new ones all the time. Range checks that SamplingParams already makes are
repeated here only where they shape the OpenAPI schema; ``to_sampling_params`` applies the checkpoint's
generation_config defaults and SamplingParams' own validation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pegainfer.errors import RequestError
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams
from pegainfer.sampling.structured import StructuredOutputsParams
from pegainfer.server.forced_tools import forced_schema

MAX_N = 128
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

NonNegInt = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# A prompt is never empty, and one request holds at most MAX_N prompts: the schema says so, so that a
# request the schema accepts is one the server serves (ids below the vocabulary size are checked later).
TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions. ``None`` means the checkpoint's default."""

    model: NonEmptyStr | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras (clients send them through extra_body).
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    #: Only these tokens may be drawn.
    allowed_token_ids: Annotated[list[NonNegInt], Field(min_length=1)] | None = None
    skip_special_tokens: bool = True
    #: Prefix caching: requests with different salts share no cached prefix (one salt per tenant).
    cache_salt: NonEmptyStr | None = None
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    # (guided_grammar: Lark or GBNF).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: list[str] | None = None
    guided_grammar: NonEmptyStr | None = None

    def check_supported(self) -> None:
        """400 for fields that are valid OpenAI but that pegainfer does not implement."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
        self.structured()  # two fields asking for a grammar, or a malformed one: 400 before anything runs

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar the answer must follow, from the one field that asks for it (400 for two)."""
        asked = self._grammar_fields()
        if len(asked) > 1:
            names = " and ".join(name for name, _ in asked)
            raise RequestError(f"{names} cannot both ask for a grammar", param=asked[1][0])
        return asked[0][1]() if asked else None

    def _grammar_fields(self) -> list[tuple[str, Callable[[], StructuredOutputsParams]]]:
        """(field, its grammar) for every field that asks for one."""
        asked: list[tuple[str, Callable[[], StructuredOutputsParams]]] = []
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs.params))
        if self.response_format is not None and self.response_format.type != "text":
            asked.append(("response_format", self.response_format.structured))
        for kind in ("json", "regex", "choice", "grammar"):
            value, name = getattr(self, f"guided_{kind}"), f"guided_{kind}"
            if value is not None:
                asked.append((name, partial(StructuredOutputsParams, **{kind: value}, param=name)))
        return asked

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk too (vLLM's extension; it needs ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(
        self,
        defaults: SamplingParams,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        vocab_size: int,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams for this request: unset fields take the checkpoint's defaults."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(token_id >= vocab_size for token_id in getattr(self, name) or ()):
                raise RequestError(f"{name} must be in [0, {vocab_size})", param=name)
        logit_bias = _token_biases(self.logit_bias or {}, vocab_size)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise RequestError("stop strings must not be empty", param="stop")
        values: dict[str, Any] = {
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "structured_outputs": self.structured(),
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            values[name] = getattr(defaults, name) if value is None else value
        if values["top_k"] > vocab_size:
            values["top_k"] = -1  # the same filter, and no huge integer reaches the sampler's tensors
        return SamplingParams(**values)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, strings, token ids, or lists of token ids."""

    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_N)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_N)]
    )
    # 0 only with echo (as vLLM): the answer is the prompt, with its logprobs when asked.
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported", param="best_of")
        if self.max_tokens == 0:
            if not self.echo:
                raise RequestError("max_tokens must be at least 1 unless echo is true", param="max_tokens")
            if self.min_tokens:
                raise RequestError("min_tokens must not exceed max_tokens (0)", param="min_tokens")

    @property
    def prompt_logprobs(self) -> int | None:
        """Logprobs of the prompt tokens: echo with logprobs asks for them (lm-evaluation-harness's
        loglikelihood requests), as in vLLM's legacy completions."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list of strings or a list of token-id lists; 400 when empty."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif not p:
            raise RequestError("the prompt is empty", param="prompt")
        elif isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        if len(prompts) > MAX_N:
            raise RequestError(f"at most {MAX_N} prompts are allowed in one request", param="prompt")
        if any(len(x) == 0 for x in prompts):
            raise RequestError("the prompt is empty", param="prompt")
        return prompts


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined into one string, the reasoning
        under the name the templates read (``reasoning_content``)."""
        data = self.model_dump(exclude_none=True)
        reasoning = data.pop("reasoning", None)
        if reasoning is not None:
            data.setdefault("reasoning_content", reasoning)
        if isinstance(self.content, list):
            data["content"] = "".join(part.text for part in self.content)
        return data


class JsonSchemaFormat(_Body):
    name: NonEmptyStr
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar it asks for: any JSON object, one that follows a schema, or none (text)."""
        if self.type == "json_object":
            return StructuredOutputsParams(json={"type": "object"}, param="response_format")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise RequestError(
                    "response_format json_schema needs its json_schema", param="response_format"
                )
            schema = self.json_schema.schema_  # {} is a schema too (any JSON value)
            return StructuredOutputsParams(
                json={"type": "object"} if schema is None else schema, param="response_format"
            )
        return None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` extra: exactly one of a JSON schema, a regex, a choice, a grammar (Lark or GBNF)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: NonEmptyStr | None = None
    choice: list[str] | None = None
    grammar: NonEmptyStr | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            param="structured_outputs",
        )


class _ChatPrompt(_Body):
    """The fields that make a chat prompt: messages rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    # vLLM extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_chat_prompt(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise RequestError(
                "continue_final_message needs the last message to be the assistant's", param="messages"
            )


class ChatCompletionRequest(_SamplingFields, _ChatPrompt):
    """POST /v1/chat/completions."""

    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    #: With ``server.reasoning_parser`` set: false leaves the reasoning out of the answer.
    include_reasoning: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        self.check_chat_prompt()

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a ``tool_choice`` that forces calls puts on the answer (``forced_tools``)."""
        return forced_schema(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _grammar_fields(self) -> list[tuple[str, Callable[[], StructuredOutputsParams]]]:
        forced = self.forced_tool_schema()
        others = super()._grammar_fields()
        if forced is None:
            return others
        return [("tool_choice", partial(StructuredOutputsParams, json=forced, param="tool_choice")), *others]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class _TokenizeFields(_Body):
    model: NonEmptyStr | None = None
    #: Also return each token's vocabulary string.
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if "prompt" in (self.model_extra or {}):  # a body with messages is a chat (tokenize_body)
            raise RequestError("prompt and messages cannot both be given", param="prompt")


class TokenizeCompletionRequest(_TokenizeFields):
    """POST /tokenize with a text prompt (vLLM's extension): its ids as /v1/completions would encode it."""

    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeFields, _ChatPrompt):
    """POST /tokenize with chat messages: the ids of the prompt /v1/chat/completions would render."""

    add_special_tokens: bool = False  # the template writes the special tokens itself

    def check_supported(self) -> None:
        super().check_supported()
        self.check_chat_prompt()


def _tokenize_kind(body: Any) -> str:
    has_messages = "messages" in body if isinstance(body, dict) else isinstance(body, TokenizeChatRequest)
    return "tagged:messages" if has_messages else "tagged:prompt"


# POST /tokenize's body: a chat when it has messages, else a prompt (validation errors name the fields of
# that one form only).
TokenizeBody = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("tagged:prompt")]
    | Annotated[TokenizeChatRequest, Tag("tagged:messages")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's extension): the text of token ids, special tokens included."""

    model: NonEmptyStr | None = None
    tokens: list[NonNegInt]


def _token_biases(biases: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys) keyed by the ids, each one in the vocabulary."""
    by_id = {}
    for key, value in biases.items():
        if not key.isascii() or not key.isdigit():  # "5", not " 5", "+5" or "1_0"
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"logit_bias token ids must be in [0, {vocab_size}), got {token}", param="logit_bias"
            )
        by_id[token] = value
    return by_id
