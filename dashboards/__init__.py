"""Dashboards as code: one definition per panel, rendered two ways.

:mod:`dashboards.panels` holds every panel once (title, SQL with the Grafana ClickHouse
plugin's macros, visualisation, unit, thresholds). :mod:`dashboards.grafana` turns them
into Grafana dashboard models (one per tier), :mod:`dashboards.provisioning` writes
them with Grafana's provisioning files, :mod:`dashboards.deploy` pushes them through
Grafana's HTTP API, and :mod:`dashboards.web` serves the same panels, running the same
SQL after :mod:`dashboards.macros` expands it exactly as the plugin would.
"""
