"""Stubs generated from protos/kvroute/v1/*.proto by setup.py when kvroute is installed
(``pip install -e .`` or ``make venv``); never written by hand nor committed."""
