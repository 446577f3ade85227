"""The deployment files (deploy/, docs/operations.md) and the cluster DDL.

Docker and a Kubernetes cluster are not available to the tests, so the files are checked
statically: they parse, every reference resolves (env vars, secrets, volumes, mounted
paths, ConfigMap/Secret keys, CLI commands), and the cluster DDL is deterministic,
committed, and runs (in its single-node form) on the real ClickHouse engine (chdb).
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from clickhouse_connect.driver.client import Client
from typer.testing import CliRunner

from loopwatch.cli import app
from loopwatch.core.config import Settings
from loopwatch.store.clickhouse import statements
from loopwatch.store.cluster import (
    RETENTION,
    Table,
    View,
    render_cluster_ddl,
    render_sql,
    schema_objects,
)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
CLUSTER_SQL = DEPLOY / "clickhouse" / "cluster.sql"
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN", re.IGNORECASE)


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def env_example() -> dict[str, str]:
    values = {}
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example line without '=': {line!r}"
            values[key.strip()] = value.strip()
    return values


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {key: str(value) for key, value in env.items()}


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} with ``values``."""

    def one(match: re.Match[str]) -> str:
        name, op, rest = match.group(1), match.group(2), match.group(3)
        value = values.get(name, "")
        if op and op.endswith("-") and not value:
            return rest
        if op and op.endswith("?") and not value:
            raise AssertionError(f"${{{name}}} is required: {rest}")
        return value

    return ENV_REF.sub(one, text)


def strings(node: Any) -> list[str]:
    """Every string (keys excluded) in a parsed YAML tree: what compose interpolates."""
    if isinstance(node, dict):
        return [text for value in node.values() for text in strings(value)]
    if isinstance(node, list):
        return [text for value in node for text in strings(value)]
    return [node] if isinstance(node, str) else []


def env_refs() -> list[re.Match[str]]:
    return [match for text in strings(compose()) for match in ENV_REF.finditer(text)]


def loopwatch_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services().items() if "build" in svc}


def host_ports(service: dict[str, Any]) -> list[tuple[str, str]]:
    published = []
    for port in service.get("ports", []):
        parts = str(port).split("/")[0].split(":")
        # "ip:host:container", "host:container" or "container" (a random host port)
        if len(parts) == 3:
            published.append((parts[0], parts[1]))
        elif len(parts) == 2:
            published.append(("0.0.0.0", parts[0]))
    return published


def assert_cli_command(args: list[str]) -> None:
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, f"`loopwatch {' '.join(args)} --help`: {result.output}"


# --- compose --------------------------------------------------------------------------


def test_every_yaml_file_in_deploy_parses():
    files = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
    assert len(files) >= 10
    for path in files:
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(doc is not None for doc in documents), path


def test_compose_has_the_whole_stack():
    names = set(services())
    assert {"kafka", "clickhouse", "grafana", "alertmanager", "processor", "detector",
            "otlp-receiver"} <= names
    assert services()["processor"]["deploy"]["replicas"] == 2
    assert "KRaft" in COMPOSE_FILE.read_text() or "KAFKA_PROCESS_ROLES" in environment(
        services()["kafka"])
    assert environment(services()["kafka"])["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_every_env_reference_is_documented_in_env_example():
    referenced = {match.group(1) for match in env_refs()}
    referenced |= {secret["environment"] for secret in compose()["secrets"].values()
                   if "environment" in secret}
    documented = env_example()
    assert referenced - set(documented) == set(), "document these in deploy/.env.example"
    assert set(documented) - referenced == set(), "stale entries in deploy/.env.example"


def test_secrets_come_from_the_environment_only():
    example = env_example()
    for match in env_refs():
        name, op = match.group(1), match.group(2)
        if SECRET_NAME.search(name):
            assert op == ":?", f"${{{name}}} must be required (${{{name}:?...}})"
            assert example[name] == "", f"{name} must have no value in .env.example"
    for secret in compose()["secrets"].values():
        assert set(secret) == {"environment"}, "secrets come from env, never files in git"
        assert example[secret["environment"]] == ""
    for name, service in services().items():
        for key, value in environment(service).items():
            if SECRET_NAME.search(key) and not key.endswith("__FILE"):
                assert ENV_REF.fullmatch(value), f"{name}.{key} is a literal: {value!r}"
            if "://" in value and "@" in value:
                userinfo = value.split("://", 1)[1].split("@", 1)[0]
                assert ":" not in userinfo or "${" in userinfo, f"{name}.{key}: literal password"


def test_volumes_secrets_and_mounted_paths_resolve():
    spec = compose()
    declared_volumes = set(spec.get("volumes") or {})
    declared_secrets = set(spec.get("secrets") or {})
    used_volumes = set()
    for name, service in spec["services"].items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).resolve().exists(), f"{name}: {source} is missing"
                assert (DEPLOY / source).resolve().is_relative_to(ROOT)
            else:
                assert source in declared_volumes, f"{name}: volume {source} not declared"
                used_volumes.add(source)
        for secret in service.get("secrets", []):
            assert (secret if isinstance(secret, str) else secret["source"]) in declared_secrets
        for dependency in service.get("depends_on") or {}:
            assert dependency in spec["services"], f"{name} depends on unknown {dependency}"
    assert used_volumes == declared_volumes


