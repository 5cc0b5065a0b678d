"""Framework integrations that are optional extras (`pip install pg-outbox[django]`).

Nothing here is imported by `import outbox`; each subpackage needs its framework.
"""
