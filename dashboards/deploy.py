"""``loopwatch dashboards deploy``: data source, folder and dashboards through Grafana's API.

Idempotent: the data source is looked up by its fixed uid and created or updated, the
folder likewise, and each dashboard is saved by uid with ``overwrite``, so running it
twice leaves Grafana as running it once. It fails early and clearly where a deploy
usually goes wrong: Grafana unreachable, a token it rejects, the ClickHouse plugin not
installed, no ClickHouse server for Grafana to read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import unquote, urlparse

import niquests
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

from loopwatch.dashboards.grafana import DATASOURCE_UID, PLUGIN_ID, dashboard_model
from loopwatch.dashboards.panels import TIERS
from loopwatch.dashboards.provisioning import FOLDER, datasource_settings

MESSAGE: Final = "loopwatch dashboards deploy"


class DeployError(RuntimeError):
    """A deploy that cannot go on; the message says what to fix."""


@dataclass
class DeployReport:
    datasource: str = ""
    folder: str = ""
    dashboards: dict[str, str] = field(default_factory=dict)


def _status(exc: GrafanaException) -> int:
    return int(getattr(exc, "status_code", 0) or 0)


def _not_found(call: Any, *args: Any) -> Any:
    """``call(*args)``, or None when Grafana answers 404."""
    try:
        return call(*args)
    except GrafanaClientError as exc:
        if _status(exc) == 404:
            return None
        raise


class Deployer:
    """One deploy against one Grafana, step by step (each step is separately testable)."""

    def __init__(self, url: str, token: str, timeout_s: float = 15.0) -> None:
        self.url = url.rstrip("/")
        self.api = GrafanaApi.from_url(self.url, credential=token, timeout=timeout_s)

    def check_access(self) -> None:
        try:
            self.api.client.GET("/org")
        except GrafanaUnauthorizedError as exc:
            raise DeployError(f"Grafana at {self.url} rejected the token (HTTP 401): use a "
                              "service account token with the Editor or Admin role") from exc
        except GrafanaClientError as exc:
            if _status(exc) == 403:
                raise DeployError(f"Grafana at {self.url} refused access with this token "
                                  "(HTTP 403): it needs the Admin role to manage data "
                                  "sources") from exc
            raise DeployError(f"Grafana at {self.url} answered {exc}") from exc

    def check_plugin(self) -> None:
        settings = _not_found(self.api.client.GET, f"/plugins/{PLUGIN_ID}/settings")
        if settings is None:
            raise DeployError(
                f"the ClickHouse data source plugin ({PLUGIN_ID}) is not installed in "
                f"Grafana at {self.url}: install it (`grafana cli plugins install {PLUGIN_ID}`"
                f" or GF_INSTALL_PLUGINS={PLUGIN_ID}), restart Grafana, and deploy again")

    def upsert_datasource(self, clickhouse_url: str, password: str) -> str:
        body = datasource_settings(clickhouse_url)
        if password:
            body["secureJsonData"] = {"password": password}
        existing = _not_found(self.api.datasource.get_datasource_by_uid, DATASOURCE_UID)
        if existing is None:
            self.api.datasource.create_datasource(body)
            return "created"
        self.api.datasource.update_datasource_by_uid(DATASOURCE_UID, body)
        return "updated"

    def ensure_folder(self) -> str:
        if _not_found(self.api.folder.get_folder, FOLDER) is not None:
            return "exists"
        self.api.folder.create_folder(FOLDER, uid=FOLDER)
        return "created"

    def save_dashboards(self, web_url: str | None = None) -> dict[str, str]:
        saved = {}
        for tier in TIERS:
            model = dashboard_model(tier.id, web_url)
            model["id"] = None
            reply = self.api.dashboard.update_dashboard(
                {"dashboard": model, "folderUid": FOLDER, "overwrite": True,
                 "message": MESSAGE})
            path = reply.get("url", f"/d/{tier.uid}") if isinstance(reply, dict) else ""
            saved[tier.uid] = f"{self.url}{path}"
        return saved


def deploy(url: str, token: str, clickhouse_url: str | None,
           clickhouse_password: str | None = None, web_url: str | None = None) -> DeployReport:
    """Create or update the data source, the folder and the three dashboards."""
    if not clickhouse_url:
        raise DeployError(
            "Grafana needs a ClickHouse server it can reach: pass --clickhouse-url "
            "http(s)://user@host:port/database or set LOOPWATCH_CLICKHOUSE_URL (the embedded "
            "chdb store lives inside loopwatch and cannot be shared with Grafana)")
    password = clickhouse_password
    if password is None:
        password = unquote(urlparse(clickhouse_url).password or "")
    deployer = Deployer(url, token)
    report = DeployReport()
    try:
        deployer.check_access()
        deployer.check_plugin()
        report.datasource = deployer.upsert_datasource(clickhouse_url, password)
        report.folder = deployer.ensure_folder()
        report.dashboards = deployer.save_dashboards(web_url)
    except DeployError:
        raise
    except niquests.exceptions.RequestException as exc:
        raise DeployError(f"cannot reach Grafana at {deployer.url}: {exc}") from exc
    except GrafanaException as exc:
        if _status(exc) == 0:
            raise DeployError(f"cannot reach Grafana at {deployer.url}: {exc}") from exc
        raise DeployError(f"Grafana at {deployer.url} refused the deploy: {exc}") from exc
    return report
