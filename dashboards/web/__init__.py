"""The built-in web view: the same panels and SQL as the Grafana dashboards, served
on 127.0.0.1 by a small stdlib HTTP server (:mod:`loopwatch.dashboards.web.server`) from the
JSON the data layer (:mod:`loopwatch.dashboards.web.api`) builds, drawn by a static page with a
vendored uPlot (no CDN, no build step)."""