def test_depends_on_conditions_have_what_they_wait_for():
    spec = services()
    for name, service in spec.items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in spec[dependency], f"{name} waits on {dependency}"
            if condition["condition"] == "service_completed_successfully":
                assert spec[dependency].get("restart") == "no"
        if service.get("restart") != "no":
            assert "healthcheck" in service, f"{name} has no healthcheck"


def test_published_ports_do_not_collide_and_bind_loopback():
    seen: dict[tuple[str, str], str] = {}
    for name, service in services().items():
        if service.get("deploy", {}).get("replicas", 1) > 1:
            assert not service.get("ports"), f"{name}: replicas cannot publish one port"
        for address, port in host_ports(service):
            for (other_address, other_port), other in seen.items():
                wildcard = "0.0.0.0" in (address, other_address)
                if port == other_port and (wildcard or address == other_address):
                    raise AssertionError(f"{name} and {other} both publish port {port}")
            seen[(address, port)] = name
            assert address == "127.0.0.1", f"{name} publishes {port} beyond loopback"


def test_loopwatch_services_run_real_commands():
    loopwatch = loopwatch_services()
    expected = {"processor": ["worker"], "detector": ["detect"],
                "otlp-receiver": ["ingest", "serve"]}
    for name, command in expected.items():
        assert loopwatch[name]["command"] == command
    for service in loopwatch.values():
        if "entrypoint" in service:
            continue
        assert_cli_command(service["command"])


def test_the_init_job_imports_what_exists():
    init = services()["init"]
    assert init["entrypoint"] == ["python", "-c"]
    code = init["command"][0]
    compile(code, "init", "exec")
    for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+?)(?:;|$)", code):
        imported = importlib.import_module(module)
        for attribute in names.split(","):
            assert hasattr(imported, attribute.strip()), f"{module}.{attribute}"


def test_loopwatch_services_connect_straight_to_kafka_and_clickhouse():
    example = {key: value or "x" for key, value in env_example().items()}
    for name, service in loopwatch_services().items():
        env = {key: interpolate(value, example) for key, value in environment(service).items()}
        settings = Settings(**{key.removeprefix("LOOPWATCH_").lower(): value
                               for key, value in env.items()
                               if key.startswith("LOOPWATCH_") and not key.startswith(
                                   "LOOPWATCH_OTLP_") and value})
        assert not settings.embedded_store, name
        assert settings.kafka_bootstrap == "kafka:9092", name
        assert settings.clickhouse_url.startswith("http://loopwatch:x@clickhouse:8123/"), name
        assert settings.partitions >= services()["processor"]["deploy"]["replicas"]
    receiver = environment(services()["otlp-receiver"])
    assert receiver["LOOPWATCH_OTLP_HOST"] == "0.0.0.0"
    assert any(port.endswith(f":{receiver['LOOPWATCH_OTLP_PORT']}")
               for port in services()["otlp-receiver"]["ports"])
    detector = environment(services()["detector"])
    assert detector["LOOPWATCH_ALERTMANAGER_URL"] == "http://alertmanager:9093"


