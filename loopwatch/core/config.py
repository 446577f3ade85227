"""Settings, read once at the edge (CLI entry) and passed down frozen.

Every knob has an environment variable ``LOOPWATCH_<NAME>``; a TOML/env file can be
named with ``LOOPWATCH_CONFIG_FILE``. With no settings at all loopwatch runs the
embedded stack: a Tansu broker on a free loopback port and chdb under the data dir.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from loopwatch.core.masking import safe_address, safe_url
from loopwatch.ingest.announce import default_data_dir
from loopwatch.ingest.events import TEST_TRAFFIC_SLICES


class LoopDetectorSettings(BaseSettings):
    """Same tool with the same args hash ``repeats`` times within ``window`` steps."""

    model_config = SettingsConfigDict(frozen=True)

    window: int = Field(10, ge=2)
    repeats: int = Field(3, ge=2)


class AdvisorSettings(BaseSettings):
    """The advisors (detectors/advisors, docs/advisors.md): what they read and when a
    finding is worth raising. Rates default to the seeds' illustrative values."""

    model_config = SettingsConfigDict(frozen=True)

    window_h: float = Field(24.0, gt=0, description="findings read this many hours of "
                            "event time, ending at the newest event")
    min_span_h: float = Field(1.0, gt=0, description="dollars per day extrapolate the "
                              "observed volume over at least this many hours of traffic")
    min_saving_usd_per_day: float = Field(1.0, ge=0, description="a finding with a dollar "
                                          "saving is raised only from this saving per day")
    min_saving_share: float = Field(0.01, ge=0, le=1, description="... and only from this "
                                    "share of the agent's model spend per day")
    alert_move_share: float = Field(0.2, gt=0, description="a finding whose recommended "
                                    "value moved by more than this share raises an info alert")
    interval_s: float = Field(300.0, gt=0, description="seconds between advisor passes in up")
    timeout_idle_usd_per_s: float = Field(0.002, ge=0, description="TMO IDLE_RATE: what a "
                                          "worker waiting on a call costs per second")
    timeout_call_cost_usd: float = Field(0.10, ge=0, description="TMO CALL_COST: the work "
                                         "thrown away when a call is cut off")
    timeout_retry_mult: float = Field(1.2, ge=1, description="TMO RETRY_MULT: a retry "
                                      "repeats more than the call alone")
    min_calls: int = Field(50, ge=1, description="a tool, prompt version or task type "
                           "needs this many calls or runs in the window to be judged")
    cache_ttl_s: float = Field(300.0, gt=0, description="the prompt cache's TTL (5 min)")
    quad_min_steps: int = Field(10, ge=3, description="a run must have this many model "
                                "calls for its prefill slope to count")
    quad_digest_tokens: int = Field(40, ge=1, description="a tool result cut to a digest "
                                    "of this many tokens (QUAD)")
    judge_min_pairs: int = Field(30, ge=2, description="runs with both a judge and a human "
                                 "label needed to judge the judge")
    judge_min_kappa: float = Field(0.4, ge=-1, le=1, description="a judge whose Cohen's "
                                   "kappa against humans is below this is flagged")
    pipeline_determinism: float = Field(0.95, gt=0, le=1, description="a task type whose "
                                        "runs take the same next step this often is a "
                                        "pipeline candidate (PIPE, NOAGENT)")


