"""One package per model family (diffusers' `pipelines/<family>/` is the model): its record (what the
registry and the loader need to know), its pipeline config, pipelines, its own stages and its tiny
random-weight builder. `registry.py` lists the records; nothing outside a family's package names it."""