def test_grafana_mounts_the_generated_provisioning():
    grafana = services()["grafana"]
    assert "grafana-clickhouse-datasource" in environment(grafana)["GF_INSTALL_PLUGINS"]
    mounts = {}
    for mount in grafana["volumes"]:
        source, target = mount.split(":")[:2]
        if source.startswith("."):
            mounts[(DEPLOY / source).resolve()] = target
    provisioning = DEPLOY / "grafana" / "provisioning"
    dashboards = DEPLOY / "grafana" / "dashboards"
    assert mounts[provisioning.resolve()] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "loopwatch.yaml").read_text())
    assert mounts[dashboards.resolve()] == provider["providers"][0]["options"]["path"]
    assert sorted(p.name for p in dashboards.glob("*.json")) == [
        "drilldown.json", "realtime.json", "trends.json"]
    datasource_text = (provisioning / "datasources" / "loopwatch.yaml").read_text()
    wanted = {match.group(1) for match in ENV_REF.finditer(datasource_text)}
    assert wanted <= set(environment(grafana)), "the data source reads these from Grafana's env"
    assert environment(grafana)["LOOPWATCH_CLICKHOUSE_USER"] == "reader"


def test_clickhouse_drop_ins():
    config = ET.parse(DEPLOY / "clickhouse" / "config.d" / "system-log-ttl.xml").getroot()
    ttl = {child.tag: child.findtext("ttl") for child in config}
    for table in ("query_log", "trace_log", "part_log", "metric_log",
                  "asynchronous_metric_log"):
        assert re.fullmatch(r"event_date \+ INTERVAL \d+ DAY DELETE", ttl[table] or ""), table
    users = ET.parse(DEPLOY / "clickhouse" / "users.d" / "loopwatch.xml").getroot()
    env = environment(services()["clickhouse"])
    for user in ("loopwatch", "reader"):
        password = users.find(f"users/{user}/password")
        assert password is not None and not (password.text or "").strip(), user
        assert password.get("from_env") in env, f"{user}'s password env is not passed"
    assert users.findtext("users/reader/profile") == "loopwatch_reader"
    assert users.findtext("users/reader/grants/query") == "GRANT SELECT ON loopwatch.*"


#: each limit loopwatch bounds a user query with, and its Settings field
READER_LIMITS = {"max_execution_time": "query_timeout_s",
                 "max_memory_usage": "query_max_memory_bytes",
                 "max_result_rows": "query_max_result_rows",
                 "max_result_bytes": "query_max_result_bytes"}


def test_the_reader_profile_is_readonly_and_its_limits_cannot_be_raised():
    """``readonly=2`` let a query's SETTINGS raise its own limits: the reader is
    ``readonly=1``, every limit has a constraint with a min (0 is "no limit") and a max,
    the modes and ``readonly`` itself are const, and its grants cover loopwatch only."""
    users = ET.parse(DEPLOY / "clickhouse" / "users.d" / "loopwatch.xml").getroot()
    profile = users.find("profiles/loopwatch_reader")
    assert profile is not None
    assert profile.findtext("readonly") == "1"
    constraints = profile.find("constraints")
    assert constraints is not None
    defaults = Settings()
    for setting, field in READER_LIMITS.items():
        value = float(profile.findtext(setting) or "0")
        limit = constraints.find(setting)
        assert limit is not None, setting
        low, high = float(limit.findtext("min") or "0"), float(limit.findtext("max") or "0")
        assert 0 < low <= value <= high, setting
        assert limit.find("changeable_in_readonly") is not None, setting
        assert value == float(getattr(defaults, field)), f"{setting} != Settings.{field}"
    for setting in ("readonly", "timeout_overflow_mode", "result_overflow_mode", "allow_ddl",
                    "allow_introspection_functions"):
        fixed = constraints.find(setting)
        assert fixed is not None and fixed.find("const") is not None, setting
    assert profile.findtext("timeout_overflow_mode") == "throw"
    assert profile.findtext("result_overflow_mode") == "throw"
    grants = [query.text for query in users.findall("users/reader/grants/query")]
    assert grants == ["GRANT SELECT ON loopwatch.*"]


