"""CPSR's runtime: the session ``cpsr_ds.initialize`` runs (session.py) and what ``engine.cpsr`` does after every
iteration (runtime.py, hooks.py), the checkpoint schedule among it (schedule.py)."""
