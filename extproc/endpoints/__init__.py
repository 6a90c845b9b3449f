"""Endpoints: pools, live load, metrics scraping."""
