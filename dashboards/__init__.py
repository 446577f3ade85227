"""Dashboards as code: one definition per panel, rendered two ways.

:mod:`loopwatch.dashboards.panels` holds every panel once (title, SQL with the Grafana ClickHouse
plugin's macros, visualisation, unit, thresholds). :mod:`loopwatch.dashboards.grafana` turns them
into Grafana dashboard models (one per tier), :mod:`loopwatch.dashboards.provisioning` writes
them with Grafana's provisioning files, :mod:`loopwatch.dashboards.deploy` pushes them through
Grafana's HTTP API, and :mod:`loopwatch.dashboards.web` serves the same panels, running the same
SQL after :mod:`loopwatch.dashboards.macros` expands it exactly as the plugin would.
"""