def test_alertmanager_config(tmp_path: Path):
    path = DEPLOY / "alertmanager" / "alertmanager.yml"
    config = yaml.safe_load(path.read_text())
    names = {receiver["name"] for receiver in config["receivers"]}
    assert config["route"]["receiver"] in names
    hook = config["receivers"][0]["webhook_configs"][0]
    assert hook["url_file"] == "/run/secrets/alert_webhook_url"
    assert "alert_webhook_url" in services()["alertmanager"]["secrets"]
    amtool = shutil.which("amtool")
    if amtool is None:
        return
    # Debian's amtool may predate url_file (0.26): check the rest with a plain url.
    copy = tmp_path / "alertmanager.yml"
    copy.write_text(path.read_text().replace(
        "url_file: /run/secrets/alert_webhook_url", "url: http://receiver.invalid/hook"))
    result = subprocess.run([amtool, "check-config", str(copy)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", text, re.MULTILINE) == ["python:3.11-slim"]
    user = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert user and not user[-1].startswith(("root", "0")), "must not run as root"
    assert 'ENTRYPOINT ["loopwatch"]' in text
    for source in re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE):
        for item in source.split():
            assert (ROOT / item).exists(), f"COPY {item}: missing"
    build = services()["processor"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (
        DEPLOY / "Dockerfile").resolve()


# --- kubernetes -----------------------------------------------------------------------


def k8s_documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    documents = []
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), f"kustomization lists missing {resource}"
        documents.extend(doc for doc in yaml.safe_load_all((K8S / resource).read_text())
                         if doc)
    return documents


def deployments() -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in k8s_documents()
            if doc["kind"] == "Deployment"}


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk - listed == {"secret.example.yaml"}
    for doc in k8s_documents():
        assert {"apiVersion", "kind", "metadata"} <= set(doc)


def test_k8s_deployments():
    found = deployments()
    assert found["loopwatch-processor"]["spec"]["replicas"] == 2
    commands = {"loopwatch-processor": ["worker"], "loopwatch-detector": ["detect"],
                "loopwatch-otlp-receiver": ["ingest", "serve"]}
    for name, args in commands.items():
        spec = found[name]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        container = spec["template"]["spec"]["containers"][0]
        assert container["args"] == args
        assert_cli_command(args)
        assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert found["loopwatch-detector"]["spec"]["strategy"]["type"] == "Recreate"


