"""Notebook helpers: token views, results views, the base policy loader, a synthetic workdir."""
