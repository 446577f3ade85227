"""Settings of the OTLP receiver, read once at the edge like :mod:`loopwatch.core.config`.

Kept apart from :class:`loopwatch.core.config.Settings` for now (env prefix
``LOOPWATCH_OTLP_``, so ``LOOPWATCH_OTLP_PORT`` works either way if they move there).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class OtlpSettings(BaseSettings):
    """Where the receiver listens and how much work it accepts before it pushes back."""

    model_config = SettingsConfigDict(env_prefix="LOOPWATCH_OTLP_", frozen=True, extra="ignore")

    host: str = Field("127.0.0.1", description="loopback by default: no auth is the default")
    port: int = Field(4318, ge=0, le=65535, description="OTLP/HTTP port; 0 = a free port")
    grpc_port: int | None = Field(
        4317, ge=0, le=65535, description="OTLP/gRPC port beside HTTP (same host, token, "
        "limits and export path); 0 = a free port; `off` (or empty) = no gRPC receiver")
    token: str | None = Field(None, description="require `Authorization: Bearer <token>`")
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="per request, after decompression (413 above)")
    max_inflight: int = Field(
        4, ge=1, description="requests decoded/published at once; more get 429 + Retry-After")
    max_connections: int = Field(
        128, ge=1, description="open connections; over it the one that has waited longest "
        "for its request headers is closed (503 + Retry-After only when all are in requests)")
    max_receiving: int = Field(
        16, ge=1, description="request bodies being received at once (memory: this x "
        "max_body_bytes); more get 429 + Retry-After before their body is read")
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body must arrive within this long of its headers, "
        "or it gets 408 and its connection is closed, freeing its receive slot")
    publish_timeout_s: float = Field(
        10.0, gt=0, description="wait this long for the broker's ack, then 503 + Retry-After")
    retry_after_s: int = Field(2, ge=1, description="the Retry-After we send with 429/503")
    grpc_max_connection_age_s: float = Field(
        300.0, gt=0, description="a gRPC connection is asked to reconnect (GOAWAY) after "
        "this long and closed body_timeout_s + publish_timeout_s later, so a client that "
        "never finishes its message holds its slot no longer than that")

    process: bool = Field(
        True, description="`loopwatch up` runs the receivers in a child process of their "
        "own, so decoding spans does not take the processors' GIL (docs/performance.md); "
        "false = in the up process, as threads")

    @field_validator("grpc_port", mode="before")
    @classmethod
    def _off(cls, value: object) -> object:
        """``off``, ``none`` or empty disables the gRPC receiver."""
        if isinstance(value, str) and value.strip().lower() in ("", "off", "none"):
            return None
        return value


def load_otlp_settings(**overrides: Any) -> OtlpSettings:
    """Environment (or ``LOOPWATCH_CONFIG_FILE``) plus explicit overrides (None = not given)."""
    given = {key: value for key, value in overrides.items() if value is not None}
    config_file = os.environ.get("LOOPWATCH_CONFIG_FILE")
    if config_file:
        return OtlpSettings(_env_file=config_file, **given)  # type: ignore[call-arg]
    return OtlpSettings(**given)