def test_processors_are_given_longer_to_stop_than_they_drain():
    """A processor stopped during an outage drains for ``drain_timeout_s`` and then stops
    retrying its writes: the supervisor must wait that long before it kills."""
    drain_s = float(environment(services()["processor"]).get(
        "LOOPWATCH_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    compose_grace = services()["processor"]["stop_grace_period"]
    assert compose_grace.endswith("s") and float(compose_grace[:-1]) > drain_s + 10
    pod = deployments()["loopwatch-processor"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > drain_s + 10


def test_k8s_config_and_secret_references_are_defined():
    documents = k8s_documents()
    configmaps = {doc["metadata"]["name"]: set(doc["data"]) for doc in documents
                  if doc["kind"] == "ConfigMap"}
    secret_docs = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    secrets = {secret_docs["metadata"]["name"]: set(secret_docs["stringData"])}
    assert all(value == "" for value in secret_docs["stringData"].values())
    assert not any(doc["kind"] == "Secret" for doc in documents), "no Secret in git"
    for deployment in deployments().values():
        pod = deployment["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    key = ref["secretKeyRef"]
                    assert key["key"] in secrets[key["name"]], key
                if "configMapKeyRef" in ref:
                    key = ref["configMapKeyRef"]
                    assert key["key"] in configmaps[key["name"]], key
    keys = configmaps["loopwatch-config"] | secrets["loopwatch-secrets"]
    assert {"LOOPWATCH_KAFKA_BOOTSTRAP", "LOOPWATCH_CLICKHOUSE_URL", "LOOPWATCH_OTLP_TOKEN",
            "LOOPWATCH_ALERTMANAGER_URL"} <= keys
    for key in configmaps["loopwatch-config"]:
        assert not SECRET_NAME.search(key), f"{key} belongs in the Secret"


def test_k8s_otlp_service_selects_the_receiver():
    service = next(doc for doc in k8s_documents() if doc["kind"] == "Service")
    receiver = deployments()["loopwatch-otlp-receiver"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= receiver["metadata"]["labels"].items()
    port_names = {port["name"] for port in receiver["spec"]["containers"][0]["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names


def test_kustomize_builds():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "image: loopwatch:" in result.stdout


# --- cluster DDL ----------------------------------------------------------------------


def test_cluster_ddl_is_deterministic_and_committed():
    assert render_cluster_ddl("loopwatch", "loopwatch") == render_cluster_ddl(
        "loopwatch", "loopwatch")
    committed = CLUSTER_SQL.read_text()
    assert committed == render_sql("loopwatch", "loopwatch"), (
        "re-render: python -m loopwatch.store.cluster --cluster loopwatch "
        "> deploy/clickhouse/cluster.sql")
    assert statements(committed) == render_cluster_ddl("loopwatch", "loopwatch")


def test_cluster_ddl_replicates_and_distributes_every_table():
    ddl = render_cluster_ddl("prod", "lw")
    tables = [obj for obj in schema_objects()
              if isinstance(obj, Table) and obj.engine != "Null"]
    views = [obj for obj in schema_objects() if isinstance(obj, View)]
    assert len(tables) >= 10 and len(views) >= 4
    # an INSERT runs on one node: the migration record, the generated views' record, and
    # 010's copy of a rebuilt table (through the Distributed fronts, synchronously)
    assert all(" ON CLUSTER prod" in statement for statement in ddl
               if not statement.startswith(("INSERT INTO lw.schema_migrations ",
                                            "INSERT INTO lw.generated_views ",
                                            "INSERT INTO lw.llm_calls_v010 ",
                                            "INSERT INTO lw.tool_calls_v010 ")))
    for table in tables:
        local = [s for s in ddl
                 if s.startswith(f"CREATE TABLE IF NOT EXISTS lw.{table.name}_local ")]
        assert len(local) == 1, table.name
        assert f"ENGINE = Replicated{table.engine}('/clickhouse/tables/{{shard}}/{{database}}/" \
               f"{{table}}', '{{replica}}'" in local[0]
        front = [s for s in ddl if s.startswith(f"CREATE TABLE IF NOT EXISTS lw.{table.name} ")]
        assert len(front) == 1, table.name
        assert f"Distributed('prod', 'lw', '{table.name}_local', cityHash64(" in front[0]
        if "run_id" in table.column_names and table.name != "dead_letters":
            assert front[0].endswith("cityHash64(run_id))"), table.name
        assert table.has_own_ttl or table.name in RETENTION, f"{table.name} has no TTL"
    runs = next(s for s in ddl if "lw.runs_local ON CLUSTER" in s and s.startswith("CREATE"))
    assert ("ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', "
            "'{replica}', version)") in runs
    for view in views:
        statement = next(s for s in ddl if f"VIEW lw.{view.name} ON CLUSTER prod AS" in s)
        sources = re.findall(r"\bFROM\s+(\S+)", statement)
        assert sources and all(source.startswith("lw.") for source in sources), statement
    for name, rule in RETENTION.items():
        assert (f"ALTER TABLE lw.{name}_local ON CLUSTER prod MODIFY TTL "
                f"{rule.column} + INTERVAL {rule.days} DAY") in ddl
    assert RETENTION["events"].days == 30 and RETENTION["llm_calls"].days == 180
    # the insert-only entry point: a Null table on every node, split into the sharded table
    entry = [s for s in ddl if "lw.events_in" in s and s.startswith("CREATE TABLE")]
    assert len(entry) == 1 and entry[0].endswith("ENGINE = Null"), entry
    # its events parsed once (a Null table on every node), then split into the sharded
    # tables by the generated views (store/event_views.py), which replace 006's split
    feeds = {s.split()[6]: (s.split()[11], re.findall(r"\bFROM\s+(\S+)", s))
             for s in ddl if s.startswith("CREATE MATERIALIZED VIEW")}
    assert feeds == {
        "lw.events_in_parse": ("lw.events_parsed", ["lw.events_in"]),
        "lw.events_parsed_events": ("lw.events", ["lw.events_parsed"]),
        "lw.events_parsed_llm_calls": ("lw.llm_calls", ["lw.events_parsed"]),
        "lw.events_parsed_tool_calls": ("lw.tool_calls", ["lw.events_parsed"]),
        "lw.events_parsed_labels": ("lw.labels", ["lw.events_parsed"])}
    parsed = [s for s in ddl if "lw.events_parsed" in s and s.startswith("CREATE TABLE")]
    assert len(parsed) == 1 and parsed[0].endswith("ENGINE = Null"), parsed
    assert "DROP VIEW IF EXISTS lw.events_in_split ON CLUSTER prod" in ddl


def test_cluster_ddl_parses_with_clickhouse(local_store: tuple[Settings, Client]):
    """chdb has no cluster to run ON CLUSTER against, but its parser is ClickHouse's."""
    _settings, client = local_store
    for statement in render_cluster_ddl("loopwatch", "loopwatch"):
        if statement.startswith("INSERT INTO"):  # the migration record: one node's insert
            continue
        formatted = client.query("SELECT formatQuery(%(q)s)",
                                 parameters={"q": statement}).result_rows[0][0]
        assert "ON CLUSTER loopwatch" in formatted


def test_cluster_ddl_rejects_names_that_are_not_identifiers():
    with pytest.raises(ValueError, match="cluster"):
        render_cluster_ddl("prod; DROP TABLE x", "lw")
    with pytest.raises(ValueError, match="database"):
        render_cluster_ddl("prod", "lw`")


def test_single_node_form_runs_on_chdb(local_store: tuple[Settings, Client]):
    _settings, client = local_store
    database = "lw_cluster_check"
    client.command(f"DROP DATABASE IF EXISTS {database}")
    try:
        for statement in render_cluster_ddl("unused", database, single_node=True):
            assert "ON CLUSTER" not in statement and "Replicated" not in statement
            client.command(statement)
        run_id = f"run-{uuid.uuid4()}"
        for version, outcome in ((1, "gave_up"), (2, "success")):
            client.command(
                f"INSERT INTO {database}.runs (run_id, agent, status, outcome, started_ts, "
                "last_event_ts, closed_ts, cost_usd, version) VALUES "
                f"('{run_id}', 'deploy-check', 'closed', '{outcome}', now64(3), now64(3), "
                f"now64(3), 0.25, {version})")
        event_id = uuid.uuid4()
        client.command(
            f"INSERT INTO {database}.events (event_id, event_type, ts, run_id, agent, "
            f"payload) VALUES ('{event_id}', 'run.start', now64(3), '{run_id}', "
            "'deploy-check', '{}')")
        local_rows = client.query(
            f"SELECT count() FROM {database}.runs_local WHERE run_id = %(r)s",
            parameters={"r": run_id}).result_rows
        assert local_rows == [(2,)], "inserts through the name table land in _local"
        final = client.query(
            f"SELECT outcome, version FROM {database}.runs FINAL WHERE run_id = %(r)s",
            parameters={"r": run_id}).result_rows
        assert final == [("success", 2)]
        split_id = uuid.uuid4()
        event = orjson.dumps({"event_type": "step", "event_id": str(split_id),
                              "ts": "2026-11-30T09:00:00Z", "run_id": run_id,
                              "agent": "deploy-check", "step": 4}).decode()
        client.command(f"INSERT INTO {database}.events_in (kafka_partition, kafka_offset, "
                       f"ingested_at, event_objects) VALUES (0, 7, now64(3), ['{event}'])")
        events = client.query(f"SELECT event_id, payload FROM {database}.events_local FINAL "
                              "ORDER BY event_type").result_rows
        assert events == [(event_id, "{}"), (split_id, '{"step":4}')]
        mix = client.query(
            f"SELECT outcome, runs FROM {database}.outcomes_1m WHERE agent = 'deploy-check'"
        ).result_rows
        assert mix == [("success", 1)]
        metrics = client.query(
            f"SELECT closed_runs, successes FROM {database}.run_metrics_1m "
            "WHERE agent = 'deploy-check'").result_rows
        assert metrics == [(1, 1)]
        ttl = client.query(
            "SELECT create_table_query FROM system.tables WHERE database = %(d)s "
            "AND name = 'events_local'", parameters={"d": database}).result_rows[0][0]
        assert "TTL ingested_at + toIntervalDay(30)" in ttl
    finally:
        client.command(f"DROP DATABASE IF EXISTS {database}")


# --- docs -----------------------------------------------------------------------------


def test_operations_guide_covers_the_retention_table():
    guide = (ROOT / "docs" / "operations.md").read_text()
    for name, rule in RETENTION.items():
        assert re.search(rf"`{name}`[^\n]*\b{rule.days}\b", guide), f"{name} retention"
    for topic in ("partitions", "ON CLUSTER", "FINAL", "BACKUP", "readonly", "HMAC",
                  "redaction", "TLS", "query_log"):
        assert topic in guide, topic
