"""Typer commands (see main.py)."""
