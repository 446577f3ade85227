"""Where the contract's fields meet OpenTelemetry GenAI semantic conventions (v1.41).

One table, read by the docs test and (later) by the OTLP receiver: loopwatch field ->
OTel attribute. Fields with no OTel name are loopwatch's own.
"""

from __future__ import annotations

FIELD_TO_OTEL: dict[str, str] = {
    "agent": "gen_ai.agent.name",
    "agent_version": "gen_ai.agent.version",
    "model": "gen_ai.request.model",
    "response_model": "gen_ai.response.model",
    "provider": "gen_ai.provider.name",
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cache_read_input_tokens": "gen_ai.usage.cache_read.input_tokens",
    "cache_creation_input_tokens": "gen_ai.usage.cache_creation.input_tokens",
    "stop_reason": "gen_ai.response.finish_reasons",
    "tool": "gen_ai.tool.name",
    "error_type": "error.type",
    "run_id": "trace_id (the OTLP receiver: one trace is one run)",
    "conversation_id (extra)": "gen_ai.conversation.id",
    "trace_id": "trace_id (span context)",
    "span_id": "span_id (span context)",
    "parent_span_id": "parent_span_id (span context)",
}

EVENT_TO_OPERATION: dict[str, str] = {
    "run.start": "invoke_agent (span start)",
    "run.end": "invoke_agent (span end)",
    "llm.call": "chat / generate_content / text_completion",
    "tool.call": "execute_tool",
}
