"""Command-line entry points (``python -m launch.<name>``).

Importing this package, or any of its commands, changes nothing in the process: each command's
``main`` calls `launch.process.setup` itself (the device count, XLA:CPU's pool, the CUDA plugin's
log lines) once its flags are parsed, before jax starts.
"""
