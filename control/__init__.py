"""dspark-ctl: the operator's client for a DSpark-serving SGLang (httpx + Typer, no torch at import)."""
