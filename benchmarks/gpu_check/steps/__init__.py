"""The steps of gpu-check, one module per family; each family is a StepRunner (runner.py) that adds
its steps."""
