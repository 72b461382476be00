"""Textual TUI for a DSpark-serving SGLang: talks to the admin API through dspark_ctl's client."""
