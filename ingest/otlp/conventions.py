"""The attribute names of the three span conventions the receiver reads.

- ``gen_ai``: OpenTelemetry GenAI semantic conventions (v1.41 names, see
  ``ingest/otel.py``): ``gen_ai.operation.name`` says what a span is.
- ``gen_ai_deprecated``: the same with names the conventions have since renamed
  (``gen_ai.system``, ``gen_ai.usage.prompt_tokens``/``completion_tokens``, the older
  ``cache_read_input_tokens`` spellings); a span using any of them is recorded as such,
  because that tells an operator which instrumentations need an upgrade.
- ``openinference``: Arize OpenInference (``openinference.span.kind``, ``llm.*``).

Each lookup is a tuple of names, current first; the first present wins.
"""

from __future__ import annotations

GEN_AI = "gen_ai"
GEN_AI_DEPRECATED = "gen_ai_deprecated"
OPENINFERENCE = "openinference"
CONVENTIONS = (GEN_AI, GEN_AI_DEPRECATED, OPENINFERENCE)

# What a span is, in loopwatch's terms.
MODEL = "model"      # one model call: llm.call, the only place tokens are counted
TOOL = "tool"        # tool.call
AGENT = "agent"      # an agent invocation: the run's start and end
WRAPPER = "wrapper"  # workflow, chain, embeddings, retrieval...: no event of its own

OPERATION_ROLES = {
    "chat": MODEL,
    "generate_content": MODEL,
    "text_completion": MODEL,
    "execute_tool": TOOL,
    "invoke_agent": AGENT,
}
OPENINFERENCE_ROLES = {"LLM": MODEL, "TOOL": TOOL, "AGENT": AGENT}

OPERATION = "gen_ai.operation.name"
OPENINFERENCE_KIND = "openinference.span.kind"

DEPRECATED_NAMES = frozenset({
    "gen_ai.system",
    "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.completion_tokens",
    "gen_ai.usage.cache_read_input_tokens",
    "gen_ai.usage.cache_creation_input_tokens",
    "gen_ai.usage.cache_write_input_tokens",
})

INPUT_TOKENS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens",
                "llm.token_count.prompt")
OUTPUT_TOKENS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens",
                 "llm.token_count.completion")
CACHE_READ_TOKENS = ("gen_ai.usage.cache_read.input_tokens",
                     "gen_ai.usage.cache_read_input_tokens",
                     "llm.token_count.prompt_details.cache_read")
CACHE_CREATION_TOKENS = ("gen_ai.usage.cache_creation.input_tokens",
                         "gen_ai.usage.cache_write.input_tokens",
                         "gen_ai.usage.cache_creation_input_tokens",
                         "gen_ai.usage.cache_write_input_tokens",
                         "llm.token_count.prompt_details.cache_write")
PROVIDER = ("gen_ai.provider.name", "gen_ai.system", "llm.provider", "llm.system")
REQUEST_MODEL = ("gen_ai.request.model", "llm.model_name", "gen_ai.response.model")
RESPONSE_MODEL = ("gen_ai.response.model",)
FINISH_REASONS = ("gen_ai.response.finish_reasons", "llm.finish_reason")
TIME_TO_FIRST_CHUNK_S = ("gen_ai.response.time_to_first_chunk",)
REPORTED_COST = ("llm.cost.total",)
TOOL_NAME = ("gen_ai.tool.name", "tool.name")
TOOL_CALL_ID = ("gen_ai.tool.call.id", "tool_call.id")
TOOL_ARGUMENTS = ("gen_ai.tool.call.arguments", "input.value")
TOOL_RESULT = ("gen_ai.tool.call.result", "output.value")
AGENT_NAME = ("gen_ai.agent.name", "agent.name")
AGENT_ID = ("gen_ai.agent.id",)
AGENT_VERSION = ("gen_ai.agent.version",)
CONVERSATION_ID = ("gen_ai.conversation.id", "session.id")
ERROR_TYPE = ("error.type",)
HTTP_STATUS = ("http.response.status_code",)

# loopwatch's own dimensions, settable on a span or (for all its spans) the resource.
CONTEXT_FIELDS = ("agent", "agent_version", "task_type", "prompt_version", "deployment",
                  "traffic_slice", "worker_id")
OWN_PREFIX = "loopwatch."

# Every span attribute that can change an event's context (see mapping._Mapper._apply).
CONTEXT_NAMES = frozenset((*AGENT_NAME, *AGENT_VERSION, *AGENT_ID, *CONVERSATION_ID,
                           *(OWN_PREFIX + name for name in CONTEXT_FIELDS)))