class Settings(BaseSettings):
    """All of loopwatch's configuration; frozen so nothing changes it after start-up."""

    model_config = SettingsConfigDict(
        env_prefix="LOOPWATCH_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
        hide_input_in_errors=True,  # a rejected value may be a password-bearing URL
    )

    data_dir: Path = Field(default_factory=default_data_dir)
    kafka_bootstrap: str | None = Field(
        None, description="host:port[,host:port]; unset = start the embedded broker"
    )
    broker_wait_s: float = Field(
        30.0, gt=0, description="how long creating the topics (`up`, `ingest serve`) waits "
        "for the broker to take a connection before giving up (exit 1)")
    broker_port: int = Field(
        0, ge=0, le=65535, description="the embedded broker's loopback port; 0 = the port "
        "recorded in <data_dir>/broker.json, or a free one on the first start (then recorded)"
    )
    clickhouse_url: str | None = Field(
        None, repr=False, description="http(s)://user:pass@host:port/db; unset = embedded chdb"
    )
    database: str = "loopwatch"
    events_topic: str = "loopwatch.events"
    deadletter_topic: str = "loopwatch.deadletter"
    partitions: int = Field(8, ge=1, le=1024)
    consumer_group: str = "loopwatch-processors"

    batch_max_events: int = Field(
        500, ge=1, description="messages per batch the processors take (faust's take_events "
        "counts messages: an SDK envelope of up to 500 events counts once). A batch's "
        "messages stay in memory until it is stored and its offsets are committed only "
        "then: 500 full envelopes are ~170k bench events, which kept the bench's events/s "
        "of 2000 (run states are written once per batch: far smaller batches were slower)"
    )
    batch_max_wait_s: float = Field(0.5, gt=0)
    fetch_max_wait_ms: int = Field(
        100, ge=1, le=60_000, description="how long the processors' consumer waits for a "
        "fetch with nothing to read (faust's own is 1500 ms). A Kafka broker answers as "
        "soon as data arrives; the embedded one answers when the wait is over, so this "
        "bounds how long a message that arrives while the processors are caught up waits")
    settle_max_runs: int = Field(
        20_000, ge=1, description="a batch stores (changelog + runs rows) the runs it "
        "touched once this many are waiting, not only at its end: a batch of 2000 envelopes "
        "can touch 100k+ runs, and each held ~10 KB of rows and changelog messages")
    max_message_bytes: int = Field(
        1_000_000, ge=1024, description="a larger message on the events or captures topic "
        "is a dead letter (its first bytes, size and sha256: processors/deadletter.py)")
    broker_max_message_bytes: int = Field(
        1_048_588, ge=65_536, description="the largest record the broker takes (Kafka's "
        "message.max.bytes / a topic's max.message.bytes; the default is Kafka's; the "
        "embedded Tansu sets none). The processors size their own records to fit it: a "
        "dead letter keeps at most this less 16 KiB of its payload, a run state larger "
        "than it is not changelogged (the run is read back from the store instead)")

    late_allowance_s: float = Field(
        5.0, ge=0, description="how far behind the newest event time a late event may be"
    )
    max_clock_skew_s: float = Field(
        300.0, gt=0, description="event times further ahead of the clock don't move event time"
    )
    idle_advance_s: float = Field(
        10.0, gt=0, description="with no events for this long, event time follows the clock"
    )
    abandon_ttl_s: float = Field(
        1800.0, gt=0, description="no run.end this long (event time) after the last event; "
        "a run that declares time_cap_s gets 2 x that instead"
    )
    abandon_ttl_by_task_type: dict[str, float] = Field(default_factory=dict)
    sweep_interval_s: float = Field(
        5.0, gt=0, description="how often open runs are checked for abandonment"
    )
    label_window_s: float = Field(
        86400.0, gt=0, description="closed runs stay in processor state this long for labels"
    )
    loop: LoopDetectorSettings = Field(default_factory=lambda: LoopDetectorSettings())
    loop_by_task_type: dict[str, LoopDetectorSettings] = Field(default_factory=dict)
    advise: AdvisorSettings = Field(default_factory=lambda: AdvisorSettings())
    near_miss_factor: float = Field(1.3, gt=1.0)
    prices_file: Path | None = Field(
        None, description="a price table to use instead of the one shipped (prices.json)"
    )
    cost_mismatch_tolerance: float = Field(
        0.01, ge=0, description="relative difference between reported and priced cost"
    )

    detect_interval_s: float = Field(15.0, gt=0, description="seconds between rule passes")
    detect_start_delay_s: float = Field(
        0.0, ge=0, description="seconds `up` waits before its first rule and advisor pass "
        "(0: at once, so a restart pages without waiting an interval; the throughput bench "
        "holds them off its window)")
    alertmanager_url: str | None = Field(None, description="post alerts to this Alertmanager")
    webhook_url: str | None = Field(None, description="loopwatch's own signed webhook")
    webhook_secret: str = Field(
        "", repr=False, description="HMAC-SHA256 key for the webhook signature")
    slack_webhook_url: str | None = Field(None, repr=False, description="its path is a secret")
    pagerduty_url: str | None = Field(
        None, description="PagerDuty Events API v2 endpoint (enqueue URL)")
    pagerduty_routing_key: str = Field("", repr=False)
    renotify_s: float = Field(4 * 3600.0, gt=0, description="re-send a still-firing alert")
    alertmanager_resend_s: float = Field(60.0, gt=0)
    silences: list[dict[str, Any]] = Field(default_factory=list)
    tool_criticality: dict[str, str] = Field(
        default_factory=dict, description="tool -> critical|warning|info (tool alert severity)")
    daily_budget_usd: dict[str, float] = Field(default_factory=dict)
    rule_overrides: list[dict[str, Any]] = Field(default_factory=list)
    link_base_url: str = Field("", description="base URL of the run drill-down, for alert links")
    alert_excluded_slices: tuple[str, ...] = Field(
        TEST_TRAFFIC_SLICES, description="traffic_slice values the alert rules leave out")

    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    sink_retry_s: float = Field(1.0, gt=0)
    session_timeout_s: float = Field(10.0, gt=0)
    drain_timeout_s: float = Field(
        60.0, ge=0, description="on SIGTERM a worker goes on consuming until its group "
        "has committed everything (the embedded broker forgets it all on stop), for at "
        "most this long; then writes the store or broker refuses stop being retried and "
        "their batches are read again after a restart. Keep it below the supervisor's "
        "grace period")
    producer_request_timeout_s: float = Field(
        1200.0, gt=0, description="a processor's write to Kafka (state changelog, dead "
        "letters) gives up after this long and is sent again, until the broker takes it")

    # -- capture and replay (docs/capture.md) --------------------------------------
    captures_topic: str = "loopwatch.captures"
    capture: Literal["off", "failures", "all"] = Field(
        "failures", description="which runs keep their prompt/response/tool payloads")
    capture_success_sample: float = Field(
        0.1, ge=0, le=1, description="share of successful runs kept under capture=failures")
    capture_max_part_bytes: int = Field(
        256 * 1024, ge=1024, description="a larger prompt/response/args/output is truncated")
    capture_retention_days: int = Field(30, ge=1, description="kept payloads live this long")
    capture_decide_interval_s: float = Field(
        10.0, gt=0, description="how often closed runs get their capture decision")
    redact: list[str] = Field(
        default_factory=lambda: ["email", "api_key", "bearer_token", "card_number"],
        description="built-in redaction patterns applied before anything leaves the emitter")
    redact_extra: dict[str, str] = Field(
        default_factory=dict, description="more patterns: name -> regular expression")
    engineer_usd_per_hour: float = Field(
        120.0, ge=0, description="trace economics: the engineer waiting on re-runs")
    storage_usd_per_gb_month: float = Field(
        0.10, ge=0, description="trace economics: what a stored compressed GB costs")

    # -- retention and security (docs/operations.md) ---------------------------------
    apply_retention: bool = Field(
        True, description="set per-table TTLs at start; off for a store fed in simulated "
        "time (the scorecard replays January), since TTLs go by event time")
    retention_days: dict[str, int] = Field(
        default_factory=dict, description="per-table TTL overrides, table -> days")
    data_dir_max_bytes: int | None = Field(
        None, ge=1024 * 1024, description="cap on the data dir; oldest partitions dropped first")
    web_token: str | None = Field(
        None, repr=False, description="require `Authorization: Bearer <token>` on the web view")

    # -- the HTTP servers: web view and OTLP receiver (docs/operations.md) -------------
    http_allowed_hosts: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="Host names the web view (and the OTLP receiver without a token) "
        "answer to besides localhost, 127.0.0.1, ::1 and the address they are bound to; "
        "comma-separated or a JSON list; `*` = any (then nothing stops DNS rebinding). "
        "Any other Host gets 421")
    http_header_timeout_s: float = Field(
        10.0, gt=0, description="a request's headers must be complete this long after its "
        "connection opened or its previous response, or the connection is closed (408): "
        "slowloris clients trickling header lines cannot hold connections")
    web_max_connections: int = Field(
        64, ge=1, description="open web view connections; over it the one that has waited "
        "longest for headers is closed, so idle or slow clients cannot fill it")

    # -- user SQL: the guard and its limits (store/sqlguard.py) -------------
    query_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a user query (loopwatch query, investigate, "
        "playbook, the web view, the store service) is stopped after this long")
    query_max_memory_bytes: int = Field(
        2 * 1024**3, ge=16 * 1024**2, description="memory one user query may use in the engine")
    query_max_result_rows: int = Field(
        1_000_000, ge=1, description="rows a user query may return; more is an error, "
        "not a truncated answer")
    query_max_result_bytes: int = Field(
        512 * 1024**2, ge=1024, description="bytes (uncompressed, in the engine) a user "
        "query's result may hold")
    query_concurrency: int = Field(
        4, ge=1, le=64, description="user queries the store service runs at once, each on "
        "a reader client of its own; the pipeline's writes never wait for them")
    clickhouse_reader_url: str | None = Field(
        None, repr=False, description="with a ClickHouse server, user SQL connects as this "
        "user (deploy's `reader`: readonly, limits under constraints, SELECT on loopwatch "
        "only); unset = LOOPWATCH_CLICKHOUSE_URL's user, still guarded and readonly=1")
    query_busy_wait_s: float = Field(
        2.0, ge=0, description="how long a query waits for a free reader before the "
        "store service refuses it as busy")

    @field_validator("clickhouse_url")
    @classmethod
    def _http_only(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(
                "LOOPWATCH_CLICKHOUSE_URL must start with http:// or https:// "
                f"(got {safe_url(value)!r}); leave it unset to use the embedded chdb store"
            )
        return value

    @field_validator("http_allowed_hosts", mode="before")
    @classmethod
    def _host_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return tuple(name.strip() for name in text.split(",") if name.strip())
        return value

    @field_validator("kafka_bootstrap")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        for part in value.split(","):
            host, _, port = part.strip().rpartition(":")
            if not host or not port.isdigit() or "@" in host or "/" in host:
                shown = ",".join(safe_address(p.strip()) for p in value.split(","))
                raise ValueError(
                    f"LOOPWATCH_KAFKA_BOOTSTRAP must be host:port[,host:port] (got {shown!r}"
                    "; an address holds no user or password)")
        return value

    @model_validator(mode="after")
    def _absolute_data_dir(self) -> Settings:
        object.__setattr__(self, "data_dir", self.data_dir.expanduser().resolve())
        return self

    @property
    def embedded_store(self) -> bool:
        return self.clickhouse_url is None

    @property
    def chdb_path(self) -> Path:
        return self.data_dir / "chdb"

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"

    @property
    def outbox_path(self) -> Path:
        return self.data_dir / "outbox" / "notifications.jsonl"

    @property
    def service_file(self) -> Path:
        """Where a running ``loopwatch up`` publishes its store-service address."""
        return self.data_dir / "service.json"

    @property
    def service_socket(self) -> Path:
        """The store service's Unix socket (0600 in the 0700 data dir; a too-long path
        gets a private temporary folder, named in :attr:`service_file`)."""
        return self.data_dir / "service.sock"

    def loop_for(self, task_type: str) -> LoopDetectorSettings:
        """The loop detector's settings for a task type (the fold reads the same two
        fields once, into a dict of its own: this call is interpreted Python)."""
        return self.loop_by_task_type.get(task_type, self.loop)


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment plus explicit CLI overrides (None = not given)."""
    given = {key: value for key, value in overrides.items() if value is not None}
    config_file = os.environ.get("LOOPWATCH_CONFIG_FILE")
    if config_file:
        return Settings(_env_file=config_file, **given)  # type: ignore[call-arg]
    return Settings(**given)
