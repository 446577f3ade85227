"""Detectors: alert rules, statistical anomaly detection, playbooks, alert routing.

``anomaly/`` holds the online statistical detectors (one interface: ``learn_one`` /
``score_one``), ``playbooks/`` the incident playbooks as data.
"""
